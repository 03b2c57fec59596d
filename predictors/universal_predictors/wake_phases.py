"""Where a predictor's start-up time goes: process start, imports, weights, engine, and its first answer.

A wake is the time from a request arriving at a model at zero to its first answer. The predictor reports its own
part of it, split into phases, in its ready log line and as the ``universal_predictor_load_seconds{phase}`` gauge,
so ``bench/cold_start.py`` and an operator reading a pod's log see the same split:

* ``process``: from the process's start (the kernel's clock, /proc/self/stat) to ``main``: the interpreter and the
  entry point's own imports;
* ``imports``: every top-level ``import`` that ran after that, until the model is ready (KServe, the predictor's
  server, the engine's libraries; nested imports are counted once, in the import that caused them);
* ``weights``: reading the weight files that are not in the page cache yet (:meth:`WakePhases.read_weights`),
  sequentially, before the engine starts: a file the kernel already holds costs nothing here (the engine maps or
  reads it at memory speed), one on disk (a node-local cache after an eviction, a freshly mounted volume) is read
  at the disk's sequential speed instead of by the engine's page faults;
* ``engine``: the rest, until the model is ready: building the engine around the weights (tensors from the files,
  tokenizer, graph), the HTTP server's start beside it;
* ``first_inference``: the first answered request, start to response (a stream: to its first chunk), which
  includes each engine's lazy first-call work (kernel selection, allocator warm-up).

The import clock wraps ``builtins.__import__`` (what ``import`` statements call) until the model is ready, then
puts it back: one counter and one clock read per import statement meanwhile, nothing after.
"""

from __future__ import annotations

import builtins
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PHASES = ("process", "imports", "weights", "engine")
#: File kinds that hold weights (safetensors, PyTorch, GGUF, ONNX, NumPy, Keras/TF, Flax, pickled estimators).
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".npy", ".npz", ".h5",
                             ".msgpack", ".pkl", ".joblib"})  # fmt: skip
_READ_CHUNK = 8 << 20


def weight_files(source: str) -> list[Path]:
    """The weight files under ``source`` (a folder, or one file); none for a name that is not a local path."""
    path = Path(source)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())


#: Pages probed per file to judge whether the page cache holds it.
_PROBES = 64


def resident_fraction(path: Path) -> float | None:
    """About how much of ``path`` the page cache holds now: 1-byte reads at :data:`_PROBES` spread offsets with
    ``RWF_NOWAIT`` (preadv2(2): EAGAIN instead of waiting for the disk); None where that cannot be asked.

    Not mincore(2): since Linux 5.0 it reports every page of a file the caller may not write as resident (a side
    channel closed: mm/mincore.c can_do_mincore), which is every weight file a pod's user reads from a
    read-only volume.
    """
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not hasattr(os, "preadv"):
        return None
    try:
        size = path.stat().st_size
        if size == 0:
            return 1.0
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        probe = bytearray(1)
        hits = 0
        offsets = sorted({size * i // _PROBES for i in range(_PROBES)})
        for offset in offsets:
            try:
                hits += os.preadv(fd, [probe], offset, flag) == 1
            except BlockingIOError:
                continue  # not in the page cache
            except OSError:
                return None  # the filesystem does not take RWF_NOWAIT
        return hits / len(offsets)
    finally:
        os.close(fd)


def read_cold(files: Iterable[Path]) -> int:
    """Read, sequentially, every file the page cache does not hold whole; returns the bytes read."""
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    for path in files:
        fraction = resident_fraction(path)
        if fraction is not None and fraction >= 0.95:
            continue
        try:
            with path.open("rb", buffering=0) as file:
                while count := file.readinto(view):
                    total += count
        except OSError:
            continue  # the engine reports an unreadable file in its own words
    return total


def process_age_s() -> float | None:
    """Seconds since this process started, from the kernel's record (Linux); None elsewhere."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        started_ticks = int(fields[19])  # starttime, field 22 of proc(5), counted after the ")"
        with open("/proc/uptime", "rb") as uptime:
            up_s = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, up_s - started_ticks / os.sysconf("SC_CLK_TCK"))


class WakePhases:
    """The clock of one predictor's start-up (module docstring). Start it first thing in ``main``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._started = time.monotonic()
        self._original_import: Any = None
        self._local = threading.local()
        self._lock = threading.Lock()

    def start(self, *, count_process: bool = True) -> None:
        """Count the process's age so far (not for a standby taking a model: it was started long before the
        wake), then time imports from now on."""
        self.seconds["process"] = (process_age_s() or 0.0) if count_process else 0.0
        self._started = time.monotonic()
        self._original_import = builtins.__import__
        builtins.__import__ = self._timed_import

    def _timed_import(self, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(self._local, "depth", 0)
        if depth:
            return self._original_import(*args, **kwargs)
        self._local.depth = 1
        started = time.monotonic()
        try:
            return self._original_import(*args, **kwargs)
        finally:
            self._local.depth = 0
            spent = time.monotonic() - started
            with self._lock:
                self.seconds["imports"] += spent

    def read_weights(self, source: str) -> int:
        """The ``weights`` phase: read the source's weight files the page cache lacks (:func:`read_cold`), timed.
        Returns the bytes read (0 when the kernel held them all)."""
        started = time.monotonic()
        read = read_cold(weight_files(source))
        self.seconds["weights"] += time.monotonic() - started
        return read

    def ready(self) -> dict[str, float]:
        """Stop the import clock; the phases, ``engine`` being what the others leave of the time since
        :meth:`start`."""
        if self._original_import is not None:
            builtins.__import__ = self._original_import
            self._original_import = None
        since_start = time.monotonic() - self._started
        self.seconds["engine"] = max(0.0, since_start - self.seconds["imports"] - self.seconds["weights"])
        return dict(self.seconds)

    def first_answer(self, seconds: float) -> bool:
        """Record the first answered request's duration (``first_inference``); True the first time only."""
        with self._lock:
            if "first_inference" in self.seconds:
                return False
            self.seconds["first_inference"] = seconds
            return True

    def describe(self) -> str:
        return ", ".join(f"{phase} {self.seconds[phase]:.2f}s" for phase in PHASES)


#: The process's clock: started by ``universal_predictors.__main__``; a predictor built another way (tests that
#: construct one in process) reports what it can.
CLOCK = WakePhases()
