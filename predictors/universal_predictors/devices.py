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


#: Whether :func:`release_memory` collects on a CPU. A shared host (:mod:`universal_predictors.shared_host`) turns it
#: off: it collects once after the removals of an eviction, where a member's unload collecting on its own took 0.35 to
#: 0.45 s with torch's objects, on the host's event loop, before the host could answer that removal (or the next).
COLLECT_ON_CPU_RELEASE = True


def release_memory(device: str) -> None:
    """Give cached accelerator memory back after a model is dropped."""
    import gc

    if is_cuda(device):
        import torch

        gc.collect()  # the dropped tensors' blocks are free only once collected
        torch.cuda.empty_cache()
    elif COLLECT_ON_CPU_RELEASE:
        gc.collect()


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
    them: a CPU-only build (torch, llama-cpp-python), no NVIDIA driver in the container (the runtime class),
    a driver too old for the CUDA the build needs, or no device visible; else None.

    Read without initialising CUDA (NVML and the files of the builds, :func:`driver_problem`): vLLM's engine
    forks, which a CUDA runtime initialised here would break."""
    if gpus <= 0:
        return None
    given = f"the pod was given {gpus} GPU{'s' if gpus > 1 else ''} ({GPUS_ENV}={gpus})"
    if backend is Backend.LLAMACPP:
        built_for = llama_cpp_cuda_version()
        if built_for is not None:
            problem = driver_problem(built_for)
            if problem is not None:
                return f"{given} but {problem}"
        import llama_cpp

        if not llama_cpp.llama_supports_gpu_offload():
            if built_for is not None:  # built with CUDA, a driver and a device there: CUDA itself failed
                return (
                    f"{given} but llama.cpp's CUDA backend (CUDA {built_for}) found no usable device: see "
                    "ggml_cuda_init's message above (a GPU of an architecture the build lacks, or a CUDA error)"
                )
            return (
                f"{given} but llama-cpp-python {llama_cpp.__version__} was built without GPU offload (no CUDA or "
                'ROCm backend): install a GPU build (CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python), '
                "as the predictor-cuda image does"
            )
        return None
    if backend is Backend.FASTER_WHISPER:
        return _ctranslate2_gpu_problem(given)
    if backend not in (Backend.TRANSFORMERS, Backend.VLLM):
        return None
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return (
            f"{given} but torch {torch.__version__} is a CPU-only build: install a CUDA build of torch "
            "(the predictor-cuda image has one)"
        )
    if torch.version.cuda is not None:
        problem = driver_problem(torch.version.cuda)
        if problem is not None:
            return f"{given} but {problem}"
    if backend is Backend.TRANSFORMERS and not torch.cuda.is_available():
        return (
            f"{given} but torch {torch.__version__} (CUDA {torch.version.cuda or torch.version.hip}) sees no GPU: "
            "the container got no GPU device (check the node's NVIDIA container runtime, the profile's "
            "runtimeClassName, and CUDA_VISIBLE_DEVICES)"
        )
    return None


#: The CUDA release CTranslate2 4.x's Linux wheels are built for (its README: CUDA 12 and cuDNN 9).
CTRANSLATE2_CUDA = "12.0"


def _ctranslate2_gpu_problem(given: str) -> str | None:
    """Why CTranslate2 (faster-whisper) cannot use the pod's GPUs, or None."""
    problem = driver_problem(CTRANSLATE2_CUDA)
    if problem is not None:
        return f"{given} but {problem}"
    import ctranslate2

    if ctranslate2.get_cuda_device_count() == 0:
        return (
            f"{given} but CTranslate2 {ctranslate2.__version__} sees no CUDA device: a build without CUDA, or the "
            "CUDA 12 and cuDNN 9 libraries it loads are missing (the predictor-cuda image has them)"
        )
    return None


#: The lowest NVIDIA driver (Linux) for each CUDA major release, with CUDA's minor-version compatibility: any
#: 12.x build runs on 525+, any 13.x on 580+ (NVIDIA's CUDA Toolkit release notes, "CUDA Driver" table).
MINIMUM_DRIVER = {12: "525", 13: "580"}


def driver_problem(built_for: str, library: str | None = None) -> str | None:
    """Why this container's GPUs cannot run code built for CUDA ``built_for`` (``"13.0"``), read through NVML
    only (never ``cuInit``, see :func:`nvml_gpu_count`); None when a driver that supports it sees a device.

    - No NVML library: the container runtime did not mount the driver, which is what happens when the pod
      runs without the NVIDIA runtime class (GPU Operator, containerd's default runtime left at runc).
    - A driver whose CUDA (``nvmlSystemGetCudaDriverVersion_v2``) is older than the build's major release.
    - No device this process may use (the device plugin allocated none, or ``CUDA_VISIBLE_DEVICES``).
    ``library`` is NVML's file (:data:`NVML_LIBRARY` by default)."""
    import ctypes

    try:
        nvml = ctypes.CDLL(library or NVML_LIBRARY)
    except OSError:
        return (
            "the container has no NVIDIA driver (libnvidia-ml.so.1 and libcuda.so.1 are not mounted): it did not "
            "run under the NVIDIA container runtime. Set the profile's runtimeClassName to the cluster's NVIDIA "
            "RuntimeClass (the GPU Operator creates one named nvidia), or make nvidia the nodes' default runtime"
        )
    status = nvml.nvmlInit_v2()
    if status != 0:
        return f"the NVIDIA driver did not initialise (NVML error {status}): check the driver on the node (nvidia-smi)"
    try:
        version = ctypes.c_int(0)
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)) == 0 and version.value > 0:
            major, minor = divmod(version.value // 10, 100)
            needed = tuple(int(part) for part in built_for.split(".")[:2])
            if (major, minor) < (needed[0], 0):
                least = MINIMUM_DRIVER.get(needed[0])
                upgrade = f"NVIDIA driver {least} or newer" if least else f"a driver that supports CUDA {built_for}"
                return (
                    f"the node's NVIDIA driver supports CUDA up to {major}.{minor} and this build needs CUDA "
                    f"{built_for}: upgrade the node to {upgrade}"
                )
    finally:
        nvml.nvmlShutdown()
    if nvml_gpu_count(library) == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return (
            f"the NVIDIA driver sees no GPU this container may use{where}: the device plugin allocated none "
            "(check the pod's nvidia.com/gpu limit and the node's allocatable GPUs)"
        )
    return None


def llama_cpp_cuda_version() -> str | None:
    """The CUDA release llama-cpp-python's CUDA backend was linked against (``"13.0"`` from the
    ``libcudart.so.13`` its ``libggml-cuda.so`` needs), read from the package's files without importing it;
    None for a build without CUDA (or no llama-cpp-python)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for directory in spec.submodule_search_locations:
        for library in sorted(Path(directory).glob("lib/libggml-cuda*.so*")):
            found = re.search(rb"libcudart\.so\.(\d+)", library.read_bytes())
            return f"{found.group(1).decode()}.0" if found else "12.0"
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


def nvml_gpu_count(library: str | None = None) -> int:
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
        nvml = ctypes.CDLL(library or NVML_LIBRARY)
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
