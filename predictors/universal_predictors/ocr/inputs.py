"""Pages as requests send them, for the tasks that read pages (ocr, document).

Both take a page (or pages) as base64 in JSON or as a ``multipart/form-data`` upload, whose other fields are
read and validated as the JSON request's fields, with the same errors. What they share lives here: the
language codes (``languages: "eng+deu"`` or a list), the form split into options and files (an unknown file
field, or a field given twice, is a 400 naming it), and :class:`PageInput`, one page's source with the field
it came in, and :class:`PageLimitArgs`, the engine arguments that bound what the pages may cost. Decoding
them within those limits is :mod:`universal_predictors.ocr.pages`'.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from universal_predictors.errors import InvalidRequest
from universal_predictors.http import FormPart, loads_json, validation_error
from universal_predictors.ocr.pages import Limits, is_pdf

#: Form fields that hold a PDF (file or base64 text), in both tasks.
DOCUMENT_FIELDS = frozenset({"document", "pdf"})

M = TypeVar("M", bound=BaseModel)


def language_codes(value: str) -> list[str]:
    """``"eng+deu"`` or ``"eng, deu"`` as ``["eng", "deu"]``."""
    return [code.strip() for code in value.replace("+", ",").split(",") if code.strip()]


class SplitLanguages(BaseModel):
    """A request model whose ``languages`` field also takes one string of codes (:func:`language_codes`)."""

    @field_validator("languages", mode="before", check_fields=False)
    @classmethod
    def _split(cls, value: Any) -> Any:
        return language_codes(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class PageInput:
    """Where a page is: the field it came in (which errors name), base64 text or uploaded bytes, and whether
    it is a PDF."""

    field: str
    value: str | bytes
    document: bool

    @classmethod
    def from_part(cls, part: FormPart, label: str | None = None) -> PageInput:
        """An uploaded file (a PDF by its field or its bytes), or a text part holding base64 as in JSON."""
        value: str | bytes = part.data if part.is_file else part.text()
        document = part.name in DOCUMENT_FIELDS or (part.is_file and is_pdf(part.data))
        return cls(label or part.name, value, document)


def split_form(
    parts: list[FormPart],
    file_fields: Collection[str],
    unknown_file: str,
    *,
    list_fields: Collection[str] = (),
    json_fields: Collection[str] = (),
) -> tuple[dict[str, Any], list[FormPart]]:
    """A form's options (to validate as the JSON request) and its file parts, in order. ``unknown_file`` says
    what the upload takes (``"an OCR upload sends its files"``); a file in another field is a 400 naming it."""
    options: dict[str, Any] = {}
    files: list[FormPart] = []
    for part in parts:
        if part.name in file_fields:
            files.append(part)
        elif part.is_file:
            raise InvalidRequest(f"{part.name}: {unknown_file} as one of {', '.join(sorted(file_fields))}",
                                 param=part.name)  # fmt: skip
        elif part.name in list_fields:
            options.setdefault(part.name, []).extend(language_codes(part.text()))
        elif part.name in options:
            raise InvalidRequest(f"{part.name}: the form field is given more than once", param=part.name)
        else:
            text = part.text()
            options[part.name] = loads_json(text, part.name, part.name) if part.name in json_fields else text
    return options, files


def validated(model: type[M], options: dict[str, Any]) -> M:
    """The form's options as ``model``, with the JSON request's validation and errors."""
    try:
        return model.model_validate(options)
    except ValidationError as exc:
        raise validation_error(exc) from None


class PageLimitArgs(BaseModel):
    """The engine arguments that bound what a request's pages may cost, each a 413 naming itself (the decode
    budget a 503 while it waits); both page tasks take them, with their own defaults where they differ."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=64 * 2**20, ge=1024, description="Bytes of the request body.")
    max_image_bytes: int = Field(default=20 * 2**20, ge=1024, description="Decoded bytes of one image or the PDF.")
    max_pixels: int = Field(default=40_000_000, ge=10_000, description="Pixels of one image, frame or PDF page.")
    max_pages: int = Field(default=32, ge=1, description="Pages of one PDF or frames of one TIFF.")
    pdf_dpi: int = Field(default=200, ge=50, le=600, description="Resolution PDF pages are rendered at.")
    pdf_timeout_s: float = Field(default=60.0, gt=0, description="Longest a PDF may take to render (a process).")
    pdf_workers: int = Field(default=2, ge=1, le=64, description="PDF render processes at once.")
    max_render_memory_mb: int = Field(
        default=1024, ge=64, le=1024 * 1024, description="Memory one PDF render process may add, in MiB."
    )
    decode_budget_mb: int = Field(
        default=1024, ge=16, le=1024 * 1024,
        description="Memory pages being decoded and read may take across concurrent requests, in MiB.",
    )  # fmt: skip
    decode_wait_s: float = Field(default=30.0, gt=0, le=3600, description="Longest a request waits for its share.")

    def limits(self, max_total_pixels: int | None = None) -> Limits:
        """The limits one request's pages are read within; ``max_total_pixels`` all its pages together
        (default: one page's ``max_pixels``)."""
        total = self.max_pixels if max_total_pixels is None else max_total_pixels
        return Limits(self.max_image_bytes, self.max_pixels, self.max_pages, self.pdf_dpi, total,
                      self.pdf_timeout_s, self.max_render_memory_mb)  # fmt: skip
