"""``task: anomaly``: named PyOD detectors fitted, scored and persisted at run time.

Routes: ``POST /v1/anomaly/fit``, ``/v1/anomaly/score``, ``/v1/anomaly/detect``,
``GET /v1/anomaly/detectors[/{name}]``, ``DELETE /v1/anomaly/detectors/{name}``, plus KServe v1/v2
(``infer``) scoring with the default detector. ``--source`` is not read: detectors come from fit
requests and from ``--state-dir`` (see :mod:`universal_predictors.anomaly.store`), so the source may be
any placeholder path, existing or not.

Fitting, encoding and scoring run on the engine thread pool, never on the event loop; the loop only
parses JSON, checks limits and installs a finished detector in the registry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import numpy as np
from fastapi import Request
from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from universal_predictors.anomaly.algorithms import ALGORITHMS, AlgorithmName
from universal_predictors.anomaly.detector import DetectorSpec, FitFailed, FittedDetector, fit
from universal_predictors.anomaly.features import FeatureSpace, FieldKind
from universal_predictors.anomaly.normalize import Normalization
from universal_predictors.anomaly.store import (
    NAME_PATTERN,
    DetectorStore,
    LoadLimits,
    SkippedFile,
    file_bytes,
    mib,
    valid_name,
)
from universal_predictors.base import UniversalPredictor
from universal_predictors.catalog import Backend, Route, Task
from universal_predictors.errors import APIError, InvalidRequest, RequestTooLarge
from universal_predictors.http import field_path, loads_json

logger = logging.getLogger(__name__)

R = TypeVar("R")


class AnomalyEngineArgs(BaseModel):
    """Engine arguments of the anomaly predictor (``--engine-arg key=value``)."""

    model_config = ConfigDict(extra="forbid")

    max_rows: int = Field(default=100_000, ge=1, description="Rows per fit/score/detect request.")
    max_features: int = Field(default=1024, ge=1, description="Columns per row (after one-hot encoding).")
    max_cells: int = Field(default=5_000_000, ge=1, description="Rows x columns per request.")
    max_categories: int = Field(default=256, ge=1, description="Distinct values per categorical field at fit.")
    max_detectors: int = Field(default=256, ge=1, description="Detectors held at once.")
    max_detector_memory_mb: float = Field(
        default=2048.0, gt=0, description="Memory all fitted detectors may hold together, in MiB (an estimate per fit)."
    )
    max_state_mb: float = Field(
        default=4096.0, gt=0, description="Disk all detector files in the state directory may take together, in MiB."
    )
    max_body_mb: float = Field(default=64.0, gt=0, description="Request body limit in MiB.")
    engine_threads: int = Field(default=1, ge=1, le=64, description="Threads fitting and scoring.")
    default_detector: str | None = Field(default=None, description="The detector KServe v1/v2 requests use.")

    @field_validator("default_detector")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not valid_name(value):
            raise ValueError(f"must match {NAME_PATTERN.pattern}")
        return value


def _detector_name(value: str) -> str:
    if not valid_name(value):
        raise ValueError(
            f"{value[:80]!r} is not a valid detector name: 1-64 characters from letters, digits, '_', '.', '-', "
            "starting with a letter or digit (no paths)"
        )
    return value


class _Request(BaseModel):
    # Unknown fields are refused: a mistyped "threshold" or "contamination" silently ignored would
    # change which rows are flagged without telling anyone.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    detector: Annotated[str, AfterValidator(_detector_name)]


class FitRequest(_Request):
    algorithm: AlgorithmName = Field(default="iforest", validation_alias=AliasChoices("algorithm", "backend"))
    data: Annotated[list[Any], Field(min_length=1)]
    schema_: dict[str, FieldKind] | None = Field(default=None, alias="schema")
    contamination: Annotated[float, Field(gt=0, le=0.5)] = 0.1
    params: dict[str, Any] = Field(default_factory=dict)
    normalization: Normalization = "standardization"


class ScoreRequest(_Request):
    data: Annotated[list[Any], Field(min_length=1)]


class DetectRequest(ScoreRequest):
    threshold: float | None = None

    @field_validator("threshold")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class DetectorNotFound(APIError):
    status_code = 404
    error_type = "not_found_error"

    def __init__(self, name: str, param: str = "detector") -> None:
        super().__init__(f"The anomaly detector {name!r} does not exist; fit it first.", param=param,
                         code="detector_not_found")  # fmt: skip


def _json_float(value: float) -> float | None:
    # Extreme inputs can drive a distance to inf; JSON has no inf, so such a score is null.
    return float(value) if math.isfinite(value) else None


class AnomalyPredictor(UniversalPredictor):
    """Named anomaly detectors, fitted by clients, persisted in the state directory."""

    task = Task.ANOMALY
    EngineArgs = AnomalyEngineArgs

    def load(self) -> bool:
        import importlib

        args: AnomalyEngineArgs = self.engine_args
        # Import every allowlisted algorithm now, so the first fit does not pay for it (and a broken
        # install fails at start, not on a request).
        for module in ("iforest", "ecod", "copod", "hbos", "lof", "knn", "ocsvm", "pca"):
            importlib.import_module(f"pyod.models.{module}")
        self.backend = Backend.PYOD
        self.detectors: dict[str, FittedDetector] = {}
        # New names whose fit is under way: each holds a max_detectors slot from its check to its end, so
        # concurrent fits cannot all pass the check and exceed the limit together.
        self._reserved: set[str] = set()
        # What fits under way will hold (memory, disk bytes), by name: counted against the budgets like the
        # fitted detectors, from the check before the fit to its end.
        self._pending: dict[str, tuple[int, int]] = {}
        self.skipped: list[SkippedFile] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=args.engine_threads, thread_name_prefix=f"engine-{self.name}"
        )
        self.store: DetectorStore | None = None
        if self.config.state_dir:
            self.store = DetectorStore(self.config.state_dir)
            self.store.prepare()  # an unwritable state dir stops start-up: persistence was asked for
            started = time.monotonic()
            limits = LoadLimits(args.max_rows, args.max_features, args.max_cells, args.max_categories,
                                args.max_detectors, self._memory_budget, self._disk_budget)  # fmt: skip
            loaded, self.skipped = self.store.load_all(limits)
            for detector in loaded:
                self.detectors[detector.spec.name] = detector
            logger.info("loaded %d anomaly detectors from %s in %.1fs", len(self.detectors), self.store.root,
                        time.monotonic() - started)  # fmt: skip
        else:
            logger.info("no --state-dir: fitted anomaly detectors live in memory only")
        return True

    def unload(self) -> None:
        if hasattr(self, "_executor"):
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.detectors = {}

    def describe(self) -> dict[str, Any]:
        if not self.ready:
            return {"persistence": bool(self.config.state_dir)}
        return {
            "persistence": self.store is not None,
            "detectors": len(self.detectors),
            "algorithms": sorted(ALGORITHMS),
            "default_detector": self._default_detector_name(),
        }

    # -- helpers ---------------------------------------------------------------------------------------------

    @property
    def args(self) -> AnomalyEngineArgs:
        engine_args: AnomalyEngineArgs = self.engine_args
        return engine_args

    async def _on_engine(self, fn: Callable[[], R]) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _get(self, name: str, param: str = "detector") -> FittedDetector:
        detector = self.detectors.get(name)
        if detector is None:
            raise DetectorNotFound(name, param)
        return detector

    def _check_size(self, rows: list[Any], width: int | None) -> None:
        args = self.args
        if len(rows) > args.max_rows:
            raise RequestTooLarge(f"data: {len(rows)} rows; the limit is {args.max_rows} (engine arg max_rows)")
        if width is None:
            first = rows[0]
            width = len(first) if isinstance(first, list | dict) else 1
        if width > args.max_features:
            raise RequestTooLarge(
                f"data: {width} features per row; the limit is {args.max_features} (engine arg max_features)"
            )
        if len(rows) * width > args.max_cells:
            raise RequestTooLarge(
                f"data: {len(rows)} rows x {width} features = {len(rows) * width} values; the limit is "
                f"{args.max_cells} (engine arg max_cells)"
            )

    @property
    def _memory_budget(self) -> int:
        return int(self.args.max_detector_memory_mb * 2**20)

    @property
    def _disk_budget(self) -> int:
        return int(self.args.max_state_mb * 2**20)

    def _check_budgets(self, name: str, memory: int, disk: int, shape: str) -> None:
        """A 413 naming the budget when the detector ``name`` (``memory`` and ``disk`` bytes) would take the
        fitted detectors and the fits under way past it; a detector it replaces does not count."""
        others = [d for n, d in self.detectors.items() if n != name]
        pending = [held for n, held in self._pending.items() if n != name]
        for index, (size, budget, arg, what) in enumerate((
            (memory, self._memory_budget, "max_detector_memory_mb", "in memory"),
            (disk, self._disk_budget, "max_state_mb", "in the state directory"),
        )):  # fmt: skip
            held = sum(d.disk_bytes if index else d.memory_bytes for d in others) + sum(p[index] for p in pending)
            if held + size <= budget:
                continue
            remedy = (
                "Fit it on fewer rows or columns."
                if size > budget
                else "Delete a detector no longer needed (DELETE /v1/anomaly/detectors/{name}), or fit this one on "
                "fewer rows or columns."
            )
            raise RequestTooLarge(
                f"data: this detector ({shape}) would take about {mib(size)} {what}; the detectors hold {mib(held)} "
                f"of the budget of {mib(budget)} (engine arg {arg}). {remedy}",
                param="data",
                code="detector_budget_exceeded",
            )

    def _default_detector_name(self) -> str | None:
        if self.args.default_detector:
            return self.args.default_detector
        return next(iter(self.detectors)) if len(self.detectors) == 1 else None

    # -- operations ------------------------------------------------------------------------------------------

    async def fit_detector(self, body: FitRequest) -> dict[str, Any]:
        algorithm = ALGORITHMS[body.algorithm]
        try:
            params = algorithm.validate(body.params).model_dump()
        except ValidationError as exc:
            first = exc.errors()[0]
            where = "params." + field_path(tuple(first["loc"]))
            message = str(first["msg"]).removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                known = ", ".join(sorted(algorithm.params.model_fields)) or "none"
                message = f"not a parameter {body.algorithm} accepts (allowed: {known})"
            raise InvalidRequest(f"{where}: {message}", param=where, code="invalid_value") from None
        self._check_size(body.data, len(body.schema_) if body.schema_ is not None else None)
        name = body.detector
        store = self.store
        args = self.args

        # Encoding is this request's own cost (bounded by max_cells); what the fitted detector will hold is
        # known from its encoded shape, and checked against the budgets before the fit pays it.
        space, matrix = await self._on_engine(
            lambda: FeatureSpace.fit(
                body.data, body.schema_, max_categories=args.max_categories, max_features=args.max_features
            )
        )
        rows, columns = matrix.shape
        memory = algorithm.held_bytes(algorithm.validate(params), rows, columns)
        disk = file_bytes(rows, columns) if store is not None else 0

        def job() -> FittedDetector:
            spec = DetectorSpec(
                name=name,
                algorithm=body.algorithm,
                params=params,
                contamination=body.contamination,
                normalization=body.normalization,
                features=space,
                fitted_at=time.time(),
            )
            try:
                detector = fit(spec, matrix)
            except FitFailed as exc:
                raise InvalidRequest(f"data: {exc}", param="data", code="fit_failed") from None
            detector.memory_bytes = memory
            if store is not None:
                try:
                    detector.disk_bytes = store.save(detector, matrix)
                    detector.persisted = True
                except OSError as exc:  # the detector still serves from memory; the response says so
                    logger.warning("could not persist anomaly detector %s: %s", name, exc)
                    detector.persist_error = f"saving to the state directory failed: {exc.strerror or exc}"
            return detector

        lock = self._lock(name)
        await lock.acquire()
        # Holding the name's lock, no other fit or delete of this name runs; checking and reserving a slot
        # with no await in between makes the limit hold across names too.
        replaced = name in self.detectors
        reserved = False
        try:
            if not replaced:
                held = len(self.detectors) + len(self._reserved)
                if held >= self.args.max_detectors:
                    raise InvalidRequest(
                        f"detector: {len(self.detectors)} detectors exist and {len(self._reserved)} more are being "
                        f"fitted; the limit is {self.args.max_detectors} (engine arg max_detectors); delete one first",
                        param="detector",
                        code="too_many_detectors",
                    )
            self._check_budgets(name, memory, disk, f"{body.algorithm}, {rows} rows x {columns} columns")
            self._pending[name] = (memory, disk)
            if not replaced:
                self._reserved.add(name)
                reserved = True
            future = asyncio.get_running_loop().run_in_executor(self._executor, job)
        except BaseException:
            self._pending.pop(name, None)
            if reserved:
                self._reserved.discard(name)
            lock.release()
            raise

        def install(done: asyncio.Future[FittedDetector]) -> None:
            # Runs on the loop when the fit ends, even if the client went away meanwhile: what is on disk
            # and what is in memory stay the same detector.
            try:
                if not done.cancelled() and done.exception() is None:
                    self.detectors[name] = done.result()
            finally:
                self._pending.pop(name, None)
                if reserved:
                    self._reserved.discard(name)
                lock.release()

        future.add_done_callback(install)
        detector = await asyncio.shield(future)
        return {**detector.summary(), "replaced": replaced}

    async def delete_detector(self, name: str) -> dict[str, Any]:
        async with self._lock(name):
            self._get(name, "name")
            if self.store is not None:
                await asyncio.to_thread(self.store.delete, name)
            del self.detectors[name]
        return {"object": "anomaly.detector.deleted", "name": name, "deleted": True}

    async def score_rows(self, detector: FittedDetector, rows: list[Any]) -> tuple[np.ndarray, np.ndarray, Any]:
        self._check_size(rows, detector.spec.features.n_encoded)
        scores = await self._on_engine(lambda: detector.score(rows))
        return scores.raw, scores.normalized, scores.encoded

    # -- KServe v1 / v2 --------------------------------------------------------------------------------------

    async def infer(self, instances: list[Any]) -> list[Any]:
        """Score instances (numeric rows, objects, or JSON strings of either) with the default detector."""
        name = self._default_detector_name()
        if name is None:
            raise InvalidRequest(
                "KServe v1/v2 requests score with the default detector: set engine arg default_detector, or fit "
                f"exactly one detector ({len(self.detectors)} exist)"
            )
        detector = self._get(name)
        if not instances:
            raise InvalidRequest("instances: must not be empty", param="instances")
        rows: list[Any] = []
        for index, instance in enumerate(instances):
            if isinstance(instance, str):  # v2 BYTES tensors carry each row as a JSON string
                instance = loads_json(instance, f"instances[{index}]", f"instances[{index}]")
            rows.append(instance)
        raw, normalized, _ = await self.score_rows(detector, rows)
        threshold = detector.threshold
        return [
            {"score": _json_float(n), "raw_score": _json_float(r), "is_anomaly": bool(n > threshold)}
            for r, n in zip(raw.tolist(), normalized.tolist(), strict=True)
        ]

    # -- routes ----------------------------------------------------------------------------------------------

    def max_body_bytes(self, route: Route) -> int:
        return int(self.args.max_body_mb * 2**20)

    async def fit_request(self, body: FitRequest, request: Request) -> dict[str, Any]:
        return {"model": self.name, **await self.fit_detector(body)}

    async def score_request(self, body: ScoreRequest, request: Request) -> dict[str, Any]:
        detector = self._get(body.detector)
        raw, normalized, encoded = await self.score_rows(detector, body.data)
        data = [
            {"index": i, "score": _json_float(n), "raw_score": _json_float(r)}
            for i, (r, n) in enumerate(zip(raw.tolist(), normalized.tolist(), strict=True))
        ]
        return self._result(detector, data, encoded)

    async def detect_request(self, body: DetectRequest, request: Request) -> dict[str, Any]:
        detector = self._get(body.detector)
        raw, normalized, encoded = await self.score_rows(detector, body.data)
        threshold = detector.threshold if body.threshold is None else body.threshold
        flags = normalized > threshold
        data = [
            {"index": i, "score": _json_float(n), "raw_score": _json_float(r), "is_anomaly": bool(f)}
            for i, (r, n, f) in enumerate(zip(raw.tolist(), normalized.tolist(), flags.tolist(), strict=True))
        ]
        result = self._result(detector, data, encoded)
        result["threshold"] = threshold
        result["threshold_source"] = "contamination" if body.threshold is None else "request"
        result["summary"] = {"rows": len(data), "anomalies": int(flags.sum())}
        return result

    async def list_detectors(self, params: dict[str, str], request: Request) -> dict[str, Any]:
        listed = [self.detectors[name].summary() for name in sorted(self.detectors)]
        result: dict[str, Any] = {"object": "list", "persistence": self.store is not None, "data": listed}
        if self.skipped:  # files in the state directory not loaded at start, and why
            result["skipped"] = [skipped.as_json() for skipped in self.skipped]
        return result

    async def get_detector(self, params: dict[str, str], request: Request) -> dict[str, Any]:
        return self._get(_path_name(params), "name").summary()

    async def delete_detector_route(self, params: dict[str, str], request: Request) -> dict[str, Any]:
        return await self.delete_detector(_path_name(params))

    def _result(self, detector: FittedDetector, data: list[dict[str, Any]], encoded: Any) -> dict[str, Any]:
        result: dict[str, Any] = {
            "object": "list",
            "model": self.name,
            "detector": detector.spec.name,
            "algorithm": detector.spec.algorithm,
            "normalization": detector.spec.normalization,
            "data": data,
        }
        if encoded.unseen_count:
            result["unseen_categories"] = {"count": encoded.unseen_count, "examples": encoded.unseen}
        result["usage"] = {"rows": len(data)}  # what the gateway's usage ledger counts for this task
        return result


def _invalid_name_message(name: str) -> str:
    try:
        _detector_name(name)
    except ValueError as exc:
        return str(exc)
    return "invalid"


def _path_name(params: dict[str, str]) -> str:
    """The detector named in the path; a 400 for a name that is not one (the binder passes ``a/b`` through)."""
    name = params.get("name", "")
    if not valid_name(name):
        raise InvalidRequest(f"name: {_invalid_name_message(name)}", param="name", code="invalid_value")
    return name
