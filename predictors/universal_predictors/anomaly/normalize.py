"""Raw detector scores to normalised scores.

Raw scores are PyOD's ``decision_function`` (higher = more anomalous) on an algorithm-specific scale.
A normalisation is fitted on the detector's training scores:

- ``standardization`` (default): ``sigmoid((raw - median) / (2 * IQR))`` of the training scores, in
  (0, 1); the median training row scores 0.5. This is the seed system's normalisation.
- ``zscore``: ``(raw - mean) / std`` of the training scores; unbounded.
- ``raw``: the raw score unchanged.

A degenerate spread (IQR or std of 0, e.g. all training rows identical) falls back to the standard
deviation, then to 1, so normalisation never divides by zero. Every normalisation is strictly
increasing, so "normalised score > normalised threshold" flags exactly the rows whose raw score is
over the raw threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Normalization = Literal["standardization", "zscore", "raw"]


@dataclass(frozen=True)
class Normalizer:
    method: Normalization
    center: float
    scale: float

    @classmethod
    def fit(cls, method: Normalization, training_scores: np.ndarray) -> Normalizer:
        scores = np.asarray(training_scores, dtype=np.float64)
        std = float(np.std(scores))
        if method == "standardization":
            q25, median, q75 = (float(v) for v in np.percentile(scores, [25, 50, 75]))
            spread = 2.0 * (q75 - q25)
            return cls(method, median, _positive(spread, 2.0 * std))
        if method == "zscore":
            return cls(method, float(np.mean(scores)), _positive(std, 0.0))
        return cls(method, 0.0, 1.0)

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, dtype=np.float64)
        if self.method == "raw":
            return raw
        z = (raw - self.center) / self.scale
        # 0.5 * (1 + tanh(z / 2)) is the logistic sigmoid without exp() overflow for large |z|.
        return 0.5 * (1.0 + np.tanh(z / 2.0)) if self.method == "standardization" else z

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "center": self.center, "scale": self.scale}


def _positive(first: float, second: float) -> float:
    for value in (first, second):
        if np.isfinite(value) and value > 0:
            return float(value)
    return 1.0
