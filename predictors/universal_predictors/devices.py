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
