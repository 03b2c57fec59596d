"""LoRA adapters on the transformers engine (PEFT, several adapters in one batch): each adapter's greedy output
equals PEFT's merged model's, a batch mixing adapters gives every row its solo output, adapters beyond
``max_loras`` are evicted least recently used first, and an adapter that does not fit is refused by name before
the model is touched, the base serving on unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.predictors.generation.tiny_llama import LlamaShape, build_llama
from tests.predictors.generation.tiny_lora import build_lora, merged_greedy
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.errors import Unavailable
from universal_predictors.generation.adapters import AdapterMismatch, AdapterRef
from universal_predictors.generation.engine import GenerationRequest, SamplingParams
from universal_predictors.generation.engines.transformers import TransformersArgs, TransformersEngine

MAX_TOKENS = 12
ADAPTERS = ("alpha", "beta", "gamma", "delta")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: build_lora(tiny_llama_dir, root / name, seed=i + 1) for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[TransformersEngine]:
    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(tiny_llama_dir))  # fmt: skip
    engine = TransformersEngine(config, TransformersArgs(batch_wait_ms=50, max_loras=3))
    engine.load()
    yield engine
    engine.unload()


def prompt_of(engine: TransformersEngine, i: int) -> list[int]:
    return engine.tokenize(f"The {i} cats sat on the", add_special_tokens=True)


def request(engine: TransformersEngine, i: int, adapter: AdapterRef | None) -> GenerationRequest:
    params = SamplingParams(MAX_TOKENS, 0.0, ignore_eos=True)
    return GenerationRequest(f"r{i}", prompt_of(engine, i), params, adapter=adapter)


async def run(engine: TransformersEngine, req: GenerationRequest) -> list[int]:
    ids: list[int] = []
    async for chunk in engine.generate(req):
        ids += chunk.token_ids
    return ids


def test_each_adapter_says_what_peft_s_merged_model_says(
    engine: TransformersEngine, adapters: dict[str, Path], tiny_llama_dir: Path
) -> None:
    outputs = {}
    for name in (None, "alpha", "beta"):
        ref = AdapterRef(name, adapters[name]) if name else None
        outputs[name] = asyncio.run(run(engine, request(engine, 0, ref)))
        expected = merged_greedy(tiny_llama_dir, adapters[name] if name else None, prompt_of(engine, 0), MAX_TOKENS)
        assert outputs[name] == expected, name
    assert len(set(map(tuple, outputs.values()))) == 3  # the adapters change what the model says


def test_a_batch_mixing_four_adapters_and_the_base_gives_each_row_its_solo_output(
    engine: TransformersEngine, adapters: dict[str, Path]
) -> None:
    steps: list[tuple[str, int, int]] = []
    names = [*ADAPTERS[:2], None, *ADAPTERS[:2], None, ADAPTERS[0], None]  # 8 rows over 2 adapters and the base
    refs = [AdapterRef(n, adapters[n]) if n else None for n in names]
    solo = [asyncio.run(run(engine, request(engine, i, ref))) for i, ref in enumerate(refs)]
    engine.step_hook = lambda stage, rows, columns: steps.append((stage, rows, columns))
    try:

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(run(engine, request(engine, i, r)) for i, r in enumerate(refs))))

        batched = asyncio.run(together())
    finally:
        engine.step_hook = None
    assert batched == solo
    assert max(rows for stage, rows, _ in steps if stage == "decode") == len(names)  # one batch, adapters mixed


def test_adapters_of_other_ranks_and_modules_mix_in_one_batch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A rank-4 adapter first, then rank 16 (every slot's matrices padded to the larger rank) on partly other modules:
    each row of a mixed batch still says what PEFT's merged model says for its adapter."""
    shapes = {"narrow": (4, ("q_proj", "v_proj")), "broad": (16, ("q_proj", "k_proj", "o_proj", "up_proj"))}
    folders = {n: build_lora(tiny_llama_dir, tmp_path / n, seed=5 + i, rank=r, targets=t)
               for i, (n, (r, t)) in enumerate(shapes.items())}  # fmt: skip
    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(tiny_llama_dir))  # fmt: skip
    engine = TransformersEngine(config, TransformersArgs(batch_wait_ms=50, max_loras=2))
    engine.load()
    try:
        engine.load_adapter(AdapterRef("narrow", folders["narrow"]))  # the slots are made at rank 4, then grown
        names = ["narrow", "broad", None, "broad", "narrow"]
        refs = [AdapterRef(n, folders[n]) if n else None for n in names]

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(run(engine, request(engine, i, r)) for i, r in enumerate(refs))))

        batched = asyncio.run(together())
        prompts = [prompt_of(engine, i) for i in range(len(names))]
    finally:
        engine.unload()
    for i, name in enumerate(names):
        expected = merged_greedy(tiny_llama_dir, folders[name] if name else None, prompts[i], MAX_TOKENS)
        assert batched[i] == expected, (i, name)


def test_adapters_beyond_max_loras_evict_the_least_recently_used(
    engine: TransformersEngine, adapters: dict[str, Path]
) -> None:
    for name in ADAPTERS:
        asyncio.run(run(engine, request(engine, 1, AdapterRef(name, adapters[name]))))
    assert engine.adapters_loaded == ["beta", "gamma", "delta"]  # max_loras=3: alpha, the oldest, went
    again = asyncio.run(run(engine, request(engine, 1, AdapterRef("alpha", adapters["alpha"]))))
    assert engine.adapters_loaded == ["gamma", "delta", "alpha"]
    assert again == asyncio.run(run(engine, request(engine, 1, AdapterRef("alpha", adapters["alpha"]))))
    assert engine.unload_adapter("gamma")
    assert engine.adapters_loaded == ["delta", "alpha"]


def test_busy_adapters_are_not_evicted_and_the_caller_hears_503(
    engine: TransformersEngine, adapters: dict[str, Path]
) -> None:
    for name in ("alpha", "beta", "gamma"):
        engine.load_adapter(AdapterRef(name, adapters[name]))
    for name in ("alpha", "beta", "gamma"):
        engine._adapter_users[name] += 1  # as three running sequences would
    try:
        with pytest.raises(Unavailable, match="max_loras"):
            engine.load_adapter(AdapterRef("delta", adapters["delta"]))
    finally:
        for name in ("alpha", "beta", "gamma"):
            engine._adapter_users[name] -= 1


def test_an_adapter_of_another_base_is_refused_by_name_and_the_base_serves_on(
    engine: TransformersEngine, tmp_path: Path
) -> None:
    base_before = asyncio.run(run(engine, request(engine, 2, None)))
    wider = build_llama(tmp_path / "wider", LlamaShape(hidden=256, heads=4, intermediate=512))
    foreign = build_lora(wider, tmp_path / "foreign", seed=9)
    with pytest.raises(
        AdapterMismatch, match=r"the adapter expects 512 -> 256 features, the base model has 256 -> 128"
    ):
        engine.load_adapter(AdapterRef("foreign", foreign))
    other_modules = build_lora(wider, tmp_path / "gate", seed=9, targets=("gate_proj",))
    with pytest.raises(AdapterMismatch):
        engine.load_adapter(AdapterRef("gate", other_modules))
    assert "foreign" not in engine.adapters_loaded
    assert asyncio.run(run(engine, request(engine, 2, None))) == base_before
