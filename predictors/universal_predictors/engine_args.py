"""Engine arguments (``--engine-arg key=value``): each predictor and each generation engine declares a pydantic
model of the keys it takes; an unknown key stops the process at start-up. A plain module, so that the
engine interface (:mod:`universal_predictors.generation.engine`) and the predictor base share it lightly.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class NoEngineArgs(BaseModel):
    """The engine arguments of a predictor or engine that takes none: every key is unknown."""

    model_config = ConfigDict(extra="forbid")


def flat_key(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The ``--engine-arg`` key a validation error's location names: a model that nests some of its keys
    (document's OCR options) maps them back with ``flat_key``; otherwise the location joined by dots."""
    mapper = getattr(model, "flat_key", None)
    return str(mapper(loc)) if mapper is not None else ".".join(str(p) for p in loc)


def known_keys(model: type[BaseModel]) -> list[str]:
    """The ``--engine-arg`` keys ``model`` takes, sorted (a nesting model lists its flat keys)."""
    listed = getattr(model, "flat_keys", None)
    return sorted(listed() if listed is not None else model.model_fields)
