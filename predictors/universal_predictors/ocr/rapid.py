"""RapidOCR: PP-OCR detection, direction and recognition models on ONNX Runtime.

``--source=builtin`` uses the models the ``rapidocr-onnxruntime`` wheel ships (PP-OCRv4, Chinese and
English). Any other source is a directory of custom ONNX models: exactly one ``*det*.onnx`` and one
``*rec*.onnx``, optionally a ``*cls*.onnx`` (the packaged one otherwise) and a ``*.txt`` character list
(for recognition models that do not carry theirs in their metadata).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from universal_predictors.base import StartupError
from universal_predictors.ocr.engine import Job
from universal_predictors.ocr.layout import Line

#: ``--source`` values that mean "the models inside the package".
BUILTIN_SOURCES = ("builtin", "packaged", "rapidocr")
#: What the packaged PP-OCRv4 recogniser reads.
BUILTIN_LANGUAGES = ("eng", "chi_sim")
#: PP-OCR recognition model name prefixes and the languages (Tesseract's codes) they read.
_PPOCR_PREFIXES = {
    "ch": BUILTIN_LANGUAGES, "en": ("eng",), "japan": ("jpn", "eng"), "korean": ("kor", "eng"),
    "chinese": BUILTIN_LANGUAGES, "cyrillic": ("rus", "ukr", "eng"),
    "latin": ("eng", "fra", "deu", "spa", "ita", "por"),
    "arabic": ("ara",), "devanagari": ("hin",), "ta": ("tam",), "te": ("tel",), "ka": ("kan",),
}  # fmt: skip


def _one(directory: Path, pattern: str, required: bool) -> Path | None:
    found = sorted(directory.glob(pattern))
    if len(found) > 1:
        raise StartupError(f"source {directory} has several {pattern} files ({', '.join(p.name for p in found)})")
    if not found and required:
        raise StartupError(f"source {directory} has no {pattern} file (or use --source=builtin)")
    return found[0] if found else None


def packaged_models() -> Path:
    import rapidocr_onnxruntime

    return Path(rapidocr_onnxruntime.__file__).parent / "models"


def model_files(source: str) -> dict[str, str]:
    """RapidOCR keyword arguments naming the model files; empty for the packaged models.

    Called on the main thread before the server starts (the predictors' ``__init__``), it also imports RapidOCR, and
    with it OpenCV, there: OpenCV's loader (cv2/__init__.py, ``bootstrap``) takes ``cv2`` out of ``sys.modules``
    while it loads the native module, so a second thread importing cv2 in that window runs a second bootstrap and
    the first fails (KeyError 'cv2.mat_wrapper', seen once in CI while ``load`` imported it on a worker thread).
    """
    import rapidocr_onnxruntime  # noqa: F401  (see above: OpenCV imported once, on this thread)

    if source.strip().lower() in BUILTIN_SOURCES:
        return {}
    directory = Path(source)
    if directory.is_dir() and directory.resolve() == packaged_models().resolve():
        return {}  # package://rapidocr_onnxruntime/models
    if not directory.is_dir():
        raise StartupError(
            f"source {source!r} is neither a directory of ONNX models nor one of {', '.join(BUILTIN_SOURCES)}"
        )
    files = {
        "det_model_path": _one(directory, "*det*.onnx", True),
        "rec_model_path": _one(directory, "*rec*.onnx", True),
        "cls_model_path": _one(directory, "*cls*.onnx", False),
        "rec_keys_path": _one(directory, "*.txt", False),
    }
    return {key: str(path) for key, path in files.items() if path is not None}


class RapidOcrEngine:
    """One RapidOCR instance; pages are recognised one after another on the engine thread."""

    name = "rapidocr"

    def __init__(
        self,
        source: str,
        *,
        languages: Sequence[str] | None,
        threads: int,
        max_side: int,
        use_angle_cls: bool,
        text_score: float,
        word_boxes: bool = False,
    ) -> None:
        from rapidocr_onnxruntime import RapidOCR

        self.files = model_files(source)
        self._languages = list(languages or self._model_languages())
        self.settings: dict[str, Any] = {
            # The package's default ("min" side 736) blows a 700x100 line up to 5000x736: slow, and it
            # splits the line. Bounding the longer side keeps small images as they are.
            "det_limit_type": "max",
            "det_limit_side_len": max_side,
            "max_side_len": max_side,
            "use_cls": use_angle_cls,
            "text_score": text_score,
            "intra_op_num_threads": threads,
        }
        self.ocr = RapidOCR(**self.settings, **self.files)
        #: Also box each character (what the document task splits lines into words with).
        self.word_boxes = word_boxes

    def _model_languages(self) -> tuple[str, ...]:
        """What the recogniser reads, from PP-OCR's file naming (``ch_PP-OCRv4_rec``, ``en_...``);
        a custom model named otherwise declares its languages with ``--engine-arg languages=...``."""
        rec = self.files.get("rec_model_path")
        if rec is None:
            return BUILTIN_LANGUAGES
        prefix = Path(rec).name.split("_")[0].lower()
        return _PPOCR_PREFIXES.get(prefix, ("eng",))

    def languages(self) -> list[str]:
        return list(self._languages)

    def recognise(self, job: Job) -> list[Line]:
        import cv2  # imported with RapidOCR by model_files, on the main thread

        # One copy of the page, its channels swapped in place (PP-OCR reads BGR): a 36-megapixel page is 103 MiB
        # a copy, and a second one was what a page held at its peak beyond this (decode_budget's accounting).
        bgr = np.array(job.image)
        cv2.cvtColor(bgr, cv2.COLOR_RGB2BGR, dst=bgr)
        if self.word_boxes:
            # Keyword arguments reset the post-processing settings: pass the configured ones along.
            result, _elapsed = self.ocr(bgr, return_word_box=True, text_score=self.settings["text_score"],
                                        box_thresh=0.5, unclip_ratio=1.6)  # fmt: skip
        else:
            result, _elapsed = self.ocr(bgr)
        lines = []
        for row in result or []:
            box, text, score = row[:3]
            corners = tuple((float(x), float(y)) for x, y in box)
            pieces = None
            if self.word_boxes and len(row) > 3 and row[3]:
                pieces = tuple(tuple((float(x), float(y)) for x, y in quad) for quad in row[3])
            lines.append(Line(str(text), float(score), corners, pieces))  # type: ignore[arg-type]  # 4 corners
        return lines

    def recognise_batch(self, jobs: Sequence[Job]) -> list[list[Line]]:
        # PP-OCR pipelines are per image (detection output sizes differ); a batch is a loop.
        return [self.recognise(job) for job in jobs]

    def describe(self) -> dict[str, Any]:
        models = {key: Path(path).name for key, path in self.files.items()} or {
            "det_model_path": "ch_PP-OCRv4_det_infer.onnx (packaged)",
            "rec_model_path": "ch_PP-OCRv4_rec_infer.onnx (packaged)",
            "cls_model_path": "ch_ppocr_mobile_v2.0_cls_infer.onnx (packaged)",
        }
        return {"models": models, "max_side": self.settings["det_limit_side_len"]}

    def close(self) -> None:
        del self.ocr
