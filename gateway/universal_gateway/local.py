"""LocalSupervisor: one predictor process per model on loopback, started on demand, stopped when idle.

The command line comes from the operator's own ``predictor_config`` (so a model runs the same way on a
laptop and in a cluster); only the source path (fetched here), the state folder and the listen address
(127.0.0.1: a predictor has no API keys of its own, so only this machine may reach it) differ.
A predictor dies with the gateway, however the gateway ends: a parent-death signal on Linux, and the
predictor's own watch on its parent (``PARENT_PID_ENV``) everywhere. Its warnings and errors appear in
the gateway's log, prefixed with the model's name; the rest with ``-v``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from universal_gateway.backends import SYSTEM_CLOCK, Backends, Clock, ModelState, ModelView, UsageStats, counted
from universal_gateway.hosts import HOST_FAMILIES, HostHandle, HostRefused, terminate
from universal_gateway.isolation import MemoryLimits, memory_bytes, tree_rss
from universal_gateway.manifests import Manifest, ManifestError, files_signature, load_manifests, member_changes
from universal_gateway.policy import ServingPolicy, is_idle
from universal_gateway.predictor_report import ask_backend
from universal_gateway.standby import STANDBY_FAMILIES, StandbyPool, replenish_due
from universal_operator.predictor import possible_backends, predictor_config, resolved_backend
from universal_predictors.catalog import Backend
from universal_predictors.config import (
    GPUS_ENV,
    HOST_FLAG,
    PARENT_PID_ENV,
    PREDICTOR_MODULE,
    STANDBY_FLAG,
    UPSTREAM_TOKEN_ENV,
    PredictorConfig,
    resolve_backend,
    resolve_source,
)
from universal_predictors.errors import Unavailable
from universal_predictors.generation.adapter_stores import (
    HF_TOKEN,
    CredentialsUnavailable,
    DownloadFailed,
    StoreSecret,
    download,
    is_remote,
    read_store_secret,
)

logger = logging.getLogger(__name__)

#: Crashes within this window count towards marking a model failed.
CRASH_WINDOW_S = 120.0
CRASHES_BEFORE_FAILED = 3
#: How long a process whose connection broke unanswered has to be seen exiting (Backends.exited).
EXIT_NOTICE_S = 2.0
#: The exit codes of a process killed from outside (not failing of itself).
_KILLED = frozenset({-signal.SIGKILL, -signal.SIGTERM})
#: A failed model is tried again on a request after this long.
FAILED_COOLDOWN_S = 30.0
STOP_GRACE_S = 10.0
#: How often ``serve`` looks for added, removed or edited manifests (one ``stat`` per file).
RESCAN_EVERY_S = 2.0
#: How long a removed or changed member's requests in flight may take before its process is stopped anyway.
DRAIN_TIMEOUT_S = 60.0
#: Where predictors listen: this machine only.
LOOPBACK = "127.0.0.1"
#: linux/prctl.h
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies (Linux's
    PR_SET_PDEATHSIG, prctl(2)); None elsewhere (the predictor's own parent watch covers that)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_LOUD_LEVELS = {"WARNING": logging.WARNING, "WARN": logging.WARNING, "ERROR": logging.ERROR,
                "CRITICAL": logging.ERROR, "FATAL": logging.ERROR}  # fmt: skip
_ERROR_START = re.compile(r"^(Traceback |\S*(Error|Exception)\b|\S+: error: )")
_WARNING_START = re.compile(r"^\S+:\d+: \w*Warning: ")  # warnings.warn's "file:line: Category: message"


def predictor_log_level(line: str, previous: int) -> int:
    """The level at which a predictor's output line enters the gateway's log: a log record's own
    level (WARNING and above stay, the rest become DEBUG); a line without one (a traceback, a message
    on stderr) is an error when it starts like one, else it goes with the line before it."""
    level = _LEVEL.search(line, 0, 80)
    if level is not None:
        return _LOUD_LEVELS.get(level.group(1), logging.DEBUG)
    if _ERROR_START.match(line):
        return logging.ERROR
    if _WARNING_START.match(line):
        return logging.WARNING
    return previous


def default_state_root() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "universal-runtime"


@dataclass(eq=False)  # one per process's life: told apart by identity (a retiring one beside its successor)
class LocalModel:
    """One model's process and bookkeeping."""

    manifest: Manifest
    state: ModelState = ModelState.IDLE
    message: str = "Not started; the first request starts it."
    process: asyncio.subprocess.Process | None = None
    port: int | None = None
    source_path: str | None = None
    starting: asyncio.Task[None] | None = None
    stopping: bool = False
    crashes: deque[float] = field(default_factory=lambda: deque(maxlen=CRASHES_BEFORE_FAILED))
    failed_at: float | None = None
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    stats: UsageStats = field(default_factory=UsageStats)
    starts: int = 0
    last_load_seconds: float | None = None
    handled_exits: set[int] = field(default_factory=set)
    watchers: set[asyncio.Task[None]] = field(default_factory=set)
    #: The backend the running predictor says it runs, where the spec leaves it to the predictor (``auto``).
    running_backend: Backend | None = None
    #: Whether the running predictor was started with an adapters file (it re-reads it; else a restart is due).
    with_adapters: bool = False
    #: Whether the running process is a standby that took this model (its libraries were imported already).
    from_standby: bool = False
    #: While it starts: Starting (the process, its imports: nothing listens yet), then Loading (its server
    #: answers, not ready: the model is loading). None otherwise.
    step: str | None = None
    #: The resident memory of its predictor (the process and its children), measured once ready and then every
    #: few seconds while it runs; kept after it stops, as the estimate for its next start.
    footprint_bytes: int | None = None
    #: Times it was stopped to make room under ``--memory-budget-mb``.
    evictions: int = 0
    #: Exits nobody asked for (a crash, the OOM killer, a kill -9), and how the latest ended.
    crash_count: int = 0
    last_exit: str | None = None
    #: Why it is not running, for a pool's status: Crashed, OOMKilled, Evicted, IdleTimeout, Failed (None: running,
    #: or never started).
    reason: str | None = None
    #: Its process's memory-limit group (:class:`universal_gateway.isolation.MemoryLimits`), while one is held.
    limit_key: str | None = None
    #: Set once a retired member (removed, or replaced by a changed manifest) has no request in flight.
    drained: asyncio.Event | None = None
    #: The shared host serving it (``--member-processes shared``), while one does; ``process`` is then the host's.
    host: HostHandle | None = None
    policy: ServingPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = ServingPolicy.from_model(self.manifest.model)

    @property
    def name(self) -> str:
        return self.manifest.model.served_name

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def running(self) -> bool:
        if self.process is None or self.process.returncode is not None:
            return False
        return self.host is None or (self.port is not None and self.host.members.get(self.port) is self)


class LocalSupervisor(Backends):
    """Serve manifests as local predictor processes with TTL unloading."""

    def __init__(
        self,
        manifests: list[Manifest],
        *,
        state_root: Path | None = None,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        reap_interval: float = 0.25,
        fetch: Callable[[Manifest], str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        standby: bool = True,
        memory_budget_mb: float | None = None,
        watch: list[Path] | None = None,
        rescan_interval: float = RESCAN_EVERY_S,
        member_memory_limit_mb: float | None = None,
        cache_dir: Path | None = None,
        shared_processes: bool = False,
        credentials_dir: Path | None = None,
        cached_prefixes: Mapping[str, Path] | None = None,
    ) -> None:
        # ``clock`` judges idleness (the TTL unload); crash windows and startup deadlines keep the system's.
        self._clock = clock
        #: The memory the running predictors may hold together (None: no bound); see :meth:`_make_room`.
        self.memory_budget = int(memory_budget_mb * MiB) if memory_budget_mb else None
        self._measured_at = 0.0
        #: The manifest files and folders re-read while serving (a pool's members): see :meth:`_rescan`.
        self._watch = watch
        self._rescan_interval = rescan_interval
        self._signature = files_signature(watch) if watch else ()
        self._scanned_at = time.monotonic()
        #: Members removed or replaced, draining their requests in flight before their process stops.
        self._retiring: set[LocalModel] = set()
        self._background: set[asyncio.Task[None]] = set()
        #: A member's memory limit when its ``spec.resources.memory`` names none (None: no limit).
        self._default_limit = int(member_memory_limit_mb * MiB) if member_memory_limit_mb else None
        self._limits: MemoryLimits | None = None
        #: ``--member-processes shared``: each library family's members in one host process (universal_gateway.hosts).
        self._shared = shared_processes
        self.hosts: dict[str, HostHandle] = {}
        self._host_starts: dict[str, asyncio.Task[HostHandle]] = {}
        #: Members about to join each family's host (making room, waiting for it to start).
        self._joining: dict[str, int] = {}
        #: Each family's host as last measured once its libraries were imported (the estimate for the next one).
        self._host_baselines: dict[str, int] = {}
        self._models = {m.model.served_name: LocalModel(m, stats=UsageStats(clock=clock)) for m in manifests}
        # Loopback is shared by every user of this machine: the predictors also want this run's token.
        self._token = self.upstream_token = secrets.token_urlsafe(32)
        self._state_root = state_root or default_state_root()
        #: Each manifest file's mtime when last read (adapters are re-read when it changes).
        self._manifest_stamps: dict[Path, int] = {}
        self._python = python
        self._env = env or {}
        self._reap_interval = reap_interval
        self._fetch = fetch or functools.partial(
            fetch_source, cache_dir=cache_dir, credentials_dir=credentials_dir, cached_prefixes=cached_prefixes
        )
        self._reaper: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        # A waiting predictor per library family, for the next model of that family to wake
        # (universal_gateway.standby); worth its memory only for a family some model at zero can use.
        self._standby = standby
        #: When the last wake ended, while the standbys are to be started again once serve is quiet.
        self._replenish_after: float | None = None
        wanted = self._standby_families()
        self.standbys = {
            family: StandbyPool(
                [python, "-m", PREDICTOR_MODULE, STANDBY_FLAG, family], self._process_env,
                enabled=standby and family in wanted and not shared_processes, start_new_session=True,
                preexec_fn=die_with_parent(),
            )
            for family in sorted(set(STANDBY_FAMILIES.values()))
        }  # fmt: skip

    def _standby_families(self, *, hosts: bool = False) -> set[str]:
        """The standby families some model at zero may use (``hosts``: the shared host families, of the models a host
        may serve)."""
        families = HOST_FAMILIES if hosts else STANDBY_FAMILIES
        return {
            family for m in self._models.values() if not m.policy.always_on
            and (not hosts or not m.manifest.model.spec.env)
            for b in possible_backends(m.manifest.model) if (family := families.get(b)) is not None
        }  # fmt: skip

    # -- Backends ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        self._reaper = asyncio.create_task(self._reap_idle(), name="local-supervisor-reaper")
        for model in self._models.values():
            if model.policy.always_on:
                model.starting = asyncio.create_task(self._start(model))
        if not any(m.policy.always_on for m in self._models.values()):
            self._replenish()  # else once the always-on models are up (the end of _start)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(pool.close() for pool in self.standbys.values()))
        await asyncio.gather(
            *(self._stop(m, reason="gateway shutting down") for m in [*self._models.values(), *self._retiring])
        )
        for start in self._host_starts.values():
            start.cancel()
        await asyncio.gather(*self._host_starts.values(), return_exceptions=True)
        await asyncio.gather(*(host.stop() for host in self.hosts.values()))
        if self._session is not None:
            await self._session.close()

    def models(self) -> list[ModelView]:
        return [self._view(m) for m in self._models.values()]

    def find(self, name: str) -> ModelView | None:
        model = self._models.get(name)  # one view, not all of them: this is on every request's path
        return self._view(model) if model is not None else None

    def model(self, name: str) -> LocalModel | None:
        return self._models.get(name)

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[str]:
        model = self._models.get(name)
        if model is None:  # removed from the manifests between the gateway's lookup and now
            raise Unavailable(f"The model {name!r} was removed from the models served here.", code="model_not_found")
        try:
            async with counted(model.stats):
                await self.ensure_ready(model)
                yield model.url
        finally:
            if model.drained is not None and model.stats.in_flight == 0:
                model.drained.set()  # a retired member's last request: its process may stop

    async def exited(self, name: str, upstream: str, *, killed: bool = False) -> bool:
        """A request got no answer: whether the model's process (or shared host) exited. A process killed as the
        request came (SIGKILL: the kernel frees its memory before it closes its sockets) may still accept the
        connection and then close it unanswered; the exit is seen here within :data:`EXIT_NOTICE_S` and recorded
        (a crash), and the next :meth:`lease` starts a successor."""
        model = self._models.get(name)
        if model is None:
            return False
        process = model.process
        if model.url != upstream or process is None:
            return not killed  # replaced or stopped already: how that one ended is not known here
        try:
            code = await asyncio.wait_for(asyncio.shield(process.wait()), EXIT_NOTICE_S)
        except TimeoutError:
            return False  # it runs on: the connection broke for another reason
        self._record_exit(model, process, code)  # as its watcher will (once: the first to see the exit records it)
        if killed:
            return code in _KILLED and model.reason != "OOMKilled"
        return True

    # -- lifecycle ---------------------------------------------------------------------------------

    async def ensure_ready(self, model: LocalModel) -> None:
        """Return once the model's process is ready; concurrent callers share one start."""
        if model.state is ModelState.READY and model.running():
            return
        if model.state is ModelState.FAILED:
            if model.failed_at is not None and time.monotonic() - model.failed_at < FAILED_COOLDOWN_S:
                raise Unavailable(
                    f"The model {model.name!r} failed to start: {model.message}",
                    code="model_failed",
                    retry_after=FAILED_COOLDOWN_S - (time.monotonic() - model.failed_at),
                )
            model.crashes.clear()
        if model.starting is None or model.starting.done():
            model.starting = asyncio.create_task(self._start(model), name=f"start-{model.name}")
        # Shield: one caller giving up must not cancel the start the others wait for.
        await asyncio.shield(model.starting)
        if model.state is not ModelState.READY:
            raise Unavailable(f"The model {model.name!r} is not available: {model.message}", code="model_failed")

    def _process_env(self, model: LocalModel | None = None) -> dict[str, str]:
        """A predictor's environment: the gateway's, the model's ``spec.env``, and the per-process variables."""
        own = {e.name: e.value for e in model.manifest.model.spec.env if e.value} if model is not None else {}
        return {**os.environ, **self._env, **own, PARENT_PID_ENV: str(os.getpid()), UPSTREAM_TOKEN_ENV: self._token}

    @staticmethod
    def _host_family(model: LocalModel, config: PredictorConfig, env: dict[str, str]) -> str | None:
        """The shared host family that serves this model (by the backend it runs, as ``auto`` resolves); None for
        llama.cpp and vLLM, a model with variables of its own (a library may read them when it is imported), and a
        model on a GPU (its device's memory is its own process's)."""
        gpus = int(env[GPUS_ENV]) if env.get(GPUS_ENV, "").isdigit() else 0
        if model.manifest.model.spec.env or gpus:
            return None
        pattern = config.source_file or config.source_projector_file
        return HOST_FAMILIES.get(resolve_backend(config.task, config.backend, config.source, pattern, gpus))

    @staticmethod
    def _standby_family(model: LocalModel, config: PredictorConfig, env: dict[str, str]) -> str | None:
        """The standby family that serves this model as a fresh process would: by the backend it runs (what
        ``auto`` resolves to, by the predictor's own rule); None for llama.cpp and vLLM (their own threads and
        libraries) and for a model with variables of its own (a library may read them when it is imported)."""
        if model.manifest.model.spec.env:
            return None
        pattern = config.source_file or config.source_projector_file
        gpus = int(env[GPUS_ENV]) if env.get(GPUS_ENV, "").isdigit() else 0
        return STANDBY_FAMILIES.get(resolve_backend(config.task, config.backend, config.source, pattern, gpus))

    def _replenish(self) -> None:
        for pool in self.standbys.values():
            pool.replenish()
        if self._shared and self._standby:  # a host waiting, its libraries imported, as a standby would
            for family in sorted(self._standby_families(hosts=True)):
                if family not in self.hosts and family not in self._host_starts and self._room_for_host(family):
                    self._background_host(family)

    def _room_for_host(self, family: str) -> bool:
        """Whether a waiting host of ``family`` fits under the memory budget beside what runs (always, without one)."""
        if self.memory_budget is None:
            return True
        used = sum(self._footprint(m) for m in self._models.values() if m.running())
        used += sum(self._host_bytes(h) for h in self.hosts.values() if h.running())
        return used + self._host_baselines.get(family, PROCESS_BASELINE_BYTES) <= self.memory_budget

    def _replenish_when_quiet(self, now: float) -> None:
        """Start the standbys a wake used once serve's models have gone quiet (universal_gateway.standby)."""
        if self._replenish_after is None:
            return
        models = list(self._models.values())
        busy = any(m.stats.in_flight or (m.starting is not None and not m.starting.done()) for m in models)
        last = max((m.stats.last_used_monotonic or 0.0 for m in models), default=None)
        if replenish_due(self._replenish_after, last, busy, now):
            self._replenish_after = None
            self._replenish()

    async def _start(self, model: LocalModel) -> None:
        try:
            await self._start_once(model)
        finally:
            # After the wake and the requests that follow it, not during them: the two would share the CPUs.
            self._replenish_after = self._clock.monotonic()

    async def _start_once(self, model: LocalModel) -> None:
        if model.running() and model.state is ModelState.READY:
            return
        backoff = self._backoff(model)
        if backoff > 0:
            await asyncio.sleep(backoff)
        model.state, model.message = ModelState.LOADING, "Starting."
        started = time.monotonic()
        try:
            if model.source_path is None:
                model.source_path = await asyncio.to_thread(self._fetch, model.manifest)
        except Exception as exc:  # an offline hub, a missing path: this model fails, the rest serve
            self._fail(model, f"cannot fetch {model.manifest.model.spec.source.uri}: {exc}")
            return
        model.port = free_port()
        state_dir = self._state_root / re.sub(r"[^A-Za-z0-9_.-]+", "_", model.name)
        state_dir.mkdir(parents=True, exist_ok=True)
        adapters = write_adapters_file(model.manifest, state_dir)
        model.with_adapters = adapters is not None
        config = predictor_config(model.manifest.model, model.port, source=model.source_path, state_dir=str(state_dir),
                                  adapters_file=str(adapters) if adapters else None)  # fmt: skip
        config = config.model_copy(update={"http_host": LOOPBACK})
        env = self._process_env(model)
        family = self._standby_family(model, config, env)
        hosted = self._host_family(model, config, env) if self._shared else None
        if hosted is not None:  # its host is not to stop for want of members while it joins
            self._joining[hosted] = self._joining.get(hosted, 0) + 1
        try:
            try:
                await self._make_room(model, family=hosted)
            except Unavailable as exc:
                model.state, model.message = ModelState.IDLE, exc.message
                raise
            model.log_tail.clear()
            model.stopping = False
            loaded: asyncio.Future[dict[str, Any]] | None = None
            if hosted is not None:
                try:
                    host = await self._host(hosted)
                    model.host, model.process = host, host.process
                    loaded = await host.add(model.name, model.port, config.to_args(), model)
                except HostRefused as exc:
                    model.host = None
                    self._fail(model, f"the {hosted} shared host cannot serve it: {exc}")
                    return
        finally:
            if hosted is not None:
                self._joining[hosted] -= 1
        if hosted is not None:
            model.from_standby = False
        else:
            model.host = None
            handed = await self.standbys[family].take(config.to_args(), env) if family is not None else None
            model.from_standby = handed is not None
            model.process = handed or await asyncio.create_subprocess_exec(
                *config.to_command(self._python),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # our signals only: Ctrl-C in the terminal goes to the gateway
                preexec_fn=die_with_parent(),
            )
        assert model.process is not None
        model.starts += 1
        model.reason = None
        if model.host is not None:
            self._limit_host(model.host)
        else:
            self._limit(model, model.process.pid)
        self.wake_steps.wake(model.name)
        where = (f", in the {hosted} shared host" if model.host is not None
                 else f", in the {family} standby process" if model.from_standby else "")  # fmt: skip
        logger.info("starting %s (pid %d, port %d%s)", model.name, model.process.pid, model.port, where)
        model.watchers = set() if model.host is not None else {
            asyncio.create_task(self._pump_logs(model, model.process)),
            asyncio.create_task(self._watch_exit(model, model.process)),
        }  # fmt: skip
        deadline = started + model.policy.startup_timeout
        assert self._session is not None
        process = model.process
        self._step(model, "Starting")
        while True:
            if process.returncode is not None:
                self._step(model, None)
                self._record_exit(model, process, process.returncode)
                return
            if loaded is not None and loaded.done() and loaded.result().get("event") == "failed":
                self._step(model, None)
                model.host = None
                self._fail(model, str(loaded.result().get("message") or "loading failed"))
                return
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self._session.get(f"{model.url}/v2/health/ready") as response:
                    if response.status == 200:
                        break
                    self._step(model, "Loading")  # its server answers: the model is loading
            if time.monotonic() > deadline:
                self._step(model, None)
                await self._stop(model, reason="startup timeout")
                self._fail(model, f"not ready within startupTimeout ({model.policy.startup_timeout_text})")
                return
            await asyncio.sleep(0.05)
        model.last_load_seconds = time.monotonic() - started
        self._step(model, None)
        model.running_backend = await self._running_backend(model)
        if loaded is not None:  # what its load added to the host (loads are one at a time there)
            with contextlib.suppress(TimeoutError):
                event = await asyncio.wait_for(asyncio.shield(loaded), 5)
                if isinstance(event.get("bytes"), int):
                    model.footprint_bytes = int(event["bytes"])
        else:
            model.footprint_bytes = tree_rss(process.pid) or model.footprint_bytes
        model.state, model.message = ModelState.READY, "Serving."
        logger.info("%s is ready (%.1fs)", model.name, model.last_load_seconds)

    def _footprint(self, model: LocalModel) -> int:
        """What ``model``'s predictor holds, or will when it starts: as measured (now, or at its last run), else
        its weights on disk plus :data:`PROCESS_BASELINE_BYTES` (in a shared host: :data:`HOSTED_OVERHEAD_BYTES`;
        the host's own share is counted once, as the host's)."""
        if model.footprint_bytes is not None:
            return model.footprint_bytes
        overhead = HOSTED_OVERHEAD_BYTES if model.host is not None else PROCESS_BASELINE_BYTES
        return weights_bytes(model.source_path) + overhead

    def _host_bytes(self, host: HostHandle) -> int:
        return host.baseline_bytes or self._host_baselines.get(host.family, PROCESS_BASELINE_BYTES)

    async def _make_room(self, model: LocalModel, *, growing: bool = False, family: str | None = None) -> None:
        """Under ``--memory-budget-mb``: stop the least recently used idle models until ``model`` fits beside the
        running ones (``growing``: ``model`` runs already and grew; ``family``: it is to join that shared host,
        whose own memory counts too if it is not running yet). A model with requests in flight, one kept by a
        warm window or ``minReplicas``, and one starting are never stopped; when they alone leave no room: 503 with
        ``Retry-After``, naming them. Each stopped model says why in its card and counts an eviction; a shared
        host left with no members stops, and its memory is freed too."""
        budget = self.memory_budget
        if budget is None:
            return
        need = 0 if growing else self._footprint(model)
        if family is not None and not growing:
            if model.footprint_bytes is None:  # never measured: its weights and a member's overhead, not a process's
                need = weights_bytes(model.source_path) + HOSTED_OVERHEAD_BYTES
            host = self.hosts.get(family)
            if host is None or not host.running():
                need += self._host_baselines.get(family, PROCESS_BASELINE_BYTES)
        if need > budget:
            raise Unavailable(
                f"The model {model.name!r} needs about {need / MiB:.0f} MiB, more than serve's whole memory budget "
                f"({budget / MiB:.0f} MiB, --memory-budget-mb); raise the budget.",
                code="memory_budget", retry_after=60,
            )  # fmt: skip
        # Members draining before they stop hold their memory still: counted, never evicted (they are going).
        running = [m for m in [*self._models.values(), *self._retiring] if m.running() and m is not model]
        used = sum(self._footprint(m) for m in running) + (self._footprint(model) if growing else 0)
        used += sum(self._host_bytes(h) for h in self.hosts.values() if h.running())
        wall = self._clock.now()
        evictable = sorted(
            (m for m in running if m not in self._retiring and m.state is ModelState.READY and m.stats.in_flight == 0
             and not m.policy.always_on
             and not m.policy.warm(wall) and (m.starting is None or m.starting.done())),
            key=lambda m: m.stats.last_used_monotonic or 0.0,
        )  # fmt: skip
        for host in list(self.hosts.values()):  # a shared host with no members first: it serves nobody
            if used + need <= budget:
                return
            if host.running() and not host.members and not self._joining.get(host.family) and host.family != family:
                logger.info("stopping the %s shared host (no members) to make room for %s", host.family, model.name)
                await host.stop()
                used -= self._host_bytes(host)
        reason = f"evicted to make room for {model.name} under the memory budget"
        # A shared host whose members all have to go goes at once, with them: its exit gives their memory back, where
        # unloading them one by one (each waiting for its server to close and for a collection) took 0.4 to 0.8 s a
        # member before the host stopped anyway (bench/pools.py: a wake across families waited 2 s for three).
        for host in self._hosts_emptied(evictable, used, need, budget, family):
            members = list(host.members.values())
            freed = sum(self._footprint(m) for m in members) + self._host_bytes(host)
            logger.info("stopping the %s shared host with its members %s (%s)", host.family,
                        ", ".join(sorted(m.name for m in members)), reason)  # fmt: skip
            for member in members:
                member.stopping = True  # its exit is asked for: not a crash (_record_exit)
            await host.stop()
            for member in members:
                self._evicted(member, model, budget, stopped_here=True)
            used -= freed
        for victim in evictable:
            if used + need <= budget:
                return
            if not victim.running():  # gone with its host above
                continue
            freed = self._footprint(victim)
            host = victim.host
            await self._stop(victim, reason=reason)
            if host is not None and not host.running():
                freed += self._host_bytes(host)
            self._evicted(victim, model, budget)
            used -= freed
        if used + need > budget and not growing:
            busy = ", ".join(sorted(m.name for m in running)) or "none"
            raise Unavailable(
                f"The model {model.name!r} needs about {need / MiB:.0f} MiB and the models running ({busy}) hold "
                f"{used / MiB:.0f} MiB of serve's {budget / MiB:.0f} MiB memory budget with requests in flight; "
                "retry shortly.",
                code="memory_budget", retry_after=5,
            )  # fmt: skip

    def _hosts_emptied(self, evictable: list[LocalModel], used: int, need: int, budget: int,
                       family: str | None) -> list[HostHandle]:  # fmt: skip
        """The shared hosts (other than ``family``'s) whose every member the least-recently-used walk of
        :meth:`_make_room` would evict to fit ``need``: what it would free, member by member, then the host."""
        left = {id(h): len(h.members) for h in self.hosts.values()}
        chosen: set[int] = set()
        for victim in evictable:
            if used + need <= budget:
                break
            chosen.add(id(victim))
            used -= self._footprint(victim)
            if victim.host is not None and id(victim.host) in left:
                left[id(victim.host)] -= 1
                if not left[id(victim.host)]:
                    used -= self._host_bytes(victim.host)
        return [
            h for h in self.hosts.values()
            if h.running() and h.members and h.family != family and not self._joining.get(h.family)
            and all(id(m) in chosen for m in h.members.values())
        ]  # fmt: skip

    def _evicted(self, victim: LocalModel, model: LocalModel, budget: int, *, stopped_here: bool = False) -> None:
        """``victim``'s card once it was stopped to make room for ``model`` (``stopped_here``: with its host, not by
        :meth:`_stop`, which says it is idle itself)."""
        if stopped_here and victim.state is not ModelState.FAILED:
            victim.state = ModelState.IDLE
        victim.evictions += 1
        victim.reason = "Evicted"
        victim.message = (
            f"Evicted: {model.name!r} needed room under serve's memory budget ({budget / MiB:.0f} MiB); "
            "the next request starts it."
        )

    async def _measure(self) -> None:
        """Every :data:`MEASURE_EVERY_S`: the running predictors' memory, and room made if they grew past the
        budget (a model's KV cache, a batch's activations)."""
        now = time.monotonic()
        if now - self._measured_at < MEASURE_EVERY_S:
            return
        self._measured_at = now
        for model in list(self._models.values()):
            if model.running() and model.process is not None and model.state is ModelState.READY and not model.host:
                model.footprint_bytes = tree_rss(model.process.pid) or model.footprint_bytes
        for host in self.hosts.values():  # what a host grew by beyond its members' loads (activations, caches)
            if host.running() and host.process is not None:
                rss = tree_rss(host.process.pid)
                members = sum(self._footprint(m) for m in host.members.values())
                if rss:
                    host.baseline_bytes = max(0, rss - members)
        if self.memory_budget is not None:
            running = [m for m in self._models.values() if m.running() and m.state is ModelState.READY]
            if sum(self._footprint(m) for m in running) > self.memory_budget and running:
                newest = max(running, key=lambda m: m.stats.last_used_monotonic or 0.0)
                await self._make_room(newest, growing=True)

    def _step(self, model: LocalModel, step: str | None) -> None:
        model.step = step
        self.wake_steps.moved(model.name, step, time.monotonic())

    async def _running_backend(self, model: LocalModel) -> Backend | None:
        """What ``auto`` chose, from the ready predictor's model card (None: the spec decides, or no answer)."""
        if resolved_backend(model.manifest.model) is not Backend.AUTO or self._session is None:
            return None
        try:
            return await ask_backend(self._session, model.url, self._token)
        except Exception as exc:  # the card is for ``ps``; serving goes on without it
            logger.info("%s did not say which backend it runs (%s)", model.name, exc or type(exc).__name__)
            return None

    def _backoff(self, model: LocalModel) -> float:
        recent = [t for t in model.crashes if time.monotonic() - t < CRASH_WINDOW_S]
        return 0.0 if not recent else min(8.0, 0.5 * 2 ** (len(recent) - 1))

    def _fail(self, model: LocalModel, message: str) -> None:
        tail = " | ".join(list(model.log_tail)[-5:])
        model.state = ModelState.FAILED
        model.reason = "Failed"
        model.message = f"{message}" + (f"; last log lines: {tail}" if tail else "")
        model.failed_at = time.monotonic()
        logger.error("%s failed: %s", model.name, model.message)

    async def _pump_logs(self, model: LocalModel, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        level = logging.DEBUG
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            model.log_tail.append(line)
            level = predictor_log_level(line, level)
            logger.log(level, "[%s] %s", model.name, line)

    async def _watch_exit(self, model: LocalModel, process: asyncio.subprocess.Process) -> None:
        self._record_exit(model, process, await process.wait())

    def _record_exit(self, model: LocalModel, process: asyncio.subprocess.Process, code: int) -> None:
        """An exit we did not ask for: restart on the next request, or mark failed after repeated crashes."""
        if model.process is not process or model.stopping or process.pid in model.handled_exits:
            return
        model.handled_exits.add(process.pid)
        model.crashes.append(time.monotonic())
        model.crash_count += 1
        key = model.host.limit_key if model.host is not None else model.limit_key
        oom = self._limits is not None and key is not None and self._limits.oom_kills(key) > 0
        self._unlimit(model)
        shared = f" (the {model.host.family} shared host, with its members)" if model.host is not None else ""
        if oom:
            model.reason = "OOMKilled"
            model.last_exit = f"killed by the OOM killer over its {self._limit_text(model)}{shared}"
        else:
            model.reason = "Crashed"
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
            model.last_exit = how + shared
        recent = [t for t in model.crashes if time.monotonic() - t < CRASH_WINDOW_S]
        if len(recent) >= CRASHES_BEFORE_FAILED:
            self._fail(model, f"the predictor crashed {len(recent)} times in a row, the latest {model.last_exit}")
        else:
            model.state = ModelState.IDLE
            model.message = f"Crashed: the predictor was {model.last_exit}; the next request restarts it."
            logger.warning("%s crashed (%s); it restarts on the next request", model.name, model.last_exit)

    async def _stop(self, model: LocalModel, reason: str) -> None:
        process = model.process
        if process is None or process.returncode is not None:
            return
        if model.host is not None:
            if not model.running():
                return
            model.stopping = True
            logger.info("stopping %s (%s; in the %s shared host)", model.name, reason, model.host.family)
            host = model.host
            assert model.port is not None
            await host.remove(model.port, model.name)
            await self._host_lost_member(host)
        else:
            model.stopping = True
            logger.info("stopping %s (%s)", model.name, reason)
            await terminate(process, STOP_GRACE_S)
            self._unlimit(model)
        if model.state is not ModelState.FAILED:
            model.state = ModelState.IDLE
            model.message = f"Stopped ({reason}); the next request starts it."

    async def _reread_adapters(self) -> None:
        """Without ``watch`` (a supervisor given manifests, not paths to watch): a manifest edited while serving has
        its models' ``spec.adapters`` applied at once (:meth:`_update_adapters`); other changes are logged."""
        for path in {m.manifest.path for m in self._models.values()}:
            try:
                stamp = path.stat().st_mtime_ns
            except OSError:
                continue
            seen = self._manifest_stamps.setdefault(path, stamp)
            if stamp == seen:
                continue
            self._manifest_stamps[path] = stamp
            try:
                edited = {m.model.served_name: m for m in load_manifests([path])}
            except Exception as exc:  # a half-saved file: the next change is read again
                logger.warning("%s changed and cannot be read (%s); serving as before", path, exc)
                continue
            for model in self._models.values():
                new = edited.get(model.name)
                if new is None or new.path != path:
                    continue
                old = model.manifest
                if new.model.spec.adapters != old.model.spec.adapters:
                    await self._update_adapters(model, new)
                if new.model.spec.model_copy(update={"adapters": []}) != old.model.spec.model_copy(
                    update={"adapters": []}
                ):
                    logger.warning("%s changed in %s beyond its adapters: restart serve to apply it", model.name, path)

    async def _reap_idle(self) -> None:
        """The TTL unload: stop models idle for longer than their idleTimeout; and warm windows
        (``scaling.warmSchedule``): start a model when one begins, keep it through it. Each tick also re-reads
        edited manifests' adapters (:meth:`_reread_adapters`)."""
        while True:
            await asyncio.sleep(self._reap_interval)
            if self._watch is not None:
                try:
                    await self._rescan()
                except Exception:  # the TTL unload and the other members go on; the next change is tried again
                    logger.exception("applying the changed manifests failed")
            else:
                await self._reread_adapters()
            await self._measure()
            now = self._clock.monotonic()
            wall = self._clock.now()
            self._replenish_when_quiet(now)
            for model in self._models.values():
                policy, stats = model.policy, model.stats
                warm = policy.warm(wall)
                if (
                    warm
                    and not model.running()
                    and model.state is ModelState.IDLE
                    and (model.starting is None or model.starting.done())
                ):  # a warm window began (or the model stopped inside one): start it before the first request
                    model.starting = asyncio.create_task(self._start(model), name=f"warm-start-{model.name}")
                    continue
                if warm:
                    continue  # kept running through the window, idle or not
                if (
                    model.state is ModelState.READY
                    and model.running()
                    and policy.gateway_stops_when_idle(in_cluster=False)
                    and is_idle(stats.last_used_monotonic, stats.in_flight, policy.idle_timeout, now)
                    and (model.starting is None or model.starting.done())
                ):
                    await self._stop(model, reason=f"idle for {policy.idle_timeout_text}")
                    model.reason = "IdleTimeout"

    # -- shared hosts (--member-processes shared) ---------------------------------------------------------

    async def _host(self, family: str) -> HostHandle:
        """The family's running shared host, started (and waited for) if there is none; HostRefused if it cannot
        start. Concurrent callers share one start."""
        host = self.hosts.get(family)
        if host is not None and host.running():
            return host
        task = self._host_starts.get(family)
        if task is None:
            task = self._background_host(family)
        return await asyncio.shield(task)

    def _background_host(self, family: str) -> asyncio.Task[HostHandle]:
        task = asyncio.create_task(self._start_host(family), name=f"host-start-{family}")
        self._host_starts[family] = task

        def done(finished: asyncio.Task[HostHandle]) -> None:
            if self._host_starts.get(family) is finished:
                del self._host_starts[family]
            if not finished.cancelled() and finished.exception() is not None:
                logger.warning("the %s shared host did not start: %s", family, finished.exception())

        task.add_done_callback(done)
        return task

    async def _start_host(self, family: str) -> HostHandle:
        def log(line: str, _level: list[int] = [logging.DEBUG]) -> None:  # noqa: B006  (the last line's level)
            _level[0] = predictor_log_level(line, _level[0])
            logger.log(_level[0], "[%s host] %s", family, line)
            for member in host.members.values():
                member.log_tail.append(line)

        host = HostHandle(
            family, [self._python, "-m", PREDICTOR_MODULE, HOST_FLAG, family], self._process_env(), on_line=log,
            start_new_session=True, preexec_fn=die_with_parent(),
        )  # fmt: skip
        await host.start()
        assert host.process is not None
        if host.baseline_bytes:
            self._host_baselines[family] = host.baseline_bytes
        self.hosts[family] = host
        watcher = asyncio.create_task(self._watch_host(host), name=f"host-watch-{family}")
        self._background.add(watcher)
        watcher.add_done_callback(self._background.discard)
        logger.info("the %s shared host is up (pid %d, %.0f MiB before any member)", family, host.process.pid,
                    (host.baseline_bytes or 0) / MiB)  # fmt: skip
        return host

    async def _watch_host(self, host: HostHandle) -> None:
        """A host's exit is each of its members' (a crash, the OOM killer): recorded for each, as for a process of
        its own; its memory limit group is released once they all are."""
        assert host.process is not None
        code = await host.process.wait()
        for member in list(host.members.values()):
            self._record_exit(member, host.process, code)
        host.members.clear()
        if self._limits is not None and host.limit_key is not None:
            self._limits.release(host.limit_key)
        host.limit_key = None
        if self.hosts.get(host.family) is host:
            del self.hosts[host.family]

    async def _host_lost_member(self, host: HostHandle) -> None:
        """After a member left: a host with no members (and none joining) stops; else its limit follows."""
        if not host.members and not self._joining.get(host.family):
            logger.info("stopping the %s shared host: no members left", host.family)
            await host.stop()
        elif host.running():
            self._limit_host(host)

    def _limit_host(self, host: HostHandle) -> None:
        """A host's memory limit: its own share plus each member's limit, while every member has one (one member
        without a limit leaves the host without one). Applied again as members come and go."""
        limits = [self._member_limit(m) for m in host.members.values()]
        if not limits or any(limit is None for limit in limits) or host.process is None:
            return
        total = self._host_bytes(host) + sum(limit for limit in limits if limit is not None)
        if self._limits is None:
            self._limits = MemoryLimits.detect()
            logger.info("member memory limits by %s", self._limits.kind)
        key = f"host-{host.family}.{host.process.pid}"
        try:
            self._limits.apply(key, host.process.pid, total)
        except (OSError, ValueError) as exc:
            logger.warning("the %s shared host: cannot apply its %.0f MiB memory limit (%s); it runs without",
                           host.family, total / MiB, getattr(exc, "strerror", None) or exc)  # fmt: skip
            return
        host.limit_key = key

    # -- per-member memory limits ------------------------------------------------------------------------

    def _member_limit(self, model: LocalModel) -> int | None:
        """Its ``spec.resources.memory`` (in a cluster, a replica's limit: here the member's), else
        ``--member-memory-limit-mb``; None: no limit."""
        memory = model.manifest.model.spec.resources.memory
        with contextlib.suppress(ValueError):  # an exponent form the CRD admits: the default then
            return memory_bytes(memory) if memory else self._default_limit
        return self._default_limit

    def _limit_text(self, model: LocalModel) -> str:
        limit = self._member_limit(model)
        kind = self._limits.kind if self._limits is not None else "no"
        return f"{limit / MiB:.0f} MiB memory limit ({kind})" if limit else "memory"

    def _limit(self, model: LocalModel, pid: int) -> None:
        """Hold the started process to the member's memory limit; refused by the OS: said once, served unbounded."""
        limit = self._member_limit(model)
        if limit is None:
            return
        if self._limits is None:
            self._limits = MemoryLimits.detect()
            logger.info("member memory limits by %s", self._limits.kind)
        key = f"{model.name}.{pid}"
        try:
            self._limits.apply(key, pid, limit)
        except (OSError, ValueError) as exc:
            logger.warning("%s: cannot apply its %s (%s); it runs without", model.name, self._limit_text(model),
                           getattr(exc, "strerror", None) or exc)  # fmt: skip
            return
        model.limit_key = key

    def _unlimit(self, model: LocalModel) -> None:
        if self._limits is not None and model.limit_key is not None:
            self._limits.release(model.limit_key)
        model.limit_key = None

    # -- members added, removed, changed while serving -------------------------------------------------------

    async def _rescan(self) -> None:
        """Every ``rescan_interval``: when a manifest under the watched paths was added, removed or rewritten
        (:func:`files_signature`; a mounted ConfigMap's atomic swap included), read them all again and apply the
        difference member by member (:meth:`apply_members`); the others are not touched. A reading that fails
        (a half-saved file, a duplicate name) is logged and the members stay as they were until the next change."""
        assert self._watch is not None
        now = time.monotonic()
        if now - self._scanned_at < self._rescan_interval:
            return
        self._scanned_at = now
        signature = files_signature(self._watch)
        if signature == self._signature:
            return
        self._signature = signature
        try:
            manifests = load_manifests(self._watch, allow_empty=True)
        except (ManifestError, OSError) as exc:
            logger.warning("the manifests changed and cannot be read (%s); serving the members as before", exc)
            return
        await self.apply_members(manifests)

    async def apply_members(self, manifests: list[Manifest]) -> None:
        """Serve ``manifests`` from now on: new models are added (started on their first request, or at once when
        kept running), removed ones leave the list at once and their process stops once their requests in flight
        are answered, a changed one is replaced the same way (its next request starts the new one), one whose
        ``spec.adapters`` alone changed keeps running and re-reads them. Each change is logged."""
        new = {m.model.served_name: m for m in manifests}
        changes = member_changes({name: m.manifest for name, m in self._models.items()}, new)
        for name in changes.removed:
            model = self._models.pop(name)
            logger.info("member %s removed; its process stops after %d requests in flight", name,
                        model.stats.in_flight)  # fmt: skip
            self._retire(model, "removed from the manifests")
        for name in changes.changed:
            old = self._models[name]
            model = self._models[name] = LocalModel(new[name], stats=UsageStats(clock=self._clock))
            model.starts, model.crash_count, model.evictions = old.starts, old.crash_count, old.evictions
            if old.manifest.model.spec.source == new[name].model.spec.source:
                model.source_path, model.footprint_bytes = old.source_path, old.footprint_bytes
            logger.info("member %s changed (%s); restarting it", name, new[name].origin)
            self._retire(old, "its manifest changed")
            if model.policy.always_on:
                model.starting = asyncio.create_task(self._start(model), name=f"start-{name}")
        for name in changes.added:
            model = self._models[name] = LocalModel(new[name], stats=UsageStats(clock=self._clock))
            logger.info("member %s added (%s, %s)", name, model.manifest.model.spec.task.value,
                        new[name].origin)  # fmt: skip
            if model.policy.always_on:
                model.starting = asyncio.create_task(self._start(model), name=f"start-{name}")
        for name in changes.adapters:
            await self._update_adapters(self._models[name], new[name])
        for name in changes.moved:
            self._models[name].manifest = new[name]
        if changes.added or changes.changed:
            wanted = self._standby_families()
            for family, pool in self.standbys.items():
                if self._standby and family in wanted and not pool.enabled:
                    pool.enabled = True
                    pool.replenish()

    def _retire(self, model: LocalModel, reason: str) -> None:
        self._retiring.add(model)
        task = asyncio.create_task(self._drain_and_stop(model, reason), name=f"retire-{model.name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drain_and_stop(self, model: LocalModel, reason: str) -> None:
        """Let a retired member's start and requests in flight finish (up to :data:`DRAIN_TIMEOUT_S`), then stop it."""
        try:
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            if model.starting is not None and not model.starting.done():
                with contextlib.suppress(Exception, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(model.starting), DRAIN_TIMEOUT_S)
            model.drained = asyncio.Event()
            if model.stats.in_flight:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(model.drained.wait(), max(0.0, deadline - time.monotonic()))
            if model.stats.in_flight:
                logger.warning("%s: %d requests still in flight after %.0fs; stopping it anyway", model.name,
                               model.stats.in_flight, DRAIN_TIMEOUT_S)  # fmt: skip
            await self._stop(model, reason=reason)
        finally:
            self._retiring.discard(model)

    async def _update_adapters(self, model: LocalModel, new: Manifest) -> None:
        """Only ``spec.adapters`` changed: its adapters file is rewritten (a running predictor re-reads its own, no
        restart), as a cluster's ConfigMap does. A running predictor started with no adapters has no list to
        re-read: it is stopped, and the next request starts it with them (in a cluster the first adapter rolls the
        predictor too)."""
        old = model.manifest
        model.manifest = replace(old, model=old.model.model_copy(
            update={"spec": old.model.spec.model_copy(update={"adapters": new.model.spec.adapters})}
        ))  # fmt: skip
        state_dir = self._state_root / re.sub(r"[^A-Za-z0-9_.-]+", "_", model.name)
        if model.with_adapters or new.model.spec.adapters:
            write_adapters_file(model.manifest, state_dir, keep_empty=True)
        if model.running() and not model.with_adapters:
            await self._stop(model, reason="its first adapters were added")
        logger.info("%s: adapters now %s", model.name, [a.name for a in new.model.spec.adapters] or "none")

    def _view(self, model: LocalModel) -> ModelView:
        return ModelView(
            name=model.name,
            task=model.manifest.model.spec.task,
            backend=(model.running_backend or resolved_backend(model.manifest.model)).value,
            state=model.state,
            message=model.message,
            endpoint=model.url if model.running() else None,
            pid=model.process.pid if model.running() and model.process else None,
            stats=model.stats,
            adapters=tuple(a.name for a in model.manifest.model.spec.adapters),
            extra={
                "starts": model.starts,
                "idle_timeout": model.policy.idle_timeout_text,
                "started_in_standby": model.from_standby,
                **({"shared_host": model.host.family} if model.host is not None and model.running() else {}),
                **({"memory_mb": round(model.footprint_bytes / MiB)} if model.footprint_bytes else {}),
                **({"evictions": model.evictions} if self.memory_budget is not None else {}),
                "crashes": model.crash_count,
                **({"last_exit": model.last_exit} if model.last_exit else {}),
                **({"reason": model.reason} if model.reason and not model.running() else {}),
                **({"memory_limit_mb": round(limit / MiB)} if (limit := self._member_limit(model)) else {}),
                **({"step": model.step} if model.step and model.state is ModelState.LOADING else {}),
                **({"max_held_requests": model.policy.max_held} if model.policy.max_held else {}),
            },
        )


MiB = 2**20
#: What a member of a shared host adds beyond its weights (its app, tokenizer, buffers), for one never measured.
HOSTED_OVERHEAD_BYTES = 32 * MiB
#: What a predictor process holds before its weights (Python, torch or its engine's libraries, the server), for a
#: model never measured: the weights come on top. Measured: an embedding predictor with all-MiniLM-L6-v2 (90 MB
#: of weights) holds about 450 MB.
PROCESS_BASELINE_BYTES = 350 * MiB
#: How often the running predictors' memory is measured.
MEASURE_EVERY_S = 5.0
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".onnx", ".pt", ".pth", ".ckpt", ".pkl", ".joblib")


def weights_bytes(source: str | None) -> int:
    """The size of a model folder's (or file's) weights on disk: 0 when unknown."""
    if not source:
        return 0
    path = Path(source)
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    except OSError:
        return 0


#: The adapters file ``serve`` writes in a model's state folder for its predictor (``--adapters-file``).
ADAPTERS_FILE = "adapters.json"


def write_adapters_file(manifest: Manifest, state_dir: Path, *, keep_empty: bool = False) -> Path | None:
    """The model's ``spec.adapters`` as its predictor reads them (paths resolved against the manifest's folder;
    hf://, s3://, gs://, http(s):// left to the predictor, which fetches on first use), written atomically (the
    predictor may be reading); None when it lists none (unless ``keep_empty``: a running predictor's list emptied).

    ``credentialsSecret`` names a cluster's Secret, which ``serve`` has not: as for the base model's source, a
    download here uses the environment the gateway was started with (HF_TOKEN, AWS_*, GOOGLE_APPLICATION_CREDENTIALS,
    ``<host>-headers``: what KServe's storage code reads), so the list names no credentials."""
    adapters = manifest.model.spec.adapters
    if not adapters and not keep_empty:
        return None
    listed = []
    for adapter in adapters:
        uri = adapter.source.storage_uri
        if "://" not in uri or uri.startswith("file://"):
            path = Path(uri.removeprefix("file://")).expanduser()
            uri = str(path if path.is_absolute() else (manifest.path.parent / path).resolve())
        listed.append({"name": adapter.name, "uri": uri})
    target = state_dir / ADAPTERS_FILE
    staging = target.with_suffix(".tmp")
    staging.write_text(json.dumps({"adapters": listed}, indent=1))
    staging.replace(target)
    return target


def under_prefix(uri: str, prefix: str) -> str | None:
    """The path of ``uri`` below ``prefix`` ('' for the prefix itself), or None when it is not under it: the same
    URI or a path below it, as KServe matches a storage URI against a LocalModelCache's ``sourceModelUri``
    (v0.20.0 pkg/apis/serving/v1alpha1/storage_uri_utils.go MatchStorageURI, both trailing slashes trimmed) and
    then mounts the path below it from the cache's claim (v0.20.0
    pkg/webhook/admission/pod/storage_initializer_injector.go InjectStorageInitializer: ``pvc://<claim>/models/``
    + ``GetStorageKey(sourceModelUri)`` (sha256[:16]) + the URI with the cache's source cut off)."""
    base, wanted = prefix.rstrip("/"), uri.rstrip("/")
    if not base:
        return None
    if wanted == base:
        return ""
    return wanted[len(base) + 1 :] if wanted.startswith(base + "/") else None


def cached_copy(uri: str, cached_prefixes: Mapping[str, Path] | None) -> Path | None:
    """The copy of ``uri`` in a folder holding a prefix's files (``serve --cached-prefix URI=DIR``: a pool's
    LocalModelCache mounted in its pod), or None when no prefix covers it or the copy lacks it (a file put under
    the prefix after the cache was downloaded): the caller then downloads as without one."""
    for prefix, folder in (cached_prefixes or {}).items():
        below = under_prefix(uri, prefix)
        if below is None:
            continue
        copy = folder / below if below else folder
        if copy.exists():
            return copy
    return None


def fetch_source(
    manifest: Manifest,
    cache_dir: Path | None = None,
    credentials_dir: Path | None = None,
    cached_prefixes: Mapping[str, Path] | None = None,
) -> str:
    """A local path for the model's files: paths as they are (relative to the manifest), hf:// downloaded,
    s3://, gs://, http(s):// downloaded by KServe's storage code into ``cache_dir`` (:func:`fetch_remote`), unless
    ``cached_prefixes`` (``serve --cached-prefix``) holds a copy (:func:`cached_copy`).

    ``credentials_dir``: a pool's copies of its members' Secrets (``serve --credentials-dir``; the operator writes
    ``<secret>.json`` there, universal_operator.reconcile.pools). A model naming ``source.credentialsSecret`` is
    then fetched with its own copy, read afresh for each download (a rotated key is used by the next), as a
    single model's storage initializer is with its Secret; a copy that is not there fails this model only, naming
    the Secret. Without it (``serve`` on a laptop) the name is not read and the process's environment is used."""
    source = manifest.model.spec.source
    if (copy := cached_copy(source.uri, cached_prefixes)) is not None:
        # As KServe mounts a LocalModelCache for any InferenceService whose URI it covers, whatever its Secret
        # (the node agent downloaded it with the cache's own credentials): the prefix is the pool owner's choice.
        return str(copy)
    secret = None
    if credentials_dir is not None and source.credentials_secret is not None:
        try:
            secret = read_store_secret(credentials_dir, source.credentials_secret)
        except CredentialsUnavailable as exc:
            raise RuntimeError(str(exc)) from None
    if is_remote(source.uri):
        return fetch_remote(source.uri, cache_dir or default_state_root() / "models", secret)
    if source.scheme == "hf":
        token = secret.text(HF_TOKEN) if secret is not None and HF_TOKEN in secret.data else None
        return _download_hf(source.uri, source.revision, source.file, source.projector_file, token=token)
    if source.scheme == "package":
        return resolve_source(source.uri)
    if source.scheme == "file" or source.scheme is None:
        raw = source.uri.removeprefix("file://")
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = (manifest.path.parent / path).resolve()
        if not path.exists() and manifest.model.spec.task.value != "anomaly":
            raise FileNotFoundError(f"{path} does not exist")
        return str(path)
    raise ValueError(
        f"{source.scheme}:// sources are served in a cluster; here use a path, file://, hf://, s3://, gs:// or https://"
    )


#: Written beside a finished download in the cache: the path KServe's storage code gave (a download cut short
#: leaves none, and is fetched again).
_FETCHED = ".fetched"


def fetch_remote(uri: str, cache_dir: Path, secret: StoreSecret | None = None) -> str:
    """``uri`` (s3://, gs://, http(s)://) into ``cache_dir`` once, with KServe's storage code (``kserve_storage``, as
    a cluster's storage initializer and the adapters' downloads run it, in a subprocess:
    :func:`universal_predictors.generation.adapter_stores.download`). Credentials are ``secret``'s, as KServe's
    credential builder would set them, else this process's environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS,
    ``<host>-headers``: what that code reads), as for a single model run by ``serve``. Later starts find it in the
    cache.

    The cache is keyed by the URI and the Secret's name: what a URI names depends on the Secret (its S3 endpoint
    annotation picks the server), and a member must not be served files its own Secret could not fetch (another
    member's download with another Secret, or a wrong key). Not by the Secret's content: a rotated key names the
    same files, and need not fetch them again."""
    import hashlib

    key = hashlib.sha256((uri if secret is None else f"{uri}\0{secret.name}").encode()).hexdigest()[:16]
    folder = cache_dir / f"{key}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', uri.rstrip('/').rsplit('/', 1)[-1])[:60]}"
    done = folder.with_name(folder.name + _FETCHED)
    if done.exists():
        fetched = done.read_text().strip()
        if Path(fetched).exists():
            return fetched
    try:
        path = download(uri, folder, secret)
    except DownloadFailed as exc:
        raise RuntimeError(str(exc)) from None
    done.write_text(str(path))
    return str(path)


def _download_hf(
    uri: str, revision: str | None, pattern: str | None, projector: str | None = None, *, token: str | None = None
) -> str:
    """Download (or find in the cache) a hub repository; offline, a clear error for this model only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    repo, _, uri_revision = uri.removeprefix("hf://").partition(":")
    revision = revision or uri_revision or None
    try:
        return str(
            snapshot_download(
                repo_id=repo,
                revision=revision,
                token=token,  # a pool member's Secret's HF_TOKEN; None: the environment's, as before
                # The projector is a second file the model needs: fetched with the weights file, never instead.
                allow_patterns=[p for p in (pattern, projector) if p] if pattern else None,
            )
        )
    # The hub library's own messages span lines and name its URLs, not what to change here: one line each.
    except GatedRepoError as exc:
        if exc.response.status_code == 401:
            raise PermissionError(
                f"{repo} is a gated repository and no hub token was sent: set HF_TOKEN (or run 'hf auth login') "
                "to a token that was granted access on the repository's page"
            ) from None
        raise PermissionError(
            f"{repo} is a gated repository and the hub refused this HF_TOKEN (HTTP {exc.response.status_code}): "
            "request access on the repository's page or use a token that has it"
        ) from None
    except RevisionNotFoundError:
        raise LookupError(
            f"{repo} has no revision {revision!r}: check source.revision (or the :REV in the URI)"
        ) from None
    except RepositoryNotFoundError:
        raise LookupError(
            f"the hub has no repository {repo} that this machine may read: check the name, or set HF_TOKEN for a "
            "private repository"
        ) from None
