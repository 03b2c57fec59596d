"""Images and PDFs with known text, rendered with Pillow for the OCR tests and the OCR bench.

Fonts are the TrueType files installed on the machine (Debian's DejaVu family here), plus Pillow's
own default font at a large size, so the samples need nothing from the network.
"""

from __future__ import annotations

import base64
import difflib
import io
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

#: The similarity (difflib ratio of lower-cased text with all whitespace removed) a reading must reach.
SIMILARITY_THRESHOLD = 0.9

FontType = ImageFont.FreeTypeFont | ImageFont.ImageFont

_FONT_DIRS = (Path("/usr/share/fonts"), Path("/usr/local/share/fonts"))
#: Preferred faces, by file name; whatever of them is installed is used.
_PREFERRED = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf",
              "LiberationSans-Regular.ttf", "LiberationSerif-Regular.ttf")  # fmt: skip


def installed_fonts() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in _FONT_DIRS:
        if root.is_dir():
            for path in sorted(root.rglob("*.ttf")):
                found.setdefault(path.name, path)
    return {name: found[name] for name in _PREFERRED if name in found}


def font(name: str | None, size: int) -> FontType:
    """An installed TrueType face at ``size`` px, or Pillow's default font (FreeType) when ``name`` is None."""
    if name is None:
        return ImageFont.load_default(size=size)
    return ImageFont.truetype(str(installed_fonts()[name]), size)


def render(lines: list[str], face: FontType, *, angle: float = 0.0, pad: int = 30) -> Image.Image:
    """Black text on white, one line per entry, then rotated by ``angle`` degrees counter-clockwise."""
    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    boxes = [probe.textbbox((0, 0), line, font=face) for line in lines]
    line_height = max(int(box[3] - box[1]) for box in boxes)
    step = int(line_height * 1.6)
    width = max(int(box[2]) for box in boxes) + 2 * pad
    height = step * len(lines) + 2 * pad
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for number, line in enumerate(lines):
        draw.text((pad, pad + number * step), line, font=face, fill="black")
    if angle:
        image = image.rotate(angle, expand=True, fillcolor="white", resample=Image.Resampling.BICUBIC)
    return image


@dataclass(frozen=True)
class Sample:
    name: str
    lines: list[str]
    image: Image.Image

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def font_samples() -> list[Sample]:
    """One line each in several faces and sizes (whatever is installed, plus Pillow's default font)."""
    texts = [
        "The quick brown fox jumps over the lazy dog",
        "Invoice number 48213 is due on March 14",
        "Pack my box with five dozen liquor jugs",
        "Sphinx of black quartz judge my vow",
        "How vexingly quick daft zebras jump",
        "Bright vixens jump over lazy dwarfs",
    ]
    sizes = [28, 36, 22, 48, 30, 26]
    faces: list[str | None] = [*installed_fonts()]
    samples = []
    for number, (text, size) in enumerate(zip(texts, sizes, strict=True)):
        name = faces[number] if number < len(faces) else None
        samples.append(Sample(f"{name or 'pillow-default'}-{size}px", [text], render([text], font(name, size))))
    samples.append(Sample("pillow-default-40px", ["Grumpy wizards make toxic brew"],
                          render(["Grumpy wizards make toxic brew"], font(None, 40))))  # fmt: skip
    return samples


def body_font(size: int = 30) -> FontType:
    fonts = installed_fonts()
    return font(next(iter(fonts)) if fonts else None, size)


def paragraph() -> Sample:
    lines = ["First line of the report", "Second line lists 2024 totals", "Third and final line"]
    return Sample("paragraph", lines, render(lines, body_font()))


def rotated(angle: float) -> Sample:
    lines = ["Rotated text still reads well"]
    return Sample(f"rotated{angle:+g}", lines, render(lines, body_font(32), angle=angle))


PDF_PAGES = [["Page one talks about apples", "and orange juice"], ["Page two is about the weather", "cold and windy"]]


def pdf(pages: list[list[str]] = PDF_PAGES, resolution: float = 150.0) -> bytes:
    """A PDF with one page per entry (Pillow's PDF writer; the predictor renders it back with PDFium)."""
    images = []
    for lines in pages:
        text = render(lines, body_font(34))
        canvas = Image.new("RGB", (text.width + 120, text.height + 160), "white")  # margins around the text
        canvas.paste(text, (60, 80))
        images.append(canvas)
    buffer = io.BytesIO()
    images[0].save(buffer, "PDF", save_all=True, append_images=images[1:], resolution=resolution)
    return buffer.getvalue()


def encode(image: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def png_claiming_size(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` (a decompression bomb's header)."""
    data = encode(Image.new("L", (8, 8), 255), "PNG")
    ihdr_at = data.index(b"IHDR")
    header = data[ihdr_at : ihdr_at + 17]
    forged = b"IHDR" + struct.pack(">II", width, height) + header[12:]
    crc = struct.pack(">I", zlib.crc32(forged) & 0xFFFFFFFF)
    return data[:ihdr_at] + forged + crc + data[ihdr_at + 21 :]


def normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.lower())


def similarity(expected: str, actual: str) -> float:
    """difflib ratio of the two texts, case- and whitespace-insensitive."""
    return difflib.SequenceMatcher(None, normalise(expected), normalise(actual)).ratio()
