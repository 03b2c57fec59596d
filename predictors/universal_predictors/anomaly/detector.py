"""A fitted detector: feature space, robust scaler, PyOD model and score normalisation.

:func:`fit` is deterministic: the same :class:`DetectorSpec` and training matrix give the same
scaler, model and scores. That is what lets the store keep only JSON and arrays (never a pickle) and
refit on start-up instead of deserialising objects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from universal_predictors.anomaly.algorithms import ALGORITHMS
from universal_predictors.anomaly.features import EncodeResult, FeatureSpace
from universal_predictors.anomaly.normalize import Normalization, Normalizer
from universal_predictors.errors import InvalidRequest


class FitFailed(ValueError):
    """The algorithm rejected the data (too few rows for its parameters, a singular matrix...)."""


@dataclass(frozen=True)
class DetectorSpec:
    """Everything needed to refit a detector from its training matrix (the store's JSON part)."""

    name: str
    algorithm: str
    params: dict[str, Any]
    contamination: float
    normalization: Normalization
    features: FeatureSpace
    fitted_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "algorithm": self.algorithm,
            "params": self.params,
            "contamination": self.contamination,
            "normalization": self.normalization,
            "features": self.features.to_json(),
            "fitted_at": self.fitted_at,
        }


@dataclass
class Scores:
    raw: np.ndarray
    normalized: np.ndarray
    encoded: EncodeResult


@dataclass
class FittedDetector:
    spec: DetectorSpec
    model: Any
    center: np.ndarray | None
    scale: np.ndarray | None
    normalizer: Normalizer
    raw_threshold: float
    training_scores: np.ndarray
    persisted: bool = False
    persist_error: str | None = None
    n_samples: int = 0
    #: What it holds in memory (an estimate made before its fit) and its file's size, in bytes: what it takes
    #: of the budgets max_detector_memory_mb and max_state_mb.
    memory_bytes: int = 0
    disk_bytes: int = 0

    @property
    def threshold(self) -> float:
        """The default decision threshold on the normalised scale, from the contamination."""
        return float(self.normalizer(np.array([self.raw_threshold]))[0])

    def transform(self, matrix: np.ndarray) -> np.ndarray:
        """Apply the robust scaling fitted with the detector (numeric columns only; one-hot stays 0/1)."""
        if self.center is None or self.scale is None:
            return matrix
        out = matrix.copy()
        columns = self.spec.features.numeric_columns()
        out[:, columns] = (out[:, columns] - self.center) / self.scale
        return out

    def score(self, rows: list[Any]) -> Scores:
        encoded = self.spec.features.encode(rows)
        with np.errstate(all="ignore"):
            scaled = self.transform(encoded.matrix)
        # Finite inputs near the float limit (1e308) overflow once scaled: the model would refuse them.
        overflow = np.argwhere(~np.isfinite(scaled))
        if len(overflow):
            index, column = (int(i) for i in overflow[0])
            where = f"data[{index}]" if self.spec.features.schema is not None else f"data[{index}][{column}]"
            raise InvalidRequest(
                f"{where}: the value is too large for this detector (it overflows once scaled by the training "
                "data's spread)",
                param=where,
                code="invalid_value",
            )
        try:
            with np.errstate(all="ignore"):
                raw = np.asarray(self.model.decision_function(scaled), dtype=np.float64).ravel()
        except (ValueError, ArithmeticError) as exc:
            raise InvalidRequest(
                f"data: these rows cannot be scored: {exc}", param="data", code="invalid_value"
            ) from None
        return Scores(raw=raw, normalized=self.normalizer(raw), encoded=encoded)

    def summary(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {
            "object": "anomaly.detector",
            "name": spec.name,
            "algorithm": spec.algorithm,
            "params": spec.params,
            "contamination": spec.contamination,
            "normalization": spec.normalization,
            "threshold": self.threshold,
            "raw_threshold": self.raw_threshold,
            "n_samples": self.n_samples,
            "n_features": spec.features.n_features,
            "n_encoded_features": spec.features.n_encoded,
            "schema": spec.features.schema_json(),
            "categories": {k: list(v) for k, v in spec.features.categories.items()} or None,
            "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(spec.fitted_at)),
            "persisted": self.persisted,
        }
        if self.persist_error:
            out["persist_error"] = self.persist_error
        return out


def fit(spec: DetectorSpec, matrix: np.ndarray) -> FittedDetector:
    """Fit scaler, model and normaliser on ``matrix`` (rows x encoded columns); FitFailed on bad data."""
    algorithm = ALGORITHMS[spec.algorithm]
    params = algorithm.validate(spec.params)
    n_samples = matrix.shape[0]
    if n_samples < algorithm.min_samples(params):
        raise FitFailed(f"{spec.algorithm} needs at least {algorithm.min_samples(params)} rows, got {n_samples}")
    center, scale = _robust_scaling(matrix, spec.features.numeric_columns())
    scaled = matrix.copy()
    if center is not None and scale is not None:
        columns = spec.features.numeric_columns()
        scaled[:, columns] = (scaled[:, columns] - center) / scale
    model = algorithm.build(params, spec.contamination)
    try:
        with np.errstate(all="ignore"):
            model.fit(scaled)
    except (ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:
        raise FitFailed(f"{spec.algorithm} could not fit this data: {exc}") from None
    training = np.asarray(model.decision_scores_, dtype=np.float64).ravel()
    if not np.isfinite(training).all():
        raise FitFailed(f"{spec.algorithm} produced non-finite scores on this data (is a feature constant?)")
    return FittedDetector(
        spec=spec,
        model=model,
        center=center,
        scale=scale,
        normalizer=Normalizer.fit(spec.normalization, training),
        raw_threshold=float(model.threshold_),
        training_scores=training,
        n_samples=n_samples,
    )


def _robust_scaling(matrix: np.ndarray, columns: list[int]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A fitted sklearn RobustScaler's median and IQR for the numeric columns (IQR 0 becomes 1)."""
    if not columns:
        return None, None
    from sklearn.preprocessing import RobustScaler

    scaler = RobustScaler().fit(matrix[:, columns])
    return np.asarray(scaler.center_, dtype=np.float64), np.asarray(scaler.scale_, dtype=np.float64)
