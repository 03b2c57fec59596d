"""The supervisor's side of a shared host: one predictor process serving several members of one library family.

``serve --member-processes shared`` (a pool's default) runs the members of each family (:data:`HOST_FAMILIES`:
torch, ocr, pyod) in one process, :mod:`universal_predictors.shared_host`,
instead of one each: in one process each further all-MiniLM-L6-v2 cost 42 MB against about 430 MB in a process of
its own. Each member keeps its own port and app, so routing, readiness and the model card are as for a process of
its own; what changes is the process's life, which :class:`HostHandle` tracks: the host is started (its imports
take the seconds a standby's would), told to add and remove members (JSON lines on its stdin), and reports each
member's ``added``, ``loaded`` (with the memory the load added to the host), ``failed`` and ``removed`` (event lines
on its stdout, among its log lines). The supervisor (:mod:`universal_gateway.local`) stops a host once it has no
members, and treats the host's exit as each member's crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from universal_gateway.isolation import tree_rss
from universal_predictors.catalog import Backend
from universal_predictors.config import HOST_EVENT_PREFIX, HOST_READY_LINE

logger = logging.getLogger(__name__)

#: The shared host family (``universal_predictors.shared_host.PRELOAD``: what it imports) of each backend a host
#: serves. llama.cpp and vLLM members get a process of their own (their own threads and memory pools).
HOST_FAMILIES: dict[Backend, str] = {
    Backend.TRANSFORMERS: "torch",
    Backend.PYOD: "pyod",
    Backend.RAPIDOCR: "ocr",
    Backend.TESSERACT: "ocr",
}

#: How long a host has to import its libraries and say so.
HOST_START_TIMEOUT_S = 300.0
#: How long a host has to say it took a member (parsing a command line, binding a port: milliseconds).
ADD_TIMEOUT_S = 30.0
#: How long a removed member's requests in flight, unloading and the host's answer may take.
REMOVE_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


async def terminate(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if ``process`` is still there after ``grace_s``; returns once it has exited."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


class HostRefused(Exception):
    """The host could not serve the member (a bad command line or engine argument, a port, a failed load), or
    it is gone."""


class HostHandle:
    """One shared host process: start it, add and remove members (by port: a member replaced by a changed manifest
    may briefly be served beside its successor under one name), follow its events and its exit."""

    def __init__(
        self,
        family: str,
        command: Sequence[str],
        env: dict[str, str],
        *,
        on_line: Callable[[str], None] | None = None,
        **spawn: Any,
    ) -> None:
        self.family = family
        self._command = list(command)
        self._env = env
        self._spawn = spawn
        self._on_line = on_line
        self.process: asyncio.subprocess.Process | None = None
        #: What the host held once its libraries were imported, before any member (its share of the memory).
        self.baseline_bytes: int | None = None
        #: The members it serves (added, loading or loaded), by port, each with the LocalModel the supervisor keeps.
        self.members: dict[int, Any] = {}
        self.log_tail: deque[str] = deque(maxlen=40)
        #: The memory limit group it is held to (universal_gateway.isolation), while one is.
        self.limit_key: str | None = None
        self._ready = asyncio.Event()
        self._waiters: dict[tuple[str, int], asyncio.Future[dict[str, Any]]] = {}
        self._pump: asyncio.Task[None] | None = None

    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Start the process and wait until it has imported its libraries; HostRefused if it exits first."""
        self.process = await asyncio.create_subprocess_exec(
            *self._command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=self._env, **self._spawn,
        )  # fmt: skip
        self._pump = asyncio.create_task(self._read(self.process), name=f"host-{self.family}-{self.process.pid}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait({ready, self._pump}, timeout=HOST_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not self._ready.is_set():
            await self.stop()
            tail = " | ".join(list(self.log_tail)[-5:])
            raise HostRefused(f"the {self.family} shared host did not start" + (f": {tail}" if tail else ""))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line == HOST_READY_LINE:
                self.baseline_bytes = tree_rss(process.pid)
                self._ready.set()
                continue
            if line.startswith(HOST_EVENT_PREFIX):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self._event(json.loads(line[len(HOST_EVENT_PREFIX) :]))
                    continue
            self.log_tail.append(line)
            if self._on_line is not None:
                self._on_line(line)
        for future in self._waiters.values():  # the host is gone: nobody answers
            if not future.done():
                future.set_result({"event": "failed", "exited": True,
                                   "message": f"the {self.family} shared host exited"})  # fmt: skip

    def _event(self, event: dict[str, Any]) -> None:
        kind, port = str(event["event"]), int(event["port"])
        for wanted in (kind, "any"):
            future = self._waiters.get((wanted, port))
            if future is not None and not future.done():
                future.set_result(event)

    def _expect(self, kind: str, port: int) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[(kind, port)] = future
        return future

    def _send(self, order: dict[str, Any]) -> None:
        if not self.running() or self.process is None or self.process.stdin is None:
            raise HostRefused(f"the {self.family} shared host is not running")
        self.process.stdin.write((json.dumps(order) + "\n").encode())

    async def add(self, name: str, port: int, argv: Sequence[str], model: Any) -> asyncio.Future[dict[str, Any]]:
        """Have the host serve ``name`` on ``port``; returns once it listens (answering 503 while it loads), with a
        future of its ``loaded`` (or ``failed``) event. HostRefused naming why if it cannot."""
        answer = self._expect("any", port)
        loaded = self._expect("loaded", port)
        self.members[port] = model
        try:
            self._send({"op": "add", "port": port, "argv": list(argv)})
            event = await asyncio.wait_for(answer, ADD_TIMEOUT_S)
        except (HostRefused, TimeoutError) as exc:
            self.members.pop(port, None)
            raise HostRefused(str(exc) or f"the {self.family} shared host did not answer") from None
        finally:
            self._waiters.pop(("any", port), None)
        if event["event"] != "added":
            self.members.pop(port, None)
            self._waiters.pop(("loaded", port), None)
            raise HostRefused(str(event.get("message") or "refused"))
        failed = self._expect("failed", port)  # a load that fails: the member is gone from the host

        def settle(done: asyncio.Future[dict[str, Any]]) -> None:
            self._waiters.pop(("loaded", port), None)
            self._waiters.pop(("failed", port), None)
            if not loaded.done():
                loaded.set_result(done.result())
            if done.result().get("event") == "failed" and not done.result().get("exited"):
                self.members.pop(port, None)  # its load failed; a host that exited is the supervisor's to record

        failed.add_done_callback(lambda f: settle(f) if not f.cancelled() else None)
        return loaded

    async def remove(self, port: int, name: str) -> None:
        """Stop serving the member on ``port``: its requests in flight end, it is unloaded. A host that does not
        answer in time is stopped (its other members with it)."""
        if port not in self.members:
            return
        self.members.pop(port, None)
        answer = self._expect("removed", port)
        try:
            self._send({"op": "remove", "port": port})
            await asyncio.wait_for(answer, REMOVE_TIMEOUT_S)
        except HostRefused:
            return
        except TimeoutError:
            logger.warning("the %s shared host did not unload %s within %.0fs; stopping it", self.family, name,
                           REMOVE_TIMEOUT_S)  # fmt: skip
            await self.stop()
        finally:
            self._waiters.pop(("removed", port), None)

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        await terminate(process, STOP_GRACE_S)
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pump, 1)
