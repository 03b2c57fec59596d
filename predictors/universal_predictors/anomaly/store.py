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
import stat
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from universal_predictors.anomaly.algorithms import ALGORITHMS
from universal_predictors.anomaly.detector import DetectorSpec, FittedDetector, fit
from universal_predictors.anomaly.features import FeatureSpace

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUBDIR = "anomaly-detectors"
#: Detector names: a file name on every filesystem, never a path (no '/', no leading '.'). Matched
#: whole (``fullmatch``): with ``match``, ``$`` also matches before a final newline, and "ok\n" passed.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Relative difference between saved and refitted training scores that counts as "the same".
REFIT_TOLERANCE = 1e-9


def file_bytes(rows: int, columns: int) -> int:
    """The size of a detector's file, known before it is written: the float64 training matrix and scores,
    with room for the .npy headers and the zip's directory (the metadata is counted when it is written)."""
    return rows * columns * 8 + rows * 8 + 4096


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def valid_name(name: str) -> bool:
    return NAME_PATTERN.fullmatch(name) is not None


#: Bytes of the JSON metadata a file may carry (names, parameters, categories).
MAX_META_BYTES = 4 * 2**20


class CorruptDetector(ValueError):
    """A file in the state directory that is not a detector this version can load."""


@dataclass(frozen=True)
class LoadLimits:
    """The limits a fit request has (engine args), applied to files in the state directory too."""

    max_rows: int
    max_features: int
    max_cells: int
    max_categories: int
    max_detectors: int
    max_memory_bytes: int
    max_disk_bytes: int


@dataclass(frozen=True)
class SkippedFile:
    """A file in the state directory that was not loaded, and why (listed in ``GET /v1/anomaly/detectors``)."""

    file: str
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"file": self.file, "reason": self.reason}


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


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

    def save(self, detector: FittedDetector, matrix: np.ndarray) -> int:
        """Write atomically: temporary file in the same directory, fsync, rename, fsync the directory; the
        file's size."""
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
                size = os.fstat(handle.fileno()).st_size
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        self._sync_dir()
        return size

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

    def load_all(self, limits: LoadLimits) -> tuple[list[FittedDetector], list[SkippedFile]]:
        """Every detector in the directory within ``limits``, and the files skipped (each with a warning).

        Only regular files are opened (never followed into a FIFO, a device or through a symbolic link),
        and each is held to a fit request's limits before its arrays are read."""
        if not self.root.is_dir():
            return [], []
        loaded: list[FittedDetector] = []
        skipped: list[SkippedFile] = []
        memory = disk = 0
        for path in sorted(self.root.glob("*.npz")):
            if path.name.startswith("."):
                continue
            try:
                _detector_name(path)  # a misnamed file is reported as such, and holds no max_detectors slot
                if len(loaded) >= limits.max_detectors:
                    raise CorruptDetector(f"{limits.max_detectors} detectors are loaded, the limit (max_detectors)")
                detector = self.load(path, limits, limits.max_memory_bytes - memory, limits.max_disk_bytes - disk)
                loaded.append(detector)
                memory += detector.memory_bytes
                disk += detector.disk_bytes
            except Exception as exc:  # any failure in one file must not stop the others or the server
                logger.warning("skipping anomaly detector file %r: %s", str(path), exc)  # %r: a name may hold "\n"
                skipped.append(SkippedFile(path.name, str(exc)))
        return loaded, skipped

    def load(self, path: Path, limits: LoadLimits, memory_left: int, disk_left: int) -> FittedDetector:
        """The detector in ``path``, refitted only when what it holds fits in ``memory_left`` bytes and its
        file in ``disk_left`` (what the detectors loaded before it left of the budgets)."""
        name = _detector_name(path)
        try:
            mode = os.lstat(path).st_mode
        except OSError as exc:
            raise CorruptDetector(f"unreadable: {exc}") from None
        if not stat.S_ISREG(mode):
            raise CorruptDetector(f"{_kind(mode)}, not a regular file")
        try:
            # O_NONBLOCK: a FIFO swapped in after the lstat does not block start-up; O_NOFOLLOW: nor a link.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise CorruptDetector(f"unreadable: {exc}") from None
        with os.fdopen(fd, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise CorruptDetector(f"{_kind(mode)}, not a regular file")
            size = os.fstat(handle.fileno()).st_size
            if size > disk_left:
                raise CorruptDetector(
                    f"its file of {mib(size)} is over what the detectors loaded before it leave of the state "
                    f"directory's budget ({mib(max(disk_left, 0))} of max_state_mb)"
                )
            meta_bytes, matrix, saved_scores = _read_arrays(handle, limits)
        if meta_bytes.dtype != np.uint8 or matrix.dtype != np.float64 or saved_scores.dtype != np.float64:
            raise CorruptDetector("unexpected array types")
        try:
            meta = json.loads(meta_bytes.tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptDetector(f"metadata is not JSON: {exc}") from None
        spec = _spec_from_meta(meta, name)
        for field, values in spec.features.categories.items():
            if len(values) > limits.max_categories:
                raise CorruptDetector(
                    f"field {field!r} has {len(values)} categories; the limit max_categories is {limits.max_categories}"
                )
        if matrix.ndim != 2 or matrix.shape[1] != spec.features.n_encoded or not np.isfinite(matrix).all():
            raise CorruptDetector(f"training matrix of shape {matrix.shape} does not match its feature space")
        rows, columns = matrix.shape
        algorithm = ALGORITHMS[spec.algorithm]
        memory = algorithm.held_bytes(algorithm.validate(spec.params), rows, columns)
        if memory > memory_left:
            raise CorruptDetector(
                f"fitted, it would hold about {mib(memory)}, over what the detectors loaded before it leave of "
                f"the memory budget ({mib(max(memory_left, 0))} of max_detector_memory_mb)"
            )
        detector = fit(spec, matrix)
        detector.persisted = True
        detector.memory_bytes, detector.disk_bytes = memory, size
        if saved_scores.shape != detector.training_scores.shape or not np.allclose(
            saved_scores, detector.training_scores, rtol=REFIT_TOLERANCE, atol=REFIT_TOLERANCE
        ):
            logger.warning(
                "anomaly detector %s: refitted training scores differ from the saved ones "
                "(a different PyOD/scikit-learn version?); serving the refitted detector",
                name,
            )
        return detector


def _detector_name(path: Path) -> str:
    """The detector a file in the state directory holds, by its name; CorruptDetector when that is no
    detector name (such as "ok\n.npz", which versions that matched names with ``match`` could write)."""
    name = path.name.removesuffix(".npz")
    if not valid_name(name):
        raise CorruptDetector(
            f"{path.name!r} is not named for a detector (1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit, then .npz), so the API can neither read nor delete it; rename or remove the file"
        )
    return name


def _read_arrays(handle: BinaryIO, limits: LoadLimits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``meta``, ``X`` and ``training_scores``, each checked against ``limits`` from its header (sizes and
    shape) before its data is read: a small compressed file cannot inflate past a fit's limits."""
    max_x_bytes = limits.max_cells * 8
    budgets = {"meta.npy": MAX_META_BYTES, "X.npy": max_x_bytes, "training_scores.npy": limits.max_rows * 8}
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(handle) as archive:
            for member, budget in budgets.items():
                info = archive.getinfo(member)
                if info.file_size > budget + 4096:  # the .npy header is small
                    raise CorruptDetector(f"{member} is {info.file_size} bytes; a fit's limits allow {budget}")
                with archive.open(info) as stream:
                    version = np.lib.format.read_magic(stream)
                    if version == (1, 0):
                        shape, _, _ = np.lib.format.read_array_header_1_0(stream)
                    elif version == (2, 0):
                        shape, _, _ = np.lib.format.read_array_header_2_0(stream)
                    else:
                        raise CorruptDetector(f"{member} has .npy format version {version}, not 1.0 or 2.0")
                    if member == "X.npy":
                        _check_shape(shape, limits)
                arrays[member] = np.load(archive.open(info), allow_pickle=False)
    except CorruptDetector:
        raise
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CorruptDetector(f"unreadable: {exc}") from None
    return arrays["meta.npy"], arrays["X.npy"], arrays["training_scores.npy"]


def _check_shape(shape: tuple[int, ...], limits: LoadLimits) -> None:
    if len(shape) != 2:
        raise CorruptDetector(f"training matrix of shape {shape} is not 2-D")
    rows, columns = shape
    if rows > limits.max_rows:
        raise CorruptDetector(f"{rows} training rows; the limit max_rows is {limits.max_rows}")
    if columns > limits.max_features:
        raise CorruptDetector(f"{columns} training columns; the limit max_features is {limits.max_features}")
    if rows * columns > limits.max_cells:
        raise CorruptDetector(f"{rows} x {columns} training values; the limit max_cells is {limits.max_cells}")


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
