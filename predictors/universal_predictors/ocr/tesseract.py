"""Tesseract (Debian's ``tesseract-ocr``), driven as a subprocess: one process per page, several at once.

``--source=builtin`` (or ``system``) reads the system's tessdata; any other source is a directory of
``*.traineddata`` files passed as ``--tessdata-dir``. Tesseract's layout analysis gives up on text
skewed by more than a few degrees, so pages are deskewed first (projection-profile estimate, within
``max_skew`` degrees) and the boxes are mapped back onto the page as sent.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import math
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from universal_predictors.base import StartupError
from universal_predictors.ocr.engine import Job
from universal_predictors.ocr.layout import Line, Point

BUILTIN_SOURCES = ("builtin", "system", "tesseract")
#: Tessdata entries that are not languages (orientation/script detection, equations).
_NOT_LANGUAGES = {"osd", "equ"}


class TesseractError(RuntimeError):
    """Tesseract failed on a page that passed every input check (logged; the client gets a 500)."""


def _otsu(values: np.ndarray) -> float:
    histogram = np.bincount(values.ravel(), minlength=256).astype(np.float64)
    total = histogram.sum()
    levels = np.arange(256)
    weight = np.cumsum(histogram)
    mean = np.cumsum(histogram * levels)
    between = (mean[-1] * weight - mean * total) ** 2 / np.maximum(weight * (total - weight), 1e-9)
    return float(np.argmax(between))


def estimate_skew(image: Image.Image, max_angle: float) -> float:
    """The rotation (degrees, counter-clockwise) that makes text rows horizontal: the angle whose
    horizontal projection of the ink is sharpest, coarse steps then fine."""
    grey = image.convert("L")
    grey.thumbnail((1000, 1000))
    values = np.asarray(grey)
    threshold = _otsu(values)
    ink = values < threshold if values.mean() > threshold else values > threshold
    if ink.mean() < 0.001:
        return 0.0
    mask = Image.fromarray((ink * 255).astype(np.uint8))

    def sharpness(angle: float) -> float:
        rows = np.asarray(mask.rotate(angle, expand=True), dtype=np.float64).sum(axis=1)
        return float(np.sum(np.diff(rows) ** 2))

    coarse = max(np.arange(-max_angle, max_angle + 0.01, 1.0), key=sharpness)
    fine = max(np.arange(coarse - 1.0, coarse + 1.01, 0.1), key=sharpness)
    return round(float(fine), 2)


def _unrotate(point: Point, angle: float, rotated: tuple[int, int], original: tuple[int, int]) -> Point:
    """Map a point of ``image.rotate(angle, expand=True)`` back onto ``image``."""
    radians = math.radians(angle)
    cos, sin = math.cos(radians), math.sin(radians)
    dx, dy = point[0] - rotated[0] / 2, point[1] - rotated[1] / 2
    return (original[0] / 2 + dx * cos - dy * sin, original[1] / 2 + dx * sin + dy * cos)


def _border_colour(image: Image.Image) -> tuple[int, ...]:
    values = np.asarray(image)
    edges = np.concatenate([values[0], values[-1], values[:, 0], values[:, -1]])
    return tuple(int(v) for v in np.median(edges, axis=0))


Rect = tuple[int, int, int, int]


def parse_tsv(tsv: str) -> list[tuple[Rect, str, float, list[Rect]]]:
    """Tesseract's TSV as lines: (left, top, width, height), text, confidence in [0, 1], the words' rects."""
    lines: dict[tuple[str, ...], dict[str, Any]] = {}
    for row in csv.DictReader(io.StringIO(tsv), delimiter="\t", quoting=csv.QUOTE_NONE):
        key = (row["page_num"], row["block_num"], row["par_num"], row["line_num"])
        if row["level"] == "4":
            box = (int(row["left"]), int(row["top"]), int(row["width"]), int(row["height"]))
            lines[key] = {"box": box, "words": [], "conf": [], "rects": []}
        elif row["level"] == "5" and key in lines and (row.get("text") or "").strip():
            lines[key]["words"].append(row["text"].strip())
            lines[key]["rects"].append((int(row["left"]), int(row["top"]), int(row["width"]), int(row["height"])))
            lines[key]["conf"].append(max(float(row["conf"]), 0.0) / 100)
    return [
        (line["box"], " ".join(line["words"]), sum(line["conf"]) / len(line["conf"]), line["rects"])
        for line in lines.values()
        if line["words"]
    ]


def check_source(source: str, command: str) -> tuple[str, str | None]:
    """The tesseract binary's path and the tessdata directory (None: the system's); StartupError otherwise."""
    binary = shutil.which(command)
    if binary is None:
        raise StartupError(f"the tesseract binary {command!r} is not on PATH (install Debian's tesseract-ocr)")
    if source.strip().lower() in BUILTIN_SOURCES:
        return binary, None
    directory = Path(source)
    if not directory.is_dir() or not any(directory.glob("*.traineddata")):
        raise StartupError(
            f"source {source!r} is neither a directory of *.traineddata files nor one of {', '.join(BUILTIN_SOURCES)}"
        )
    return binary, str(directory)


class TesseractEngine:
    """Tesseract processes, ``workers`` at a time (one thread each, so they do not fight for cores)."""

    name = "tesseract"

    def __init__(
        self,
        source: str,
        *,
        languages: Sequence[str] | None,
        workers: int,
        psm: int,
        timeout_s: float,
        max_skew: float,
        command: str,
    ) -> None:
        self.binary, self.tessdata = check_source(source, command)
        self.timeout_s = timeout_s
        self.installed = self._list_languages()
        if not self.installed:
            raise StartupError("tesseract has no languages installed (apt-get install tesseract-ocr-eng)")
        default = list(languages) if languages else (["eng"] if "eng" in self.installed else self.installed[:1])
        missing = [code for code in default if code not in self.installed]
        if missing:
            raise StartupError(
                f"engine arg languages: {', '.join(missing)} not installed ({', '.join(self.installed)})"
            )
        self.default_languages = default
        self.workers = workers or os.cpu_count() or 1
        self.psm = psm
        self.max_skew = max_skew
        self.version = self._run([self.binary, "--version"]).splitlines()[0]
        self.pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="tesseract")

    def _base(self) -> list[str]:
        return [self.binary, *(["--tessdata-dir", self.tessdata] if self.tessdata else [])]

    def _run(self, command: list[str], data: bytes | None = None) -> str:
        env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
        try:
            done = subprocess.run(
                command, input=data, capture_output=True, timeout=self.timeout_s if data else 30, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            raise TesseractError(f"tesseract took longer than {self.timeout_s}s") from None
        if done.returncode != 0:
            raise TesseractError(f"tesseract exited with {done.returncode}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode("utf-8", errors="replace")

    def _list_languages(self) -> list[str]:
        output = self._run([*self._base(), "--list-langs"])
        names = [line.strip() for line in output.splitlines()[1:] if line.strip()]
        return sorted(name for name in names if name not in _NOT_LANGUAGES)

    def languages(self) -> list[str]:
        return list(self.installed)

    def recognise(self, job: Job) -> list[Line]:
        image = job.image
        angle = estimate_skew(image, self.max_skew) if self.max_skew > 0 else 0.0
        upright = image
        if abs(angle) >= 0.3:
            upright = image.rotate(
                angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=_border_colour(image)
            )
        buffer = io.BytesIO()
        upright.save(buffer, "PPM")  # uncompressed: no time spent encoding
        command = [
            *self._base(),
            "stdin",
            "stdout",
            "-l",
            "+".join(job.languages or self.default_languages),
            "--psm",
            str(self.psm),
        ]
        if job.dpi:
            command += ["--dpi", str(job.dpi)]
        tsv = self._run([*command, "tsv"], buffer.getvalue())

        def on_page(rect: Rect) -> tuple[tuple[float, float], ...]:
            left, top, width, height = rect
            corners = ((left, top), (left + width, top), (left + width, top + height), (left, top + height))
            if upright is not image:
                return tuple(_unrotate(p, angle, upright.size, image.size) for p in corners)
            return tuple((float(x), float(y)) for x, y in corners)

        lines: list[Line] = []
        for rect, text, confidence, words in parse_tsv(tsv):
            # The words' boxes ride along as the line's pieces (the document task's words).
            pieces = tuple(on_page(word) for word in words)
            lines.append(Line(text, confidence, on_page(rect), pieces))  # type: ignore[arg-type]  # four corners
        return lines

    def recognise_batch(self, jobs: Sequence[Job]) -> list[list[Line]]:
        return list(self.pool.map(self.recognise, jobs))

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "workers": self.workers, "default_languages": self.default_languages}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
