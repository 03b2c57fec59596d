"""Engine arguments (``--engine-arg key=value``): each predictor and each generation engine declares a pydantic
model of the keys it takes; an unknown key stops the process at start-up. A plain module, so that the
engine interface (:mod:`universal_predictors.generation.engine`) and the predictor base share it lightly.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class NoEngineArgs(BaseModel):
    """The engine arguments of a predictor or engine that takes none: every key is unknown."""

    model_config = ConfigDict(extra="forbid")
