"""llguidance's compiler (JSON schemas, regexes, grammars) in a process of its own: a native crash costs one request.

llguidance compiles a schema in Rust; a schema that drives it past its stack (4,000 chained ``$defs`` did: SIGSEGV)
or its memory (an allocation failure aborts) used to take the whole predictor down, and three in a row marked the
model failed. The Python bounds in :mod:`universal_predictors.generation.constraints` stop every shape found so far;
this is the second wall, for the shapes not found yet. One warm child (spawned on first use, reused) compiles one
schema at a time under an address-space cap (:data:`MEMORY_MB`) and a time limit (:data:`TIMEOUT_S`). A child that
dies, runs out of memory or time is killed and replaced on the next compile, and that schema is refused: a 400
naming it too complex to compile, remembered (``constraints.refusals``) so it is not tried again.

Compiled grammars are cached by the caller, so the child sees each distinct schema once: measured on a 2-CPU machine,
the first compile with the child's start 0.3 s, later ones a millisecond plus llguidance's own time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

#: What the compiler process may add to its address space, in MiB (the environment variable overrides it).
MEMORY_MB_ENV = "UNIVERSAL_RUNTIME_SCHEMA_COMPILE_MEMORY_MB"
MEMORY_MB = 1024
#: The longest one compile may take, in seconds (the environment variable overrides it).
TIMEOUT_S_ENV = "UNIVERSAL_RUNTIME_SCHEMA_COMPILE_TIMEOUT_S"
TIMEOUT_S = 30.0
#: Bytes of refused schemas remembered (their keys), least recently refused dropped first.
REFUSALS_BYTES = 4 * 2**20
#: llguidance's JSON compile options: ``","`` and ``":"`` separators, no whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}
#: How long the compiler process may take to start (import llguidance).
START_TIMEOUT_S = 120.0

_MP = multiprocessing.get_context("spawn")  # never fork a process with engine threads running


class CompilerFailed(Exception):
    """The compiler process died, ran out of memory or out of time on this schema; the message says which."""


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        logger.warning("%s=%r is not a number; using %g", name, value, default)
        return default


def _child(conn: Connection, memory_mb: int) -> None:
    """The compiler process: ``(kind, source)`` in (``json`` and a schema's JSON, or ``regex``, ``choice`` (a JSON
    list) or ``grammar`` and its text); ``("grammar", llguidance's grammar)`` or ``("unsupported", messages)`` out."""
    import resource

    import llguidance

    with contextlib.suppress(OSError, ValueError):  # the cap: its size now plus memory_mb
        with open("/proc/self/statm", "rb") as statm:
            now = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = now + memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    conn.send(("ready",))
    options: Any = JSON_OPTIONS
    while True:
        try:
            kind, source = conn.recv()
        except EOFError:
            return
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=options)
            else:  # regex, choice, grammar: as vLLM's guidance backend reads them (llguidance.grammar_from)
                grammar = llguidance.grammar_from(kind, source)
            # Without a tokenizer: the same verdict (grammar and regex checks do not depend on one) and cheaper.
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        except MemoryError:
            conn.send(("failed", f"it needed more memory than {memory_mb} MiB"))
            continue
        except (ValueError, TypeError, RuntimeError) as exc:  # llguidance refuses (a bound past its range, ...)
            conn.send(("unsupported", [str(exc)]))
            continue
        conn.send(("unsupported", list(messages)) if is_error or messages else ("grammar", grammar))


class SchemaCompiler:
    """The warm compiler process (module docstring). Thread-safe: one compile at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Connection | None = None

    def compile(self, schema_json: str, kind: str = "json") -> tuple[str | None, list[str]]:
        """``(grammar, [])`` or ``(None, llguidance's messages)`` for a schema's JSON (or a ``regex``, ``choice`` or
        ``grammar`` source, by ``kind``); CompilerFailed when the process did not answer."""
        memory_mb = int(_setting(MEMORY_MB_ENV, MEMORY_MB))
        timeout_s = _setting(TIMEOUT_S_ENV, TIMEOUT_S)
        with self._lock:
            conn = self._ensure(memory_mb)
            try:
                conn.send((kind, schema_json))
                if not conn.poll(timeout_s):
                    self._stop()
                    raise CompilerFailed(f"compiling it took longer than {timeout_s:g} s")
                answer = conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                code = self._stop()
                raise CompilerFailed(f"the compiler stopped ({_how(code)}; memory cap {memory_mb} MiB)") from None
        kind, value = answer
        if kind == "grammar":
            return value, []
        if kind == "failed":
            with self._lock:
                self._stop()
            raise CompilerFailed(value)
        return None, list(value)

    def _ensure(self, memory_mb: int) -> Connection:
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        self._stop()
        receiver, sender = _MP.Pipe(duplex=True)
        process = _MP.Process(target=_child, args=(sender, memory_mb), name="schema-compiler", daemon=True)
        process.start()
        sender.close()
        if not receiver.poll(START_TIMEOUT_S):
            process.kill()
            raise CompilerFailed("the compiler process did not start")
        with contextlib.suppress(EOFError):
            if receiver.recv() == ("ready",):
                self._process, self._conn = process, receiver
                return receiver
        process.kill()
        raise CompilerFailed("the compiler process did not start")

    def _stop(self) -> int | None:
        """Kill the process (if any); its exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        process.join(0.5)
        if process.is_alive():
            process.kill()
            process.join(5)
        return process.exitcode  # type: ignore[no-any-return]

    def close(self) -> None:
        with self._lock:
            self._stop()


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


compiler = SchemaCompiler()
