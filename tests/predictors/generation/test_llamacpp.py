"""The llama.cpp engine beyond the shared conformance suite: agreement with transformers on the same
weights, the context plan from a cgroup memory limit, ``--source-file`` matching, start-up errors and
the bounded queue, and continuous batching (slots, prefix reuse, chunked prompts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import openai
import pytest
from prometheus_client import REGISTRY

pytest.importorskip("llama_cpp", reason="the llamacpp engine needs llama-cpp-python")

from tests.predictors.generation.tiny_llama import CHAT_TEMPLATE
from tests.predictors.harness import PredictorProcess, run_predictor_cli, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.engine import (
    Engine,
    GenerationRequest,
    JSONSchemaConstraint,
    SamplingParams,
    TokenLogprob,
)
from universal_predictors.generation.engines.llamacpp import (
    MIB,
    LlamaCppArgs,
    LlamaCppEngine,
    ModelShape,
    find_gguf,
    flash_attn_type,
    plan_context,
    plan_slots,
)
from universal_predictors.host import container_memory_limit, default_threads, physical_cores

GIB = 1 << 30


def config_for(source: Path, backend: Backend, source_file: str | None = None) -> PredictorConfig:
    return PredictorConfig(
        model_name="tiny-llama", task=Task.GENERATE, backend=backend, source=str(source), source_file=source_file
    )


@pytest.fixture(scope="module")
def llama_engine(tiny_llama_gguf: Path) -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(config_for(tiny_llama_gguf, Backend.LLAMACPP), LlamaCppArgs())
    engine.load()
    yield engine
    engine.unload()


@pytest.fixture(scope="module")
def hf_engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    from universal_predictors.generation.engines.transformers import TransformersArgs, TransformersEngine

    engine = TransformersEngine(config_for(tiny_llama_dir, Backend.TRANSFORMERS), TransformersArgs())
    engine.load()
    yield engine
    engine.unload()


def run(engine: Engine, prompt: list[int], **params: object) -> tuple[list[int], str, str | None, list[TokenLogprob]]:
    """Drive one sequence to its end: (token ids, text, finish_reason, logprobs)."""
    constraint = params.pop("constraint", None)

    async def go() -> tuple[list[int], str, str | None, list[TokenLogprob]]:
        ids: list[int] = []
        text, finish, logprobs = "", None, []
        request = GenerationRequest("r", prompt, SamplingParams(**params), constraint)  # type: ignore[arg-type]
        async for chunk in engine.generate(request):
            ids += chunk.token_ids
            text += chunk.text
            logprobs += chunk.logprobs or []
            finish = chunk.finish_reason
        return ids, text, finish, logprobs

    return asyncio.run(go())


# -- the same weights on both engines ----------------------------------------------------------------

TEXTS = [
    "The river in Paris",
    "Hello, how are you today?",
    'Unicode: café, naïve, Zürich, 東京 🙂 {"city": "Oslo", "count": 42}',
    "  leading spaces\nand\ttabs, numbers 3.14 -7 2024",
    "text with a special token <|im_end|> inside",
]


@pytest.mark.parametrize("add_special", [True, False])
def test_llamacpp_tokenises_exactly_like_transformers(
    llama_engine: LlamaCppEngine, hf_engine: Engine, add_special: bool
) -> None:
    for text in TEXTS:
        ids = hf_engine.tokenize(text, add_special_tokens=add_special)
        assert llama_engine.tokenize(text, add_special_tokens=add_special) == ids, text
        assert llama_engine.detokenize(ids) == hf_engine.detokenize(ids), text


def test_llamacpp_renders_the_gguf_chat_template_like_transformers(
    llama_engine: LlamaCppEngine, hf_engine: Engine
) -> None:
    assert llama_engine.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for tool_list in (None, tools):
        text = llama_engine.apply_chat_template(messages, tool_list)
        assert text == hf_engine.apply_chat_template(messages, tool_list)
        assert llama_engine.tokenize(text, add_special_tokens=False) == hf_engine.tokenize(
            text, add_special_tokens=False
        )


def test_llamacpp_greedy_tokens_and_logprobs_match_transformers(
    llama_engine: LlamaCppEngine, hf_engine: Engine
) -> None:
    for text in TEXTS[:3]:
        prompt = hf_engine.tokenize(text, add_special_tokens=True)
        ours = run(llama_engine, prompt, max_tokens=16, temperature=0.0, logprobs=3)
        theirs = run(hf_engine, prompt, max_tokens=16, temperature=0.0, logprobs=3)
        assert ours[0] == theirs[0], text
        assert ours[1] == theirs[1]
        assert ours[2] == theirs[2] == "length"
        for mine, ref in zip(ours[3], theirs[3], strict=True):
            assert mine.logprob == pytest.approx(ref.logprob, abs=1e-2)  # F32 on both, summed differently
            assert [t.token_id for t in mine.top] == [t.token_id for t in ref.top]


def test_llamacpp_penalties_match_transformers_under_greedy(llama_engine: LlamaCppEngine, hf_engine: Engine) -> None:
    prompt = hf_engine.tokenize("The river in Paris", add_special_tokens=True)
    plain = run(llama_engine, prompt, max_tokens=24, temperature=0.0)[0]
    penalised = run(llama_engine, prompt, max_tokens=24, temperature=0.0, presence_penalty=0.8, frequency_penalty=0.6)
    assert penalised[0] != plain
    assert penalised[0] == run(hf_engine, prompt, max_tokens=24, temperature=0.0, presence_penalty=0.8,
                               frequency_penalty=0.6)[0]  # fmt: skip
    # A penalty large enough that no token may come twice.
    unique = run(llama_engine, prompt, max_tokens=40, temperature=0.0, presence_penalty=100.0)[0]
    assert len(set(unique)) == len(unique)


def test_llamacpp_same_seed_same_tokens_different_seed_different_tokens(llama_engine: LlamaCppEngine) -> None:
    prompt = llama_engine.tokenize("Once upon a time", add_special_tokens=True)
    first = run(llama_engine, prompt, max_tokens=24, temperature=1.0, seed=7)[0]
    assert run(llama_engine, prompt, max_tokens=24, temperature=1.0, seed=7)[0] == first
    assert run(llama_engine, prompt, max_tokens=24, temperature=1.0, seed=8)[0] != first


def test_llamacpp_schema_grammar_yields_valid_json_and_ends_with_eos(llama_engine: LlamaCppEngine) -> None:
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}  # fmt: skip
    prompt = llama_engine.tokenize("Give me JSON:", add_special_tokens=True)
    ids, text, finish, _ = run(llama_engine, prompt, max_tokens=200, temperature=0.8, seed=3,
                               constraint=JSONSchemaConstraint(schema))  # fmt: skip
    assert finish == "stop"
    assert ids[-1] in llama_engine.eos_token_ids
    jsonschema.validate(json.loads(text), schema)


def test_both_engines_report_the_models_vocabulary_size(
    llama_engine: LlamaCppEngine, hf_engine: Engine, tiny_llama_dir: Path
) -> None:
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    assert llama_engine.vocab_size == hf_engine.vocab_size == vocab


def test_llamacpp_rejects_out_of_vocabulary_prompt_ids(llama_engine: LlamaCppEngine) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(llama_engine, [0, 10_000], max_tokens=2)


# -- continuous batching ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batching_engine(tiny_llama_gguf: Path) -> Iterator[LlamaCppEngine]:
    """Two slots and a small batch, so prompt chunking shows with short prompts."""
    engine = LlamaCppEngine(config_for(tiny_llama_gguf, Backend.LLAMACPP), LlamaCppArgs(n_parallel=2, n_batch=16))
    engine.load()
    yield engine
    engine.unload()


def prompt_tokens_evaluated() -> float:
    return REGISTRY.get_sample_value("universal_predictor_prompt_tokens_total", {"model": "tiny-llama"}) or 0.0


def test_a_prompt_sharing_a_cached_prefix_evaluates_only_the_rest_and_each_slot_keeps_its_own(
    batching_engine: LlamaCppEngine,
) -> None:
    engine = batching_engine
    system = engine.tokenize("You are a weather service. Answer in one line. " * 3, add_special_tokens=True)
    before = prompt_tokens_evaluated()
    ids = run(engine, system, max_tokens=4, temperature=0.0)[0]
    assert prompt_tokens_evaluated() - before == len(system)  # a cold slot reads the whole prompt
    # The next turn extends it: only what the slot does not hold is read (the cache holds the prompt and
    # every generated token but the last; the last prompt token is always read again for its logits).
    turn = system + engine.tokenize(" Oslo?", add_special_tokens=False)
    cached = system + ids[:-1]
    shared = next(
        (i for i, (a, b) in enumerate(zip(cached, turn, strict=False)) if a != b), min(len(cached), len(turn))
    )
    before = prompt_tokens_evaluated()
    run(engine, turn, max_tokens=4, temperature=0.0)
    assert prompt_tokens_evaluated() - before == len(turn) - min(shared, len(turn) - 1)
    assert len(turn) - min(shared, len(turn) - 1) < len(turn) // 2
    # An unrelated prompt takes the other slot (least recently used), so the first slot's cache survives.
    run(engine, engine.tokenize("Completely different words here", add_special_tokens=True), max_tokens=2)
    before = prompt_tokens_evaluated()
    again = run(engine, turn, max_tokens=4, temperature=0.0)
    assert prompt_tokens_evaluated() - before == 1
    assert again[0] == run(engine, turn, max_tokens=4, temperature=0.0)[0]


def test_a_long_prompt_is_read_in_chunks_while_a_running_stream_keeps_streaming(
    batching_engine: LlamaCppEngine,
) -> None:
    engine = batching_engine
    short = engine.tokenize("Go on and on", add_special_tokens=True)
    long = engine.tokenize("a long document about rivers " * 40, add_special_tokens=True)[:200]

    async def go() -> tuple[int, int, list[int]]:
        streamed = 0
        long_started = asyncio.Event()
        at_long_start: list[int] = []

        async def stream_short() -> None:
            nonlocal streamed
            request = GenerationRequest("a", short, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
            async for chunk in engine.generate(request):
                streamed += len(chunk.token_ids)
                long_started.set()  # the stream is running: now the long prompt arrives

        async def stream_long() -> list[int]:
            await long_started.wait()
            ids: list[int] = []
            request = GenerationRequest("b", long, SamplingParams(max_tokens=3, temperature=0.0))
            async for chunk in engine.generate(request):
                if not ids:
                    at_long_start.append(streamed)
                ids += chunk.token_ids
            return ids

        short_task = asyncio.create_task(stream_short())
        long_ids = await stream_long()
        at_end = streamed
        await short_task
        return at_long_start[0], at_end, long_ids

    at_first_long_token, _, long_ids = asyncio.run(go())
    solo_long = run(engine, long, max_tokens=3, temperature=0.0)[0]  # afterwards: a cold cache above
    # 16-token batches: one token of the running stream and 15 prompt tokens each, so the 200-token
    # prompt takes 14 steps, in each of which the stream got a token (never one step swallowing it all),
    # and the long prompt's answer is the same as when it ran alone.
    assert at_first_long_token >= 8
    assert at_first_long_token < 80  # the long prompt did not wait for the stream to finish
    assert long_ids == solo_long


def test_concurrent_sequences_beyond_the_slots_wait_and_all_match_their_solo_outputs(
    batching_engine: LlamaCppEngine,
) -> None:
    engine = batching_engine
    prompts = [engine.tokenize(f"Item {i}: the market in Lima", add_special_tokens=True) for i in range(5)]
    alone = [run(engine, p, max_tokens=6, temperature=0.8, seed=i)[0] for i, p in enumerate(prompts)]

    async def together() -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            ids: list[int] = []
            request = GenerationRequest(str(i), prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=i))
            async for chunk in engine.generate(request):
                ids += chunk.token_ids
            return ids

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    assert asyncio.run(together()) == alone  # 5 sequences through 2 slots: 3 waited, none changed


def test_slots_default_from_cpus_and_shrink_until_each_keeps_a_useful_context() -> None:
    # Plenty of memory: two slots per CPU (at least 2, at most 8), each with the training context.
    assert plan_slots(SEVEN_B, 4 * GIB, 64 * GIB, None, None, cpus=2) == (32768, 4)
    assert plan_slots(SEVEN_B, 4 * GIB, 256 * GIB, None, None, cpus=16) == (32768, 8)
    assert plan_slots(SEVEN_B, 4 * GIB, 64 * GIB, None, None, cpus=1) == (32768, 2)
    # 8 GiB: the cache left after the weights and a reserve, shared by 4 slots of 6553 tokens.
    assert plan_slots(SEVEN_B, 4 * GIB, 8 * GIB, None, None, cpus=2) == (6553, 4)
    # 5 GiB: 4096 tokens of cache in all; split, no slot would keep a useful context: one slot.
    assert plan_slots(SEVEN_B, 4 * GIB, 5 * GIB, None, None, cpus=2) == (4096, 1)
    # Explicit values win when they fit, and are refused with the numbers when they do not.
    assert plan_slots(SEVEN_B, 4 * GIB, 8 * GIB, None, 2, cpus=2) == (13107, 2)
    assert plan_slots(SEVEN_B, 4 * GIB, 8 * GIB, 2048, None, cpus=2) == (2048, 4)
    with pytest.raises(ValueError, match=r"for each of 8 slots \(n_parallel\).*lower n_ctx or n_parallel"):
        plan_slots(SEVEN_B, 4 * GIB, 8 * GIB, 4096, 8, cpus=2)


def test_a_quantized_kv_cache_holds_more_context_and_serves_with_flash_attention(tiny_llama_gguf: Path) -> None:
    # q8_0 K and V: 34 bytes per 32 values instead of 64, so the same memory holds 1.88x the tokens.
    q8 = dataclasses.replace(SEVEN_B, k_bytes=34 / 32, v_bytes=34 / 32)
    assert q8.kv_bytes_per_token == 32 * 8 * 128 * 2 * 34 // 32
    assert plan_slots(q8, 4 * GIB, 8 * GIB, None, None, cpus=2) == (12336, 4)
    state_bytes = {}
    for cache in ("f16", "q8_0"):
        engine = LlamaCppEngine(config_for(tiny_llama_gguf, Backend.LLAMACPP),
                                LlamaCppArgs(type_k=cache, type_v=cache, n_parallel=1))  # fmt: skip
        engine.load()
        try:
            assert engine.describe()["flash_attn"] is (cache == "q8_0")  # a quantized V cache needs it
            assert engine.describe()["kv_cache_types"] == f"{cache}/{cache}"
            prompt = engine.tokenize("The river in Paris", add_special_tokens=True)
            ids, _, finish, _ = run(engine, prompt, max_tokens=8, temperature=0.0)
            assert len(ids) == 8
            assert finish == "length"
            # What llama.cpp itself holds: the cached cells serialise at their element type's size.
            state_bytes[cache] = llama_cpp.llama_state_get_size(engine._ctx.ctx)
        finally:
            engine.unload()
    assert state_bytes["q8_0"] < state_bytes["f16"] * 0.8


def test_flash_attention_left_unset_is_llama_cpps_own_choice_not_off() -> None:
    assert flash_attn_type(None) == llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    assert flash_attn_type(True) == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert flash_attn_type(False) == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert LlamaCppArgs().flash_attention(gpu=True) is None  # on a GPU: llama.cpp decides per device


def test_the_gpus_free_memory_caps_an_offloaded_models_context_and_is_named_when_short() -> None:
    # Every layer on the GPU: the weights and the cache live in its memory, not under the cgroup limit.
    assert plan_slots(SEVEN_B, 4 * GIB, 8 * GIB, None, None, cpus=2, limit_name="the GPUs' free memory") == (6553, 4)
    with pytest.raises(ValueError, match=r"the GPUs' free memory \(6144 MiB\).*or raise the GPUs' free memory"):
        plan_slots(SEVEN_B, 4 * GIB, 6 * GIB, 32768, 1, cpus=2, limit_name="the GPUs' free memory")


@pytest.mark.parametrize(
    ("engine_arg", "message"),
    [
        ("type_v=q8_0 flash_attn=false", "type_v=q8_0 needs flash_attn"),
        ("tensor_split=3,x", "tensor_split '3,x': comma-separated numbers"),
        ("split_mode=diagonal", "split_mode"),
    ],
)
def test_gpu_engine_arguments_are_checked_at_start_up_with_one_line(
    tiny_llama_gguf: Path, engine_arg: str, message: str
) -> None:
    args = [f"--engine-arg={pair}" for pair in engine_arg.split()]
    result = run_predictor_cli(["--model_name=m", "--task=generate", "--backend=llamacpp",
                                f"--source={tiny_llama_gguf}", *args])  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]


def test_a_llamacpp_predictor_keeps_openmp_threads_spinning_and_every_other_waits_passively(
    tiny_llama_gguf: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from universal_predictors.__main__ import set_openmp_wait_policy

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    set_openmp_wait_policy(config_for(tiny_llama_gguf, Backend.AUTO))  # a GGUF: auto is llama.cpp
    assert "OMP_WAIT_POLICY" not in os.environ  # libgomp's default: spin at llama.cpp's barriers
    set_openmp_wait_policy(config_for(tiny_llama_dir, Backend.TRANSFORMERS))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the environment's own choice wins
    set_openmp_wait_policy(config_for(tiny_llama_dir, Backend.TRANSFORMERS))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_decode_threads_default_to_physical_cores_with_hyperthread_siblings_counted_once(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    for cpu in allowed:  # every allowed CPU a hyperthread of one core
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{allowed[0]}-{allowed[-1]}\n")
    assert physical_cores(tmp_path) == 1
    for cpu in allowed:  # each its own core
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{cpu}\n")
    assert physical_cores(tmp_path) == min(len(allowed), default_threads())


# -- the context plan ----------------------------------------------------------------------------------

# A 7B-class shape: 32 layers, 8 KV heads of 128: 128 KiB of f16 KV cache per token.
SEVEN_B = ModelShape(train_context=32768, layers=32, kv_heads=8, key_dim=128, value_dim=128)


def test_kv_bytes_per_token_come_from_layers_kv_heads_and_head_size() -> None:
    assert SEVEN_B.kv_bytes_per_token == 32 * 8 * 256 * 2
    metadata = {"general.architecture": "qwen2", "qwen2.context_length": "4096", "qwen2.block_count": "24",
                "qwen2.attention.head_count": "14", "qwen2.attention.head_count_kv": "2",
                "qwen2.embedding_length": "896"}  # fmt: skip
    shape = ModelShape.from_metadata(metadata)
    assert shape == ModelShape(train_context=4096, layers=24, kv_heads=2, key_dim=64, value_dim=64)
    with pytest.raises(ValueError, match=r"qwen2\.block_count"):
        ModelShape.from_metadata({k: v for k, v in metadata.items() if "block_count" not in k})


def test_context_is_the_training_context_when_memory_is_plentiful() -> None:
    assert plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=64 * GIB, requested=None) == 32768
    assert plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=None, requested=None) == 32768


def test_context_is_capped_by_the_kv_cache_that_fits_beside_the_weights() -> None:
    # 8 GiB limit - 4 GiB weights - 819 MiB reserve (10%) = 3277 MiB of cache = 26214 tokens of 128 KiB.
    n_ctx = plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=8 * GIB, requested=None)
    assert n_ctx == (8 * GIB - 4 * GIB - int(8 * GIB * 0.10)) // SEVEN_B.kv_bytes_per_token
    assert 16384 < n_ctx < 32768
    # Half the memory, much less context; the cap always leaves the weights and the reserve.
    small = plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=5 * GIB, requested=None)
    assert small * SEVEN_B.kv_bytes_per_token <= 5 * GIB - 4 * GIB - 512 * MIB


def test_a_model_that_leaves_no_room_for_a_cache_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"does not fit.*4096 MiB.*weights \(4096 MiB\)"):
        plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=4 * GIB, requested=None)


def test_an_explicit_n_ctx_wins_but_must_fit_memory_and_the_training_context() -> None:
    assert plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=64 * GIB, requested=2048) == 2048
    with pytest.raises(ValueError, match=r"n_ctx=65536 exceeds the model's training context \(32768\)"):
        plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=64 * GIB, requested=65536)
    with pytest.raises(ValueError, match=r"n_ctx=32768 needs 4096 MiB of KV cache.*the memory limit \(6144 MiB\)"):
        plan_context(SEVEN_B, weights_bytes=4 * GIB, memory_limit=6 * GIB, requested=32768)


def test_memory_limit_is_read_from_cgroup_v2_and_v1_not_the_host(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    assert container_memory_limit(v2) == 8 * GIB
    (v2 / "memory.max").write_text("max\n")
    assert container_memory_limit(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("2147483648\n")
    assert container_memory_limit(v1) == 2 * GIB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert container_memory_limit(v1) is None
    assert container_memory_limit(tmp_path / "none") is None


# -- picking the GGUF file ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_folder(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-folder")
    shutil.copy(tiny_llama_gguf, folder / "tiny-llama-F32.gguf")
    (folder / "quant").mkdir()
    shutil.copy(tiny_llama_gguf, folder / "quant" / "tiny-llama-Q8_0.gguf")
    (folder / "README.md").write_text("not a model")
    return folder


def test_source_file_glob_picks_one_gguf_inside_the_source(gguf_folder: Path, tiny_llama_gguf: Path) -> None:
    assert find_gguf(gguf_folder, "*F32.gguf") == gguf_folder / "tiny-llama-F32.gguf"
    assert find_gguf(gguf_folder, "quant/*Q8_0*") == gguf_folder / "quant" / "tiny-llama-Q8_0.gguf"
    assert find_gguf(gguf_folder, None) == gguf_folder / "tiny-llama-F32.gguf"  # the only top-level .gguf
    assert find_gguf(tiny_llama_gguf, None) == tiny_llama_gguf  # a single file as the source
    assert find_gguf(tiny_llama_gguf, "*.gguf") == tiny_llama_gguf


def test_source_file_errors_name_the_pattern_and_the_files_found(gguf_folder: Path, tiny_llama_gguf: Path) -> None:
    with pytest.raises(ValueError, match=r"'\*Q4_K_M\*' matches no file .*quant/tiny-llama-Q8_0.gguf, tiny-llama-F32"):
        find_gguf(gguf_folder, "*Q4_K_M*")
    with pytest.raises(ValueError, match=r"'\*\*/\*.gguf' matches 2 files .*tiny-llama-F32.gguf.*exactly one"):
        find_gguf(gguf_folder, "**/*.gguf")
    with pytest.raises(ValueError, match=r"'\*Q4\*' does not match the source file"):
        find_gguf(tiny_llama_gguf, "*Q4*")


def test_a_source_file_pattern_matching_nothing_stops_start_up_with_one_line(gguf_folder: Path) -> None:
    result = run_predictor_cli(["--model_name=m", "--task=generate", "--backend=llamacpp",
                                f"--source={gguf_folder}", "--source-file=*Q4_K_M*.gguf"])  # fmt: skip
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "*Q4_K_M*.gguf" in line
    assert "tiny-llama-F32.gguf" in line


def test_unknown_llamacpp_engine_argument_stops_start_up_with_one_line(tiny_llama_gguf: Path) -> None:
    result = run_predictor_cli(["--model_name=m", "--task=generate", "--backend=llamacpp",
                                f"--source={tiny_llama_gguf}", "--engine-arg=n_gpu_layer=5"])  # fmt: skip
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "n_gpu_layer" in line
    assert "n_gpu_layers" in line  # the known keys are listed


def test_an_n_ctx_beyond_the_training_context_stops_start_up_with_one_line(tiny_llama_gguf: Path) -> None:
    result = run_predictor_cli(["--model_name=m", "--task=generate", "--backend=llamacpp",
                                f"--source={tiny_llama_gguf}", "--engine-arg=n_ctx=4096"])  # fmt: skip
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "n_ctx=4096 exceeds the model's training context (512)" in line


# -- a predictor over a folder, with a small queue --------------------------------------------------------


@pytest.fixture(scope="module")
def small_queue_predictor(gguf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name="tiny-llama", task=Task.GENERATE, backend=Backend.AUTO, source=str(gguf_folder),
        source_file="quant/*Q8_0.gguf", engine_args={"max_queue": "1", "n_ctx": "256", "n_parallel": "1"},
    )  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("llamacpp-small-queue")) as predictor:
        yield predictor


def test_auto_picks_llamacpp_for_a_gguf_pattern_and_reports_the_file(small_queue_predictor: PredictorProcess) -> None:
    [card] = httpx.get(f"{small_queue_predictor.openai_url}/models", timeout=30).json()["data"]
    assert card["backend"] == "llamacpp"
    assert card["gguf_file"] == "tiny-llama-Q8_0.gguf"
    assert card["context_length"] == 256  # the explicit n_ctx


def test_more_sequences_than_the_engine_ever_holds_get_413_not_a_503(small_queue_predictor: PredictorProcess) -> None:
    client = openai.OpenAI(base_url=small_queue_predictor.openai_url, api_key="unused", max_retries=0, timeout=60)
    ok = client.completions.create(model="tiny-llama", prompt="The river", max_tokens=4, n=2, temperature=0)
    assert len(ok.choices) == 2  # one running + one queued fit
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny-llama", prompt="The river", max_tokens=4, n=3, stream=stream)
        # Never admissible, however idle the engine: retrying cannot help, so no 503 and no Retry-After.
        assert info.value.status_code == 413
        assert "Retry-After" not in info.value.response.headers
        assert info.value.body["code"] == "too_many_sequences"  # type: ignore[index]


def test_a_chat_image_to_a_gguf_model_without_a_projector_is_a_400_naming_the_model(
    small_queue_predictor: PredictorProcess,
) -> None:
    client = openai.OpenAI(base_url=small_queue_predictor.openai_url, api_key="unused", max_retries=0, timeout=60)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}]
        )  # type: ignore[list-item]
    assert info.value.body["code"] == "images_not_supported"  # type: ignore[index]
    assert "'tiny-llama'" in info.value.body["message"]  # type: ignore[index]
