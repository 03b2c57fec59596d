"""PredictorConfig: the predictor's command line, the one contract between operator, supervisor and predictor."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from universal_predictors.catalog import Backend, Task
from universal_predictors.config import (
    FILE_PATTERN_BACKENDS,
    FILE_PATTERN_TASKS,
    PREDICTOR_MODULE,
    TASK_BACKENDS,
    PredictorConfig,
    backend_allowed,
    render_engine_arg,
    resolve_backend,
)

FULL = PredictorConfig(
    model_name="Qwen/Qwen2.5-0.5B",
    task=Task.GENERATE,
    backend=Backend.LLAMACPP,
    source="hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    source_file="*q4_k_m.gguf",
    source_projector_file="*mmproj*.gguf",
    engine_args={"n_ctx": "8192", "flash_attn": "true", "stop": "a=b", "empty": "", "dotted.key-1": "x y"},
    engine_arg_defaults={
        Backend.LLAMACPP: {"n_ctx": "4096", "type_k": "q8_0=x"},
        Backend.VLLM: {"enforce_eager": "true"},
    },
    http_port=9000,
)
MINIMAL = PredictorConfig(model_name="m", task=Task.EMBED, source="/mnt/models")


@pytest.mark.parametrize("config", [FULL, MINIMAL], ids=["every field", "required fields only"])
def test_to_args_parses_back_to_the_same_config(config: PredictorConfig) -> None:
    assert PredictorConfig.from_args(config.to_args()) == config


def test_to_args_spells_every_flag_with_engine_args_sorted() -> None:
    assert FULL.to_args() == [
        "--model_name=Qwen/Qwen2.5-0.5B",
        "--task=generate",
        "--backend=llamacpp",
        "--source=hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        "--source-file=*q4_k_m.gguf",
        "--source-projector-file=*mmproj*.gguf",
        "--engine-arg=dotted.key-1=x y",
        "--engine-arg=empty=",
        "--engine-arg=flash_attn=true",
        "--engine-arg=n_ctx=8192",
        "--engine-arg=stop=a=b",
        "--engine-arg-default=llamacpp:n_ctx=4096",
        "--engine-arg-default=llamacpp:type_k=q8_0=x",
        "--engine-arg-default=vllm:enforce_eager=true",
        "--http_port=9000",
    ]


def test_minimal_args_omit_optional_flags_and_default_port_and_backend() -> None:
    assert MINIMAL.to_args() == [
        "--model_name=m",
        "--task=embed",
        "--backend=auto",
        "--source=/mnt/models",
        "--http_port=8080",
    ]


def test_to_command_prefixes_the_interpreter_and_module() -> None:
    assert MINIMAL.to_command() == ["python", "-m", PREDICTOR_MODULE, *MINIMAL.to_args()]
    assert MINIMAL.to_command("/venv/bin/python")[:3] == ["/venv/bin/python", "-m", "universal_predictors"]


def test_engine_arg_value_keeps_everything_after_the_first_equals_sign() -> None:
    parsed = PredictorConfig.from_args([*MINIMAL.to_args(), "--engine-arg=stop===", "--engine-arg", "x=-1"])
    assert parsed.engine_args == {"stop": "==", "x": "-1"}


@pytest.mark.parametrize("key", ["1abc", "-x", "a b", "a=b", "", "ключ", "a/b"])
def test_engine_arg_keys_must_be_identifier_like(key: str) -> None:
    with pytest.raises(ValidationError, match="engine argument key"):
        PredictorConfig(model_name="m", task=Task.EMBED, source="/m", engine_args={key: "1"})


@pytest.mark.parametrize("key", ["n_ctx", "_private", "rope.scaling", "max-model-len", "A9"])
def test_engine_arg_keys_accept_identifiers_dots_and_dashes(key: str) -> None:
    assert PredictorConfig(model_name="m", task=Task.EMBED, source="/m", engine_args={key: "1"}).engine_args == {
        key: "1"
    }


@pytest.mark.parametrize("item", ["novalue", "=value"])
def test_malformed_engine_arg_is_rejected_naming_it(item: str) -> None:
    with pytest.raises(ValueError, match=f"--engine-arg '{item}'") as caught:
        PredictorConfig.from_args([*MINIMAL.to_args(), "--engine-arg", item])
    assert "KEY=VALUE" in str(caught.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--task", "embed", "--source", "/m"],  # no --model_name
        ["--model_name", "m", "--task", "translate", "--source", "/m"],  # unknown task
        ["--model_name", "m", "--task", "embed", "--source", "/m", "--backend", "onnx"],  # unknown backend
        ["--model_name", "m", "--task", "embed", "--source", "/m", "--unknown-flag", "1"],
        ["--model_name", "m", "--task", "embed", "--source", "/m", "--http_port", "0"],
    ],
    ids=["missing model name", "unknown task", "unknown backend", "unknown flag", "port out of range"],
)
def test_from_args_rejects_a_bad_command_line(argv: list[str]) -> None:
    with pytest.raises((SystemExit, ValidationError)):
        PredictorConfig.from_args(argv)


@pytest.mark.parametrize(
    ("value", "text"), [(True, "true"), (False, "false"), (8192, "8192"), (0.9, "0.9"), ("chatml", "chatml")]
)
def test_engine_arg_values_render_with_lower_case_booleans(value: object, text: str) -> None:
    assert render_engine_arg(value) == text  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("task", "backend", "source", "file", "gpus", "expected"),
    [
        (Task.GENERATE, Backend.AUTO, "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF", None, 0, Backend.LLAMACPP),
        (Task.GENERATE, Backend.AUTO, "hf://org/repo", "*q4_k_m.gguf", 1, Backend.LLAMACPP),
        (Task.EMBED, Backend.AUTO, "/models/nomic-embed.Q8_0.gguf", None, 0, Backend.LLAMACPP),
        (Task.OCR, Backend.AUTO, "/opt/models/rapidocr", None, 0, Backend.RAPIDOCR),
        (Task.ANOMALY, Backend.AUTO, "/opt/models/anomaly", None, 0, Backend.PYOD),
        (Task.GENERATE, Backend.AUTO, "hf://meta-llama/Llama-3.1-8B-Instruct", None, 1, Backend.AUTO),
        (Task.GENERATE, Backend.AUTO, "hf://meta-llama/Llama-3.1-8B-Instruct", None, 0, Backend.TRANSFORMERS),
        (Task.EMBED, Backend.AUTO, "hf://BAAI/bge-m3", None, 1, Backend.TRANSFORMERS),
        (Task.RERANK, Backend.AUTO, "hf://BAAI/bge-reranker-base", None, 0, Backend.TRANSFORMERS),
        (Task.RERANK, Backend.AUTO, "hf://someone/reranker-gguf", None, 0, Backend.TRANSFORMERS),
        (Task.GENERATE, Backend.VLLM, "hf://org/model-GGUF", "*.gguf", 1, Backend.VLLM),
        (Task.OCR, Backend.TESSERACT, "/opt/models/tess", None, 0, Backend.TESSERACT),
    ],
    ids=[
        "gguf repo -> llamacpp",
        "gguf file pattern beats gpu -> llamacpp",
        "gguf embed file -> llamacpp",
        "ocr -> rapidocr",
        "anomaly -> pyod",
        "generate on gpu stays auto",
        "generate on cpu -> transformers",
        "embed on gpu -> transformers",
        "rerank -> transformers",
        "gguf only counts for generate and embed",
        "explicit backend kept",
        "explicit ocr backend kept",
    ],
)
def test_resolve_backend(
    task: Task, backend: Backend, source: str, file: str | None, gpus: int, expected: Backend
) -> None:
    assert resolve_backend(task, backend, source, file, gpus) is expected


@pytest.mark.parametrize("task", list(Task))
@pytest.mark.parametrize("backend", list(Backend))
def test_backend_allowed_is_auto_or_the_tasks_table_entry(task: Task, backend: Backend) -> None:
    assert backend_allowed(task, backend) == (backend is Backend.AUTO or backend in TASK_BACKENDS[task])


def test_every_task_has_a_backend_table_entry_and_auto_resolves_to_an_allowed_backend() -> None:
    assert set(TASK_BACKENDS) == set(Task)
    for task in Task:
        for gpus in (0, 1):
            resolved = resolve_backend(task, Backend.AUTO, "/m", None, gpus)
            assert backend_allowed(task, resolved)


def test_file_patterns_apply_to_backends_that_serve_their_tasks() -> None:
    assert all(backend_allowed(t, b) for t in FILE_PATTERN_TASKS for b in FILE_PATTERN_BACKENDS)


@pytest.mark.parametrize("field", ["source_file", "model_name", "source"])
def test_values_starting_with_a_dash_survive_the_command_line(field: str) -> None:
    config = MINIMAL.model_copy(update={field: "-rc1"})
    assert PredictorConfig.from_args(config.to_args()) == config


# --------------------------------------------------------------------------------------------------
# GPUs: vLLM shards a model over every GPU the replica gets


def _vllm_engine_args(resources: str, engine_args: str = "{}") -> dict[str, str]:
    from tests.factories import model
    from universal_operator.predictor import predictor_config

    manifest = f"""
    metadata: {{name: llama}}
    spec:
      task: generate
      backend: vllm
      source: {{uri: 's3://models/llama-70b'}}
      resources: {resources}
      engineArgs: {engine_args}
    """
    return predictor_config(model(manifest)).engine_args


def test_vllm_on_several_gpus_gets_tensor_parallel_size_equal_to_the_gpu_count() -> None:
    assert _vllm_engine_args("{gpus: 4}", "{max_model_len: 8192}") == {
        "max_model_len": "8192",
        "tensor_parallel_size": "4",
    }


def test_a_users_tensor_parallel_size_is_kept() -> None:
    assert _vllm_engine_args("{gpus: 4}", "{tensor_parallel_size: 2, pipeline_parallel_size: 2}") == {
        "tensor_parallel_size": "2",
        "pipeline_parallel_size": "2",
    }


def test_one_gpu_or_another_backend_gets_no_tensor_parallel_size() -> None:
    assert _vllm_engine_args("{gpus: 1}") == {}  # vLLM's own default is one GPU


def test_embed_on_vllm_is_refused_with_the_backends_that_serve_it() -> None:
    from universal_operator.spec import SpecError, parse_model

    with pytest.raises(SpecError) as refused:
        parse_model(
            {
                "metadata": {"name": "bge"},
                "spec": {"task": "embed", "backend": "vllm", "source": {"uri": "hf://BAAI/bge-m3"}},
            }
        )
    assert refused.value.field == "spec.backend"
    assert "'vllm' does not serve task 'embed'" in refused.value.message
    assert "transformers, llamacpp" in refused.value.message


def test_engine_arg_defaults_apply_to_their_backend_only_under_the_models_own_args() -> None:
    assert FULL.engine_args_for(Backend.LLAMACPP)["n_ctx"] == "8192"  # the model's own wins
    assert FULL.engine_args_for(Backend.LLAMACPP)["type_k"] == "q8_0=x"
    assert "enforce_eager" not in FULL.engine_args_for(Backend.LLAMACPP)
    assert FULL.engine_args_for(Backend.TRANSFORMERS) == FULL.engine_args


@pytest.mark.parametrize("item", ["vllm", "vllm:", "vllm:novalue", "nosuch:k=v", ":k=v", "vllm:=v"])
def test_a_malformed_engine_arg_default_is_rejected_naming_it(item: str) -> None:
    with pytest.raises(ValueError, match="--engine-arg-default"):
        PredictorConfig.from_args(["--model_name=m", "--task=generate", "--source=/m", f"--engine-arg-default={item}"])
