"""Client bytes to page images, with every limit checked before the expensive step it protects.

Base64 is sized before it is decoded, an image's pixel count is read from its header before its pixels
are, and a PDF page's pixel count is computed from its size in points before it is rendered. Every
client mistake is an :class:`InvalidRequest` (400) and every limit an :class:`RequestTooLarge` (413)
naming the field, the limit's engine argument and its value.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import threading
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from universal_predictors.errors import InvalidRequest, RequestTooLarge

#: Pillow's names for the formats a client may send as an image.
IMAGE_FORMATS = ("PNG", "JPEG", "TIFF", "WEBP")
_FORMAT_NAMES = "PNG, JPEG, TIFF or WebP"

_DATA_URL = re.compile(r"^data:[\w.+/-]*(;[\w=.+-]*)*;base64,", re.IGNORECASE)

# PDFium is not thread-safe; decoding runs on worker threads, so every PDFium call holds this lock.
_PDFIUM_LOCK = threading.Lock()


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the engine."""

    max_image_bytes: int
    max_pixels: int
    max_pages: int
    pdf_dpi: int


@dataclass
class Page:
    """One image to recognise: ``index`` is the input's position, ``page`` its 1-based page (PDF, TIFF)."""

    index: int
    page: int | None
    image: Image.Image  # RGB
    dpi: int | None


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def decode_base64(value: str, field: str, max_bytes: int) -> bytes:
    """Standard or URL-safe base64, with or without padding, line breaks or a ``data:`` URL prefix."""
    text = _DATA_URL.sub("", value.strip(), count=1)
    if any(c.isspace() for c in text[:4096]) or "\n" in text:
        text = "".join(text.split())
    if not text:
        raise InvalidRequest(f"{field}: is empty", param=field, code="invalid_image")
    estimated = len(text) * 3 // 4
    if estimated > max_bytes + 2:
        raise RequestTooLarge(
            f"{field}: the decoded data is about {_human(estimated)}; the limit max_image_bytes is {_human(max_bytes)}",
            param=field,
            code="image_too_large",
        )
    text += "=" * (-len(text) % 4)
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(text.encode("ascii"))
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise InvalidRequest(f"{field}: is not valid base64", param=field, code="invalid_base64") from None


def is_pdf(data: bytes) -> bool:
    # The header may follow a little junk; PDF readers look in the first kilobyte.
    return b"%PDF-" in data[:1024]


def _check_pixels(width: int, height: int, field: str, limits: Limits) -> None:
    if width * height > limits.max_pixels:
        raise RequestTooLarge(
            f"{field}: {width}x{height} is {width * height} pixels; the limit max_pixels is {limits.max_pixels}",
            param=field,
            code="image_too_large",
        )


def _check_pages(total: int, field: str, limits: Limits) -> None:
    if total > limits.max_pages:
        raise RequestTooLarge(
            f"{field}: has {total} pages; the limit max_pages is {limits.max_pages}",
            param=field,
            code="too_many_pages",
        )


def _to_rgb(frame: Image.Image) -> Image.Image:
    """RGB on white: transparent areas would otherwise turn black and hide black text."""
    if frame.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # Deep greyscale (scans, microscopy): stretch to 8 bits instead of clipping at 255.
        values = np.asarray(frame, dtype=np.float32)
        low, high = float(values.min()), float(values.max())
        frame = Image.fromarray(((values - low) * (255.0 / ((high - low) or 1.0))).astype(np.uint8))
    if frame.mode == "P" and "transparency" in frame.info:
        frame = frame.convert("RGBA")
    if frame.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        frame = frame.convert("RGBA")
        background = Image.new("RGBA", frame.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, frame).convert("RGB")
    return frame.convert("RGB")


def _image_dpi(image: Image.Image) -> int | None:
    dpi = image.info.get("dpi")
    try:
        value = round(float(dpi[0])) if dpi else 0
    except (TypeError, ValueError, IndexError):
        return None
    # Many encoders write 1 or 72 when they know nothing; let the engine estimate instead.
    return value if 100 <= value <= 1200 else None


def open_image(data: bytes, index: int, field: str, limits: Limits) -> list[Page]:
    """A PNG, JPEG, TIFF (every frame) or WebP (first frame) as RGB pages; the header is checked first."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise RequestTooLarge(
            f"{field}: the image has more pixels than the limit max_pixels ({limits.max_pixels})",
            param=field,
            code="image_too_large",
        ) from None
    except UnidentifiedImageError:
        raise InvalidRequest(
            f"{field}: is not a {_FORMAT_NAMES} image{_sniff(data)}", param=field, code="unsupported_image_format"
        ) from None
    except Exception:
        raise InvalidRequest(f"{field}: the image could not be read", param=field, code="invalid_image") from None
    frames = getattr(image, "n_frames", 1) if image.format == "TIFF" else 1
    _check_pages(frames, field, limits)
    pages: list[Page] = []
    try:
        for number in range(frames):
            image.seek(number)
            _check_pixels(image.width, image.height, field, limits)
            image.load()
            frame = ImageOps.exif_transpose(image) if image.format == "JPEG" else image
            pages.append(Page(index, number + 1 if frames > 1 else None, _to_rgb(frame), _image_dpi(image)))
    except RequestTooLarge:
        raise
    except Exception:
        raise InvalidRequest(
            f"{field}: the image data is corrupt or truncated", param=field, code="invalid_image"
        ) from None
    return pages


def _sniff(data: bytes) -> str:
    """Name a well-known format the client sent by mistake, so the 400 says what was received."""
    magic = {b"GIF8": "GIF", b"BM": "BMP", b"%PDF": "PDF (send it as document)", b"\x00\x00\x01\x00": "ICO"}
    for prefix, name in magic.items():
        if data.startswith(prefix):
            return f" (received {name})"
    return ""


def render_pdf(data: bytes, index: int, field: str, limits: Limits) -> list[Page]:
    """Every page of a PDF rendered at ``limits.pdf_dpi`` with PDFium; sizes checked before rendering."""
    import pypdfium2

    scale = limits.pdf_dpi / 72
    pages: list[Page] = []
    with _PDFIUM_LOCK:
        try:
            document = pypdfium2.PdfDocument(data)
        except pypdfium2.PdfiumError as exc:
            raise InvalidRequest(
                f"{field}: is not a readable PDF ({exc})", param=field, code="invalid_document"
            ) from None
        try:
            count = len(document)
            if count == 0:
                raise InvalidRequest(f"{field}: the PDF has no pages", param=field, code="invalid_document")
            _check_pages(count, field, limits)
            for number in range(count):
                page = document[number]
                try:
                    width_pt, height_pt = page.get_size()
                    width, height = round(width_pt * scale), round(height_pt * scale)
                    _check_pixels(width, height, f"{field} page {number + 1}", limits)
                    bitmap = page.render(scale=scale, may_draw_forms=True)
                    image = bitmap.to_pil().convert("RGB")
                finally:
                    page.close()
                pages.append(Page(index, number + 1, image, limits.pdf_dpi))
        except (InvalidRequest, RequestTooLarge):
            raise
        except Exception:
            raise InvalidRequest(
                f"{field}: the PDF could not be rendered", param=field, code="invalid_document"
            ) from None
        finally:
            document.close()
    return pages


def decode_inputs(images: list[str] | None, document: str | None, limits: Limits) -> list[Page]:
    """All pages of one request, in order (blocking: run it off the event loop). ``max_pages`` bounds each
    document (a PDF, a multi-page TIFF); the number of images is the caller's to bound."""
    pages: list[Page] = []
    if document is not None:
        data = decode_base64(document, "document", limits.max_image_bytes)
        _check_bytes(data, "document", limits)
        if not is_pdf(data):
            raise InvalidRequest("document: is not a PDF", param="document", code="invalid_document")
        pages += render_pdf(data, 0, "document", limits)
    for index, value in enumerate(images or []):
        field = f"images[{index}]"
        data = decode_base64(value, field, limits.max_image_bytes)
        _check_bytes(data, field, limits)
        pages += open_image(data, index, field, limits)
    return pages


def _check_bytes(data: bytes, field: str, limits: Limits) -> None:
    if len(data) > limits.max_image_bytes:
        raise RequestTooLarge(
            f"{field}: the decoded data is {_human(len(data))}; the limit max_image_bytes is "
            f"{_human(limits.max_image_bytes)}",
            param=field,
            code="image_too_large",
        )
