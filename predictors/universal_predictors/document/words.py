"""A page's words and boxes: from the OCR engines or from the request, in pixels and LayoutLM's 0-1000 grid."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from universal_predictors.errors import InvalidRequest
from universal_predictors.ocr.layout import Line, Word, reading_order, split_words

Box = tuple[float, float, float, float]
#: The grid LayoutLM models read boxes on: 0-1000 in both directions, whatever the page's size.
GRID = 1000


def normalise(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """A pixel box (x0, y0, x1, y1) on the 0-1000 grid, clamped to the page."""
    x0, y0, x1, y1 = box

    def on(value: float, size: int) -> int:
        return min(GRID, max(0, int(GRID * value / size)))

    return (on(x0, width), on(y0, height), on(x1, width), on(y1, height))


@dataclass(frozen=True)
class PageWords:
    """The words of one page in reading order, their pixel boxes and the page's size."""

    words: list[str]
    boxes: list[Box]
    width: int
    height: int
    confidences: list[float] | None = None  # from OCR; None when the request sent the words

    @property
    def normalised(self) -> list[tuple[int, int, int, int]]:
        return [normalise(box, self.width, self.height) for box in self.boxes]

    def as_json(self, indices: Sequence[int] | None = None) -> list[dict[str, object]]:
        """Words as the responses list them: text, pixel box, 0-1000 box (and OCR confidence)."""
        chosen = range(len(self.words)) if indices is None else indices
        normalised = self.normalised
        out: list[dict[str, object]] = []
        for i in chosen:
            item: dict[str, object] = {
                "index": i,
                "text": self.words[i],
                "box": [round(v, 1) for v in self.boxes[i]],
                "normalized_box": list(normalised[i]),
            }
            if self.confidences is not None:
                item["confidence"] = round(self.confidences[i], 4)
            out.append(item)
        return out

    def union_box(self, indices: Sequence[int]) -> Box:
        boxes = [self.boxes[i] for i in indices]
        return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes),
                max(b[3] for b in boxes))  # fmt: skip


#: The narrowest word gap, as a share of the line's height, and how much wider than the widest gap between
#: letters it must be: a line's gaps fall into the two groups when the jump between them is this large.
MIN_WORD_GAP = 0.2
GAP_JUMP = 1.5


def ink_segments(image: Image.Image, line: Line) -> list[tuple[float, float]] | None:
    """The horizontal extents of the words' ink in the line's box.

    The ink-free column runs between letters are narrow and those between words wide; the split is at the
    largest jump in the sorted run widths (at least ``GAP_JUMP`` times, and at least ``MIN_WORD_GAP`` of the
    line's height). For a roughly horizontal line only (a slanted one has no clean columns): None otherwise."""
    (_x0, y0), (_x1, y1), _, (_, y3) = line.box
    height = abs(y3 - y0)
    if height < 4 or abs(y1 - y0) > 0.25 * height:
        return None
    xs, ys = [p[0] for p in line.box], [p[1] for p in line.box]
    left, top = max(int(min(xs)), 0), max(int(min(ys)), 0)
    right, bottom = min(int(max(xs)) + 1, image.width), min(int(max(ys)) + 1, image.height)
    if right - left < 2 or bottom - top < 2:
        return None
    grey = np.asarray(image.crop((left, top, right, bottom)).convert("L"), dtype=np.int16)
    low, high = int(grey.min()), int(grey.max())
    if high - low < 40:
        return None
    middle = (low + high) / 2
    # The ink is the minority side of the threshold (dark text on light, or light on dark).
    ink = grey < middle if (grey < middle).mean() < 0.5 else grey >= middle
    columns = np.flatnonzero(ink.any(axis=0))
    if columns.size == 0:
        return None
    runs: list[tuple[int, int]] = []  # inked column runs [start, end)
    start = previous = int(columns[0])
    for x in columns[1:]:
        if x != previous + 1:
            runs.append((start, previous + 1))
            start = int(x)
        previous = int(x)
    runs.append((start, previous + 1))
    gaps = sorted(b[0] - a[1] for a, b in itertools.pairwise(runs))
    threshold: float | None = None
    if gaps:
        jumps = [(gaps[k] / max(gaps[k - 1], 1), gaps[k]) for k in range(1, len(gaps))
                 if gaps[k] >= MIN_WORD_GAP * height]  # fmt: skip
        best = max(jumps, default=(0.0, 0))
        if best[0] >= GAP_JUMP:
            threshold = best[1]
    segments: list[tuple[float, float]] = []
    for run in runs:
        if segments and (threshold is None or run[0] - segments[-1][1] + left < threshold):
            segments[-1] = (segments[-1][0], float(left + run[1]))
        else:
            segments.append((float(left + run[0]), float(left + run[1])))
    return segments


def _split_line(image: Image.Image | None, line: Line) -> list[Word]:
    """A line's words: split at its spaces, and (PP-OCR's recognisers often drop the spaces) where the
    characters' boxes fall into different runs of ink."""
    pieces = line.pieces
    if pieces is None or len(pieces) != len(line.text):
        return split_words(line)  # word boxes (Tesseract) or none
    segments = ink_segments(image, line) if image is not None else None
    if segments is None:
        return split_words(line)

    def segment_of(i: int) -> int:
        centre = sum(p[0] for p in pieces[i]) / len(pieces[i])
        return min(range(len(segments)), key=lambda k: max(segments[k][0] - centre, centre - segments[k][1], 0.0))

    (_, top), _, _, (_, bottom) = line.box
    words: list[Word] = []
    current: list[int] = []
    last_segment = -1

    def close() -> None:
        if current:
            text = "".join(line.text[i] for i in current)
            x0 = max(min(min(p[0] for p in pieces[i]) for i in current), segments[segment_of(current[0])][0])
            x1 = min(max(max(p[0] for p in pieces[i]) for i in current), segments[segment_of(current[-1])][1])
            if x1 <= x0:
                x0, x1 = segments[segment_of(current[0])][0], segments[segment_of(current[-1])][1]
            words.append(Word(text, line.confidence, (x0, min(top, bottom), x1, max(top, bottom))))
            current.clear()

    for i, char in enumerate(line.text):
        if char.isspace():
            close()
            last_segment = -1
            continue
        segment = segment_of(i)
        if current and segment != last_segment:
            close()
        current.append(i)
        last_segment = segment
    close()
    return words


def from_lines(lines: Sequence[Line], width: int, height: int, image: Image.Image | None = None) -> PageWords:
    """The OCR engine's lines split into words, in reading order; with the page's ``image``, RapidOCR's
    space-less lines are split where the ink has gaps (see :func:`_split_line`)."""
    found = [word for row in reading_order(lines) for line in row for word in _split_line(image, line)]
    return PageWords([w.text for w in found], [w.box for w in found], width, height, [w.confidence for w in found])


def from_request(words: list[str], boxes: list[list[float]] | None, width: int, height: int) -> PageWords:
    """Words the client read itself, with one pixel box (x0, y0, x1, y1) each; 400 naming what is wrong."""
    if boxes is None:
        raise InvalidRequest("boxes: words need their boxes, one [x0, y0, x1, y1] in pixels per word", param="boxes")
    if len(boxes) != len(words):
        raise InvalidRequest(f"boxes: {len(boxes)} boxes for {len(words)} words; send one box per word",
                             param="boxes")  # fmt: skip
    checked: list[Box] = []
    for i, (word, box) in enumerate(zip(words, boxes, strict=True)):
        if not word.strip():
            raise InvalidRequest(f"words[{i}]: is empty", param=f"words[{i}]")
        if len(box) != 4:
            raise InvalidRequest(f"boxes[{i}]: a box is [x0, y0, x1, y1] (4 numbers), got {len(box)}",
                                 param=f"boxes[{i}]")  # fmt: skip
        x0, y0, x1, y1 = (float(v) for v in box)
        if not (0 <= x0 <= x1 <= width and 0 <= y0 <= y1 <= height):
            raise InvalidRequest(
                f"boxes[{i}]: {box} is not a box on the {width}x{height} page (0 <= x0 <= x1 <= width, "
                f"0 <= y0 <= y1 <= height, in pixels)",
                param=f"boxes[{i}]",
            )
        checked.append((x0, y0, x1, y1))
    return PageWords(list(words), checked, width, height)
