"""Lines (text, confidence, quadrilateral) and their reading order: top-to-bottom, left-to-right.

Rows are formed in the text's own frame: the page's skew is estimated from the lines' top edges and
the centres are rotated back by it, so a slightly rotated line that an engine splits into pieces is
still one row, read left to right.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Point = tuple[float, float]


@dataclass
class Line:
    """One recognised line (or piece of one): its text, confidence in [0, 1] and four corners
    (top-left, top-right, bottom-right, bottom-left) in the image's pixel coordinates."""

    text: str
    confidence: float
    box: tuple[Point, Point, Point, Point]
    #: The boxes of the line's characters (RapidOCR, on request) or words (Tesseract), when the engine gives them.
    pieces: tuple[tuple[Point, ...], ...] | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "text": self.text,
            "confidence": round(self.confidence, 4),
            "box": [[round(x, 1), round(y, 1)] for x, y in self.box],
        }


def _skew(lines: Sequence[Line]) -> float:
    """The median angle (radians) of the top edges of lines wider than tall; 0 when there are none."""
    angles = []
    for line in lines:
        (x0, y0), (x1, y1), _, (x3, y3) = line.box
        width, height = math.hypot(x1 - x0, y1 - y0), math.hypot(x3 - x0, y3 - y0)
        if width > height > 0:
            angles.append(math.atan2(y1 - y0, x1 - x0))
    return statistics.median(angles) if angles else 0.0


def reading_order(lines: Sequence[Line]) -> list[list[Line]]:
    """Rows top to bottom, each row's pieces left to right."""
    if not lines:
        return []
    angle = _skew(lines)
    cos, sin = math.cos(angle), math.sin(angle)
    placed = []
    for line in lines:
        cx = sum(p[0] for p in line.box) / 4
        cy = sum(p[1] for p in line.box) / 4
        (x0, y0), _, _, (x3, y3) = line.box
        height = max(math.hypot(x3 - x0, y3 - y0), 1.0)
        # Coordinates along (u) and across (v) the text direction.
        placed.append((cx * cos + cy * sin, -cx * sin + cy * cos, height, line))
    placed.sort(key=lambda item: item[1])
    rows: list[list[tuple[float, float, float, Line]]] = []
    for item in placed:
        if rows:
            row = rows[-1]
            centre = sum(p[1] for p in row) / len(row)
            height = min(item[2], statistics.median(p[2] for p in row))
            # Same row when the centres are within half a line height of each other.
            if abs(item[1] - centre) < 0.5 * height:
                row.append(item)
                continue
        rows.append([item])
    return [[p[3] for p in sorted(row, key=lambda p: p[0])] for row in rows]


def assemble(lines: Sequence[Line]) -> tuple[str, float, list[Line]]:
    """The page's text (rows joined by newlines), its confidence (mean over characters) and the
    lines in reading order."""
    rows = reading_order(lines)
    ordered = [line for row in rows for line in row]
    row_texts = (" ".join(line.text.strip() for line in row if line.text.strip()) for row in rows)
    text = "\n".join(row for row in row_texts if row)
    characters = sum(len(line.text) for line in ordered)
    confidence = sum(line.confidence * len(line.text) for line in ordered) / characters if characters else 0.0
    return text.strip("\n"), confidence, ordered


@dataclass(frozen=True)
class Word:
    """One word of a line: its text, the line's confidence and an axis-aligned pixel box (x0, y0, x1, y1)."""

    text: str
    confidence: float
    box: tuple[float, float, float, float]


def _along(a: Point, b: Point, t: float) -> Point:
    return (a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t)


def _bounds(quads: Sequence[Sequence[Point]]) -> tuple[float, float, float, float]:
    xs = [p[0] for quad in quads for p in quad]
    ys = [p[1] for quad in quads for p in quad]
    return (min(xs), min(ys), max(xs), max(ys))


#: A gap between two characters' boxes wider than this share of the line's height separates words.
WORD_GAP = 0.3


def _split_by_pieces(line: Line) -> list[Word] | None:
    """Words from per-character boxes: split at whitespace and at gaps wider than ``WORD_GAP`` line heights
    (PP-OCR's recognisers often drop the spaces between words; the gaps stay)."""
    pieces = line.pieces
    if pieces is not None:
        tokens = list(re.finditer(r"\S+", line.text))
        if len(pieces) == len(tokens) != len(line.text):  # one box per word (Tesseract)
            return [Word(m.group(), line.confidence, _bounds([q])) for m, q in zip(tokens, pieces, strict=True)]
    if pieces is None or len(pieces) != len(line.text):
        return None
    (_, y0), _, _, (_, y3) = line.box
    gap = WORD_GAP * max(abs(y3 - y0), 1.0)
    words: list[Word] = []
    current: list[int] = []

    def close() -> None:
        if current:
            text = "".join(line.text[i] for i in current)
            words.append(Word(text, line.confidence, _bounds([pieces[i] for i in current])))
            current.clear()

    for i, char in enumerate(line.text):
        if char.isspace():
            close()
            continue
        if current:
            left = max(p[0] for p in pieces[current[-1]])
            right = min(p[0] for p in pieces[i])
            if right - left > gap:
                close()
        current.append(i)
    close()
    return words


def split_words(line: Line) -> list[Word]:
    """The line's words, each with an axis-aligned box.

    With one box per word (Tesseract's), those. With per-character boxes (RapidOCR), words are split at
    spaces and at wide gaps and boxed by their characters. Otherwise a word's box is the slice of the
    line's quadrilateral its characters take by count, what a monospaced estimate gives.
    """
    text = line.text
    if not text.strip():
        return []
    by_pieces = _split_by_pieces(line)
    if by_pieces is not None:
        return by_pieces
    tl, tr, br, bl = line.box
    total = len(text)
    words = []
    for match in re.finditer(r"\S+", text):
        start, end = match.start() / total, match.end() / total
        corners = [_along(tl, tr, start), _along(tl, tr, end), _along(bl, br, end), _along(bl, br, start)]
        xs, ys = [p[0] for p in corners], [p[1] for p in corners]
        words.append(Word(match.group(), line.confidence, (min(xs), min(ys), max(xs), max(ys))))
    return words


def page_words(lines: Sequence[Line]) -> list[Word]:
    """Every word of the page in reading order (rows top to bottom, left to right)."""
    return [word for row in reading_order(lines) for line in row for word in split_words(line)]
