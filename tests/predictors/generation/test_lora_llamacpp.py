"""LoRA adapters on the llama.cpp engine (GGUF LoRAs, one adapter per decode, grouped): each adapter's greedy
output equals llama-cpp-python's own ``Llama(lora_path=...)``, a batch mixing adapters gives every request its
solo output, adapters beyond ``max_loras`` are freed least recently used first, and an adapter that does not
fit is refused by name before llama.cpp reads it, the base serving on unchanged."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the llamacpp engine needs llama-cpp-python")

from tests.predictors.generation.tiny_llama import LlamaShape, build_llama
from tests.predictors.generation.tiny_lora import build_lora, lora_to_gguf
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.errors import Unavailable
from universal_predictors.generation.adapters import AdapterMismatch, AdapterRef
from universal_predictors.generation.engine import GenerationRequest, SamplingParams
from universal_predictors.generation.engines.llamacpp import LlamaCppArgs, LlamaCppEngine

MAX_TOKENS = 12
N_CTX = 128
ADAPTERS = ("alpha", "beta", "gamma", "delta", "epsilon")


@pytest.fixture(scope="module")
def llama_cpp_source() -> Path:
    from bench.llama_server import vendored_llama_cpp

    return vendored_llama_cpp()


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, llama_cpp_source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each adapter's folder holding its one GGUF LoRA (the PEFT folder converted by llama.cpp's converter)."""
    root = tmp_path_factory.mktemp("gguf-loras")
    peft = {name: build_lora(tiny_llama_dir, root / "peft" / name, seed=i + 1) for i, name in enumerate(ADAPTERS)}
    for name in ADAPTERS:
        (root / name).mkdir()
    lora_to_gguf(tiny_llama_dir, {peft[name]: root / name / f"{name}-f32.gguf" for name in ADAPTERS}, llama_cpp_source)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def engine(tiny_llama_gguf: Path) -> Iterator[LlamaCppEngine]:
    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.LLAMACPP,
                             source=str(tiny_llama_gguf))  # fmt: skip
    engine = LlamaCppEngine(config, LlamaCppArgs(n_parallel=8, n_ctx=N_CTX, max_loras=4))
    engine.load()
    yield engine
    engine.unload()


def prompt_of(engine: LlamaCppEngine, i: int) -> list[int]:
    return engine.tokenize(f"The {i} cats sat on the", add_special_tokens=True)


def request(engine: LlamaCppEngine, i: int, adapter: AdapterRef | None) -> GenerationRequest:
    return GenerationRequest(f"r{i}", prompt_of(engine, i), SamplingParams(MAX_TOKENS, 0.0, ignore_eos=True),
                             adapter=adapter)  # fmt: skip


def ref(adapters: dict[str, Path], name: str | None) -> AdapterRef | None:
    return AdapterRef(name, adapters[name]) if name else None


async def run(engine: LlamaCppEngine, req: GenerationRequest) -> list[int]:
    ids: list[int] = []
    async for chunk in engine.generate(req):
        ids += chunk.token_ids
    return ids


def reference_greedy(base: Path, adapter_gguf: Path | None, prompt: list[int], eog: frozenset[int]) -> list[int]:
    """llama-cpp-python's own LoRA path: ``Llama(lora_path=...)``, greedy, EOS masked (as ``ignore_eos``)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter_gguf) if adapter_gguf else None, n_ctx=N_CTX,
                          seed=0, n_threads=1, verbose=False)  # fmt: skip

    def no_eos(_: object, logits: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
        logits[list(eog)] = -np.inf
        return logits

    out: list[int] = []
    try:
        for token in llm.generate(prompt, temp=0.0, top_k=1, logits_processor=llama_cpp.LogitsProcessorList([no_eos])):
            out.append(int(token))
            if len(out) == MAX_TOKENS:
                break
    finally:
        llm.close()
    return out


def test_each_adapter_says_what_llama_cpp_python_s_own_lora_path_says(
    engine: LlamaCppEngine, adapters: dict[str, Path], tiny_llama_gguf: Path
) -> None:
    """The same prompt in turn on the base and two adapters: a slot's cache of one is never reused by another
    (K and V depend on the adapter), so each matches the reference of its own."""
    outputs = {}
    prompt = prompt_of(engine, 0)
    for name in (None, "alpha", "beta", None):
        outputs[name] = asyncio.run(run(engine, request(engine, 0, ref(adapters, name))))
        gguf = next(adapters[name].glob("*.gguf")) if name else None
        assert outputs[name] == reference_greedy(tiny_llama_gguf, gguf, prompt, engine.eos_token_ids), name
    assert len(set(map(tuple, outputs.values()))) == 3  # the adapters change what the model says


def test_a_batch_mixing_four_adapters_and_the_base_gives_each_request_its_solo_output(
    engine: LlamaCppEngine, adapters: dict[str, Path]
) -> None:
    names = ["alpha", "beta", "gamma", "delta", None, "alpha", None, "beta"]  # 8 sequences, 8 slots
    refs = [ref(adapters, n) for n in names]
    solo = [asyncio.run(run(engine, request(engine, i, r))) for i, r in enumerate(refs)]
    decodes: list[tuple[str | None, int]] = []
    engine.step_hook = lambda adapter, tokens: decodes.append((adapter, tokens))
    try:

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(run(engine, request(engine, i, r)) for i, r in enumerate(refs))))

        batched = asyncio.run(together())
    finally:
        engine.step_hook = None
    assert batched == solo
    # Decoded together: one decode per adapter a step, each adapter's sequences in one batch (two generating
    # on alpha, beta and the base), the groups taking turns rather than one after the other.
    assert {(adapter, 2) for adapter in ("alpha", "beta", None)} <= set(decodes)
    switches = sum(1 for a, b in itertools.pairwise(decodes) if a[0] != b[0])
    assert switches >= 4 * (MAX_TOKENS - 1)


def test_adapters_beyond_max_loras_are_freed_least_recently_used_first(
    engine: LlamaCppEngine, adapters: dict[str, Path]
) -> None:
    for name in ("alpha", "beta", "gamma", "delta", "epsilon"):
        asyncio.run(run(engine, request(engine, 1, ref(adapters, name))))
    assert engine.adapters_loaded == ["beta", "gamma", "delta", "epsilon"]  # max_loras=4: alpha, the oldest, went
    again = asyncio.run(run(engine, request(engine, 1, ref(adapters, "alpha"))))
    assert engine.adapters_loaded == ["gamma", "delta", "epsilon", "alpha"]
    assert not engine.load_adapter(AdapterRef("alpha", adapters["alpha"]))  # resident: nothing to do
    assert again == asyncio.run(run(engine, request(engine, 1, ref(adapters, "alpha"))))
    assert engine.unload_adapter("gamma")
    assert engine.adapters_loaded == ["delta", "epsilon", "alpha"]


def test_busy_adapters_are_not_freed_and_the_caller_hears_503(
    engine: LlamaCppEngine, adapters: dict[str, Path]
) -> None:
    busy = ("alpha", "beta", "gamma", "delta")
    for name in busy:
        engine.load_adapter(AdapterRef(name, adapters[name]))
    for name in busy:
        engine._adapter_users[name] += 1  # as four running sequences would
    try:
        with pytest.raises(Unavailable, match="max_loras") as refused:
            engine.load_adapter(AdapterRef("epsilon", adapters["epsilon"]))
        assert refused.value.code == "adapters_busy"
        assert not engine.unload_adapter("alpha")
    finally:
        for name in busy:
            engine._adapter_users[name] -= 1
    assert sorted(engine.adapters_loaded) == sorted(busy)


def test_an_adapter_that_does_not_fit_is_refused_by_name_and_the_base_serves_on(
    engine: LlamaCppEngine, adapters: dict[str, Path], llama_cpp_source: Path, tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    base_before = asyncio.run(run(engine, request(engine, 2, None)))
    wider = build_llama(tmp_path / "wider", LlamaShape(hidden=256, heads=4, intermediate=512))
    (tmp_path / "foreign").mkdir()
    lora_to_gguf(wider, {build_lora(wider, tmp_path / "peft", seed=9): tmp_path / "foreign" / "f.gguf"},
                 llama_cpp_source)  # fmt: skip
    loaded = engine.adapters_loaded
    with pytest.raises(AdapterMismatch, match=r"blk\.\d\.\w+\.weight: the adapter expects \d+ -> \d+ features, "
                                              r"the base model has \d+ -> \d+"):  # fmt: skip
        engine.load_adapter(AdapterRef("foreign", tmp_path / "foreign"))
    with pytest.raises(AdapterMismatch, match="not a GGUF LoRA adapter"):  # a model, not an adapter
        engine.load_adapter(AdapterRef("model", tiny_llama_gguf))
    with pytest.raises(AdapterMismatch, match=r"one GGUF LoRA \(\*\.gguf\)"):  # a PEFT folder, not converted
        engine.load_adapter(AdapterRef("peft", tmp_path / "peft"))
    assert engine.adapters_loaded == loaded
    with pytest.raises(AdapterMismatch):  # and a request naming it fails alone
        asyncio.run(run(engine, request(engine, 2, AdapterRef("foreign", tmp_path / "foreign"))))
    assert asyncio.run(run(engine, request(engine, 2, None))) == base_before
    assert engine._adapter_users["foreign"] == 0


def test_a_predictor_process_serves_its_gguf_adapters_by_name(
    engine: LlamaCppEngine, adapters: dict[str, Path], tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    """The whole predictor on llama.cpp: ``--adapters-file`` lists GGUF LoRA folders, ``tiny:beta`` answers as
    llama-cpp-python's own ``lora_path`` run does, and ``/v1/models`` lists the adapters with their parent."""
    import json

    import openai

    from tests.predictors.harness import running_predictor

    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps({"adapters": [{"name": n, "uri": str(adapters[n])} for n in ("alpha", "beta")]}))
    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.LLAMACPP,
                             source=str(tiny_llama_gguf), engine_args={"n_ctx": str(N_CTX)},
                             adapters_file=str(listing))  # fmt: skip
    prompt = prompt_of(engine, 3)
    expected_ids = reference_greedy(
        tiny_llama_gguf, next(adapters["beta"].glob("*.gguf")), prompt, engine.eos_token_ids
    )
    with running_predictor(config, tmp_path) as running:
        client = openai.OpenAI(base_url=running.openai_url, api_key="unused", max_retries=0)
        cards = {m.id: m.model_extra for m in client.models.list().data}
        assert cards["tiny:beta"]["parent"] == "tiny"
        answer = client.completions.create(model="tiny:beta", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        assert answer.model == "tiny:beta"
        with running.client() as http:
            expected = http.post("/detokenize", json={"model": "tiny", "tokens": expected_ids}).json()["prompt"]
        assert answer.choices[0].text == expected.removesuffix("\ufffd")  # a held-back partial character
