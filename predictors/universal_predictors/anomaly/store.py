"""Fitted detectors in the state directory, in a format that is never unpickled.

The state directory is writable by the pod (a PersistentVolumeClaim), so anything there must be
treated as untrusted input at load time: a pickle (or joblib) file in it would run arbitrary code on
the next start for whoever managed to write it. So a detector is saved as data only:

    <state-dir>/anomaly-detectors/<name>.npz   (numpy's zip of .npy arrays, loaded with allow_pickle=False)
        meta             uint8   UTF-8 JSON: format version, algorithm, validated params, contamination,
                                 normalisation, feature space (schema, categories), fitted_at
        X                float64 the encoded training matrix (before scaling)
        training_scores  float64 the raw training scores at fit time (a consistency check on reload)

On load the detector is refitted from ``X`` with the same parameters (:func:`detector.fit` is
deterministic: randomised algorithms carry a fixed ``random_state``), and the training scores are
compared with the saved ones: a difference (a different PyOD or scikit-learn version) is logged. The
parameters pass the same allowlist as a client's request, so a tampered file can at worst make a bad
detector, never run code. One file per detector, written to a temporary name and renamed over the old
one, so a crash mid-write leaves the previous version or nothing, never half a file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid
import zipfile
from pathlib import Path

import numpy as np

from universal_predictors.anomaly.algorithms import ALGORITHMS
from universal_predictors.anomaly.detector import DetectorSpec, FittedDetector, fit
from universal_predictors.anomaly.features import FeatureSpace

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUBDIR = "anomaly-detectors"
#: Detector names: a file name on every filesystem, never a path (no '/', no leading '.').
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Relative difference between saved and refitted training scores that counts as "the same".
REFIT_TOLERANCE = 1e-9


def valid_name(name: str) -> bool:
    return bool(NAME_PATTERN.match(name))


class CorruptDetector(ValueError):
    """A file in the state directory that is not a detector this version can load."""


class DetectorStore:
    """Reads and writes detector files under ``<state_dir>/anomaly-detectors``."""

    def __init__(self, state_dir: str) -> None:
        self.root = Path(state_dir) / SUBDIR

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        if not valid_name(name):  # callers validate first; this is the last line against traversal
            raise ValueError(f"invalid detector name {name!r}")
        return self.root / f"{name}.npz"

    def save(self, detector: FittedDetector, matrix: np.ndarray) -> None:
        """Write atomically: temporary file in the same directory, fsync, rename, fsync the directory."""
        meta = {"format": FORMAT_VERSION, **detector.spec.to_json()}
        target = self.path(detector.spec.name)
        temporary = self.root / f".{detector.spec.name}.{uuid.uuid4().hex}.tmp"
        try:
            with temporary.open("wb") as handle:
                np.savez(
                    handle,
                    meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                    X=np.ascontiguousarray(matrix, dtype=np.float64),
                    training_scores=detector.training_scores,
                )
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        self._sync_dir()

    def delete(self, name: str) -> bool:
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            return False
        self._sync_dir()
        return True

    def _sync_dir(self) -> None:
        # The rename/unlink is durable only once the directory entry is; not every filesystem allows it.
        with contextlib.suppress(OSError):
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def load_all(self) -> list[FittedDetector]:
        """Every detector in the directory; a file that fails to load is skipped with a warning."""
        if not self.root.is_dir():
            return []
        loaded = []
        for path in sorted(self.root.glob("*.npz")):
            if path.name.startswith("."):
                continue
            try:
                loaded.append(self.load(path))
            except Exception as exc:  # any failure in one file must not stop the others or the server
                logger.warning("skipping anomaly detector file %s: %s", path, exc)
        return loaded

    def load(self, path: Path) -> FittedDetector:
        name = path.name.removesuffix(".npz")
        if not valid_name(name):
            raise CorruptDetector(f"{path.name} is not a valid detector file name")
        try:
            with np.load(path, allow_pickle=False) as archive:
                meta_bytes = archive["meta"]
                matrix = archive["X"]
                saved_scores = archive["training_scores"]
        except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise CorruptDetector(f"unreadable: {exc}") from None
        if meta_bytes.dtype != np.uint8 or matrix.dtype != np.float64 or saved_scores.dtype != np.float64:
            raise CorruptDetector("unexpected array types")
        try:
            meta = json.loads(meta_bytes.tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptDetector(f"metadata is not JSON: {exc}") from None
        spec = _spec_from_meta(meta, name)
        if matrix.ndim != 2 or matrix.shape[1] != spec.features.n_encoded or not np.isfinite(matrix).all():
            raise CorruptDetector(f"training matrix of shape {matrix.shape} does not match its feature space")
        detector = fit(spec, matrix)
        detector.persisted = True
        if saved_scores.shape != detector.training_scores.shape or not np.allclose(
            saved_scores, detector.training_scores, rtol=REFIT_TOLERANCE, atol=REFIT_TOLERANCE
        ):
            logger.warning(
                "anomaly detector %s: refitted training scores differ from the saved ones "
                "(a different PyOD/scikit-learn version?); serving the refitted detector",
                name,
            )
        return detector


def _spec_from_meta(meta: object, name: str) -> DetectorSpec:
    if not isinstance(meta, dict):
        raise CorruptDetector("metadata is not an object")
    if meta.get("format") != FORMAT_VERSION:
        raise CorruptDetector(f"format {meta.get('format')!r} is not {FORMAT_VERSION}")
    if meta.get("name") != name:
        raise CorruptDetector(f"the file names detector {meta.get('name')!r}, not {name!r}")
    algorithm = meta.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise CorruptDetector(f"unknown algorithm {algorithm!r}")
    contamination = meta.get("contamination")
    if not isinstance(contamination, float) or not 0 < contamination <= 0.5:
        raise CorruptDetector(f"contamination {contamination!r} out of range")
    normalization = meta.get("normalization")
    if normalization not in ("standardization", "zscore", "raw"):
        raise CorruptDetector(f"unknown normalization {normalization!r}")
    fitted_at = meta.get("fitted_at")
    if not isinstance(fitted_at, int | float):
        raise CorruptDetector("fitted_at is not a number")
    try:
        params = ALGORITHMS[algorithm].validate(meta.get("params") or {}).model_dump()
        features = FeatureSpace.from_json(meta["features"])
    except Exception as exc:
        raise CorruptDetector(f"invalid parameters or features: {exc}") from None
    return DetectorSpec(
        name=name,
        algorithm=algorithm,
        params=params,
        contamination=contamination,
        normalization=normalization,
        features=features,
        fitted_at=float(fitted_at),
    )
