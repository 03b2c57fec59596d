"""The PyOD algorithms a client may fit, and the keyword arguments each accepts.

Parameters are an allowlist per algorithm (pydantic, ``extra="forbid"``): a client can tune what makes
sense and nothing else (no ``n_jobs`` that would take every core from the engine thread, no callables,
no verbosity). Randomised algorithms get ``random_state=0`` unless the client sets one, so a detector
refitted from its saved training matrix (see :mod:`.store`) gives the same scores as the original.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
Neighbors = Annotated[int, Field(ge=1, le=1000)]
TreeAlgorithm = Literal["auto", "ball_tree", "kd_tree", "brute"]
Metric = Literal["minkowski", "euclidean", "manhattan", "chebyshev", "cosine"]


class IForestParams(_Params):
    n_estimators: Annotated[int, Field(ge=1, le=2000)] = 100
    max_samples: Literal["auto"] | Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] = "auto"
    max_features: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] = 1.0
    bootstrap: bool = False
    random_state: Seed = 0


class ECODParams(_Params):
    pass


class COPODParams(_Params):
    pass


class HBOSParams(_Params):
    n_bins: Literal["auto"] | Annotated[int, Field(ge=2, le=1000)] = 10
    alpha: Annotated[float, Field(gt=0, lt=1)] = 0.1
    tol: Annotated[float, Field(gt=0, lt=1)] = 0.5


class LOFParams(_Params):
    n_neighbors: Neighbors = 20
    algorithm: TreeAlgorithm = "auto"
    leaf_size: Annotated[int, Field(ge=1, le=1000)] = 30
    metric: Metric = "minkowski"
    p: Annotated[int, Field(ge=1, le=10)] = 2


class KNNParams(_Params):
    n_neighbors: Neighbors = 5
    method: Literal["largest", "mean", "median"] = "largest"
    algorithm: TreeAlgorithm = "auto"
    leaf_size: Annotated[int, Field(ge=1, le=1000)] = 30
    metric: Metric = "minkowski"
    p: Annotated[int, Field(ge=1, le=10)] = 2


class OCSVMParams(_Params):
    kernel: Literal["rbf", "linear", "poly", "sigmoid"] = "rbf"
    degree: Annotated[int, Field(ge=1, le=10)] = 3
    gamma: Literal["auto", "scale"] | Annotated[float, Field(gt=0)] = "auto"
    coef0: float = 0.0
    tol: Annotated[float, Field(gt=0)] = 1e-3
    nu: Annotated[float, Field(gt=0, le=1)] = 0.5
    shrinking: bool = True
    max_iter: Annotated[int, Field(ge=-1, le=10_000_000)] = -1


class PCAParams(_Params):
    n_components: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, lt=1)] | None = None
    whiten: bool = False
    weighted: bool = True
    standardization: bool = True
    svd_solver: Literal["auto", "full", "arpack", "randomized"] = "auto"
    random_state: Seed = 0


def _pyod(module: str, name: str) -> Callable[..., Any]:
    def build(**kwargs: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(f"pyod.models.{module}"), name)(**kwargs)

    return build


class Algorithm:
    """One allowlisted PyOD algorithm: its parameter model and constructor."""

    def __init__(self, name: str, params: type[_Params], build: Callable[..., Any], *, single_job: bool) -> None:
        self.name = name
        self.params = params
        self._build = build
        self._single_job = single_job

    def validate(self, raw: Mapping[str, Any]) -> _Params:
        """The client's params as this algorithm's model (pydantic ValidationError on a bad key or value)."""
        return self.params.model_validate(dict(raw))

    def build(self, params: _Params, contamination: float) -> Any:
        kwargs = params.model_dump()
        if self._single_job:
            kwargs["n_jobs"] = 1  # the engine thread is the unit of concurrency; never fan out over cores
        return self._build(contamination=contamination, **kwargs)

    def min_samples(self, params: _Params) -> int:
        """The fewest training rows the algorithm can fit (neighbour methods need more than k)."""
        neighbors = getattr(params, "n_neighbors", None)
        return max(2, neighbors + 1) if isinstance(neighbors, int) else 2


ALGORITHMS: dict[str, Algorithm] = {
    "iforest": Algorithm("iforest", IForestParams, _pyod("iforest", "IForest"), single_job=True),
    "ecod": Algorithm("ecod", ECODParams, _pyod("ecod", "ECOD"), single_job=True),
    "copod": Algorithm("copod", COPODParams, _pyod("copod", "COPOD"), single_job=True),
    "hbos": Algorithm("hbos", HBOSParams, _pyod("hbos", "HBOS"), single_job=False),
    "lof": Algorithm("lof", LOFParams, _pyod("lof", "LOF"), single_job=True),
    "knn": Algorithm("knn", KNNParams, _pyod("knn", "KNN"), single_job=True),
    "ocsvm": Algorithm("ocsvm", OCSVMParams, _pyod("ocsvm", "OCSVM"), single_job=False),
    "pca": Algorithm("pca", PCAParams, _pyod("pca", "PCA"), single_job=False),
}

AlgorithmName = Literal["iforest", "ecod", "copod", "hbos", "lof", "knn", "ocsvm", "pca"]
