"""``task: ocr``: ``POST /v1/ocr`` over RapidOCR (default) or Tesseract, pages micro-batched.

A request carries ``images`` (PNG, JPEG, TIFF, WebP) or one PDF ``document`` (alias ``pdf``), rendered
page by page with PDFium, either as JSON with base64 strings or as a ``multipart/form-data`` upload (the
way ``curl -F file=@page.png -F model=NAME`` sends files): file parts named ``file``/``files``/``image``/
``images`` are images, or the document when they are a PDF; ``document``/``pdf`` parts are the document;
``model``, ``languages`` and ``return_boxes`` are form fields. Both shapes meet the same limits with the
same errors. Decoding runs on a worker thread and recognition on the engine thread, so the event loop only
moves bytes; pages of concurrent requests share batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import AliasChoices, ConfigDict, Field

from universal_predictors.base import UniversalPredictor
from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.catalog import Backend, Route, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.decode_budget import DecodeBudget
from universal_predictors.errors import InvalidRequest, RequestTooLarge
from universal_predictors.http import (
    FormPart,
    is_multipart_form,
    parse_form,
    parse_json,
)
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
from universal_predictors.ocr.layout import Line, assemble
from universal_predictors.ocr.pages import (
    OCR_BYTES_PER_PIXEL,
    Limits,
    Page,
    PdfRenderers,
    PixelBudget,
    decode_base64,
    decode_document,
    decode_image_bytes,
    image_pages,
    is_pdf,
)


class OcrEngineArgs(OcrOptions, PageLimitArgs):
    """Engine arguments of the OCR predictor (``--engine-arg key=value``)."""

    model_config = ConfigDict(extra="forbid")

    # Batching: pages from concurrent requests share a trip to the engine thread.
    max_batch_size: int = Field(default=8, ge=1, le=256)
    max_wait_ms: float = Field(default=2.0, ge=0, le=1000)
    # Limits (PageLimitArgs'), and the ocr task's own: images per request, pixels of them all.
    max_images: int = Field(default=16, ge=1, description="Entries of images[] in one request.")
    max_total_pixels: int = Field(
        default=100_000_000, ge=10_000, description="Pixels of all images, frames and pages of one request."
    )
    # The engines' reading options (languages, threads, max_side, text_score, psm, timeout_s, tesseract_cmd) are
    # OcrOptions', shared with the document task; these are the ocr task's own.
    use_angle_cls: bool = True
    workers: int = Field(default=0, ge=0, le=64, description="Tesseract processes at once (0: one per core).")
    max_skew: float = Field(default=15.0, ge=0, le=45, description="Deskew search range in degrees (0: off).")

    def limits(self, max_total_pixels: int | None = None) -> Limits:
        return super().limits(self.max_total_pixels if max_total_pixels is None else max_total_pixels)


class OcrRequest(SplitLanguages):
    """``POST /v1/ocr``; unknown extension fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    images: list[str] | None = Field(default=None, description="Base64 PNG, JPEG, TIFF or WebP images.")
    document: str | None = Field(
        default=None, validation_alias=AliasChoices("document", "pdf"), description="A base64 PDF."
    )
    languages: list[str] | None = Field(default=None, description="Language codes ('eng', 'en', 'deu', ...).")
    return_boxes: bool = False

    def inputs(self) -> OcrInputs:
        images: list[tuple[str, str | bytes]] | None = None
        if self.images is not None:
            images = [(f"images[{i}]", value) for i, value in enumerate(self.images)]
        document = ("document", self.document) if self.document is not None else None
        return OcrInputs(images, document, self.languages, self.return_boxes)


@dataclass(frozen=True)
class OcrInputs:
    """What one OCR request asks, from JSON (base64 text) or a form upload (bytes): each input with the
    field it came in, which errors name."""

    images: list[tuple[str, str | bytes]] | None
    document: tuple[str, str | bytes] | None
    languages: list[str] | None = None
    return_boxes: bool = False


#: Form file fields that hold images (or the document, when the file is a PDF); DOCUMENT_FIELDS the document.
IMAGE_FIELDS = frozenset({"file", "files", "image", "images"})
#: Form fields validated as the JSON request's; a field given twice keeps a list only for these.
_LIST_FIELDS = frozenset({"languages"})


def form_request(parts: list[FormPart]) -> tuple[str | None, OcrInputs]:
    """The model and inputs of a ``multipart/form-data`` OCR request; a 400 names any field that is wrong."""
    options, files = split_form(parts, IMAGE_FIELDS | DOCUMENT_FIELDS, "an OCR upload sends its files",
                                list_fields=_LIST_FIELDS)  # fmt: skip
    body = validated(OcrRequest, options)
    counts: dict[str, int] = {}
    for part in files:
        counts[part.name] = counts.get(part.name, 0) + 1
    seen: dict[str, int] = {}
    images: list[tuple[str, str | bytes]] = []
    documents: list[tuple[str, str | bytes]] = []
    for part in files:
        # Errors name the field as sent: ``file``, or ``images[2]`` when the field is repeated.
        index = seen[part.name] = seen.get(part.name, -1) + 1
        page = PageInput.from_part(part, f"{part.name}[{index}]" if counts[part.name] > 1 else part.name)
        (documents if page.document else images).append((page.field, page.value))
    if len(documents) > 1:
        raise InvalidRequest(f"{documents[1][0]}: send one PDF per request", param=documents[1][0])
    if documents and images:
        raise InvalidRequest(f"{documents[0][0]}: send either images or a PDF document, not both",
                             param=documents[0][0])  # fmt: skip
    inputs = OcrInputs(images or None, documents[0] if documents else None, body.languages, body.return_boxes)
    return body.model, inputs


@dataclass(frozen=True)
class Read:
    """A page read: where it came from, its size, its lines (its image already released)."""

    index: int
    page: int | None
    size: tuple[int, int]
    lines: list[Line]


class OcrPredictor(UniversalPredictor):
    """One OCR engine; every page of every request goes through one micro-batcher."""

    task = Task.OCR
    EngineArgs = OcrEngineArgs

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__(config)
        # A source the engine cannot use stops the process with one line, before the server starts.
        if config.backend is Backend.TESSERACT:
            from universal_predictors.ocr.tesseract import check_source

            check_source(config.source, self.engine_args.tesseract_cmd)
        else:
            from universal_predictors.ocr.rapid import model_files

            model_files(config.source)

    def load(self) -> bool:
        from PIL import Image

        args: OcrEngineArgs = self.engine_args
        languages = language_codes(args.languages) if args.languages else None
        engine: OcrEngine
        if self.config.backend is Backend.TESSERACT:
            from universal_predictors.ocr.tesseract import TesseractEngine

            engine = TesseractEngine(
                self.config.source,
                languages=languages,
                workers=args.workers,
                psm=args.psm,
                timeout_s=args.timeout_s,
                max_skew=args.max_skew,
                command=args.tesseract_cmd,
            )
            self.default_languages: list[str] = engine.default_languages
            self.backend = Backend.TESSERACT
        else:
            from universal_predictors.ocr.rapid import RapidOcrEngine

            engine = RapidOcrEngine(
                self.config.source,
                languages=languages,
                threads=args.threads,
                max_side=args.max_side,
                use_angle_cls=args.use_angle_cls,
                text_score=args.text_score,
            )
            self.default_languages = engine.languages()
            self.backend = Backend.RAPIDOCR
        # Pillow's own bomb check follows ours, so its warnings never fire for images we accept.
        Image.MAX_IMAGE_PIXELS = args.max_pixels
        self.ocr = engine
        self.limits = args.limits()
        self.renderers = PdfRenderers(args.pdf_workers, args.max_render_memory_mb)
        self.decode_budget = DecodeBudget(args.decode_budget_mb * 2**20, args.decode_wait_s,
                                          largest_bytes=2 * args.max_pixels * OCR_BYTES_PER_PIXEL)  # fmt: skip
        self.batcher: MicroBatcher[Job, list[Line]] = MicroBatcher(
            engine.recognise_batch,
            model_name=self.name,
            policy=BatchPolicy(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms),
            # Bigger pages last in a batch: small ones are not held up behind them.
            cost=lambda job: job.image.width * job.image.height,
        )
        return True

    def unload(self) -> None:
        if hasattr(self, "ocr"):
            self.ocr.close()
            del self.ocr

    def describe(self) -> dict[str, Any]:
        if not hasattr(self, "ocr"):
            return {}
        limits = self.limits
        return {
            "engine": self.ocr.name,
            "languages": self.ocr.languages(),
            "default_languages": self.default_languages,
            "limits": {
                "max_image_bytes": limits.max_image_bytes,
                "max_pixels": limits.max_pixels,
                "max_pages": limits.max_pages,
                "max_images": self.engine_args.max_images,
                "max_body_bytes": self.engine_args.max_body_bytes,
                "pdf_dpi": limits.pdf_dpi,
                "max_total_pixels": limits.max_total_pixels,
                "pdf_timeout_s": limits.pdf_timeout_s,
                "max_render_memory_mb": limits.max_render_memory_mb,
            },
            **self.ocr.describe(),
        }

    def _languages(self, requested: list[str] | None) -> tuple[str, ...]:
        return resolve_languages(requested, self.ocr.languages(), self.default_languages)

    async def recognise(self, pages: list[Page], languages: tuple[str, ...]) -> list[list[Line]]:
        return await self.batcher.submit_many([Job(page.image, languages, page.dpi) for page in pages])

    async def _input_pages(self, value: str | bytes, index: int, field: str, budget: PixelBudget, *,
                           document: bool | None) -> AsyncGenerator[Page, None]:  # fmt: skip
        """The pages of one input, decoded (or rendered) one at a time. ``document``: True for a PDF, False
        for an image, None to tell by the bytes (KServe instances)."""
        if document is None:
            assert isinstance(value, str)  # KServe instances: base64 text
            data = await asyncio.to_thread(decode_base64, value, field, self.limits.max_image_bytes)
            document = is_pdf(data)
            value_bytes: bytes | None = data
        else:
            value_bytes = None
        if document:
            if value_bytes is None:
                value_bytes = await asyncio.to_thread(decode_document, value, field, self.limits)
            async for page in self.renderers.pages(value_bytes, index, field, self.limits, budget,
                                                   run=self.decode_budget.run):  # fmt: skip
                yield page
            return
        data = (
            value_bytes
            if value_bytes is not None
            else await asyncio.to_thread(decode_image_bytes, value, field, self.limits)
        )
        frames = await asyncio.to_thread(image_pages, data, index, field, self.limits, budget)
        async for page in self._decoded(frames):
            yield page

    async def _read_pages(self, sources: list[AsyncGenerator[Page, None]], languages: tuple[str, ...]
                          ) -> list[Read]:  # fmt: skip
        """Recognise pages as they are decoded, in windows of at most ``max_batch_size`` pages and about
        ``max_pixels`` pixels: a window's images are released once read, so a request never holds all its
        decoded pages at once."""
        args: OcrEngineArgs = self.engine_args
        out: list[Read] = []
        window: list[Page] = []
        pixels = 0

        async def flush() -> None:
            nonlocal window, pixels
            lines = await self.recognise(window, languages)
            out.extend(
                Read(page.index, page.page, page.image.size, found) for page, found in zip(window, lines, strict=True)
            )
            window, pixels = [], 0  # the window's images go with it

        try:
            for source in sources:
                async for page in source:
                    window.append(page)
                    pixels += page.image.width * page.image.height
                    if len(window) >= args.max_batch_size or pixels >= self.limits.max_pixels:
                        await flush()
            if window:
                await flush()
        finally:  # however this ends (an error, cancelled): a PDF render process stops now, not at GC
            for source in sources:
                await source.aclose()
        return out

    async def _decoded(self, pages: Iterator[Page]) -> AsyncGenerator[Page, None]:
        """Iterate a blocking page iterator (decoding) on the decode budget's threads, one page at a time."""
        while (page := await self.decode_budget.run(next, pages, None)) is not None:
            yield page

    def _decode_cost(self, budget: PixelBudget, *, pdf: bool) -> int:
        """What a request holds at once while its pages are read, in bytes: at most a window (about
        ``max_pixels``) plus the page being decoded, at :data:`OCR_BYTES_PER_PIXEL`. For images, no more than
        their headers add up to (counted before any is decoded); a PDF's pages are sized as they render, so it
        reserves the window's worth, within the budget (PDFs then take turns, never a 413 for that)."""
        window = 2 * self.limits.max_pixels
        pixels = window if pdf else min(window, budget.limit - budget.left)
        cost = pixels * OCR_BYTES_PER_PIXEL
        return min(cost, self.decode_budget.total) if pdf else cost

    @staticmethod
    def _result(read: Read, return_boxes: bool) -> dict[str, Any]:
        text, confidence, ordered = assemble(read.lines)
        item: dict[str, Any] = {"index": read.index}
        if read.page is not None:
            item["page"] = read.page
        item["text"] = text
        item["confidence"] = round(confidence, 4)
        if return_boxes:
            item["width"], item["height"] = read.size
            item["boxes"] = [line.as_json() for line in ordered]
        return item

    async def ocr_request(self, body: OcrInputs, request: Request | None = None) -> dict[str, Any]:
        args: OcrEngineArgs = self.engine_args
        if body.images is None and body.document is None:
            raise InvalidRequest(
                "images: send images (base64 images, or files uploaded in the form field 'file') or document (a PDF)",
                param="images",
            )
        if body.images is not None and body.document is not None:
            raise InvalidRequest("document: send either images or document, not both", param="document")
        if body.images is not None and not body.images:
            raise InvalidRequest("images: must not be empty", param="images")
        if body.images is not None and len(body.images) > args.max_images:
            raise RequestTooLarge(
                f"images: the request has {len(body.images)} images; the limit max_images is {args.max_images}",
                param="images",
                code="too_many_images",
            )
        languages = self._languages(body.languages)
        budget = PixelBudget(self.limits)
        sources: list[AsyncGenerator[Page, None]] = []
        if body.document is not None:
            field, value = body.document
            sources.append(self._input_pages(value, 0, field, budget, document=True))
        else:
            # Every image's headers are checked against the budget before the first is decoded.
            for index, (field, value) in enumerate(body.images or []):
                raw = await asyncio.to_thread(decode_image_bytes, value, field, self.limits)
                frames = await asyncio.to_thread(image_pages, raw, index, field, self.limits, budget)
                sources.append(self._decoded(frames))
        field = body.document[0] if body.document is not None else "images"
        async with self.decode_budget.reserve(self._decode_cost(budget, pdf=body.document is not None), field):
            read = await self._read_pages(sources, languages)
        data = [self._result(item, body.return_boxes) for item in read]
        return {
            "object": "list",
            "model": self.name,
            "data": data,
            "usage": {"images": len(body.images or []) or 1, "pages": len(read)},
        }

    async def infer(self, instances: list[Any]) -> list[Any]:
        """KServe v1/v2: each instance a base64 image or PDF -> {text, confidence[, pages]}."""
        if len(instances) > self.engine_args.max_images:
            raise RequestTooLarge(
                f"instances: {len(instances)} inputs; the limit max_images is {self.engine_args.max_images}",
                param="instances",
            )
        for position, value in enumerate(instances):
            if not isinstance(value, str):
                field = f"instances[{position}]"
                raise InvalidRequest(f"{field}: must be a base64 image or PDF string", param=field)
        budget = PixelBudget(self.limits)
        sources = [
            self._input_pages(value, i, f"instances[{i}]", budget, document=None) for i, value in enumerate(instances)
        ]
        async with self.decode_budget.reserve(self._decode_cost(budget, pdf=True), "instances"):
            read = await self._read_pages(sources, tuple(self.default_languages))
        outputs: list[Any] = []
        for position in range(len(instances)):
            items = [self._result(item, False) for item in read if item.index == position]
            if len(items) == 1 and items[0].get("page") is None:
                outputs.append({"text": items[0]["text"], "confidence": items[0]["confidence"]})
            else:
                text = "\n\f\n".join(item["text"] for item in items)  # form feed between pages, as Tesseract
                confidence = sum(item["confidence"] for item in items) / len(items)
                outputs.append({"text": text, "confidence": round(confidence, 4), "pages": items})
        return outputs

    # A client that leaves stops its request: decoding, a PDF render process, queued pages.
    stop_on_disconnect = True

    async def read_request(self, route: Route, request: Request) -> tuple[str | None, OcrInputs]:
        """JSON (base64 images or a PDF) or a ``multipart/form-data`` upload, to the same inputs."""
        limit = self.engine_args.max_body_bytes
        if is_multipart_form(request):
            return form_request(await parse_form(request, limit))
        body = await parse_json(request, OcrRequest, limit)
        return body.model, body.inputs()
