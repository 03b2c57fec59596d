"""Client bytes to page images, with every limit checked before the expensive step it protects.

Base64 is sized before it is decoded, an image's pixel count is read from its header before its pixels
are, and a PDF page's pixel count is computed from its size in points before it is rendered. The pixels
of all pages of one request share one budget (``max_total_pixels``), checked from the headers before any
page is decoded; pages are then decoded one at a time (:func:`image_pages`). A PDF is rendered in a child
process (:class:`PdfRenderers`) with a time budget (``pdf_timeout_s``): a small file whose page draws nested
forms a billion times is killed there, instead of pinning a core and PDFium's lock. Every client mistake
is an :class:`InvalidRequest` (400) and every limit an :class:`RequestTooLarge` (413) naming the field,
the limit's engine argument and its value. What other image inputs share (base64, opening an image from its header,
RGB on white) lives in :mod:`universal_predictors.image_inputs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from PIL import Image, ImageOps

from universal_predictors.errors import APIError, InvalidRequest, RequestTooLarge
from universal_predictors.host import container_memory_limit
from universal_predictors.image_inputs import check_bytes as _shared_check_bytes
from universal_predictors.image_inputs import decode_base64 as decode_base64  # the OCR task imports it from here
from universal_predictors.image_inputs import open_header as _open_header
from universal_predictors.image_inputs import to_rgb as _to_rgb

logger = logging.getLogger(__name__)

# PDFium is not thread-safe; decoding runs on worker threads, so every PDFium call holds this lock.
_PDFIUM_LOCK = threading.Lock()


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the engine."""

    max_image_bytes: int
    max_pixels: int
    max_pages: int
    pdf_dpi: int
    max_total_pixels: int
    pdf_timeout_s: float
    #: What a PDF render process may add to its address space, in MiB (RLIMIT_AS: PDFium aborts beyond it).
    max_render_memory_mb: int = 1024


#: Memory one page's pixel takes while it is decoded and recognised, in bytes, as a predictor's RSS shows it: the
#: decoded frame and its RGB copy (Pillow keeps 4 bytes a pixel), the engine's BGR array and RapidOCR's resized
#: copies, on two threads whose malloc arenas each keep what they freed until the heap is trimmed. Measured: one
#: 6000x6000 PNG page raised an OCR predictor's RSS by 545-585 MiB (15-17 B/pixel); rounded up.
#: The engine's working memory for detection (set by ``max_side``, not the page) is separate: one page at a time.
OCR_BYTES_PER_PIXEL = 16


class PixelBudget:
    """The pixels one request may decode, across all its images, frames and pages (``max_total_pixels``)."""

    def __init__(self, limits: Limits) -> None:
        self.limit = limits.max_total_pixels
        self.left = limits.max_total_pixels

    def take(self, width: int, height: int, field: str) -> None:
        if width * height > self.left:
            used = self.limit - self.left
            raise RequestTooLarge(
                f"{field}: the request's images and pages add up to more than {self.limit} pixels ({used} before "
                f"this {width}x{height} one); the limit max_total_pixels is {self.limit}",
                param=field,
                code="too_many_pixels",
            )
        self.left -= width * height


@dataclass
class Page:
    """One image to recognise: ``index`` is the input's position, ``page`` its 1-based page (PDF, TIFF)."""

    index: int
    page: int | None
    image: Image.Image  # RGB
    dpi: int | None


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


def _image_dpi(image: Image.Image) -> int | None:
    dpi = image.info.get("dpi")
    try:
        value = round(float(dpi[0])) if dpi else 0
    except (TypeError, ValueError, IndexError):
        return None
    # Many encoders write 1 or 72 when they know nothing; let the engine estimate instead.
    return value if 100 <= value <= 1200 else None


def image_pages(
    data: bytes, index: int, field: str, limits: Limits, budget: PixelBudget | None = None
) -> Iterator[Page]:
    """A PNG, JPEG, TIFF (every frame) or WebP (first frame) as RGB pages, decoded one at a time (blocking:
    iterate it off the event loop). Every frame's size is checked (``max_pixels``, ``budget``) from the
    headers when the generator is created, before the first frame is decoded."""
    image, frames = _open_checked(data, field, limits, budget)
    return _decode_frames(image, frames, index, field)


def _count_frames(image: Image.Image, limit: int) -> int:
    """A TIFF's frames, counted no further than ``limit + 1``: Pillow's ``n_frames`` walks the whole chain
    of image directories (in time quadratic in their number), and a few megabytes can chain 100,000s."""
    if image.format != "TIFF":
        return 1
    count = 1
    while count <= limit:
        try:
            image.seek(count)  # reads that frame's directory, not its pixels
        except EOFError:
            break
        count += 1
    return count


def _corrupt(field: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: the image data is corrupt or truncated", param=field, code="invalid_image")


def _open_counted(data: bytes, field: str, limits: Limits) -> tuple[Image.Image, int]:
    """The image opened from its header and its frames counted (a 413 past ``max_pages``); no pixels read."""
    image = _open_header(data, field, limits.max_pixels, pdf="PDF (send it as document)")
    try:
        frames = _count_frames(image, limits.max_pages)
    except Exception:
        raise _corrupt(field) from None
    if frames > limits.max_pages:
        raise RequestTooLarge(
            f"{field}: the TIFF has more than {limits.max_pages} frames (pages); the limit max_pages is "
            f"{limits.max_pages}. Send at most {limits.max_pages} pages per request",
            param=field,
            code="too_many_pages",
        )
    return image, frames


def _check_frame(image: Image.Image, number: int, frames: int, field: str, limits: Limits,
                 budget: PixelBudget | None) -> None:  # fmt: skip
    """Frame ``number`` (0-based) within ``max_pixels`` and taken from ``budget``, from its header alone."""
    try:
        image.seek(number)  # seeking a TIFF reads its directory, not its pixels
        _check_pixels(image.width, image.height, field, limits)
        if budget is not None:
            budget.take(image.width, image.height, field if frames == 1 else f"{field} frame {number + 1}")
    except RequestTooLarge:
        raise
    except Exception:
        raise _corrupt(field) from None


def _open_checked(data: bytes, field: str, limits: Limits, budget: PixelBudget | None) -> tuple[Image.Image, int]:
    image, frames = _open_counted(data, field, limits)
    for number in range(frames):
        _check_frame(image, number, frames, field, limits, budget)
    try:
        image.seek(0)
    except Exception:
        raise _corrupt(field) from None
    return image, frames


def _decode_frame(image: Image.Image, number: int, frames: int, index: int, field: str) -> Page:
    try:
        image.seek(number)
        image.load()
        frame = ImageOps.exif_transpose(image) if image.format == "JPEG" else image
        return Page(index, number + 1 if frames > 1 else None, _to_rgb(frame), _image_dpi(image))
    except Exception:
        raise _corrupt(field) from None


def _decode_frames(image: Image.Image, frames: int, index: int, field: str) -> Iterator[Page]:
    for number in range(frames):
        page = _decode_frame(image, number, frames, index, field)
        if number == frames - 1:
            # The decoded frame goes before its RGB copy does to the engine, not when the caller asks for a
            # next page: a 36-megapixel page held twice was 275 MiB instead of 137.
            image.close()
        yield page


def image_page(data: bytes, field: str, limits: Limits, budget: PixelBudget, number: int) -> Page:
    """Frame ``number`` (1-based; TIFFs have several) of an image as an RGB page, decoded (blocking). The
    frames before it are seeked past, their directories read and their pixels not; only the chosen frame is
    checked (``max_pixels``) and taken from ``budget`` before it is decoded."""
    image, frames = _open_counted(data, field, limits)
    try:
        if not 1 <= number <= frames:
            raise InvalidRequest(
                f"page: the image has {frames} frame{'s' if frames != 1 else ''}; page {number} is out of range",
                param="page",
                code="page_out_of_range",
            )
        _check_frame(image, number - 1, frames, field, limits, budget)
        return _decode_frame(image, number - 1, frames, 0, field)
    finally:
        image.close()


def render_pdf_pages(
    data: bytes, index: int, field: str, limits: Limits, budget: PixelBudget | None = None, only: int | None = None
) -> Iterator[Page]:
    """Every page of a PDF rendered at ``limits.pdf_dpi`` with PDFium, one at a time; every page's size is
    checked (``max_pixels``, ``budget``) before the first is rendered. ``only``: just that 1-based page (a
    400 naming the page count when the PDF has no such page)."""
    import pypdfium2

    scale = limits.pdf_dpi / 72
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
            if only is not None and not 1 <= only <= count:
                raise InvalidRequest(
                    f"page: the PDF has {count} page{'s' if count != 1 else ''}; page {only} is out of range "
                    f"(pages are numbered from 1)",
                    param="page",
                    code="page_out_of_range",
                )
            numbers = range(count) if only is None else [only - 1]
            for number in numbers:
                width_pt, height_pt = document.get_page_size(number)
                width, height = round(width_pt * scale), round(height_pt * scale)
                _check_pixels(width, height, f"{field} page {number + 1}", limits)
                if budget is not None:
                    budget.take(width, height, f"{field} page {number + 1}")
            for number in numbers:
                page = document[number]
                try:
                    bitmap = page.render(scale=scale, may_draw_forms=True)
                    image = bitmap.to_pil().convert("RGB")
                finally:
                    page.close()
                yield Page(index, number + 1, image, limits.pdf_dpi)
        except (InvalidRequest, RequestTooLarge):
            raise
        except Exception:
            raise InvalidRequest(
                f"{field}: the PDF could not be rendered", param=field, code="invalid_document"
            ) from None
        finally:
            document.close()


#: How long a render process may take to start (import PDFium) before its time budget starts.
START_TIMEOUT_S = 60.0
#: How a render process that ran out of its address space ends: PDFium's allocation failure handler aborts
#: (SIGABRT); the kernel's OOM killer (SIGKILL) where a cgroup limit came first.
_OUT_OF_MEMORY_EXITS = (-signal.SIGABRT, -signal.SIGKILL)
#: Start method of PDF render processes: "spawn" is safe in a process with engine threads running.
_MP = multiprocessing.get_context("spawn")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the predictor dies, so a render never outlives it."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _render_child(conn: Connection, data: bytes, index: int, field: str, limits: Limits, pixels_left: int,
                  only: int | None = None) -> None:  # fmt: skip
    """The render process: each page as ``("page", number, (width, height), rgb_bytes)``, then ``("done",)``;
    a client mistake or a limit as ``("error", class_name, message, param, code)``."""
    _die_with_parent()
    import pypdfium2  # noqa: F401  (imported before the clock starts: "ready" starts it)

    _limit_address_space(limits.max_render_memory_mb)
    conn.send(("ready",))
    budget = PixelBudget(limits)
    budget.left = pixels_left
    try:
        for page in render_pdf_pages(data, index, field, limits, budget, only):
            conn.send(("page", page.page, page.image.size, page.image.tobytes()))
        conn.send(("done", limits.max_total_pixels - budget.left))
    except APIError as error:
        conn.send(("error", type(error).__name__, error.message, error.param, error.code))
    except MemoryError:
        refusal = _render_memory(field, limits)
        conn.send(("error", type(refusal).__name__, refusal.message, refusal.param, refusal.code))
    finally:
        conn.close()


def _limit_address_space(megabytes: int) -> None:
    """Cap this process's address space at its size now plus ``megabytes`` (Linux, RLIMIT_AS): PDFium's
    allocations beyond it fail, and PDFium aborts the process, instead of a 2 KB PDF of nested forms taking
    gigabytes of the predictor's memory (measured: 1.6 GB at 200 dpi in 4 s without a limit)."""
    import resource

    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/statm", "rb") as statm:
            now = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = now + megabytes * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _render_memory(field: str, limits: Limits) -> RequestTooLarge:
    return RequestTooLarge(
        f"{field}: rendering the PDF needed more memory than the limit max_render_memory_mb "
        f"({limits.max_render_memory_mb} MiB); the document is too complex to render (raise the engine "
        "argument max_render_memory_mb to allow it)",
        param=field,
        code="render_memory",
    )


class PdfRenderers:
    """PDF renders in child processes, at most ``workers`` at once, each killed when its ``pdf_timeout_s``
    runs out or its request is cancelled (the client left)."""

    def __init__(self, workers: int, memory_mb: int | None = None) -> None:
        self.workers = workers
        self._slots: asyncio.Semaphore | None = None
        limit = container_memory_limit()
        if memory_mb is not None and limit is not None and workers * memory_mb * 2**20 > limit // 2:
            logger.warning("pdf_workers x max_render_memory_mb (%d x %d MiB) is more than half of this container's "
                           "memory limit (%d MiB): concurrent PDF renders may get the predictor killed; lower "
                           "either engine argument", workers, memory_mb, limit // 2**20)  # fmt: skip

    async def pages(
        self,
        data: bytes,
        index: int,
        field: str,
        limits: Limits,
        budget: PixelBudget,
        only: int | None = None,
        run: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    ) -> AsyncIterator[Page]:
        """The PDF's pages (or page ``only``), rendered by a child process; ``run`` receives them off the event
        loop (the decode budget's threads: universal_predictors.decode_budget)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            receiver, sender = _MP.Pipe(duplex=False)
            process = _MP.Process(target=_render_child, args=(sender, data, index, field, limits, budget.left, only),
                                  name=f"pdf-render-{field}", daemon=True)  # fmt: skip
            process.start()
            sender.close()
            loop = asyncio.get_running_loop()
            # The budget counts time waiting for the renderer (from when it has started, not the interpreter's
            # start-up), not the caller's time recognising pages.
            time_left = limits.pdf_timeout_s
            started = False
            outcome = "finished"
            try:
                while True:
                    waited_from = loop.time()
                    try:
                        message = await asyncio.wait_for(
                            run(_receive, receiver), max(0.0, time_left) if started else START_TIMEOUT_S
                        )
                    except TimeoutError:
                        outcome = f"over pdf_timeout_s ({limits.pdf_timeout_s:g} s)"
                        raise RequestTooLarge(
                            f"{field}: rendering the PDF took longer than the limit pdf_timeout_s "
                            f"({limits.pdf_timeout_s:g} s); the document is too complex to render",
                            param=field,
                            code="render_timeout",
                        ) from None
                    if message is not None and message[0] == "ready":
                        started = True
                        continue
                    time_left -= loop.time() - waited_from
                    if message is None:  # the process died: PDFium aborts when an allocation fails
                        process.join(2)
                        if process.exitcode in _OUT_OF_MEMORY_EXITS:
                            outcome = f"out of max_render_memory_mb ({limits.max_render_memory_mb} MiB)"
                            raise _render_memory(field, limits)
                        raise InvalidRequest(
                            f"{field}: the PDF could not be rendered", param=field, code="invalid_document"
                        )
                    if message[0] == "done":
                        budget.left = budget.limit - message[1]
                        return
                    if message[0] == "error":
                        _, kind, text, param, code = message
                        error = RequestTooLarge if kind == "RequestTooLarge" else InvalidRequest
                        raise error(text, param=param, code=code)
                    _, number, size, pixels = message
                    yield Page(index, number, Image.frombytes("RGB", size, pixels), limits.pdf_dpi)
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled (the client left)"
                raise
            finally:
                # Done, over its time budget, or cancelled: never let it render on.
                if process.is_alive() and outcome != "finished":
                    logger.warning("%s: stopping the PDF render process %s: %s", field, process.pid, outcome)
                process.kill()  # SIGKILL; a finished one has nothing left to do
                process.join(2)
                receiver.close()


def _receive(conn: Connection) -> Any:
    """The next message, or None once the render process has gone without saying why."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def decode_document(document: str | bytes, field: str, limits: Limits) -> bytes:
    """A PDF's bytes from base64 (JSON) or as uploaded (a form's file), within ``max_image_bytes``."""
    data = document if isinstance(document, bytes) else decode_base64(document, field, limits.max_image_bytes)
    _check_bytes(data, field, limits)
    if not is_pdf(data):
        raise InvalidRequest(f"{field}: is not a PDF", param=field, code="invalid_document")
    return data


def decode_image_bytes(value: str | bytes, field: str, limits: Limits) -> bytes:
    """An image's bytes from base64 (JSON) or as uploaded (a form's file), within ``max_image_bytes``."""
    data = value if isinstance(value, bytes) else decode_base64(value, field, limits.max_image_bytes)
    _check_bytes(data, field, limits)
    return data


def _check_bytes(data: bytes, field: str, limits: Limits) -> None:
    _shared_check_bytes(data, field, limits.max_image_bytes)
