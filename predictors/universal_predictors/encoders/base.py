"""The predictor base of the encoder tasks, and the transformers loading they share."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from universal_predictors.base import UniversalPredictor
from universal_predictors.devices import detect_device, dtype_for
from universal_predictors.encoders.args import EncoderEngineArgs
from universal_predictors.errors import InvalidRequest


class EncoderPredictor(UniversalPredictor):
    """One encoder model (embed, rerank, classify, NER): its input limit, engine arguments and model card.

    ``load()`` sets :attr:`max_tokens` (from :func:`~universal_predictors.encoders.limits.input_limit`);
    an input over it is answered with
    :func:`~universal_predictors.encoders.limits.context_length_exceeded`."""

    EngineArgs: ClassVar[type[BaseModel]] = EncoderEngineArgs
    #: The most tokens (special tokens included) one input may have; set by ``load()``.
    max_tokens: int

    def card(self) -> dict[str, Any]:
        """The task's own fields for ``/openai/v1/models`` (the base adds ``max_input_tokens``)."""
        return {}

    def describe(self) -> dict[str, Any]:
        if not self.ready:
            return {}
        return {**self.card(), "max_input_tokens": self.max_tokens}

    @staticmethod
    def strings(instances: list[Any]) -> list[str]:
        """KServe v1/v2 instances as texts: each must be a string."""
        if not instances:
            raise InvalidRequest("instances: must not be empty", param="instances")
        for i, value in enumerate(instances):
            if not isinstance(value, str):
                raise InvalidRequest(f"instances[{i}]: must be a string", param=f"instances[{i}]")
        return list(instances)


def load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def load_model(auto_class: Any, source: str, args: EncoderEngineArgs) -> tuple[Any, str]:
    """``auto_class.from_pretrained(source)`` on the device ``args`` choose, in eval mode; and the device."""
    device = detect_device(args.device)
    model = auto_class.from_pretrained(
        source, local_files_only=True, trust_remote_code=False, dtype=dtype_for(device, args.dtype)
    )
    return model.to(device).eval(), device
