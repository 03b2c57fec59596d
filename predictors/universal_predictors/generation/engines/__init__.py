"""Which engine runs a generation model: one line per backend, imported only when chosen."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING

from universal_predictors.config import Backend, PredictorConfig, is_gguf

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
    cls: type[Engine] = getattr(module, class_name)
    return cls


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_backend(config: PredictorConfig) -> Backend:
    """What ``auto`` means for this model on this machine (explicit backends pass through)."""
    if config.backend is not Backend.AUTO:
        return config.backend
    if config.source_file or is_gguf(config.source, None):
        chosen, why = Backend.LLAMACPP, "the source is a GGUF file"
    elif _cuda_available() and importlib.util.find_spec("vllm") is not None and _vllm_supports(config):
        chosen, why = Backend.VLLM, "a GPU is present, vllm is installed and supports the architecture"
    else:
        chosen, why = Backend.TRANSFORMERS, "no GGUF source and no usable vLLM"
    logger.info("backend auto resolved to %s: %s", chosen.value, why)
    return chosen


def _vllm_supports(config: PredictorConfig) -> bool:
    try:
        return engine_class(Backend.VLLM).supports(config)
    except (EngineUnavailable, AttributeError):
        return False
