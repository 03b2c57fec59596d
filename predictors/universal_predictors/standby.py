"""A predictor process started before it is needed, its libraries already imported: the local wake's head start.

Most of a small model's wake is not its weights but the interpreter and its libraries: MiniLM (90 MB of weights,
read from the page cache in milliseconds) took 7.5 s from ``python -m universal_predictors`` to ready on a 2-CPU
machine, of which importing torch, transformers and sentence-transformers was about 5 s (an anomaly model: PyOD
and scikit-learn, about 2 of its 3.5 s). ``serve`` keeps a process per library family that has paid for those
imports waiting (``python -m universal_predictors --standby torch``, or ``light``: :data:`PRELOAD`): on a wake it
is handed the model's command line and environment on its stdin (one JSON line) and goes on as if started with
them.

What the standby imported must not change what the predictor does, so it takes only what it can serve
exactly as a fresh process would, and declines the rest (exit status :data:`DECLINED`, one line saying why; the
supervisor then starts a fresh process):

* ``OMP_WAIT_POLICY``: libgomp reads it once, when torch loads it; the standby imports torch with ``PASSIVE``, which
  every engine but llama.cpp gets (:func:`universal_predictors.__main__.set_openmp_wait_policy`), so a llama.cpp
  model is declined;
* KServe's flags: ``kserve.model_server`` parses the command line once, when imported, into its ModelServer's
  defaults; a command line whose KServe flags parse differently from the standby's own is declined;
* the environment: the supervisor hands over only models without ``spec.env`` of their own (a variable such as
  ``OMP_NUM_THREADS`` or ``HF_HOME`` is read when a library is imported), and the handed-over environment may
  only add the supervisor's per-process variables; anything else already set differently is declined.

No CUDA is touched before the hand-over (torch's import does not initialise it), and the standby never forks.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import IO, Any

from universal_predictors.config import (
    PARENT_PID_ENV,
    PREDICTOR_MODULE,
    STANDBY_ACCEPTED_LINE,
    STANDBY_DECLINED_EXIT,
    STANDBY_READY_LINE,
    UPSTREAM_TOKEN_ENV,
)

#: What a standby imports ahead of time, by family: ``torch`` for the engines on torch (sentence-transformers for
#: embeddings and reranking, transformers for the rest), ``light`` for those without it (PyOD's detectors as the
#: anomaly task imports them at load, RapidOCR on onnxruntime, PDFium), each with the predictor's own server.
#: A missing one (an install without that extra) is skipped.
SERVER = ("universal_predictors.server", "universal_predictors.base", "universal_predictors.registry")
PRELOAD: dict[str, tuple[str, ...]] = {
    "torch": (
        "torch", "transformers", "sentence_transformers", *SERVER,
        *(f"universal_predictors.tasks.{t}" for t in ("embed", "rerank", "classify", "ner", "generate", "document")),
        "universal_predictors.generation.engines.transformers",
    ),
    "light": (
        *(f"pyod.models.{m}" for m in ("iforest", "ecod", "copod", "hbos", "lof", "knn", "ocsvm", "pca")),
        "onnxruntime", "rapidocr_onnxruntime", "pypdfium2", *SERVER,
        "universal_predictors.tasks.anomaly", "universal_predictors.tasks.ocr",
    ),
}  # fmt: skip
#: The first line a standby prints once its imports are done; the supervisor waits for it.
READY_LINE = STANDBY_READY_LINE
#: The line a standby prints once it has checked what it was handed and serves it; until then it may decline.
ACCEPTED_LINE = STANDBY_ACCEPTED_LINE
#: Exit status of a standby that declined what it was handed (the line before it says why).
DECLINED = STANDBY_DECLINED_EXIT
#: Environment variables the supervisor sets per process, which the standby may take over from the hand-over.
PER_PROCESS_ENV = frozenset({PARENT_PID_ENV, UPSTREAM_TOKEN_ENV})


#: KServe's flags whose import-time values nothing reads: those :func:`universal_predictors.server.serve` passes
#: to the ModelServer itself, and ``model_name`` (KServe's own entry point's; the predictor has its own).
SERVE_PASSES = frozenset({"http_port", "grpc_port", "enable_grpc", "workers", "model_name"})


class Declined(Exception):
    """The standby cannot serve this command line exactly as a fresh process would."""


def preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules``; the names that could be imported."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        done.append(name)
    return done


def read_assignment(stream: IO[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment handed over on ``stream``; Declined when there is none (the supervisor
    closed it: this standby is no longer wanted)."""
    line = stream.readline()
    if not line:
        raise Declined("no model was handed over")
    try:
        message: Any = json.loads(line)
        argv, env = message["argv"], message["env"]
    except (ValueError, KeyError, TypeError) as exc:
        raise Declined(f"the hand-over is not a JSON object with argv and env: {exc}") from exc
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise Declined("argv must be a list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise Declined("env must map strings to strings")
    return argv, env


def check_environment(handed: dict[str, str], current: dict[str, str]) -> None:
    """Declined when ``handed`` sets anything the standby's imports may have read differently."""
    changed = sorted(
        key for key in set(handed) | set(current)
        if key not in PER_PROCESS_ENV and handed.get(key) != current.get(key)
    )  # fmt: skip
    if changed:
        raise Declined(f"the environment differs from the standby's in {', '.join(changed[:5])}")


def check_kserve_flags(argv: Sequence[str]) -> None:
    """Declined when KServe's flags in ``argv`` differ from those its module parsed when the standby imported it."""
    from kserve import model_server

    wanted, _ = model_server.parser.parse_known_args(list(argv))
    differ = sorted(
        key for key, value in vars(wanted).items()
        if key not in SERVE_PASSES and getattr(model_server.args, key, None) != value
    )  # fmt: skip
    if differ:
        raise Declined(f"KServe's flags differ from the standby's ({', '.join(differ)})")


def run(family: str, stdin: IO[str], stdout: IO[str], argv_prefix: str) -> list[str]:
    """The standby's life up to the hand-over: import, announce, wait, check. The command line to run (the
    engine check, llama.cpp or not, is the caller's: it needs the parsed configuration)."""
    global _setproctitle
    _setproctitle = _import_setproctitle()
    inherited = dict(os.environ)  # before anything below sets a variable of its own
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # kserve.model_server parses sys.argv when imported: the standby's own command line has no KServe flags.
    sys.argv = [argv_prefix]
    if family not in PRELOAD:
        raise Declined(f"no standby family {family!r}; one of {', '.join(PRELOAD)}")
    preload(PRELOAD[family])
    print(READY_LINE, file=stdout, flush=True)
    argv, env = read_assignment(stdin)
    check_environment(env, inherited)
    check_kserve_flags(argv)
    os.environ.update(env)
    sys.argv = [argv_prefix, *argv]
    return argv


def retitle(argv: Sequence[str]) -> None:
    """Show the model's command line as this process's (``ps``, /proc/PID/cmdline), as a fresh process would have
    it: one line, shell-quoted (setproctitle; without it the title stays ``--standby``)."""
    if _setproctitle is not None:
        _setproctitle.setproctitle(shlex.join([sys.executable, "-m", PREDICTOR_MODULE, *argv]))


def _import_setproctitle() -> Any:
    """setproctitle, imported before anything changes the environment: it finds the command line's memory by
    walking from the original ``environ``, which ``os.environ.update`` may move."""
    try:
        import setproctitle
    except ImportError:
        return None
    setproctitle.getproctitle()  # its first call finds the command line's memory: now, while it still can
    return setproctitle


_setproctitle: Any = None
