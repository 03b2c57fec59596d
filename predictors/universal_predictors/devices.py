"""Device and dtype choice: CUDA, then Apple's MPS, then the CPU; whether an allocated GPU is usable."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from universal_predictors.catalog import Backend, Task
from universal_predictors.config import GPUS_ENV


def detect_device(requested: str | None = None) -> str:
    """``cuda`` when a GPU is usable, else ``mps``, else ``cpu``; an explicit request wins."""
    if requested and requested != "auto":
        return requested
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def is_cuda(device: str) -> bool:
    """``cuda`` or one of its devices (``cuda:1``), as torch names them."""
    return device == "cuda" or device.startswith("cuda:")


def dtype_for(device: str, requested: str | None = None) -> Any:
    """fp32 on the CPU; bf16 on GPUs that support it, else fp16; an explicit request wins."""
    import torch

    if requested and requested != "auto":
        return getattr(torch, requested)
    if is_cuda(device):
        return torch.bfloat16 if native_bf16() else torch.float16
    if device == "mps":
        return torch.float16
    return torch.float32


def release_memory(device: str) -> None:
    """Give cached accelerator memory back after a model is dropped."""
    import gc

    gc.collect()
    if is_cuda(device):
        import torch

        torch.cuda.empty_cache()


def native_bf16() -> bool:
    """Whether the current CUDA device computes in bf16 natively (compute capability 8.0 and later).

    ``torch.cuda.is_bf16_supported()`` alone also answers True where bf16 is only emulated (T4, V100: it
    tries to allocate a bf16 tensor, which works anywhere); torch 2.13 ``torch/cuda/__init__.py``
    ``is_bf16_supported(including_emulation=False)`` checks the capability only (ROCm: always True).
    """
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False))


def model_dtype(device: str, requested: str | None, checkpoint: Any, *, bf16: bool | None = None) -> Any:
    """The dtype to load a checkpoint saved in ``checkpoint`` (a torch dtype, its name, or None) on ``device``.

    An explicit request wins. On CUDA the checkpoint's own half precision is kept (fp16 stays fp16, bf16
    stays bf16), fp32 or unknown becomes bf16, and bf16 becomes fp16 on a GPU without native bf16
    (``bf16``, default :func:`native_bf16`): vLLM 0.32's rule (``vllm/config/model.py``
    ``_resolve_auto_dtype``, ``vllm/platforms/cuda.py`` ``supported_dtypes``). Elsewhere as
    :func:`dtype_for` (fp32 on the CPU: its half-precision kernels are slow or missing).
    """
    import torch

    if (requested and requested != "auto") or not is_cuda(device):
        return dtype_for(device, requested)
    if isinstance(checkpoint, str):
        checkpoint = getattr(torch, checkpoint, None)
    native = native_bf16() if bf16 is None else bf16
    if checkpoint == torch.float16:
        return torch.float16
    return torch.bfloat16 if native else torch.float16


def allocated_gpus(environ: Mapping[str, str] = os.environ) -> int:
    """How many GPUs the operator gave this pod (``UNIVERSAL_RUNTIME_GPUS``, rendered from
    ``spec.resources.gpus``); 0 when unset (local runs, CPU models).

    Not ``NVIDIA_VISIBLE_DEVICES``: NVIDIA's CUDA base images set it to ``all`` whether or not the device
    plugin allocated anything, so it cannot tell a GPU pod from a CPU pod on the CUDA image."""
    value = environ.get(GPUS_ENV, "").strip()
    return int(value) if value.isdigit() else 0


def gpu_unusable_reason(backend: Backend, gpus: int) -> str | None:
    """One line naming what is missing when the pod was given ``gpus`` GPUs and ``backend`` cannot use
    them (a CPU-only torch, llama-cpp-python built without GPU offload, no device visible); else None.

    vLLM is checked without touching CUDA (its engine forks, which a CUDA runtime initialised here would
    break): only whether torch is a CPU build."""
    if gpus <= 0:
        return None
    given = f"the pod was given {gpus} GPU{'s' if gpus > 1 else ''} ({GPUS_ENV}={gpus})"
    if backend is Backend.LLAMACPP:
        import llama_cpp

        if not llama_cpp.llama_supports_gpu_offload():
            return (
                f"{given} but llama-cpp-python {llama_cpp.__version__} was built without GPU offload (no CUDA or "
                'ROCm backend): install a GPU build (CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python), '
                "as the predictor-cuda image does"
            )
        return None
    if backend not in (Backend.TRANSFORMERS, Backend.VLLM):
        return None
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return (
            f"{given} but torch {torch.__version__} is a CPU-only build: install a CUDA build of torch "
            "(the predictor-cuda image has one)"
        )
    if backend is Backend.TRANSFORMERS and not torch.cuda.is_available():
        return (
            f"{given} but torch {torch.__version__} (CUDA {torch.version.cuda or torch.version.hip}) sees no GPU: "
            "the container got no GPU device (check the node's NVIDIA container runtime, the profile's "
            "runtimeClassName, and CUDA_VISIBLE_DEVICES)"
        )
    return None


#: Backends that compute on the CPU only (RapidOCR's ONNX Runtime CPU build, Tesseract, PyOD's detectors).
CPU_ONLY = frozenset({Backend.RAPIDOCR, Backend.TESSERACT, Backend.PYOD})


def gpus_left_unused(task: Task, backend: Backend, gpus: int) -> str | None:
    """Why a predictor of ``task`` on ``backend`` given ``gpus`` GPUs would leave them idle (None: it uses them).

    The encoder tasks (embed, rerank, classify, NER, document) run on transformers, so ``auto`` is checked as
    transformers (an embed GGUF resolves to llamacpp before the predictor starts); OCR and anomaly detection run
    on the CPU whatever they are given. Before, such a pod started and silently ran on its CPU."""
    if gpus <= 0:
        return None
    if backend in CPU_ONLY:
        return (
            f"the pod was given {gpus} GPU{'s' if gpus > 1 else ''} ({GPUS_ENV}={gpus}) but task {task.value} "
            f"runs on the CPU ({backend.value} has no GPU path here): remove spec.resources.gpus"
        )
    if backend is Backend.AUTO:
        backend = Backend.TRANSFORMERS
    return gpu_unusable_reason(backend, gpus)


#: NVML's library, as the NVIDIA container toolkit mounts it into a GPU pod (beside the driver).
NVML_LIBRARY = "libnvidia-ml.so.1"


def nvml_gpu_count() -> int:
    """GPUs this process may use, counted through NVML: CUDA itself is never initialised.

    ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, which runs ``cuInit`` (torch 2.13
    torch/cuda/__init__.py, is_available); a process that did so cannot use CUDA in a forked child, and
    vLLM forks its engine core unless ``torch.cuda.is_initialized()`` says CUDA is up (vllm 0.32
    utils/system_utils.py _maybe_force_spawn, utils/platform_utils.py cuda_is_initialized), which it
    does not after a bare ``cuInit``: the engine core dies with "initialization error". NVML is how
    vLLM itself decides that CUDA is there (vllm 0.32 platforms/__init__.py cuda_platform_plugin:
    nvmlInit, nvmlDeviceGetCount) and how torch counts devices without poisoning fork
    (torch.cuda._raw_device_count_nvml). No NVML library (no driver, a CPU node): 0 GPUs.
    ``CUDA_VISIBLE_DEVICES`` is honoured as CUDA reads it: the count of its entries up to the first
    one that is not a device (torch.cuda._parse_visible_devices' rule, simplified to ordinals and UUIDs).
    """
    import ctypes
    import os

    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return 0
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
        present = int(count.value)
    finally:
        nvml.nvmlShutdown()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    usable = 0
    for entry in (item.strip() for item in visible.split(",")):
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < present)):
            break
        usable += 1
    return min(usable, present)
