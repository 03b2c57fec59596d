"""What each task is, written once: its backends, its pip extra, its predictor class and its HTTP routes.

Everything else that knows about tasks reads this table: ``Task`` and ``TASK_BACKENDS`` (the predictor's
command line, the spec models, the operator's validation), the predictor registry, the gateway's route
table and ``/openapi.json``, the CRD's task enum and CEL rules, and the README's task table (a test holds
it). Adding a task is its predictor module, one :class:`TaskEntry` here (and its ``Task`` member), then
``make crd``, which regenerates the CRD and the request schemas.

The control plane imports this module, so it stays light: pydantic and the standard library. A
predictor class and a request model are named by import path (``module:Class``) and never imported
here; the request models' JSON Schemas are generated into ``request_schemas.json`` beside this file
(:mod:`universal_predictors.request_schemas`), which the gateway reads as data.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from enum import StrEnum
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Task(StrEnum):
    """What a model does; one predictor class per task, one :class:`TaskEntry` per member."""

    GENERATE = "generate"
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    NER = "ner"
    OCR = "ocr"
    DOCUMENT = "document"
    ANOMALY = "anomaly"
    TRANSCRIBE = "transcribe"


class Backend(StrEnum):
    """The engine that runs a model; ``auto`` lets the source and the hardware decide."""

    AUTO = "auto"
    TRANSFORMERS = "transformers"
    LLAMACPP = "llamacpp"
    VLLM = "vllm"
    RAPIDOCR = "rapidocr"
    TESSERACT = "tesseract"
    PYOD = "pyod"
    FASTER_WHISPER = "faster-whisper"


class ModelFrom(StrEnum):
    """Where the gateway finds the ``model`` that routes a request."""

    JSON = "json"  # the JSON body's "model" field
    FORM = "form"  # the "model" field of a multipart/form-data body (file uploads)
    QUERY = "query"  # ?model=NAME; without it, the one model of the task when there is exactly one


_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
_PATH_PARAM = re.compile(r"\{([a-z_]+)\}")


class Route(BaseModel):
    """One HTTP route a task serves, as the gateway exposes it and as the predictor answers it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["GET", "POST", "DELETE"]
    path: str = Field(
        pattern=r"^[a-z0-9_-]+(/([a-z0-9_-]+|\{[a-z_]+\}))*$",
        description="Under the gateway's /v1 and /openai/v1 (no leading slash); {param} is one path segment.",
    )
    upstream: str = Field(pattern=r"^/", description="The predictor's path, with the same {params}.")
    aliases: tuple[str, ...] = Field(default=(), description="More predictor paths answering the same way.")
    operation: str = Field(
        pattern=r"^[a-z][a-z0-9_]*$", description="The OpenAPI operationId; the predictor's metrics label."
    )
    handler: str = Field(
        pattern=r"^[a-z][a-z0-9_]*$",
        description="The predictor method that answers (universal_predictors.binding): (body, request) for a POST, "
        "(path params, request) for GET and DELETE.",
    )
    summary: str = Field(min_length=1)
    model_from: tuple[ModelFrom, ...] = (ModelFrom.JSON,)
    request: str | None = Field(
        default=None, pattern=_IMPORT_PATH, description="The predictor's pydantic body model, module:Class."
    )
    errors: Literal["openai", "anthropic"] = Field(
        default="openai",
        description="The shape of its errors (gateway's and predictor's): OpenAI's, or Anthropic's for the Messages "
        "API (which also takes its key as x-api-key).",
    )

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(_PATH_PARAM.findall(self.path))

    @model_validator(mode="after")
    def _consistent(self) -> Route:
        if not self.model_from:
            raise ValueError(f"{self.method} {self.path}: model_from names at least one place")
        if tuple(_PATH_PARAM.findall(self.upstream)) != self.params:
            raise ValueError(f"{self.method} {self.path}: the upstream path {self.upstream} needs the same params")
        has_body = ModelFrom.JSON in self.model_from or ModelFrom.FORM in self.model_from
        if has_body != (self.method == "POST"):
            raise ValueError(f"{self.method} {self.path}: a POST takes model from its body, GET/DELETE from the query")
        if self.request is not None and self.method != "POST":
            raise ValueError(f"{self.method} {self.path}: only a POST has a request body model")
        return self


class TaskEntry(BaseModel):
    """One task: what it does and everything the three programs need to know about it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9]*$", description="The value of spec.task and --task.")
    summary: str = Field(min_length=1, description="What it does, for the README and the CRD's description.")
    backends: tuple[Backend, ...] = Field(
        min_length=1, description="The engines it runs on; ``auto`` means the first unless the source says more."
    )
    extra: str = Field(pattern=r"^[a-z][a-z0-9-]*$", description="The pip extra that brings its default engine.")
    predictor: str = Field(pattern=_IMPORT_PATH, description="The predictor class, module:Class.")
    routes: tuple[Route, ...] = Field(min_length=1)
    #: Whether a source may hold several weight files, one picked by ``source.file`` (a GGUF pattern).
    file_pattern: bool = False

    @model_validator(mode="after")
    def _backends(self) -> TaskEntry:
        if Backend.AUTO in self.backends:
            raise ValueError(f"task {self.name}: auto is every task's; list the engines it resolves to")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"task {self.name}: a backend is listed twice")
        return self


class Catalog(BaseModel):
    """Every task; routes are unique across tasks (the gateway routes each to one task)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: tuple[TaskEntry, ...]

    @model_validator(mode="after")
    def _unique(self) -> Catalog:
        names = [entry.name for entry in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"a task is listed twice: {sorted(n for n in names if names.count(n) > 1)}")
        seen: dict[tuple[str, str], str] = {}
        for entry in self.tasks:
            for route in entry.routes:
                key = (route.method, _PATH_PARAM.sub("{}", route.path))
                if key in seen:
                    raise ValueError(f"{route.method} {route.path} is served by both {seen[key]} and {entry.name}")
                seen[key] = entry.name
        return self

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.tasks]

    def routes(self) -> list[tuple[TaskEntry, Route]]:
        return [(entry, route) for entry in self.tasks for route in entry.routes]

    def with_task(self, entry: TaskEntry) -> Catalog:
        """This catalog with one more task (what adding a task amounts to)."""
        return Catalog(tasks=(*self.tasks, entry))


def _post(
    path: str,
    upstream: str,
    summary: str,
    request: str,
    *forms: ModelFrom,
    handler: str,
    aliases: tuple[str, ...] = (),
    errors: Literal["openai", "anthropic"] = "openai",
) -> Route:
    return Route(
        method="POST",
        path=path,
        upstream=upstream,
        operation=path.replace("/", "_"),
        summary=summary,
        model_from=(ModelFrom.JSON, *forms),
        request=request,
        handler=handler,
        aliases=aliases,
        errors=errors,
    )


_TASKS = "universal_predictors.tasks"

CATALOG = Catalog(
    tasks=(
        TaskEntry(
            name=Task.GENERATE,
            summary=(
                "text generation: chat (images in on vision-language models) and completions, streaming, tools "
                "and structured output"
            ),
            backends=(Backend.TRANSFORMERS, Backend.LLAMACPP, Backend.VLLM),
            extra="generate",
            predictor=f"{_TASKS}.generate:GeneratePredictor",
            file_pattern=True,
            routes=(
                _post(
                    "chat/completions",
                    "/openai/v1/chat/completions",
                    "OpenAI chat completions",
                    "universal_predictors.generation.protocol:ChatCompletionRequest",
                    handler="chat_completions",
                ),
                _post(
                    "completions",
                    "/openai/v1/completions",
                    "OpenAI completions",
                    "universal_predictors.generation.protocol:CompletionRequest",
                    handler="completions",
                ),
                # OpenAI's Responses API (vLLM serves it at the same path: vllm 0.32
                # entrypoints/openai/responses/api_router.py), stateless in the predictor.
                _post(
                    "responses",
                    "/openai/v1/responses",
                    "OpenAI responses",
                    "universal_predictors.generation.responses_api:ResponsesRequest",
                    handler="responses",
                ),
                # Anthropic's Messages API, at the path vLLM serves it (vllm 0.32 entrypoints/anthropic/api_router.py).
                _post(
                    "messages",
                    "/v1/messages",
                    "Anthropic messages",
                    "universal_predictors.generation.messages_api:MessagesRequest",
                    handler="messages",
                    errors="anthropic",
                ),
                _post(
                    "messages/count_tokens",
                    "/v1/messages/count_tokens",
                    "Anthropic message token count",
                    "universal_predictors.generation.messages_api:CountTokensRequest",
                    handler="count_message_tokens",
                    errors="anthropic",
                ),
                # vLLM's tokenizer routes and shapes (vllm 0.32 entrypoints/serve/tokenize/api_router.py): a
                # prompt or a chat to the model's token ids, and ids back to text.
                _post(
                    "tokenize",
                    "/tokenize",
                    "Token ids of a prompt or a chat",
                    "universal_predictors.generation.protocol:TokenizeRequest",
                    handler="tokenize",
                ),
                _post(
                    "detokenize",
                    "/detokenize",
                    "Text of token ids",
                    "universal_predictors.generation.protocol:DetokenizeRequest",
                    handler="detokenize",
                ),
            ),
        ),
        # vLLM generates only: the embedding predictor has no vLLM encoder (vLLM's pooling runner is not
        # wired in), so embed on vllm is refused at admission rather than admitted to crash-loop.
        TaskEntry(
            name=Task.EMBED,
            summary="embeddings",
            backends=(Backend.TRANSFORMERS, Backend.LLAMACPP),
            extra="transformers",
            predictor=f"{_TASKS}.embed:EmbedPredictor",
            file_pattern=True,
            routes=(
                _post(
                    "embeddings",
                    "/openai/v1/embeddings",
                    "OpenAI embeddings",
                    f"{_TASKS}.embed:EmbeddingRequest",
                    handler="embeddings",
                ),
            ),
        ),
        TaskEntry(
            name=Task.RERANK,
            summary="reranking documents against a query (cross-encoder or bi-encoder)",
            backends=(Backend.TRANSFORMERS,),
            extra="transformers",
            predictor=f"{_TASKS}.rerank:RerankPredictor",
            # /v1/rerank too: the path Cohere's and Jina's clients call a predictor on directly.
            routes=(
                _post(
                    "rerank",
                    "/openai/v1/rerank",
                    "Rerank documents",
                    f"{_TASKS}.rerank:RerankRequest",
                    handler="rerank_request",
                    aliases=("/v1/rerank",),
                ),
            ),
        ),
        TaskEntry(
            name=Task.CLASSIFY,
            summary="text classification",
            backends=(Backend.TRANSFORMERS,),
            extra="transformers",
            predictor=f"{_TASKS}.classify:ClassifyPredictor",
            routes=(
                _post(
                    "classify",
                    "/v1/classify",
                    "Classify texts",
                    f"{_TASKS}.classify:ClassifyRequest",
                    handler="classify_request",
                ),
            ),
        ),
        TaskEntry(
            name=Task.NER,
            summary="named-entity recognition",
            backends=(Backend.TRANSFORMERS,),
            extra="transformers",
            predictor=f"{_TASKS}.ner:NerPredictor",
            routes=(_post("ner", "/v1/ner", "Tag named entities", f"{_TASKS}.ner:NerRequest", handler="ner_request"),),
        ),
        TaskEntry(
            name=Task.OCR,
            summary="OCR of images and PDFs, sent as base64 JSON or as a file upload",
            backends=(Backend.RAPIDOCR, Backend.TESSERACT),
            extra="ocr",
            predictor=f"{_TASKS}.ocr:OcrPredictor",
            routes=(
                _post(
                    "ocr",
                    "/v1/ocr",
                    "Read text in images and PDFs",
                    f"{_TASKS}.ocr:OcrRequest",
                    ModelFrom.FORM,
                    handler="ocr_request",
                ),
            ),
        ),
        # Documents are read with the OCR engines (rapidocr or tesseract, an engine arg) when the model needs words.
        TaskEntry(
            name=Task.DOCUMENT,
            summary="document understanding of a page image or PDF page: question answering, fields, page class",
            backends=(Backend.TRANSFORMERS,),
            extra="document",
            predictor=f"{_TASKS}.document:DocumentPredictor",
            routes=(
                _post(
                    "document/qa",
                    "/v1/document/qa",
                    "Answer a question about a page",
                    f"{_TASKS}.document:DocumentQARequest",
                    ModelFrom.FORM,
                    handler="answer",
                ),
                _post(
                    "document/extract",
                    "/v1/document/extract",
                    "Extract fields from a page",
                    f"{_TASKS}.document:DocumentExtractRequest",
                    ModelFrom.FORM,
                    handler="extract",
                ),
                _post(
                    "document/classify",
                    "/v1/document/classify",
                    "Classify a page",
                    f"{_TASKS}.document:DocumentClassifyRequest",
                    ModelFrom.FORM,
                    handler="classify",
                ),
            ),
        ),
        TaskEntry(
            name=Task.ANOMALY,
            summary="anomaly detection with named PyOD detectors fitted at run time",
            backends=(Backend.PYOD,),
            extra="anomaly",
            predictor=f"{_TASKS}.anomaly:AnomalyPredictor",
            routes=(
                _post(
                    "anomaly/fit",
                    "/v1/anomaly/fit",
                    "Fit a named detector",
                    f"{_TASKS}.anomaly:FitRequest",
                    handler="fit_request",
                ),
                _post(
                    "anomaly/score",
                    "/v1/anomaly/score",
                    "Score rows",
                    f"{_TASKS}.anomaly:ScoreRequest",
                    handler="score_request",
                ),
                _post(
                    "anomaly/detect",
                    "/v1/anomaly/detect",
                    "Flag anomalous rows",
                    f"{_TASKS}.anomaly:DetectRequest",
                    handler="detect_request",
                ),
                Route(
                    method="GET",
                    path="anomaly/detectors",
                    upstream="/v1/anomaly/detectors",
                    operation="list_anomaly_detectors",
                    handler="list_detectors",
                    summary="List the fitted detectors",
                    model_from=(ModelFrom.QUERY,),
                ),
                Route(
                    method="GET",
                    path="anomaly/detectors/{name}",
                    upstream="/v1/anomaly/detectors/{name}",
                    operation="get_anomaly_detector",
                    handler="get_detector",
                    summary="One fitted detector",
                    model_from=(ModelFrom.QUERY,),
                ),
                Route(
                    method="DELETE",
                    path="anomaly/detectors/{name}",
                    upstream="/v1/anomaly/detectors/{name}",
                    operation="delete_anomaly_detector",
                    handler="delete_detector_route",
                    summary="Delete a fitted detector",
                    model_from=(ModelFrom.QUERY,),
                ),
            ),
        ),
        # OpenAI's audio API: multipart uploads only (its SDK sends nothing else), errors in OpenAI's shape.
        TaskEntry(
            name=Task.TRANSCRIBE,
            summary="speech to text (Whisper-family): OpenAI's audio transcriptions and translations, streaming",
            backends=(Backend.TRANSFORMERS, Backend.FASTER_WHISPER),
            extra="transcribe",
            predictor=f"{_TASKS}.transcribe:TranscribePredictor",
            routes=(
                Route(
                    method="POST",
                    path="audio/transcriptions",
                    upstream="/openai/v1/audio/transcriptions",
                    operation="audio_transcriptions",
                    summary="OpenAI audio transcriptions",
                    model_from=(ModelFrom.FORM,),
                    request=f"{_TASKS}.transcribe:TranscriptionRequest",
                    handler="transcriptions",
                ),
                Route(
                    method="POST",
                    path="audio/translations",
                    upstream="/openai/v1/audio/translations",
                    operation="audio_translations",
                    summary="OpenAI audio translations (to English)",
                    model_from=(ModelFrom.FORM,),
                    request=f"{_TASKS}.transcribe:TranslationRequest",
                    handler="translations",
                ),
            ),
        ),
    )
)

if [t.value for t in Task] != CATALOG.names:  # pragma: no cover - a catalog edited without its Task member
    raise RuntimeError(f"Task {[t.value for t in Task]} and the catalog's tasks {CATALOG.names} differ")

#: The engines each task can run on, ``auto`` always allowed. The CRD's CEL rule, the operator's
#: validation and the predictor's dispatch all read this table.
TASK_BACKENDS: Mapping[Task, tuple[Backend, ...]] = {Task(e.name): e.backends for e in CATALOG.tasks}


# -- request schemas -------------------------------------------------------------------------------------------

#: Generated by ``python -m universal_predictors.request_schemas`` (``make crd``); a test holds it current.
REQUEST_SCHEMAS_FILE = "request_schemas.json"


class RequestSchemas(BaseModel):
    """The JSON Schemas (2020-12, as OpenAPI 3.1 takes them) of the routes' request models.

    ``requests`` maps a route's ``request`` import path to its schema's name in ``components``; nested
    models are components too, referenced as ``#/components/schemas/NAME``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: dict[str, str] = Field(default_factory=dict)
    components: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def schema_of(self, request: str | None) -> dict[str, Any] | None:
        name = self.requests.get(request) if request else None
        return self.components[name] if name is not None else None


@functools.cache
def request_schemas() -> RequestSchemas:
    """The committed request schemas (data read from the package, no predictor code imported)."""
    text = resources.files("universal_predictors").joinpath(REQUEST_SCHEMAS_FILE).read_text()
    return RequestSchemas.model_validate(json.loads(text))
