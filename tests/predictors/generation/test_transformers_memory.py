"""The transformers engine's memory on a GPU, with the logic run on the CPU (issue 16 items 5, 7, 10):
a KV-token budget computed from a given free-memory figure, admission by that budget, chunked prefill,
and a CUDA out-of-memory error (``torch.OutOfMemoryError`` raised from the engine's forward step through
its ``step_hook``, the model itself untouched) becoming 503 with ``Retry-After`` for the sequences it hit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import APIRouter, FastAPI
from prometheus_client import REGISTRY

from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.errors import Unavailable
from universal_predictors.generation.engine import GenerationRequest, SamplingParams
from universal_predictors.generation.engines.transformers import (
    CacheShape,
    TransformersArgs,
    TransformersEngine,
    device_map_for,
    step_reserve_bytes,
    token_budget,
)
from universal_predictors.tasks.generate import GeneratePredictor

GIB = 1 << 30
MODEL = "tiny-llama"

#: Llama-3.1-8B's shape in bf16 (config.json of meta-llama/Llama-3.1-8B-Instruct): 128 KiB of KV cache a token.
LLAMA_8B = CacheShape(
    layers=32, kv_heads=8, head_dim=128, heads=32, hidden=4096, intermediate=14336, vocab=128256, dtype_bytes=2
)


def config_for(source: Path) -> PredictorConfig:
    return PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(source))


def loaded(source: Path, **args: Any) -> TransformersEngine:
    engine = TransformersEngine(config_for(source), TransformersArgs(**args))
    engine.load()
    return engine


async def generate(engine: TransformersEngine, prompt: list[int], max_tokens: int) -> list[int]:
    ids: list[int] = []
    request = GenerationRequest(f"r{id(prompt)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
    return ids


def run_all(engine: TransformersEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def go() -> list[list[int]]:
        return list(await asyncio.gather(*(generate(engine, p, max_tokens) for p in prompts)))

    return asyncio.run(go())


def oom_counter() -> float:
    return REGISTRY.get_sample_value("universal_predictor_out_of_memory_total", {"model": MODEL}) or 0.0


def raise_oom_once(stage: str) -> Callable[[str, int, int], None]:
    """A step hook that makes the next forward step of ``stage`` fail as the CUDA allocator does."""
    fired = False

    def hook(step: str, rows: int, columns: int) -> None:
        nonlocal fired
        if step == stage and not fired:
            fired = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")

    return hook


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    engine = loaded(tiny_llama_dir)
    texts = [
        "The river in Paris is open from 3 to 11, said the guide. Hello, how are you today?",
        "Hi",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10",
        '{"city": "Oslo", "thing": "museum", "count": 42}',
    ]
    ids = [engine.tokenize(t, add_special_tokens=True) for t in texts]
    engine.unload()
    return ids


@pytest.fixture(scope="module")
def solo(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens generated alone, in one prefill pass, on an unbounded engine."""
    engine = loaded(tiny_llama_dir, max_batch_size=1, prefill_chunk=100_000)
    outputs = [run_all(engine, [p], 24)[0] for p in prompts]
    engine.unload()
    return outputs


# -- the budget from a free-memory figure ------------------------------------------------------------


def test_kv_bytes_per_token_come_from_layers_kv_heads_head_size_and_dtype(tiny_llama_dir: Path) -> None:
    assert LLAMA_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    from transformers import AutoConfig

    tiny = CacheShape.from_config(AutoConfig.from_pretrained(tiny_llama_dir), dtype_bytes=4)
    assert (tiny.layers, tiny.kv_heads, tiny.head_dim, tiny.heads) == (2, 1, 64, 2)
    assert tiny.kv_bytes_per_token == 2 * 2 * 1 * 64 * 4


def test_the_budget_is_the_free_memory_beyond_the_kept_back_share_less_one_steps_activations() -> None:
    # An 80 GiB GPU with 16 GiB of 8B weights loaded: 64 GiB free, 8 GiB kept back at utilization 0.9.
    reserve = step_reserve_bytes(LLAMA_8B, prefill_chunk=512, max_rows=32, context=131072)
    assert reserve == 2 * 512 * (4 * 4096 + 3 * 14336) * 2 + 32 * 128256 * 8  # a chunk's activations, the logits
    # Eager attention holds the chunk's fp32 scores against the whole context too: 8 GiB more here.
    eager = step_reserve_bytes(LLAMA_8B, prefill_chunk=512, max_rows=32, context=131072, eager_attention=True)
    assert eager - reserve == 512 * 32 * 131072 * 4 == 8 * GIB
    budget = token_budget(64 * GIB, 80 * GIB, LLAMA_8B, utilization=0.9, prefill_chunk=512, max_rows=32, context=131072)
    usable = 64 * GIB - int(80 * GIB * 0.1) - reserve
    assert budget == usable * 32 // (33 * 128 * 1024)  # the cache and one layer's copy in flight
    assert 400_000 < budget < 460_000  # about three full 131k contexts


def test_a_small_gpu_gets_a_budget_below_the_training_context_and_a_full_one_gets_none() -> None:
    # An L4 (24 GiB) holding the same weights: the context of 131,072 cannot fit; the budget says how much does.
    l4 = token_budget(
        int(7.5 * GIB), 24 * GIB, LLAMA_8B, utilization=0.9, prefill_chunk=512, max_rows=32, context=131072
    )
    assert 10_000 < l4 < 131072
    # Less utilization, less budget; nothing free beyond the kept-back share: no budget at all.
    lower = token_budget(
        int(7.5 * GIB), 24 * GIB, LLAMA_8B, utilization=0.8, prefill_chunk=512, max_rows=32, context=131072
    )
    assert lower < l4
    assert token_budget(2 * GIB, 24 * GIB, LLAMA_8B, utilization=0.9, prefill_chunk=512, max_rows=32, context=8192) == 0


def test_a_gpu_budget_caps_the_context_the_model_card_reports(tiny_llama_dir: Path) -> None:
    engine = loaded(tiny_llama_dir, max_batch_tokens=100)
    try:
        assert engine.context_length == 100  # the tiny model's own context is 512
        assert engine.describe()["max_batch_tokens"] == 100
        with pytest.raises(ValueError, match=r"exceeds the context \(100\)"):
            run_all(engine, [[1] * 60], 41)  # 101 tokens could never fit the batch's cache
    finally:
        engine.unload()


# -- admission by the budget ------------------------------------------------------------------------


def test_sequences_join_the_batch_only_while_its_padded_cache_fits_the_token_budget(
    tiny_llama_dir: Path, prompts: list[list[int]], solo: list[list[int]]
) -> None:
    cost = max(len(p) for p in prompts) + 24
    engine = loaded(tiny_llama_dir, max_batch_tokens=2 * cost, max_batch_size=8)
    rows: list[int] = []
    engine.step_hook = lambda stage, n, columns: rows.append(n) if stage == "decode" else None
    try:
        outputs = run_all(engine, prompts, 24)
    finally:
        engine.unload()
    assert max(rows) == 2  # two of the longest fit the budget; a third would not
    assert outputs == solo  # the waiting ones ran later, to the same tokens


def test_without_a_budget_every_sequence_runs_in_one_batch(
    tiny_llama_dir: Path, prompts: list[list[int]], solo: list[list[int]]
) -> None:
    engine = loaded(tiny_llama_dir, max_batch_size=8, batch_wait_ms=50)
    rows: list[int] = []
    engine.step_hook = lambda stage, n, columns: rows.append(n) if stage == "decode" else None
    try:
        outputs = run_all(engine, prompts, 24)
    finally:
        engine.unload()
    assert max(rows) == len(prompts)
    assert outputs == solo


def preemptions() -> float:
    return REGISTRY.get_sample_value("universal_predictor_preemptions_total", {"model": MODEL}) or 0.0


def run_to_the_end_of_the_context(
    engine: TransformersEngine, prompts: list[list[int]], context: int
) -> list[list[int]]:
    """Greedy generations as a request without ``max_tokens`` gets them: the planner gives each what the
    context leaves after its prompt; EOS ignored, so each really runs that far."""

    async def one(prompt: list[int]) -> list[int]:
        ids: list[int] = []
        params = SamplingParams(max_tokens=context - len(prompt), temperature=0, ignore_eos=True)
        async for chunk in engine.generate(GenerationRequest(f"r{id(prompt)}", prompt, params)):
            ids += chunk.token_ids
        return ids

    async def go() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(go())


def test_requests_without_max_tokens_share_the_batch_and_the_latest_is_preempted_when_the_cache_outgrows_it(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    """Issue 24 item 14: a request that names no ``max_tokens`` may use the whole context; admitting on that
    worst case ran such requests one at a time whenever the budget was near the context. They are admitted
    on their prompts, grow on demand, and the latest is recomputed later when the cache would not fit."""
    context = 128
    short = sorted(prompts, key=len)[:2]
    solo_engine = loaded(tiny_llama_dir, max_batch_size=1, max_model_len=context)
    try:
        alone = [run_to_the_end_of_the_context(solo_engine, [p], context)[0] for p in short]
    finally:
        solo_engine.unload()
    engine = loaded(tiny_llama_dir, max_batch_tokens=context, max_batch_size=8, batch_wait_ms=50)
    rows: list[int] = []
    engine.step_hook = lambda stage, n, columns: rows.append(n) if stage == "decode" else None
    before = preemptions()
    try:
        assert engine.context_length == context
        outputs = run_to_the_end_of_the_context(engine, short, context)
    finally:
        engine.unload()
    assert max(rows) == 2  # both ran together while their cache fitted (worst-case admission: never)
    assert preemptions() - before >= 1  # two rows of 65 columns do not fit 128: the latest waited
    assert outputs == alone  # the preempted one resumed where it stopped: the same tokens, none repeated
    assert [len(o) for o in outputs] == [context - len(p) for p in short]


# -- chunked prefill ---------------------------------------------------------------------------------


def test_a_long_prefill_runs_in_chunks_of_prefill_chunk_tokens_with_the_same_tokens_as_one_pass(
    tiny_llama_dir: Path, prompts: list[list[int]], solo: list[list[int]]
) -> None:
    engine = loaded(tiny_llama_dir, prefill_chunk=8, max_batch_size=8, batch_wait_ms=50)
    steps: list[tuple[int, int]] = []
    engine.step_hook = lambda stage, n, columns: steps.append((n, columns)) if stage == "prefill" else None
    try:
        outputs = run_all(engine, prompts, 24)
    finally:
        engine.unload()
    assert len(steps) > len(prompts)  # the longest prompt alone needs several steps
    assert all(columns <= max(1, 8 // n) for n, columns in steps)  # at most 8 tokens a step over all rows
    assert outputs == solo


# -- out of memory -----------------------------------------------------------------------------------


def test_an_oom_in_a_prefill_fails_only_the_arrivals_with_503_and_the_running_sequence_continues(
    tiny_llama_dir: Path, prompts: list[list[int]], solo: list[list[int]]
) -> None:
    engine = loaded(tiny_llama_dir)
    before = oom_counter()
    steps: list[str] = []
    armed = False
    decoding = asyncio.Event()  # set from the engine thread once the running sequence decodes
    loop: asyncio.AbstractEventLoop | None = None

    def hook(stage: str, rows: int, columns: int) -> None:
        nonlocal armed
        steps.append(stage)
        if stage == "decode" and loop is not None:
            loop.call_soon_threadsafe(decoding.set)
        if armed and stage == "prefill":
            armed = False
            steps.append("oom")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")

    engine.step_hook = hook

    async def go() -> tuple[list[int], BaseException | None, list[int]]:
        nonlocal armed, loop
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(generate(engine, prompts[0], 300))  # long: still running after the OOM
        await decoding.wait()
        armed = True
        error: BaseException | None = None
        try:
            await generate(engine, prompts[2], 24)
        except Unavailable as exc:
            error = exc
        after = await generate(engine, prompts[2], 24)  # the engine serves again, beside the running one
        return await running, error, after

    try:
        running, error, after = asyncio.run(go())
    finally:
        engine.unload()
    assert isinstance(error, Unavailable)
    assert error.status_code == 503
    assert error.code == "out_of_memory"
    assert error.headers() == {"Retry-After": "1"}
    assert "decode" in steps[steps.index("oom") :]  # the running sequence kept decoding after the OOM
    assert len(running) == 300
    assert running[:24] == solo[0]
    assert after == solo[2]
    assert oom_counter() == before + 1


def test_an_oom_in_a_decode_fails_the_whole_batch_with_503_and_the_next_request_is_served(
    tiny_llama_dir: Path, prompts: list[list[int]], solo: list[list[int]]
) -> None:
    engine = loaded(tiny_llama_dir, batch_wait_ms=50)
    engine.step_hook = raise_oom_once("decode")
    before = oom_counter()

    async def go() -> list[Any]:
        return list(await asyncio.gather(*(generate(engine, p, 24) for p in prompts[:3]), return_exceptions=True))

    try:
        results = asyncio.run(go())
        after = run_all(engine, [prompts[1]], 24)
    finally:
        engine.unload()
    assert [type(r) for r in results] == [Unavailable] * 3
    assert all(r.code == "out_of_memory" for r in results)
    assert after == [solo[1]]
    assert oom_counter() == before + 1


def test_a_sticky_device_error_marks_the_engine_dead_for_readiness_and_refuses_what_follows(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    engine = loaded(tiny_llama_dir)

    def hook(step: str, rows: int, columns: int) -> None:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected by the test)")

    engine.step_hook = hook
    try:
        assert engine.health() is None
        with pytest.raises(RuntimeError, match="illegal memory access"):
            run_all(engine, [prompts[0]], 4)
        assert engine.health() == (
            "the GPU reported an unrecoverable error: CUDA error: an illegal memory access was encountered "
            "(injected by the test)"
        )
        with pytest.raises(Unavailable, match="the predictor restarts"):  # refused, not left waiting
            run_all(engine, [prompts[1]], 4)
    finally:
        engine.unload()


@pytest.fixture
def app_predictor(tiny_llama_dir: Path) -> Iterator[GeneratePredictor]:
    predictor = GeneratePredictor(config_for(tiny_llama_dir))
    predictor.load()
    predictor.ready = True
    yield predictor
    predictor.unload()


def test_an_oom_reaches_the_client_as_503_with_retry_after_unary_and_as_an_error_event_streamed(
    app_predictor: GeneratePredictor,
) -> None:
    router = APIRouter()
    app_predictor.add_routes(router)
    app = FastAPI()
    app.include_router(router)
    engine = app_predictor.engine_impl
    assert isinstance(engine, TransformersEngine)
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 4, "temperature": 0}

    async def go() -> tuple[httpx.Response, list[Any], httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://predictor") as client:
            engine.step_hook = raise_oom_once("prefill")
            unary = await client.post("/openai/v1/completions", json=body)
            engine.step_hook = raise_oom_once("decode")
            streamed = await client.post("/openai/v1/completions", json={**body, "stream": True})
            events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            again = await client.post("/openai/v1/completions", json=body)
            return unary, events, again

    unary, events, again = asyncio.run(go())
    assert unary.status_code == 503
    assert unary.headers["Retry-After"] == "1"
    assert unary.json()["error"]["code"] == "out_of_memory"
    # A stream's 200 went out at admission; the failure is its last event, OpenAI-shaped.
    assert events[-1]["error"]["code"] == "out_of_memory"
    assert again.status_code == 200
    assert again.json()["choices"][0]["finish_reason"] == "length"


# -- several GPUs ------------------------------------------------------------------------------------


def test_the_model_is_sharded_with_device_map_only_when_auto_lands_on_cuda_with_several_gpus() -> None:
    assert device_map_for("cuda", "auto", gpus=4) == "auto"
    assert device_map_for("cuda", "auto", gpus=1) is None
    assert device_map_for("cuda:1", "cuda:1", gpus=4) is None  # an explicit device keeps one GPU
    assert device_map_for("cpu", "auto", gpus=0) is None
