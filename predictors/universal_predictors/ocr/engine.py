"""What the OCR predictor needs from an engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from universal_predictors.errors import InvalidRequest
from universal_predictors.ocr.layout import Line

#: ISO 639-1 codes and common spellings to Tesseract's traineddata names (RapidOCR maps them on).
LANGUAGE_ALIASES = {
    "en": "eng", "english": "eng", "de": "deu", "german": "deu", "fr": "fra", "french": "fra", "es": "spa",
    "spanish": "spa", "it": "ita", "pt": "por", "nl": "nld", "pl": "pol", "ru": "rus", "ja": "jpn", "ko": "kor",
    "zh": "chi_sim", "ch": "chi_sim", "zh-cn": "chi_sim", "zh-hans": "chi_sim", "zh-tw": "chi_tra",
    "zh-hant": "chi_tra", "ar": "ara", "hi": "hin", "tr": "tur", "uk": "ukr", "sv": "swe", "da": "dan",
    "fi": "fin", "no": "nor", "cs": "ces", "el": "ell", "he": "heb",
}  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One page for the engine thread: the image, the languages asked for, its resolution if known."""

    image: Image.Image
    languages: tuple[str, ...]
    dpi: int | None


class OcrEngine(Protocol):
    name: str

    def languages(self) -> list[str]:
        """The languages this engine can read, in the codes a request uses."""
        ...

    def recognise_batch(self, jobs: Sequence[Job]) -> list[list[Line]]:
        """Recognise each page (blocking; runs on the engine thread)."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def resolve_languages(
    requested: Sequence[str] | None, installed: Sequence[str], default: Sequence[str]
) -> tuple[str, ...]:
    """Requested language codes as installed names; 400 naming the installed ones for anything else."""
    if not requested:
        return tuple(default)
    resolved = []
    for position, code in enumerate(requested):
        key = code.strip().lower()
        name = key if key in installed else LANGUAGE_ALIASES.get(key, key)
        if name not in installed:
            raise InvalidRequest(
                f"languages[{position}]: {code!r} is not installed; installed: {', '.join(installed)}",
                param=f"languages[{position}]",
                code="unsupported_language",
            )
        if name not in resolved:
            resolved.append(name)
    return tuple(resolved)


class OcrOptions(BaseModel):
    """How the OCR engines read: the ocr task's engine arguments of these names, and the document task's
    with an ``ocr_`` prefix (``tesseract_cmd`` as it is), nested there as ``ocr``."""

    model_config = ConfigDict(extra="forbid")

    # Languages: tesseract's default when a request names none; for rapidocr, what custom models read.
    languages: str | None = None
    # rapidocr
    threads: int = Field(default=-1, ge=-1, le=256, description="ONNX Runtime intra-op threads (-1: all cores).")
    max_side: int = Field(default=2000, ge=256, le=8192, description="Longest side detection works at.")
    text_score: float = Field(default=0.5, ge=0, le=1, description="Drop lines recognised below this score.")
    # tesseract
    psm: int = Field(default=3, ge=0, le=13, description="Tesseract page segmentation mode.")
    timeout_s: float = Field(default=120.0, gt=0, description="Longest one Tesseract page may take.")
    tesseract_cmd: str = "tesseract"
