"""Where a predictor's start-up time goes: process start, imports, weights and engine.

A wake is the time from a request arriving at a model at zero to its first answer. The predictor reports its own
part of it, split into phases, in its ready log line and as the ``universal_predictor_load_seconds{phase}`` gauge,
so ``bench/cold_start.py`` and an operator reading a pod's log see the same split:

* ``process``: from the process's start (the kernel's clock, /proc/self/stat) to ``main``: the interpreter and the
  entry point's own imports;
* ``imports``: every top-level ``import`` that ran after that, until the model is ready (KServe, the predictor's
  server, the engine's libraries; nested imports are counted once, in the import that caused them);
* ``weights_and_engine``: the rest, until the model is ready: reading the weight files and building the engine
  around them (one call in most libraries; the weights alone have a floor ``bench/cold_start.py`` measures), the
  HTTP server's start beside it.

The first inference comes after ready; ``bench/cold_start.py`` measures it from the outside (first answer minus
ready).

The import clock wraps ``builtins.__import__`` (what ``import`` statements call) until the model is ready, then
puts it back: one counter and one clock read per import statement meanwhile, nothing after.
"""

from __future__ import annotations

import builtins
import os
import threading
import time
from typing import Any

PHASES = ("process", "imports", "weights_and_engine")


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

    def ready(self) -> dict[str, float]:
        """Stop the import clock; the phases, ``weights_and_engine`` being what the others leave of the time
        since :meth:`start`."""
        if self._original_import is not None:
            builtins.__import__ = self._original_import
            self._original_import = None
        since_start = time.monotonic() - self._started
        self.seconds["weights_and_engine"] = max(0.0, since_start - self.seconds["imports"])
        return dict(self.seconds)

    def describe(self) -> str:
        return ", ".join(f"{phase} {self.seconds[phase]:.2f}s" for phase in PHASES)


#: The process's clock: started by ``universal_predictors.__main__``; a predictor built another way (tests that
#: construct one in process) reports what it can.
CLOCK = WakePhases()
