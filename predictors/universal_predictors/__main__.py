"""``python -m universal_predictors --model_name NAME --task TASK --source PATH [...]``: serve one model.

The flags are :class:`universal_predictors.config.PredictorConfig`'s plus KServe's own ModelServer
flags. A bad flag or engine argument stops the process with one line and exit status 2.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from universal_predictors import standby, tracing, wake_phases
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import (
    HOST_FLAG,
    PARENT_PID_ENV,
    STANDBY_FLAG,
    PredictorConfig,
    resolve_backend,
    resolve_source,
)

PROG = "universal_predictors"
#: KServe's signal that the model may appear only after the predictor starts: its pod webhook sets
#: MODEL_INIT_MODE=async on the predictor of a modelcar (KServe v0.16.0 pkg/utils/storage.go,
#: ConfigureModelcarToContainer; pkg/constants/constants.go ModelInitModeEnvVarKey), whose sidecar links
#: /mnt/models into the shared volume only once it runs.
MODEL_INIT_MODE_ENV = "MODEL_INIT_MODE"
#: How long a predictor in that mode waits for its model to appear (seconds; the env var overrides it).
MODEL_WAIT_ENV = "UNIVERSAL_RUNTIME_MODEL_WAIT_SECONDS"
MODEL_WAIT_DEFAULT_S = 600.0


class ModelNeverAppeared(Exception):
    """The model path stayed missing or empty for the whole wait."""


def wait_for_model(path: str, timeout_s: float, interval_s: float = 0.5) -> None:
    """Return once ``path`` is a file or a non-empty directory; ModelNeverAppeared after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        try:
            if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
                return
        except OSError:
            pass  # a dangling link while the sidecar starts: keep waiting
        if not announced:
            logging.getLogger(PROG).info("waiting up to %gs for the model to appear at %s (%s=async)", timeout_s, path,
                                         MODEL_INIT_MODE_ENV)  # fmt: skip
            announced = True
        if time.monotonic() >= deadline:
            raise ModelNeverAppeared(
                f"the model did not appear at {path} within {timeout_s:g}s ({MODEL_INIT_MODE_ENV}=async: "
                f"KServe's modelcar sidecar provides it); check the modelcar container's image and logs, or "
                f"raise {MODEL_WAIT_ENV}"
            )
        time.sleep(interval_s)


def watch_parent(parent: int, interval_s: float = 1.0) -> threading.Thread:
    """Kill this process once ``parent`` is no longer its parent (it died: we were re-parented).

    The local supervisor's parent-death signal does this on Linux; this watch is for where that does
    not exist, and costs one getppid() a second."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def wants_active_openmp_wait(config: PredictorConfig) -> bool:
    """Whether the model runs llama.cpp, whose threads want OpenMP's active wait (see set_openmp_wait_policy)."""
    pattern = config.source_file or config.source_projector_file
    return resolve_backend(config.task, config.backend, config.source, pattern, gpus=0) is Backend.LLAMACPP


def set_openmp_wait_policy(config: PredictorConfig) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it or the engine is llama.cpp.

    Idle OpenMP threads that spin steal the CPU a predictor shares with its neighbours (measured: a
    single-sentence embedding on torch took 100+ ms instead of ~20 ms on a busy 2-core machine). llama.cpp
    is the opposite case: its decode threads meet at a barrier after every graph node, and passive waiting
    puts each one to sleep there (measured on the ~155M bench Llama at c=1: 31 tok/s against 41 spinning,
    which is llama-server's own default). Called before any engine loads libgomp (neither kserve nor the
    config imports it), since libgomp reads the variable once, when it loads."""
    if not wants_active_openmp_wait(config):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == HOST_FLAG:
        if os.environ.get(PARENT_PID_ENV, "").isdigit():
            watch_parent(int(os.environ[PARENT_PID_ENV]))
        from universal_predictors import shared_host

        return shared_host.run(argv[1], sys.argv[0])
    from_standby = len(argv) == 2 and argv[0] == STANDBY_FLAG
    if from_standby:
        try:  # wait, libraries imported, for the command line of the model to serve
            argv = standby.run(argv[1], sys.stdin, sys.stdout, sys.argv[0])
        except standby.Declined as exc:
            print(f"{PROG}: standby declined: {exc}", flush=True)
            return standby.DECLINED
    wake_phases.CLOCK.start(count_process=not from_standby)
    if os.environ.get(PARENT_PID_ENV, "").isdigit():
        watch_parent(int(os.environ[PARENT_PID_ENV]))
    # kserve.model_server parses sys.argv when imported; give it only what it knows.
    from kserve import model_server

    parser = PredictorConfig.argument_parser(parents=[model_server.parser])
    parser.set_defaults(enable_grpc=False)  # one model per process: HTTP only unless asked
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = PredictorConfig.from_namespace(ns)
        config = config.model_copy(update={"source": resolve_source(config.source)})
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    if from_standby:
        if wants_active_openmp_wait(config):
            print(f"{PROG}: standby declined: llama.cpp models start fresh (OpenMP's wait policy was set when "
                  f"torch loaded)", flush=True)  # fmt: skip
            return standby.DECLINED
        standby.retitle(argv)
        print(standby.ACCEPTED_LINE, flush=True)
        logging.getLogger(PROG).info("standby process %d serves %s", os.getpid(), config.model_name)
    set_openmp_wait_policy(config)

    if os.environ.get(MODEL_INIT_MODE_ENV) == "async" and config.source.startswith("/"):
        try:
            timeout_s = float(os.environ.get(MODEL_WAIT_ENV) or MODEL_WAIT_DEFAULT_S)
            wait_for_model(config.source, timeout_s)
        except ValueError:
            print(f"{PROG}: error: {MODEL_WAIT_ENV} must be a number of seconds", file=sys.stderr)
            return 2
        except ModelNeverAppeared as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 1

    from universal_predictors.base import StartupError
    from universal_predictors.registry import EXTRAS, predictor_class
    from universal_predictors.server import serve

    try:
        cls = predictor_class(config.task)
    except ImportError as exc:
        print(
            f"{PROG}: error: task {config.task.value} needs a package that is not installed ({exc.name}); "
            f"install universal-runtime[{EXTRAS[config.task]}]",
            file=sys.stderr,
        )
        return 2
    from universal_predictors.devices import allocated_gpus, gpus_left_unused

    # Generate and transcribe check with the engine they resolve (tasks/generate.py, tasks/transcribe.py); every other
    # task here, before loading.
    resolves_itself = config.task in (Task.GENERATE, Task.TRANSCRIBE)
    unused = None if resolves_itself else gpus_left_unused(config.task, config.backend, allocated_gpus())
    if unused is not None:
        print(f"{PROG}: error: {unused}", file=sys.stderr)
        return 2
    try:
        predictor = cls(config)
    except StartupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:  # before the routes are bound (serve): they are traced or not from then on
        tracing.configure("universal-predictor", attributes={"universal_runtime.model": config.model_name,
                                                             "universal_runtime.task": config.task.value})  # fmt: skip
    except tracing.TracingConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    serve(predictor, config.http_port, host=config.http_host, enable_grpc=bool(ns.enable_grpc), grpc_port=ns.grpc_port)
    return 0


def exit_without_final_collection(status: int) -> None:
    """Exit with ``status`` without the interpreter's last garbage collection over every object left.

    With torch and an engine loaded that collection walks millions of objects: seconds between SIGTERM
    and the process's end (10 s and more measured on a busy 2-CPU machine), which a pod's termination
    grace period and every test's predictor stop wait for. ``gc.freeze`` moves them all out of the
    collector's reach; the process ends anyway, and atexit handlers (logging's flush among them) still run.
    """
    import gc

    gc.freeze()
    raise SystemExit(status)


if __name__ == "__main__":
    exit_without_final_collection(main())
