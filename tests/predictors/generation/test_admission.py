"""Admission and cancellation on every engine: a bounded queue (``max_queue``) that answers 503
``overloaded`` with ``Retry-After`` before any stream starts, the queue-depth gauge, and a client that goes
away before its first byte stopping its generation. One predictor per engine, started with one running
sequence and a small queue so that overload and queueing are easy to reach.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.predictors.generation.conftest import EngineCase, case_predictor, engine_params, require_engine
from tests.predictors.harness import OFFLINE_ENV, PredictorProcess, predictor_command
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

MODEL = "tiny-llama"
#: The random model (almost) never ends on its own: every sequence runs to max_tokens.
MAX_TOKENS = 400
_VLLM_CPU = (("dtype", "float32"), ("enforce_eager", "true"), ("kv_cache_memory_bytes", "256M"))

#: One sequence runs at a time on every engine; ``max_queue`` more may wait. Enough queued work that a
#: request queued last still waits when the test has seen it arrive: llama.cpp runs the tiny model about
#: ten times faster than the others, so it gets a longer queue.
ENGINES = [
    EngineCase(Backend.TRANSFORMERS, "transformers", engine_args=(("max_batch_size", "1"), ("max_queue", "6"))),
    # Passive OpenMP waits for llama.cpp here (the predictor's default leaves libgomp spinning at its barriers,
    # as llama-server does, for speed on CPUs of its own): these tests are about admission, and with the
    # threads spinning on 2 CPUs any other busy process (CI builds the images meanwhile) stalls every step,
    # measured: a flood and two disconnects 6 min instead of 31 s beside one busy process; passive, 31 s.
    EngineCase(
        Backend.LLAMACPP,
        "llama_cpp",
        gguf=True,
        engine_args=(("max_queue", "40"),),
        env=(("OMP_WAIT_POLICY", "PASSIVE"),),
    ),
    EngineCase(Backend.VLLM, "vllm", engine_args=(*_VLLM_CPU, ("max_num_seqs", "1"), ("max_queue", "6"))),
]


def capacity(case: EngineCase) -> int:
    """Sequences admitted at once: the running one and the queue."""
    return 1 + int(dict(case.engine_args)["max_queue"])


@pytest.fixture(scope="module", params=engine_params(ENGINES), ids=lambda case: case.backend.value)
def engine_case(request: pytest.FixtureRequest) -> EngineCase:
    case: EngineCase = request.param
    return case


@pytest.fixture(scope="module")
def predictor(
    engine_case: EngineCase, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PredictorProcess]:
    with case_predictor(engine_case, request, tmp_path_factory, "admission") as running:
        yield running


async def metric(http: httpx.AsyncClient, predictor: PredictorProcess, name: str) -> float:
    text = (await http.get(f"{predictor.url}/metrics")).text
    match = re.search(rf'^{name}\{{model="{MODEL}"\}} ([0-9.e+]+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def poll(
    http: httpx.AsyncClient, predictor: PredictorProcess, name: str, until: str, value: float, what: str
) -> None:
    """Poll a metric until it is ``>=`` / ``==`` value; fail naming ``what`` after a generous deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        current = await metric(http, predictor, name)
        if (current >= value) if until == ">=" else (current == value):
            return
        assert loop.time() < deadline, f"{what}: {name} stayed at {current}"
        await asyncio.sleep(0.02)  # between polls: leave the two cores to the predictor


def aclient(predictor: PredictorProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0, timeout=120)


# -- the bounded queue --------------------------------------------------------------------------------


async def _flood(predictor: PredictorProcess, size: int) -> tuple[list[object], float]:
    """``size`` concurrent streams; each one's chunks or its error, and the largest queue depth seen."""
    done = asyncio.Event()
    async with aclient(predictor) as client, httpx.AsyncClient(timeout=30) as http:

        async def one(i: int) -> object:
            try:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"Flood {i}", max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                return [chunk async for chunk in stream]
            except openai.APIStatusError as exc:
                return exc

        async def watch() -> float:
            deepest = 0.0
            while not done.is_set():
                deepest = max(deepest, await metric(http, predictor, "universal_predictor_queue_depth"))
                # Between scrapes: a scrape loop with no pause takes a core from the engine it measures
                # (llama.cpp's decode threads spin at their barriers), and the flood then outlasts its timeout.
                await asyncio.sleep(0.01)
            return deepest

        watcher = asyncio.ensure_future(watch())
        try:
            results = list(await asyncio.gather(*(one(i) for i in range(size))))
        finally:
            done.set()
        deepest = await watcher
        # Idle again: the gauge does not keep a stale depth.
        await poll(http, predictor, "universal_predictor_queue_depth", "==", 0, "the queue never drained")
    return results, deepest


def test_a_flood_beyond_the_queue_bound_gets_503_overloaded_with_retry_after_before_any_stream(
    predictor: PredictorProcess, engine_case: EngineCase
) -> None:
    size = 2 * capacity(engine_case) + 8
    results: list[object] = []
    deepest = 0.0
    for _ in range(3):  # a flood is over in a second; another round if this one never caught the queue
        round_results, round_deepest = asyncio.run(_flood(predictor, size))
        results += round_results
        deepest = max(deepest, round_deepest)
        if deepest > 0:
            break
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    served = [r for r in results if isinstance(r, list)]
    assert len(refused) + len(served) == len(results), [r for r in results if not isinstance(r, list)]
    assert refused, "nothing was refused"
    assert served, "nothing was served"
    for error in refused:
        assert error.status_code == 503, (error.status_code, error.body)
        assert float(error.response.headers["retry-after"]) > 0
        assert error.code == "overloaded"
        assert error.type == "server_error"
        assert isinstance(error.body, dict)
        assert "overloaded" in error.body["message"]
    for chunks in served:  # an admitted stream runs to its end: no error event after the 200
        assert isinstance(chunks, list)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
    assert deepest > 0, "the queue-depth gauge stayed at 0 while sequences waited"


@pytest.mark.parametrize("value", ["-1", "many"])
def test_a_bad_max_queue_stops_start_up_with_one_line_naming_it(
    engine_case: EngineCase, request: pytest.FixtureRequest, tmp_path: Path, value: str
) -> None:
    require_engine(engine_case)
    source = request.getfixturevalue("tiny_llama_gguf" if engine_case.gguf else "tiny_llama_dir")
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=engine_case.backend, source=str(source),
                             engine_args={"max_queue": value}, http_port=1)  # fmt: skip
    result = subprocess.run(predictor_command(config), capture_output=True, text=True, timeout=300, check=False,
                            env={**os.environ, **OFFLINE_ENV}, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("universal_predictors: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "max_queue" in lines[0]
    assert "Traceback" not in result.stderr


# -- a client gone before its first byte ----------------------------------------------------------------


async def _disconnect_before_the_first_byte(predictor: PredictorProcess, blockers: int, stream: bool) -> None:
    """Fill the engine with ``blockers`` (one running, the rest queued), queue a victim behind them, drop
    the victim's connection before any byte of its body, and see its generation stopped and counted."""
    async with aclient(predictor) as client, httpx.AsyncClient(timeout=30) as http:
        await poll(http, predictor, "universal_predictor_in_flight", "==", 0, "the engine was busy before the test")
        cancelled = await metric(http, predictor, "universal_predictor_cancelled_total")
        generated = await metric(http, predictor, "universal_predictor_generated_tokens_total")
        busy = [
            asyncio.ensure_future(
                client.completions.create(model=MODEL, prompt=f"Busy {i}", max_tokens=MAX_TOKENS, temperature=0)
            )
            for i in range(blockers)
        ]
        await poll(http, predictor, "universal_predictor_in_flight", ">=", blockers, "the blockers never arrived")

        body = json.dumps({"model": MODEL, "prompt": "Victim", "max_tokens": MAX_TOKENS, "temperature": 0,
                           "stream": stream}).encode()  # fmt: skip
        host, port = predictor.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /openai/v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
        )
        await writer.drain()
        if stream:  # admitted: the 200 and its headers come; the body (its first token) waits its turn
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
        # Closed at once: the victim is still queued behind the blockers (waiting to see it counted in
        # flight first would race a fast engine, which can run the whole queue meanwhile). The cancel
        # counter below is the proof the predictor took the victim in.
        writer.close()

        await poll(http, predictor, "universal_predictor_cancelled_total", ">=", cancelled + 1,
                   "the disconnect was never counted")  # fmt: skip
        answers = await asyncio.gather(*busy)
        await poll(http, predictor, "universal_predictor_in_flight", "==", 0, "the engine never went idle")
        by_blockers = sum(a.usage.completion_tokens for a in answers if a.usage is not None)
        total = await metric(http, predictor, "universal_predictor_generated_tokens_total") - generated
        by_victim = total - by_blockers
        assert by_blockers == blockers * MAX_TOKENS
        assert by_victim < MAX_TOKENS, "the victim ran to max_tokens after its client had gone"
        # Nothing of it is left running: the count stays put while another request completes.
        await client.completions.create(model=MODEL, prompt="after", max_tokens=2, temperature=0)
        total = await metric(http, predictor, "universal_predictor_generated_tokens_total") - generated
        assert total == by_blockers + by_victim + 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_client_that_disconnects_before_its_first_byte_stops_its_generation(
    predictor: PredictorProcess, engine_case: EngineCase, stream: bool
) -> None:
    asyncio.run(_disconnect_before_the_first_byte(predictor, capacity(engine_case) - 1, stream))
