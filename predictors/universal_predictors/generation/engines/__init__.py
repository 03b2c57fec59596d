"""Which engine runs a generation model: one line per backend, imported only when chosen."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING

from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig, is_gguf

if TYPE_CHECKING:
    from universal_predictors.generation.engine import Engine

logger = logging.getLogger(__name__)

ENGINES: dict[Backend, str] = {
    Backend.TRANSFORMERS: "universal_predictors.generation.engines.transformers:TransformersEngine",
    Backend.LLAMACPP: "universal_predictors.generation.engines.llamacpp:LlamaCppEngine",
    Backend.VLLM: "universal_predictors.generation.engines.vllm:VllmEngine",
}

#: The pip extra that brings each engine.
ENGINE_EXTRAS: dict[Backend, str] = {
    Backend.TRANSFORMERS: "generate",
    Backend.LLAMACPP: "llamacpp",
    Backend.VLLM: "vllm",
}


class EngineUnavailable(Exception):
    """The chosen engine cannot be imported; the message names the extra to install."""


def engine_class(backend: Backend) -> type[Engine]:
    """The engine class for ``backend``; EngineUnavailable names a missing package and its extra."""
    if backend not in ENGINES:
        raise EngineUnavailable(
            f"backend {backend.value} cannot generate text (use one of {', '.join(b.value for b in ENGINES)})"
        )
    module_name, _, class_name = ENGINES[backend].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineUnavailable(
            f"the {backend.value} backend needs a package that is not installed ({exc.name}); "
            f"install universal-runtime[{ENGINE_EXTRAS[backend]}]"
        ) from None
    except RuntimeError as exc:
        # vLLM's CUDA build reads its engine arguments' defaults at import, which needs a device: without one it
        # raises "Failed to infer device type" (vllm 0.32 config/device.py DeviceConfig.__post_init__).
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = (
            ": this vLLM build needs a GPU it can see; give the model spec.resources.gpus, or use backend "
            "transformers or llamacpp on the CPU"
            if backend is Backend.VLLM
            else ""
        )
        raise EngineUnavailable(f"the {backend.value} backend could not start ({first}){hint}") from None
    cls: type[Engine] = getattr(module, class_name)
    return cls


def _gpu_for_vllm() -> bool:
    """A GPU is visible and torch is a CUDA build, judged without initialising CUDA (see
    :func:`universal_predictors.devices.nvml_gpu_count`: vLLM must be free to fork its engine core)."""
    try:
        import torch
    except ImportError:
        return False
    if torch.version.cuda is None:  # a CPU (or ROCm) build: vLLM's CUDA platform cannot run here
        return False
    from universal_predictors.devices import nvml_gpu_count

    return nvml_gpu_count() > 0


def engine_arg_keys(backend: Backend) -> frozenset[str] | None:
    """The ``--engine-arg`` keys ``backend``'s engine knows, or None when it cannot be imported here."""
    try:
        return frozenset(engine_class(backend).EngineArgs.model_fields)
    except EngineUnavailable:
        return None


def resolve_backend(config: PredictorConfig) -> Backend:
    """What ``auto`` means for this model on this machine (explicit backends pass through).

    A GGUF source runs on llama.cpp. Otherwise vLLM when a GPU is visible, vllm is installed and
    implements the architecture, else transformers; and of those, only an engine that knows every
    ``--engine-arg`` key given: a key only transformers knows (``device_map``) picks transformers on a
    GPU node rather than stopping the pod, and a key no candidate knows is named by the last one's check.
    """
    if config.backend is not Backend.AUTO:
        return config.backend
    if config.source_file or config.source_projector_file or is_gguf(config.source, None):
        logger.info("backend auto resolved to %s: the source is a GGUF file", Backend.LLAMACPP.value)
        return Backend.LLAMACPP
    candidates: list[tuple[Backend, str]] = []
    if _gpu_for_vllm() and importlib.util.find_spec("vllm") is not None and _vllm_supports(config):
        candidates.append((Backend.VLLM, "a GPU is present, vllm is installed and supports the architecture"))
    candidates.append((Backend.TRANSFORMERS, "no GGUF source and no usable vLLM"))
    given = set(config.engine_args)
    for backend, why in candidates:
        known = engine_arg_keys(backend)
        unknown = sorted(given - known) if known is not None else []
        if not unknown:
            logger.info("backend auto resolved to %s: %s", backend.value, why)
            return backend
        logger.info("backend auto passed over %s: engine args %s are not its own", backend.value, ", ".join(unknown))
    chosen = candidates[-1][0]
    logger.info("backend auto resolved to %s: no candidate knows every engine arg", chosen.value)
    return chosen


def _vllm_supports(config: PredictorConfig) -> bool:
    try:
        return engine_class(Backend.VLLM).supports(config)
    except (EngineUnavailable, AttributeError):
        return False
