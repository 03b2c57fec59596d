"""Device and dtype choice: CUDA, then Apple's MPS, then the CPU."""

from __future__ import annotations

from typing import Any


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


def dtype_for(device: str, requested: str | None = None) -> Any:
    """fp32 on the CPU; bf16 on GPUs that support it, else fp16; an explicit request wins."""
    import torch

    if requested and requested != "auto":
        return getattr(torch, requested)
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "mps":
        return torch.float16
    return torch.float32


def release_memory(device: str) -> None:
    """Give cached accelerator memory back after a model is dropped."""
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


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
