"""A page's words and boxes: from the OCR engines or from the request, in pixels and LayoutLM's 0-1000 grid."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from universal_predictors.errors import InvalidRequest
from universal_predictors.ocr.layout import Line, page_words

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


def from_lines(lines: Sequence[Line], width: int, height: int) -> PageWords:
    """The OCR engine's lines split into words (see :func:`universal_predictors.ocr.layout.split_words`)."""
    found = page_words(lines)
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
