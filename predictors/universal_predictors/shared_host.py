"""One process serving several models of one library family: a pool's shared host.

A pool's members are small models used now and then (embeddings, classifiers, NER, OCR, anomaly detectors). In a
process of its own each pays for the interpreter, torch, transformers and the server: about 430 MB with
all-MiniLM-L6-v2 loaded, of which the model is 90 MB; in one process, each further MiniLM added 42 MB, each RapidOCR
32 MB (``bench/pools.py``). ``serve --member-processes shared`` therefore runs the members of each library family
(:data:`PRELOAD`: ``torch``, ``ocr``, ``pyod``) in one host process:
``python -m universal_predictors --shared-host FAMILY``.

The host imports the family's libraries, prints :data:`HOST_READY_LINE` and then takes orders from the supervisor,
one JSON object a line on its stdin; it answers with :data:`EVENT_PREFIX` lines on its stdout (among its log
lines, which the supervisor shows as the host's):

- ``{"op": "add", "port": N, "argv": [...]}``: serve the member whose command line (the one a process of its own
  would get: ``PredictorConfig.to_args``) is ``argv``, on port N, with its own app (its routes, KServe's v1/v2 routes,
  the health routes), exactly as a process of its own would answer. ``added`` once it listens (it answers 503
  "loading" until loaded), then ``loaded`` with the memory its load added to the process (loads are one at a time,
  so that each member's share is measured), or ``failed`` with why (a bad engine argument, a file that does not
  load: that member fails, the others serve on).
- ``{"op": "remove", "port": N}``: stop answering on that port (requests in flight end first, for up to
  :data:`STOP_GRACE_S`), unload it; ``removed`` with the process's memory then. The memory goes back to the system
  :data:`GIVE_BACK_AFTER_S` after the last removal (one collection for removals in a row): ``gave_back`` (port 0)
  with the process's memory after.

A member's environment is the host's: the supervisor hosts only members without ``spec.env`` (a variable may be
read when a library is imported), and KServe's flags must parse as the host's did (its module reads them once),
as for a standby (:func:`universal_predictors.standby.check_kserve_flags`). The host exits when its stdin closes
(the supervisor is gone) or on SIGTERM.

What sharing costs: one member's crash (a segfault in a native library, the OOM killer) ends the host and with it
the family's other members; the supervisor reports each as crashed and starts a new host on the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from universal_predictors import devices, standby, tracing, wake_phases
from universal_predictors.config import HOST_EVENT_PREFIX, HOST_READY_LINE, PredictorConfig, resolve_source

logger = logging.getLogger("universal_predictors.shared_host")

#: What each host family imports before its first member, so that a member's load measures the member alone
#: (its weights, its tokenizer) and the libraries count once, as the host's. Narrower than a standby's families
#: (:data:`universal_predictors.standby.PRELOAD`): an OCR member's host does not import PyOD and scikit-learn
#: (seconds of its wake), nor an anomaly member's ONNX Runtime: each imports what a process of its own would. The
#: supervisor's side names the same families (``universal_gateway.hosts.HOST_FAMILIES``).
PRELOAD: dict[str, tuple[str, ...]] = {
    "torch": standby.PRELOAD["torch"],
    # PyOD's detectors are imported by the first fit that names one, in a host as in a process of its own.
    "pyod": (*standby.SERVER, "universal_predictors.tasks.anomaly"),
    "ocr": ("onnxruntime", "rapidocr_onnxruntime", "pypdfium2", *standby.SERVER, "universal_predictors.tasks.ocr"),
}  # fmt: skip
#: How long a removed member's requests in flight may take before its port closes anyway.
STOP_GRACE_S = 10.0
EVENT_PREFIX = HOST_EVENT_PREFIX


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


#: Seconds after the last removal before the unloaded members' memory is given back (:meth:`SharedHost.remove`).
GIVE_BACK_AFTER_S = 0.5


def emit(event: str, **fields: Any) -> None:
    """One event line for the supervisor."""
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


@dataclass(eq=False)
class Member:
    name: str
    port: int
    predictor: Any
    server: Any
    serving: asyncio.Task[None]
    loading: asyncio.Task[None] | None = None


def _quiet_server_class() -> Any:
    import uvicorn

    class MemberServer(uvicorn.Server):
        """uvicorn's server without its signal handlers: several serve in one loop; the host handles signals."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return MemberServer


def build_app(predictor: Any) -> Any:
    """The member's app: our routes first, then KServe's (``/``, ``/metrics``, v1 and v2, their error handlers),
    as :class:`universal_predictors.server.UniversalModelServer` assembles one process's app from KServe's
    RESTServer (KServe 0.21.0 python/kserve/kserve/protocol/rest/server.py ``_register_endpoints``)."""
    from fastapi import APIRouter, FastAPI
    from kserve import errors as kserve_errors
    from kserve.model_repository import ModelRepository
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.model_repository_extension import ModelRepositoryExtension
    from kserve.protocol.rest.server import metrics_handler
    from kserve.protocol.rest.v1_endpoints import register_v1_endpoints
    from kserve.protocol.rest.v2_endpoints import register_v2_endpoints

    from universal_predictors.server import install_routes

    app = FastAPI()
    install_routes(app, predictor)
    repository = ModelRepository()
    repository.update(predictor)
    dataplane = DataPlane(model_registry=repository)
    extension = ModelRepositoryExtension(model_registry=repository)
    root = APIRouter()
    root.add_api_route("/", dataplane.live)
    root.add_api_route("/metrics", metrics_handler, methods=["GET"])
    app.include_router(root)
    register_v1_endpoints(app, dataplane, extension)
    register_v2_endpoints(app, dataplane, extension)
    for error, handler in (
        (kserve_errors.InvalidInput, kserve_errors.invalid_input_handler),
        (kserve_errors.InferenceError, kserve_errors.inference_error_handler),
        (kserve_errors.ModelNotFound, kserve_errors.model_not_found_handler),
        (kserve_errors.ModelNotReady, kserve_errors.model_not_ready_handler),
        (NotImplementedError, kserve_errors.not_implemented_error_handler),
    ):
        app.add_exception_handler(error, handler)
    return app


class SharedHost:
    """The host's state: its members by name, one load at a time."""

    def __init__(self, family: str) -> None:
        self.family = family
        #: By port: a member replaced by a changed manifest may be served beside its successor, under one name.
        self.members: dict[int, Member] = {}
        self._load_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._give_back_timer: asyncio.TimerHandle | None = None
        self._giving_back: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        orders = asyncio.create_task(self._read_orders(reader))
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait({orders, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (orders, stopping):
            task.cancel()
        # Exiting: every member's port closed at once (requests in flight end first, within the grace), nothing
        # unloaded one by one (the process's end gives it all back; ``__main__`` skips the final collection).
        for member in self.members.values():
            member.server.should_exit = True
        serving = [member.serving for member in self.members.values()]
        if serving:
            await asyncio.wait(serving, timeout=STOP_GRACE_S + 5)

    async def _read_orders(self, reader: asyncio.StreamReader) -> None:
        pending: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            try:
                order = json.loads(line)
                op, port = order["op"], int(order["port"])
            except (ValueError, KeyError, TypeError) as exc:
                logger.error("an order that is not a JSON object with op and port: %s", exc)
                continue
            if op == "add":
                task = asyncio.create_task(self.add(port, order.get("argv")))
            elif op == "remove":
                task = asyncio.create_task(self.remove(port))
            else:
                logger.error("an unknown order %r", op)
                continue
            pending.add(task)
            task.add_done_callback(pending.discard)
        # stdin closed: the supervisor is gone (or wants us gone)

    async def add(self, port: int, argv: Any) -> None:
        """Serve one more member on ``port``; ``added`` then ``loaded``, or ``failed``."""
        name = "?"
        try:
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a list of strings")
            standby.check_kserve_flags(argv)
            config = PredictorConfig.from_args(argv)
            config = config.model_copy(update={"source": resolve_source(config.source)})
            name = config.model_name
            if config.http_port != port or port in self.members:
                raise ValueError(f"port {port} is not this command line's, or is served here already")
            # Off the event loop: its task's modules may be imported now (the other members answer meanwhile).
            predictor = await asyncio.to_thread(self._predictor, config)
            app = build_app(predictor)
            import uvicorn

            server = _quiet_server_class()(uvicorn.Config(
                app, host=config.http_host or "0.0.0.0", port=config.http_port, log_config=None,
                timeout_graceful_shutdown=int(STOP_GRACE_S), lifespan="off",
            ))  # fmt: skip
        except Exception as exc:  # a bad command line, engine argument or port: this member only
            emit("failed", name=name, port=port, message=_first_line(exc))
            return
        member = Member(name, port, predictor, server, asyncio.create_task(server.serve(), name=f"serve-{name}"))
        self.members[port] = member
        while not server.started:
            if member.serving.done():  # the port is taken, or the socket failed
                self.members.pop(port, None)
                emit("failed", name=name, port=port, message=f"cannot listen on port {port}")
                return
            await asyncio.sleep(0.01)
        emit("added", name=name, port=port)
        member.loading = asyncio.create_task(self._load(member))

    def _predictor(self, config: PredictorConfig) -> Any:
        from universal_predictors.base import StartupError
        from universal_predictors.registry import predictor_class

        try:
            cls = predictor_class(config.task)
        except ImportError as exc:
            raise ValueError(f"task {config.task.value} needs a package that is not installed ({exc.name})") from None
        try:
            predictor = cls(config)
        except StartupError as exc:
            raise ValueError(str(exc)) from None
        predictor.start()
        return predictor

    async def _load(self, member: Member) -> None:
        async with self._load_lock:
            if self.members.get(member.port) is not member:
                return  # removed while waiting its turn
            before = resident_bytes()
            wake_phases.CLOCK = wake_phases.WakePhases()  # this member's phases (the imports were the host's)
            wake_phases.CLOCK.start(count_process=False)
            try:
                await member.predictor.load_and_serve()
            except Exception as exc:
                logger.exception("loading %s failed", member.name)
                await self.remove(member.port, report=False)
                emit("failed", name=member.name, port=member.port, message=f"loading failed: {_first_line(exc)}")
                return
            after = resident_bytes()
        emit("loaded", name=member.name, port=member.port, bytes=max(0, after - before), rss=after)

    async def remove(self, port: int, *, report: bool = True) -> None:
        """Stop serving the member on ``port`` and give its memory back; ``removed`` with the process's memory."""
        member = self.members.pop(port, None)
        name = member.name if member is not None else "?"
        if member is not None:
            member.server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(member.serving), STOP_GRACE_S + 5)
            if member.loading not in (None, asyncio.current_task()) and not member.loading.done():
                member.loading.cancel()  # its turn had not come (a load in a thread runs to its end)
            with contextlib.suppress(Exception):
                member.predictor.stop()
            # Its tasks on this loop: the health watch, a micro-batcher's worker (named after its model).
            watch = getattr(member.predictor, "_health_watch", None)
            for task in asyncio.all_tasks():
                if task is watch or task.get_name() == f"batcher-{name}":
                    task.cancel()
            member.predictor = member.server = None
            member = None
        if report:  # answered before the memory is given back: the supervisor's wake of another need not wait for it
            emit("removed", name=name, port=port, rss=resident_bytes())
        self._give_back_soon()

    def _give_back_soon(self) -> None:
        """The memory of what was unloaded given back :data:`GIVE_BACK_AFTER_S` after the last removal: removals in a
        row (an eviction making room for another family) then cost one collection, not one each. A full collection
        holds the interpreter's lock for its whole length (0.3 to 0.5 s with torch's objects), so the host answered
        nothing meanwhile, the next removal included: three evictions in a row took 2 s before the room was made."""
        if self._give_back_timer is not None:
            self._give_back_timer.cancel()
        self._give_back_timer = asyncio.get_running_loop().call_later(GIVE_BACK_AFTER_S, self._give_back_now)

    def _give_back_now(self) -> None:
        self._give_back_timer = None

        async def give_back() -> None:
            async with self._load_lock:  # never during a load, whose share is what the process grew by
                await asyncio.to_thread(_give_back)
            emit("gave_back", port=0, rss=resident_bytes())

        task = asyncio.create_task(give_back(), name="give-back")
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _give_back() -> None:
    """What an unloaded member held, back to the system: a full collection, then the allocator's free pages."""
    from universal_predictors.allocator import trim_heap

    gc.collect()
    gc.freeze()  # the remaining members' objects, out of the collector's reach again (base.load_and_serve)
    trim_heap()


def run(family: str, argv0: str) -> int:
    """``python -m universal_predictors --shared-host FAMILY``: import the family's libraries (:data:`PRELOAD`),
    then serve the members the supervisor adds."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.argv = [argv0]  # kserve.model_server parses sys.argv when imported: the host's own has no KServe flags
    if family not in PRELOAD:
        print(f"universal_predictors: error: no shared-host family {family!r}; one of {', '.join(PRELOAD)}",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    devices.COLLECT_ON_CPU_RELEASE = False  # the host collects once after removals (SharedHost._give_back_soon)
    standby.preload(PRELOAD[family])
    try:
        tracing.configure("universal-predictor", attributes={"universal_runtime.shared_host": family})
    except tracing.TracingConfigError as exc:
        print(f"universal_predictors: error: {exc}", file=sys.stderr)
        return 2
    print(HOST_READY_LINE, flush=True)
    asyncio.run(SharedHost(family).run())
    return 0
