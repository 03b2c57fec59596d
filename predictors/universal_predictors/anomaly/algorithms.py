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


#: What a fitted model holds, in bytes, given its params, training rows and columns: an upper estimate from
#: what PyOD 2's models keep (pickled sizes measured at 5,000 x 40 and 20,000 x 10), known before the fit.
HeldBytes = Callable[[Any, int, int], int]


def _matrices(copies: float) -> HeldBytes:
    """``copies`` float64 copies of the training matrix (ECOD and COPOD keep it and four tails: 5.1-5.3)."""
    return lambda params, rows, columns: int(copies * rows * columns * 8)


def _neighbours(params: Any, rows: int, columns: int) -> int:
    """The training matrix and its tree (2 copies), and each row's k neighbours' distances and indices."""
    return 2 * rows * columns * 8 + rows * int(params.n_neighbors) * 16


def _trees(params: Any, rows: int, columns: int) -> int:
    """Trees of at most 256 samples each (511 nodes): 32 KiB a tree bounds what was measured (12 KiB)."""
    return int(params.n_estimators) * 32 * 1024


def _histograms(params: Any, rows: int, columns: int) -> int:
    bins = 1000 if params.n_bins == "auto" else int(params.n_bins)  # "auto": at most a bin a row, capped
    return columns * min(bins, rows) * 16


def _components(params: Any, rows: int, columns: int) -> int:
    return 4 * columns * columns * 8


class Algorithm:
    """One allowlisted PyOD algorithm: its parameter model, constructor and fitted size."""

    def __init__(self, name: str, params: type[_Params], build: Callable[..., Any], *, single_job: bool,
                 held_bytes: HeldBytes) -> None:  # fmt: skip
        self.name = name
        self.params = params
        self._build = build
        self._single_job = single_job
        self._held_bytes = held_bytes

    def held_bytes(self, params: _Params, rows: int, columns: int) -> int:
        """Bytes a model fitted on ``rows`` x ``columns`` holds in memory (an upper estimate), with the
        scores and labels every detector keeps (four 8-byte values a row)."""
        return self._held_bytes(params, rows, columns) + rows * 32 + columns * 16

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
    "iforest": Algorithm("iforest", IForestParams, _pyod("iforest", "IForest"), single_job=True, held_bytes=_trees),
    "ecod": Algorithm("ecod", ECODParams, _pyod("ecod", "ECOD"), single_job=True, held_bytes=_matrices(6)),
    "copod": Algorithm("copod", COPODParams, _pyod("copod", "COPOD"), single_job=True, held_bytes=_matrices(6)),
    "hbos": Algorithm("hbos", HBOSParams, _pyod("hbos", "HBOS"), single_job=False, held_bytes=_histograms),
    "lof": Algorithm("lof", LOFParams, _pyod("lof", "LOF"), single_job=True, held_bytes=_neighbours),
    "knn": Algorithm("knn", KNNParams, _pyod("knn", "KNN"), single_job=True, held_bytes=_neighbours),
    "ocsvm": Algorithm("ocsvm", OCSVMParams, _pyod("ocsvm", "OCSVM"), single_job=False, held_bytes=_matrices(1)),
    "pca": Algorithm("pca", PCAParams, _pyod("pca", "PCA"), single_job=False, held_bytes=_components),
}

AlgorithmName = Literal["iforest", "ecod", "copod", "hbos", "lof", "knn", "ocsvm", "pca"]
