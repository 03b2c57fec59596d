"""One predictor process kept waiting with its libraries imported, handed the next model that wakes.

A local wake of a small model is mostly the interpreter importing torch, transformers and sentence-transformers
(about 5 of MiniLM's 7.5 s on a 2-CPU machine); the predictor's side is :mod:`universal_predictors.standby`.
The supervisor keeps one such process per library family some model at zero uses (:data:`STANDBY_FAMILIES`;
``serve --no-standby`` keeps none: each costs the memory of its imports while it waits, about 0.5 GB for torch's,
0.35 GB for the light one), hands it the next eligible model's command line and environment as one JSON line on
its stdin, and starts the next standby only once that model is up and serve's models have gone quiet
(:func:`replenish_due`), so the two never share the CPUs during a wake or the requests that follow it.
A standby that declines (a llama.cpp model, KServe flags or an environment it did not import with) says why and
exits; the model then starts as a fresh process, as it would without a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from universal_predictors.catalog import Backend
from universal_predictors.config import STANDBY_ACCEPTED_LINE, STANDBY_READY_LINE

logger = logging.getLogger(__name__)

#: The standby family (the libraries it imports: universal_predictors.standby.PRELOAD) of each backend a standby
#: serves: torch for transformers, a light one for PyOD, RapidOCR and Tesseract. llama.cpp and vLLM start fresh.
STANDBY_FAMILIES: dict[Backend, str] = {
    Backend.TRANSFORMERS: "torch",
    Backend.PYOD: "light",
    Backend.RAPIDOCR: "light",
    Backend.TESSERACT: "light",
}
#: After a standby failed to start, wait this long before trying another (a broken install must not spin).
RETRY_AFTER_FAILURE_S = 60.0
#: How long a standby has to say it took the model (it parses a command line: milliseconds).
ACCEPT_TIMEOUT_S = 30.0
#: The next standby starts once no model has had a request in flight, and none has started, for this long.
#: Its imports take a core for seconds (the light family's 4 to 9 s on a 2-CPU machine): started right after a
#: wake, they shared the CPUs with the requests that woke the model, and an OCR predictor (ONNX Runtime's
#: intra-op threads on both cores) answered in 135 to 145 ms p50 against 48 ms without (bench/pools.py).
REPLENISH_WHEN_QUIET_S = 2.0
#: ... or this long after the wake at the latest: a pool that is never quiet still gets its standby.
REPLENISH_AT_LATEST_S = 60.0


def replenish_due(woke_at: float, last_request_at: float | None, busy: bool, now: float) -> bool:
    """Whether to start the next standby at ``now`` after a wake that ended at ``woke_at``: once serve's models
    have been quiet (nothing ``busy``: no request in flight, no model starting; the last request ended at
    ``last_request_at``) for :data:`REPLENISH_WHEN_QUIET_S`, or :data:`REPLENISH_AT_LATEST_S` after the wake."""
    if now - woke_at >= REPLENISH_AT_LATEST_S:
        return True
    if busy:
        return False
    quiet_since = max(woke_at, last_request_at or woke_at)
    return now - quiet_since >= REPLENISH_WHEN_QUIET_S


class StandbyPool:
    """At most one waiting predictor process (see the module docstring)."""

    def __init__(self, command: Sequence[str], env: Callable[[], dict[str, str]], *, enabled: bool = True,
                 **spawn_options: Any) -> None:  # fmt: skip
        """``command`` starts a standby, in the environment ``env()`` gives, with ``spawn_options`` for
        :func:`asyncio.create_subprocess_exec` (the supervisor's session and parent-death settings)."""
        self._command = list(command)
        self._env = env
        self._spawn_options = spawn_options
        self.enabled = enabled
        self._process: asyncio.subprocess.Process | None = None
        self._ready = asyncio.Event()
        self._starting: asyncio.Task[None] | None = None
        self._failed_at: float | None = None
        self.handed_over = 0

    @property
    def pid(self) -> int | None:
        """The waiting standby's pid, once its imports are done; None while there is none ready."""
        process = self._process
        if process is None or process.returncode is not None or not self._ready.is_set():
            return None
        return process.pid

    def replenish(self) -> None:
        """Start a standby unless one is waiting or starting (or standbys are off, or the last one failed lately)."""
        if not self.enabled or (self._starting is not None and not self._starting.done()):
            return
        if self._process is not None and self._process.returncode is None:
            return
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_FAILURE_S:
            return
        self._starting = asyncio.create_task(self._start(), name="standby-start")

    async def wait_ready(self) -> int | None:
        """The standby's pid once it is ready (None if it has just been taken)."""
        await self._ready.wait()
        return self.pid

    async def _start(self) -> None:
        self._ready.clear()
        started = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self._env(),
                **self._spawn_options,
            )
        except OSError as exc:
            self._failed_at = time.monotonic()
            logger.warning("cannot start a standby predictor (%s); models start fresh", exc)
            return
        self._process = process
        assert process.stdout is not None
        tail: list[str] = []
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line == STANDBY_READY_LINE:
                self._ready.set()
                logger.info("standby predictor ready (pid %d, %.1fs): the next model to wake starts in it",
                            process.pid, time.monotonic() - started)  # fmt: skip
                return
            tail = [*tail[-4:], line]
            logger.debug("[standby] %s", line)
        code = await process.wait()
        self._process, self._failed_at = None, time.monotonic()
        logger.warning("the standby predictor exited with %s before it was ready (%s); models start fresh for "
                       "the next %gs", code, " | ".join(tail) or "no output", RETRY_AFTER_FAILURE_S)  # fmt: skip

    async def take(self, argv: Sequence[str], env: dict[str, str]) -> asyncio.subprocess.Process | None:
        """The standby, now running the model ``argv`` describes; None when there is no ready standby or it
        declined (the caller starts a fresh process). Call :meth:`replenish` once that model is up.

        A standby still importing is waited for: it started before this wake did, so it is ready sooner than a
        fresh process would be, and a fresh one beside it would only share the CPUs with it."""
        if self._starting is not None and not self._starting.done():
            with contextlib.suppress(Exception):  # its failure is logged by _start; a fresh process follows
                await asyncio.shield(self._starting)
        process = self._process
        if process is None or process.returncode is not None or not self._ready.is_set():
            return None
        self._process = None
        self._ready.clear()
        assert process.stdin is not None
        try:
            process.stdin.write(json.dumps({"argv": list(argv), "env": env}).encode() + b"\n")
            await process.stdin.drain()
            process.stdin.close()
            said = await asyncio.wait_for(self._until_accepted(process), ACCEPT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            said = f"no answer ({exc or type(exc).__name__})"
        if said is None:
            self.handed_over += 1
            return process
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        logger.info("the standby predictor declined (%s); starting a fresh process", said)
        return None

    @staticmethod
    async def _until_accepted(process: asyncio.subprocess.Process) -> str | None:
        """None once the standby says it took the model; else the last line it said before it exited."""
        assert process.stdout is not None
        last = "it exited without a word"
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line == STANDBY_ACCEPTED_LINE:
                return None
            last = line
        return last

    async def close(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starting
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
