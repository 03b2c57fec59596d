"""``task: document``: question answering, field extraction and classification over one page.

``POST /v1/document/qa``, ``/v1/document/extract`` and ``/v1/document/classify`` take one page: an
``image`` (PNG, JPEG, TIFF, WebP) or a PDF ``document`` (alias ``pdf``) with the 1-based ``page`` to read
(default 1), as JSON with base64 strings or as a ``multipart/form-data`` upload (file fields ``file`` /
``image`` / ``document`` / ``pdf``; the other fields as form fields, ``words``, ``boxes`` and ``schema``
as JSON text). The model is one of the families of :mod:`universal_predictors.document.family`, its head
(hence the one route it serves) read from its config's ``architectures``.

Families that read words (LayoutLMv3) get them from this project's OCR engines, RapidOCR (default) or
Tesseract (``--engine-arg ocr_engine=tesseract``), or from the request (``words`` with pixel ``boxes``,
when the client has its own OCR); the words and their boxes come back with the answer, in pixels and on
LayoutLM's 0-1000 grid. Decoding and tokenisation run on worker threads, OCR on the OCR engine's thread
and the model on the engine thread, where pages of concurrent requests share forward passes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import Request
from pydantic import AliasChoices, ConfigDict, Field, model_validator

from universal_predictors.base import UniversalPredictor
from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.binding import request_model
from universal_predictors.catalog import Backend, Route, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.decode_budget import DecodeBudget
from universal_predictors.document.donut import CLASSIFY_PROMPT, EXTRACT_PROMPT, QA_PROMPT
from universal_predictors.document.family import DocumentModel, Head, PageJob, resolve
from universal_predictors.document.words import PageWords, from_lines, from_request, normalise
from universal_predictors.errors import InvalidRequest
from universal_predictors.http import (
    FormPart,
    is_multipart_form,
    parse_form,
    parse_json,
)
from universal_predictors.image_inputs import open_image
from universal_predictors.ocr.engine import Job, OcrEngine, OcrOptions, resolve_languages
from universal_predictors.ocr.inputs import (
    DOCUMENT_FIELDS,
    PageInput,
    PageLimitArgs,
    SplitLanguages,
    language_codes,
    split_form,
    validated,
)
from universal_predictors.ocr.layout import Line
from universal_predictors.ocr.pages import (
    OCR_BYTES_PER_PIXEL,
    Page,
    PdfRenderers,
    PixelBudget,
    decode_document,
    decode_image_bytes,
    image_page,
)

ROUTES = {head: f"/v1/document/{head.value}" for head in Head}


class DocumentOcr(OcrOptions):
    """The document task's OCR: which engine, its models, and how it reads (:class:`OcrOptions`)."""

    engine: Literal["rapidocr", "tesseract"] = "rapidocr"
    source: str = Field(default="builtin", description="The OCR engine's models (see task ocr's --source).")


def _ocr_key(name: str) -> str:
    """The flat engine-arg key of a :class:`DocumentOcr` field."""
    return name if name == "tesseract_cmd" else f"ocr_{name}"


_OCR_KEYS = {_ocr_key(name): name for name in DocumentOcr.model_fields}


class DocumentEngineArgs(PageLimitArgs):
    """Engine arguments of the document predictor (``--engine-arg key=value``)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nest_ocr(cls, raw: Any) -> Any:
        """``ocr_threads=2`` (and every :data:`_OCR_KEYS` key) into ``ocr``; a bare ``ocr`` key stays unknown."""
        if not isinstance(raw, dict):
            return raw
        flat = {key: value for key, value in raw.items() if key not in _OCR_KEYS and key != "ocr"}
        nested = {_OCR_KEYS[key]: value for key, value in raw.items() if key in _OCR_KEYS}
        if "ocr" in raw:
            flat["ocr "] = raw["ocr"]  # not a key: refused as unknown, named as sent below
        return {**flat, "ocr": nested} if nested else flat

    @classmethod
    def flat_key(cls, loc: tuple[int | str, ...]) -> str:
        if len(loc) >= 2 and loc[0] == "ocr":
            return _ocr_key(str(loc[1]))
        return ".".join(str(p).strip() for p in loc)

    @classmethod
    def flat_keys(cls) -> list[str]:
        return [key for key in cls.model_fields if key != "ocr"] + list(_OCR_KEYS)

    head: Literal["auto", "qa", "extract", "classify"] = Field(
        default="auto", description="The model's head (route); auto: from config.json architectures."
    )
    max_batch_size: int = Field(default=8, ge=1, le=256, description="Pages per forward pass at most.")
    max_wait_ms: float | None = Field(
        default=None, ge=0, le=1000, description="How long a batch waits for company (default: the family's)."
    )
    device: str = "auto"
    dtype: str = "auto"
    # The OCR that gives word models their words: the OCR task's engines, their options given flat
    # (``ocr_engine``, ``ocr_threads``, ..., ``tesseract_cmd``) and nested here (:meth:`_nest_ocr`).
    ocr: DocumentOcr = Field(default_factory=lambda: DocumentOcr())
    # Limits (PageLimitArgs'), with the document task's defaults where they differ, and its own: words.
    max_pages: int = Field(default=500, ge=1, description="Pages of a PDF (or frames of a TIFF) at most.")
    pdf_dpi: int = Field(default=150, ge=50, le=600, description="Resolution PDF pages are rendered at.")
    max_words: int = Field(default=4096, ge=1, description="Words of a page (OCR'd or sent).")
    # OCR-free encoder-decoders (Donut): the task prompt of each route and how the decoder generates.
    max_length: int | None = Field(
        default=None, ge=2, description="Decoder tokens at most, the prompt included (default: its positions)."
    )
    num_beams: int = Field(default=1, ge=1, le=16, description="1: greedy; more: beam search.")
    qa_prompt: str = Field(default=QA_PROMPT, description="Donut's question prompt; {question} is the question.")
    extract_prompt: str = Field(default=EXTRACT_PROMPT, description="Donut's extraction start token.")
    classify_prompt: str = Field(default=CLASSIFY_PROMPT, description="Donut's classification start token.")

    def family_options(self) -> dict[str, Any]:
        """What a family reads itself (:attr:`DocumentModel.options`)."""
        return self.model_dump(include={"max_length", "num_beams", "qa_prompt", "extract_prompt", "classify_prompt"})


class DocumentRequest(SplitLanguages):
    """The page every document route reads; unknown extension fields are ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    image: str | None = Field(default=None, description="A base64 PNG, JPEG, TIFF or WebP page image.")
    document: str | None = Field(
        default=None, validation_alias=AliasChoices("document", "pdf"), description="A base64 PDF."
    )
    page: int | None = Field(default=None, ge=1, description="The 1-based page of the PDF (or TIFF frame); 1.")
    words: list[str] | None = Field(
        default=None, max_length=100_000, description="The page's words, when the client ran OCR itself."
    )
    boxes: list[list[float]] | None = Field(
        default=None, description="One [x0, y0, x1, y1] pixel box per word (with words)."
    )
    languages: list[str] | None = Field(default=None, description="OCR languages ('eng', 'en', ...).")
    return_words: bool = Field(default=False, description="Also return every word of the page with its boxes.")


class DocumentQARequest(DocumentRequest):
    """``POST /v1/document/qa``."""

    question: str = Field(min_length=1, max_length=4096)


class DocumentExtractRequest(DocumentRequest):
    """``POST /v1/document/extract``."""

    fields_schema: dict[str, Any] | None = Field(
        default=None,
        alias="schema",
        description="A JSON Schema object whose properties name the fields wanted; only those are returned.",
    )


class DocumentClassifyRequest(DocumentRequest):
    """``POST /v1/document/classify``."""

    top_k: int | None = Field(default=None, ge=1, description="How many labels all_scores lists (default all).")


IMAGE_FIELDS = frozenset({"file", "image"})
_JSON_FIELDS = frozenset({"words", "boxes", "schema"})


def form_request(parts: list[FormPart], model: type[DocumentRequest]) -> tuple[DocumentRequest, PageInput | None]:
    """A ``multipart/form-data`` request as the JSON one (same validation and errors), and its uploaded page."""
    options, files = split_form(parts, IMAGE_FIELDS | DOCUMENT_FIELDS, "a document upload sends its page",
                                json_fields=_JSON_FIELDS)  # fmt: skip
    body = validated(model, options)
    if len(files) > 1:
        raise InvalidRequest(f"{files[1].name}: send one page (one image or one PDF) per request", param=files[1].name)
    return body, PageInput.from_part(files[0]) if files else None


def json_input(body: DocumentRequest) -> PageInput | None:
    if body.image is not None and body.document is not None:
        raise InvalidRequest("document: send either image or document (a PDF), not both", param="document")
    if body.image is not None:
        return PageInput("image", body.image, False)
    if body.document is not None:
        return PageInput("document", body.document, True)
    return None


class DocumentPredictor(UniversalPredictor):
    """One document model with one head; its pages' OCR and forward passes are micro-batched."""

    task = Task.DOCUMENT
    EngineArgs = DocumentEngineArgs

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__(config)
        # A source no family serves, or a head none of them has, stops the process with one line.
        args: DocumentEngineArgs = self.engine_args
        requested = None if args.head == "auto" else Head(args.head)
        self.document_model: DocumentModel = resolve(config.source, requested, args.family_options())
        if self.document_model.needs_words:
            if args.ocr.engine == "tesseract":
                from universal_predictors.ocr.tesseract import check_source

                check_source(args.ocr.source, args.ocr.tesseract_cmd)
            else:
                from universal_predictors.ocr.rapid import model_files

                model_files(args.ocr.source)

    # -- lifecycle -------------------------------------------------------------------------------------

    def load(self) -> bool:
        from PIL import Image

        args: DocumentEngineArgs = self.engine_args
        model = self.document_model
        model.load(args.device, args.dtype)
        self.ocr: OcrEngine | None = self._ocr_engine(args) if model.needs_words else None
        self.default_languages: list[str] = self.ocr.languages() if self.ocr is not None else []
        if self.ocr is not None and args.ocr.languages:
            self.default_languages = list(
                resolve_languages(language_codes(args.ocr.languages), self.ocr.languages(), [])
            )
        Image.MAX_IMAGE_PIXELS = args.max_pixels
        self.limits = args.limits()
        self.renderers = PdfRenderers(args.pdf_workers, args.max_render_memory_mb)
        self.decode_budget = DecodeBudget(args.decode_budget_mb * 2**20, args.decode_wait_s,
                                          largest_bytes=args.max_pixels * OCR_BYTES_PER_PIXEL)  # fmt: skip
        self.max_wait_ms = model.max_wait_ms if args.max_wait_ms is None else args.max_wait_ms
        self.in_flight = 0
        policy = BatchPolicy(max_batch_size=args.max_batch_size, max_wait_ms=self.max_wait_ms)
        # Pages still being decoded (or OCR'd) are company a batch waits for (``expected``).
        self.batcher: MicroBatcher[Any, Any] = MicroBatcher(
            model.forward, model_name=self.name, policy=policy, cost=model.cost, expected=lambda: self.in_flight
        )
        if self.ocr is not None:
            self.ocr_batcher: MicroBatcher[Job, list[Line]] = MicroBatcher(
                self.ocr.recognise_batch,
                model_name=self.name,
                policy=policy,
                cost=lambda job: job.image.width * job.image.height,
            )
        self.backend = Backend.TRANSFORMERS
        return True

    def _ocr_engine(self, args: DocumentEngineArgs) -> OcrEngine:
        languages = language_codes(args.ocr.languages) if args.ocr.languages else None
        if args.ocr.engine == "tesseract":
            from universal_predictors.ocr.tesseract import TesseractEngine

            ocr = args.ocr
            return TesseractEngine(ocr.source, languages=languages, workers=0, psm=ocr.psm, timeout_s=ocr.timeout_s,
                                   max_skew=15.0, command=ocr.tesseract_cmd)  # fmt: skip
        from universal_predictors.ocr.rapid import RapidOcrEngine

        return RapidOcrEngine(
            args.ocr.source,
            languages=languages,
            threads=args.ocr.threads,
            max_side=args.ocr.max_side,
            use_angle_cls=True,
            text_score=args.ocr.text_score,
            word_boxes=True,
        )

    def unload(self) -> None:
        self.document_model.close()
        if getattr(self, "ocr", None) is not None:
            assert self.ocr is not None
            self.ocr.close()
            self.ocr = None

    def describe(self) -> dict[str, Any]:
        if not self.ready:
            return {}
        model = self.document_model
        args: DocumentEngineArgs = self.engine_args
        return {
            "family": model.family,
            "head": model.head.value,
            "routes": [ROUTES[head] for head in model.serves()],
            "ocr": {"engine": self.ocr.name, "languages": self.default_languages} if self.ocr is not None else None,
            "limits": {
                "max_image_bytes": args.max_image_bytes,
                "max_pixels": args.max_pixels,
                "max_pages": args.max_pages,
                "max_words": args.max_words,
                "max_body_bytes": args.max_body_bytes,
                "pdf_dpi": args.pdf_dpi,
            },
            **model.describe(),
        }

    # -- a page ------------------------------------------------------------------------------------------

    def _check_head(self, head: Head) -> None:
        model = self.document_model
        served = model.serves()
        if head not in served:
            raise InvalidRequest(
                f"The model {self.name!r} is a {model.family} {model.head.value} model; it serves "
                f"{', '.join(ROUTES[h] for h in served)}, not {ROUTES[head]}.",
                code="unsupported_route",
            )

    async def _source(self, source: PageInput | None) -> tuple[PageInput, bytes]:
        """The page's bytes (a PDF or an image) from base64 or the upload, within ``max_image_bytes``."""
        if source is None:
            raise InvalidRequest(
                "image: send the page as image (a base64 image, or a file uploaded in the form field 'file') or "
                "document (a base64 PDF, with page)",
                param="image",
            )
        decode = decode_document if source.document else decode_image_bytes
        return source, await asyncio.to_thread(decode, source.value, source.field, self.limits)

    def _decode_cost(self, source: PageInput, data: bytes, number: int | None) -> int:
        """What reading the page holds, in bytes (:data:`OCR_BYTES_PER_PIXEL` per pixel: the page, the OCR's
        copies, the model's input): an image's first frame by its header; a PDF page (sized only once
        rendered) or a later TIFF frame at ``max_pixels``, within the whole budget (they take turns)."""
        if source.document or (number or 1) > 1:
            return min(self.limits.max_pixels * OCR_BYTES_PER_PIXEL, self.decode_budget.total)
        header = open_image(data, source.field, self.limits.max_pixels)
        try:
            return header.width * header.height * OCR_BYTES_PER_PIXEL
        finally:
            header.close()

    async def _page(self, source: PageInput, data: bytes, number: int | None) -> Page:
        budget = PixelBudget(self.limits)
        if source.document:
            pages = [p async for p in self.renderers.pages(data, 0, source.field, self.limits, budget, number or 1,
                                                          run=self.decode_budget.run)]  # fmt: skip
            return pages[0]
        return await self.decode_budget.run(image_page, data, source.field, self.limits, budget, number or 1)

    async def _words(self, body: DocumentRequest, page: Page) -> PageWords | None:
        args: DocumentEngineArgs = self.engine_args
        width, height = page.image.size
        if not self.document_model.needs_words:
            return None
        if body.words is not None:
            words = from_request(body.words, body.boxes, width, height)
        else:
            if body.boxes is not None:
                raise InvalidRequest("words: boxes come with the words they box; send words too", param="words")
            assert self.ocr is not None
            languages = resolve_languages(body.languages, self.ocr.languages(), self.default_languages)
            lines = await self.ocr_batcher.submit(Job(page.image, languages, page.dpi))
            words = await asyncio.to_thread(from_lines, lines, width, height, page.image)
        if len(words.words) > args.max_words:
            raise InvalidRequest(
                f"words: the page has {len(words.words)} words; the limit max_words is {args.max_words}",
                param="words",
                code="too_many_words",
            )
        return words

    async def _run(self, body: DocumentRequest, source: PageInput | None, head: Head, question: str | None = None
                   ) -> tuple[Page, PageWords | None, Any, Any]:  # fmt: skip
        self.in_flight += 1  # from the start: pages still being decoded are company for a batch
        try:
            return await self._read(body, source, head, question)
        finally:
            self.in_flight -= 1
            self.batcher.notify()

    async def _read(self, body: DocumentRequest, source: PageInput | None, head: Head, question: str | None
                    ) -> tuple[Page, PageWords | None, Any, Any]:  # fmt: skip
        source, data = await self._source(source)
        cost = await asyncio.to_thread(self._decode_cost, source, data, body.page)
        # The page's memory is held from its decode until the model has its input (the predictor-wide budget).
        async with self.decode_budget.reserve(cost, source.field):
            page = await self._page(source, data, body.page)
            words = await self._words(body, page)
            job = PageJob(page.image, words, question, head)
            if words is not None and not words.words:
                return page, words, None, None  # nothing to read: no forward pass
            # The processor works on the full page (its own resize decides what the model sees) on the budget's
            # threads, where what it frees is reused by the next page (universal_predictors.decode_budget).
            encoded = await self.decode_budget.run(self.document_model.encode, job)
        output = await self._forward(encoded)
        return page, words, encoded, output

    async def _forward(self, encoded: Any) -> Any:
        # A lone page goes straight to the model; concurrent pages still being decoded join its batch
        # (the batcher waits for them, at most max_wait_ms, while self.in_flight says some are coming).
        return await self.batcher.submit(encoded)

    def _envelope(self, kind: str, page: Page, body: DocumentRequest) -> dict[str, Any]:
        out: dict[str, Any] = {"object": f"document.{kind}", "model": self.name}
        if page.page is not None or body.page is not None:
            out["page"] = page.page or body.page
        out["width"], out["height"] = page.image.size
        return out

    def _usage(self, words: PageWords | None, encoded: Any, output: Any = None) -> dict[str, Any]:
        usage: dict[str, Any] = {"pages": 1}
        if words is not None:
            usage["words"] = len(words.words)
        if encoded is not None and hasattr(encoded, "tokens"):
            usage["prompt_tokens"] = encoded.tokens
            usage["truncated"] = bool(getattr(encoded, "truncated", False))
        if output is not None and hasattr(output, "token_ids"):  # a decoder's output: the tokens it wrote
            usage["completion_tokens"] = len(output.token_ids)
        return usage

    @staticmethod
    def _boxed(words: PageWords | None, indices: list[int]) -> dict[str, Any]:
        if words is None or not indices:
            return {"box": None, "normalized_box": None}
        box = words.union_box(indices)
        return {"box": [round(v, 1) for v in box], "normalized_box": list(normalise(box, words.width, words.height))}

    # -- routes --------------------------------------------------------------------------------------------

    # A client that leaves stops its request (the binder's unless_disconnected): its decoding, a PDF render
    # process, its OCR and its page still queued for a forward pass; a batch already running finishes.
    stop_on_disconnect = True

    async def read_request(self, route: Route, request: Request) -> tuple[str | None, Any]:
        """The route's request (JSON, or a ``multipart/form-data`` upload read as the JSON) and its page."""
        assert route.request is not None
        model: Any = request_model(route.request)
        limit = self.engine_args.max_body_bytes
        if is_multipart_form(request):
            body, source = form_request(await parse_form(request, limit), model)
        else:
            body = await parse_json(request, model, limit)
            source = json_input(body)
        return body.model, (body, source)

    async def answer(self, read: tuple[DocumentQARequest, PageInput | None], request: Request) -> dict[str, Any]:
        body, source = read
        self._check_head(Head.QA)
        page, words, encoded, output = await self._run(body, source, Head.QA, body.question)
        out = self._envelope("qa", page, body)
        out["question"] = body.question
        if encoded is None:
            result: dict[str, Any] = {"answer": None, "score": 0.0, "words": []}
        else:
            result = self.document_model.qa(encoded, output, words)
        indices = result.get("words") or []
        out["answer"] = result["answer"]
        out["score"] = result["score"]
        out["answer_words"] = words.as_json(indices) if words is not None else []
        out.update(self._boxed(words, indices))
        if body.return_words and words is not None:
            out["words"] = words.as_json()
        out["usage"] = self._usage(words, encoded, output)
        return out

    def _wanted(self, schema: dict[str, Any] | None) -> dict[str, str] | None:
        """The schema's property names -> the model's field names (case-insensitive); 400 naming unknown ones."""
        if schema is None:
            return None
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            raise InvalidRequest(
                "schema: a JSON Schema object whose properties name the fields wanted, e.g. "
                '{"type": "object", "properties": {"total": {"type": "string"}}}',
                param="schema",
            )
        names = self.document_model.field_names()
        by_lower = {name.lower(): name for name in names}
        unknown = [key for key in properties if key.lower() not in by_lower]
        if unknown:
            raise InvalidRequest(
                f"schema.properties: {', '.join(repr(k) for k in unknown)} "
                f"{'is not a field' if len(unknown) == 1 else 'are not fields'} the model {self.name!r} extracts; "
                f"it extracts {', '.join(names)}",
                param="schema.properties",
                code="unknown_field",
            )
        return {key: by_lower[key.lower()] for key in properties}

    async def extract(self, read: tuple[DocumentExtractRequest, PageInput | None], request: Request
                      ) -> dict[str, Any]:  # fmt: skip
        body, source = read
        self._check_head(Head.EXTRACT)
        wanted = self._wanted(body.fields_schema)  # before any decoding: a wrong key costs nothing
        page, words, encoded, output = await self._run(body, source, Head.EXTRACT)
        found = [] if encoded is None else self.document_model.extract(encoded, output, words)
        keys = wanted or {name: name for name in self.document_model.field_names()}
        fields = []
        values: dict[str, str | None] = {key: None for key in keys}
        best: dict[str, float] = {}
        for item in found:
            for key, name in keys.items():
                if item["name"] != name:
                    continue
                entry = {"name": key, "text": item["text"], "score": item["score"],
                         "words": words.as_json(item["words"]) if words is not None else [],
                         **self._boxed(words, item["words"])}  # fmt: skip
                fields.append(entry)
                if item["score"] > best.get(key, -1.0):
                    best[key] = item["score"]
                    values[key] = item["text"]
        out = self._envelope("extract", page, body)
        out["values"] = values
        out["fields"] = fields
        structured = None if encoded is None else self.document_model.structured(output, body.fields_schema)
        if structured is not None:
            out["json"] = structured
        if body.return_words and words is not None:
            out["words"] = words.as_json()
        out["usage"] = self._usage(words, encoded, output)
        return out

    async def classify(self, read: tuple[DocumentClassifyRequest, PageInput | None], request: Request
                       ) -> dict[str, Any]:  # fmt: skip
        body, source = read
        self._check_head(Head.CLASSIFY)
        page, words, encoded, output = await self._run(body, source, Head.CLASSIFY)
        if encoded is None:  # a page with no words: the model still sees its pixels
            assert words is not None
            encoded = await asyncio.to_thread(self.document_model.encode, PageJob(page.image, words))
            output = await self._forward(encoded)
        scores = self.document_model.classify(encoded, output)
        out = self._envelope("classification", page, body)
        out["label"], out["score"] = scores[0] if scores else (None, 0.0)
        listed = scores if body.top_k is None else scores[: body.top_k]
        out["all_scores"] = [{"label": label, "score": score} for label, score in listed]
        if body.return_words and words is not None:
            out["words"] = words.as_json()
        out["usage"] = self._usage(words, encoded, output)
        return out
