"""Hostile documents on a real OCR predictor (RapidOCR): a tiny PDF that would render for hours is stopped at
its time budget or when its client leaves, without holding up other PDFs; a multi-frame TIFF cannot decode
more pixels than the request's budget, and its frames are counted no further than max_pages + 1; a multipart
upload's boundary is held to RFC 2046; the document route decodes the TIFF page it reads and none before it.
The hostile files are built here."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.predictors import ocr_samples as samples
from tests.predictors.harness import PredictorProcess, running_predictor
from tests.security.memory import peak_rise_mb, settled_rss_mb
from tests.security.predictor_fixtures import openai_error
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.ocr.pages import OCR_BYTES_PER_PIXEL

PDF_TIMEOUT_S = 20
#: The time-budget tests' render memory: above what the hostile PDF takes at 200 dpi (about 1.6 GB, measured).
ROOMY_RENDER_MB = 4096
#: The memory test's: far below it.
TIGHT_RENDER_MB = 512
MAX_PIXELS = 4_000_000
MAX_TOTAL_PIXELS = 10_000_000
MAX_PAGES = 32  # the OCR default


def nested_forms_pdf(depth: int = 6, repeats: int = 10) -> bytes:
    """A one-page PDF of about 2 KB whose page draws form F{depth}; each form draws the one below it ``repeats``
    times and the last fills the page: ``repeats ** depth`` full-page fills (10**6: hours of PDFium)."""
    objects: list[bytes] = []

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    def stream(dictionary: bytes, content: bytes) -> bytes:
        length = str(len(content)).encode()
        return b"<< " + dictionary + b" /Length " + length + b" >>\nstream\n" + content + b"\nendstream"

    form = b"/Type /XObject /Subtype /Form /BBox [0 0 612 792]"
    inner = add(stream(form, b"0 0 612 792 re f"))
    for _ in range(depth):
        resources = b" /Resources << /XObject << /F " + str(inner).encode() + b" 0 R >> >>"
        inner = add(stream(form + resources, b"/F Do " * repeats))
    content = add(stream(b"", b"/F Do"))
    page = add(b"<< /Type /Page /Parent " + str(content + 2).encode() + b" 0 R /MediaBox [0 0 612 792] /Contents "
               + str(content).encode() + b" 0 R /Resources << /XObject << /F " + str(inner).encode()
               + b" 0 R >> >> >>")  # fmt: skip
    pages = add(b"<< /Type /Pages /Kids [" + str(page).encode() + b" 0 R] /Count 1 >>")
    catalog = add(b"<< /Type /Catalog /Pages " + str(pages).encode() + b" 0 R >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += str(number).encode() + b" 0 obj\n" + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 " + str(len(objects) + 1).encode() + b"\n0000000000 65535 f \n"
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size " + str(len(objects) + 1).encode() + b" /Root " + str(catalog).encode() + b" 0 R >>\n"
    out += b"startxref\n" + str(xref).encode() + b"\n%%EOF\n"
    return bytes(out)


def white_tiff(frames: int, side: int) -> bytes:
    """``frames`` white ``side`` x ``side`` bilevel frames, compressed to a few kilobytes."""
    frame = Image.new("1", (side, side), 1)
    buffer = io.BytesIO()
    frame.save(buffer, "TIFF", save_all=True, append_images=[frame] * (frames - 1), compression="tiff_lzw")
    return buffer.getvalue()


def tiff_chain(frames: int, then: int = 0, strips: list[int] | None = None) -> bytes:
    """A little-endian TIFF of ``frames`` 1x1 bilevel image directories in a chain, all on one one-byte strip
    (114 bytes a frame: 128,000 of them are 14 MB). The last directory points on to offset ``then`` (0: the
    chain ends there). ``strips``: each frame's strip offset instead (one past the file's end: pixels that
    cannot be read)."""
    entries = [(256, 3, 1), (257, 3, 1), (258, 3, 1), (259, 3, 1), (262, 3, 1), (273, 4, 8), (277, 3, 1),
               (278, 3, 1), (279, 4, 1)]  # fmt: skip
    size = 2 + 12 * len(entries) + 4
    out = bytearray(b"II*\x00" + struct.pack("<I", 10) + b"\x00\x00")  # the strip at 8, directories from 10
    for number in range(frames):
        out += struct.pack("<H", len(entries))
        for tag, kind, value in entries:
            value = strips[number] if strips is not None and tag == 273 else value
            # A SHORT value sits left-justified in the entry's four value bytes.
            out += struct.pack("<HHIHH" if kind == 3 else "<HHII", tag, kind, 1, value, *([0] if kind == 3 else []))
        out += struct.pack("<I", 10 + (number + 1) * size if number + 1 < frames else then)
    return bytes(out)


@pytest.fixture(scope="module")
def ocr_predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    engine_args = {"pdf_timeout_s": str(PDF_TIMEOUT_S), "max_pixels": str(MAX_PIXELS),
                   "max_total_pixels": str(MAX_TOTAL_PIXELS), "max_render_memory_mb": str(ROOMY_RENDER_MB)}  # fmt: skip
    config = PredictorConfig(model_name="ocr", task=Task.OCR, backend=Backend.RAPIDOCR, source="builtin",
                             engine_args=engine_args)  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("security-ocr")) as predictor:
        yield predictor


def children_rss_mb(pid: int) -> int:
    """The resident memory of ``pid``'s child processes now, in MiB (Linux /proc)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == pid:
                total += int(stat[21]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    return total


def test_a_pdf_over_its_render_memory_is_refused_and_its_process_bounded(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    engine_args = {"pdf_timeout_s": "120", "max_render_memory_mb": str(TIGHT_RENDER_MB)}
    config = PredictorConfig(model_name="ocr", task=Task.OCR, backend=Backend.RAPIDOCR, source="builtin",
                             engine_args=engine_args)  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("render-memory")) as predictor:
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, children_rss_mb(predictor.process.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            refused = ocr(predictor, 120, document=base64.b64encode(nested_forms_pdf()).decode())
        finally:
            done.set()
            sampler.join()
        error = openai_error(refused, 413)
        assert error["code"] == "render_memory"
        assert error["param"] == "document"
        assert f"max_render_memory_mb ({TIGHT_RENDER_MB} MiB)" in error["message"]
        # Without the limit the render process reaches about 1.6 GB; with it, its limit and the interpreter.
        assert peak < TIGHT_RENDER_MB + 256, f"the render process peaked at {peak} MiB"
        after = ocr(predictor, document=samples.b64(samples.pdf()))
        assert after.status_code == 200, after.text


def ocr(predictor: PredictorProcess, timeout: float = 120, **body: Any) -> httpx.Response:
    with predictor.client(timeout=timeout) as client:
        return client.post("/v1/ocr", json=body)


def test_the_hostile_pdf_is_small() -> None:
    assert len(nested_forms_pdf()) < 3000


def test_a_pdf_over_its_render_budget_is_stopped_while_other_pdfs_are_read(ocr_predictor: PredictorProcess) -> None:
    hostile = base64.b64encode(nested_forms_pdf()).decode()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(ocr, ocr_predictor, 60, document=hostile)
        normal = pool.submit(ocr, ocr_predictor, 60, document=samples.b64(samples.pdf()))
        read = normal.result()
        refused = slow.result()
    assert read.status_code == 200, read.text
    assert [item["page"] for item in read.json()["data"]] == [1, 2]
    error = openai_error(refused, 413)
    assert error["code"] == "render_timeout"
    assert error["param"] == "document"
    assert f"pdf_timeout_s ({PDF_TIMEOUT_S} s)" in error["message"]


def test_a_client_leaving_stops_its_pdf_render(ocr_predictor: PredictorProcess) -> None:
    hostile = base64.b64encode(nested_forms_pdf()).decode()
    with pytest.raises(httpx.ReadTimeout):
        ocr(ocr_predictor, 2, document=hostile)  # leaves long before the budget runs out
    stopped = "stopping the PDF render process"
    deadline = time.monotonic() + PDF_TIMEOUT_S  # before its own budget could have stopped it
    while not any(stopped in line and "the client left" in line for line in ocr_predictor.log_tail(200).splitlines()):
        assert time.monotonic() < deadline, "the render process was not stopped when the client left"
        time.sleep(0.2)
    after = ocr(ocr_predictor, document=samples.b64(samples.pdf()))
    assert after.status_code == 200, after.text


def test_tiff_frames_over_the_requests_pixel_budget_are_a_413_before_decoding(ocr_predictor: PredictorProcess) -> None:
    tiff = white_tiff(frames=4, side=2000)  # 4 x 4,000,000 pixels against a budget of 10,000,000
    assert len(tiff) < 100_000
    error = openai_error(ocr(ocr_predictor, images=[base64.b64encode(tiff).decode()]), 413)
    assert error["code"] == "too_many_pixels"
    assert error["param"] == "images[0] frame 3"
    assert f"the limit max_total_pixels is {MAX_TOTAL_PIXELS}" in error["message"]


def test_the_tiff_chain_is_a_tiff_pillow_reads_frame_by_frame() -> None:
    with Image.open(io.BytesIO(tiff_chain(3))) as image:
        assert (image.format, image.n_frames, image.size) == ("TIFF", 3, (1, 1))


def test_a_tiff_over_max_pages_is_a_413_before_the_rest_of_its_chain_is_read(ocr_predictor: PredictorProcess) -> None:
    """Issue 31, item 12: the page check came after Pillow's ``n_frames`` had walked the whole chain (128,000
    directories: 73 s of CPU before the 413). Here directory 34 is not there at all (its offset is past the
    end of the file): reading it fails, so only a count that stops at max_pages + 1 (33) gets to the 413."""
    tiff = tiff_chain(MAX_PAGES + 1, then=0x7FFF_FFF0)
    error = openai_error(ocr(ocr_predictor, images=[base64.b64encode(tiff).decode()]), 413)
    assert error["code"] == "too_many_pages"
    assert error["param"] == "images[0]"
    assert f"more than {MAX_PAGES} frames" in error["message"]
    assert f"the limit max_pages is {MAX_PAGES}" in error["message"]


def test_the_pixel_budget_spans_all_images_of_a_request(ocr_predictor: PredictorProcess) -> None:
    one = base64.b64encode(white_tiff(frames=1, side=2000)).decode()  # 4,000,000 pixels each
    assert ocr(ocr_predictor, images=[one, one]).status_code == 200
    error = openai_error(ocr(ocr_predictor, images=[one, one, one]), 413)
    assert error["param"] == "images[2]"
    assert "max_total_pixels" in error["message"]


def test_tiff_frames_within_the_budget_are_read_frame_by_frame(ocr_predictor: PredictorProcess) -> None:
    first, second = samples.font_samples()[:2]
    buffer = io.BytesIO()
    first.image.save(buffer, "TIFF", save_all=True, append_images=[second.image])
    response = ocr(ocr_predictor, images=[samples.b64(buffer.getvalue())])
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(item["index"], item["page"]) for item in data] == [(0, 1), (0, 2)]
    assert samples.similarity(first.text, data[0]["text"]) >= samples.SIMILARITY_THRESHOLD
    assert samples.similarity(second.text, data[1]["text"]) >= samples.SIMILARITY_THRESHOLD


def upload(predictor: PredictorProcess, boundary: str, image: bytes) -> httpx.Response:
    """An OCR form upload (the model's name, one PNG) delimited by ``boundary``."""
    delimiter = b"--" + boundary.encode()
    body = b"".join([
        delimiter, b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nocr\r\n',
        delimiter, b'\r\nContent-Disposition: form-data; name="file"; filename="page.png"\r\n'
        b"Content-Type: image/png\r\n\r\n", image, b"\r\n",
        delimiter, b"--\r\n",
    ])  # fmt: skip
    with predictor.client(timeout=120) as client:
        return client.post("/v1/ocr", content=body,
                           headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("length", [71, 257, 4000])
def test_a_multipart_boundary_over_rfc_2046s_70_characters_is_a_400_naming_it(
    ocr_predictor: PredictorProcess, length: int
) -> None:
    """Issue 31, item 15: over 256 characters python-multipart refused the boundary outside the parser's
    error handling (a 500); up to 256 it was parsed."""
    error = openai_error(upload(ocr_predictor, "b" * length, png(samples.font_samples()[0].image)), 400)
    assert error["code"] == "invalid_body"
    assert f"the boundary in its Content-Type is {length} characters; RFC 2046 allows at most 70" in error["message"]


def test_a_70_character_boundary_is_read(ocr_predictor: PredictorProcess) -> None:
    sample = samples.font_samples()[0]
    response = upload(ocr_predictor, "b" * 70, png(sample.image))
    assert response.status_code == 200, response.text
    assert samples.similarity(sample.text, response.json()["data"][0]["text"]) >= samples.SIMILARITY_THRESHOLD


# -- the document route's page (issue 31, item 13) ----------------------------------------------------------

#: The document predictor's page limit: a 6000 x 6000 frame is within it, 36,000,000 pixels.
DOCUMENT_MAX_PIXELS = 40_000_000


@pytest.fixture(scope="module")
def document_predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    from tests.predictors.tiny_layoutlm import build_layoutlm

    root = tmp_path_factory.mktemp("security-document")
    config = PredictorConfig(model_name="document", task=Task.DOCUMENT, source=str(build_layoutlm(root / "qa", "qa")),
                             engine_args={"max_pixels": str(DOCUMENT_MAX_PIXELS)})  # fmt: skip
    with running_predictor(config, root / "logs") as predictor:
        yield predictor


def document_qa(predictor: PredictorProcess, image: bytes, page: int) -> httpx.Response:
    """A question on ``page`` of ``image``, with the page's words sent (no OCR)."""
    body = {"image": base64.b64encode(image).decode(), "page": page, "question": "What?", "words": ["total"],
            "boxes": [[0, 0, 1, 1]]}  # fmt: skip
    with predictor.client(timeout=300) as client:
        return client.post("/v1/document/qa", json=body)


def test_a_tiff_page_is_decoded_alone_never_the_frames_before_it(document_predictor: PredictorProcess) -> None:
    """The first frame's pixels lie past the end of the file: decoding it fails, so only a route that seeks
    past it to page 2 answers."""
    tiff = tiff_chain(2, strips=[0x7FFF_FFF0, 8])
    with Image.open(io.BytesIO(tiff)) as image, pytest.raises(OSError, match="truncated"):
        image.load()
    response = document_qa(document_predictor, tiff, page=2)
    assert response.status_code == 200, response.text
    assert openai_error(document_qa(document_predictor, tiff, page=3), 400)["code"] == "page_out_of_range"


def test_a_page_over_the_documents_pixel_limit_is_a_413_before_decoding(document_predictor: PredictorProcess) -> None:
    tiff = white_tiff(frames=1, side=6400)  # 40,960,000 pixels
    error = openai_error(document_qa(document_predictor, tiff, page=1), 413)
    assert "max_pixels" in error["message"]


# -- the document route's pages across requests (issue 31, items 4 and 14: the decode budget) ----------------

#: One 6000 x 6000 page's reservation (36 megapixels at OCR_BYTES_PER_PIXEL) and a little: one page at a time.
DOCUMENT_BUDGET_MB = 6000 * 6000 * OCR_BYTES_PER_PIXEL // 2**20 + 26


@pytest.fixture(scope="module")
def budgeted_document(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    from tests.predictors.tiny_layoutlm import build_layoutlm

    root = tmp_path_factory.mktemp("security-document-budget")
    config = PredictorConfig(model_name="document", task=Task.DOCUMENT, source=str(build_layoutlm(root / "qa", "qa")),
                             engine_args={"max_pixels": str(DOCUMENT_MAX_PIXELS), "decode_wait_s": "600",
                                          "decode_budget_mb": str(DOCUMENT_BUDGET_MB)})  # fmt: skip
    with running_predictor(config, root / "logs") as predictor:
        yield predictor


def test_concurrent_large_pages_are_read_within_the_decode_budget(budgeted_document: PredictorProcess) -> None:
    """Before the budget, each request decoded its page as it came: 8 concurrent 6000 x 6000 pages were all
    held at once (item 13 measured 2.9 GB for 3 concurrent 500-page TIFFs)."""
    page = png(Image.new("RGB", (6000, 6000), "white"))
    assert document_qa(budgeted_document, page, page=1).status_code == 200  # warm
    pid = budgeted_document.process.pid
    idle = settled_rss_mb(pid)
    answers: list[httpx.Response] = []

    def burst() -> None:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers.extend(pool.map(lambda _: document_qa(budgeted_document, page, page=1), range(8)))

    rise = peak_rise_mb(pid, idle, burst)
    assert [a.status_code for a in answers] == [200] * 8, answers[0].text
    assert rise < DOCUMENT_BUDGET_MB, f"8 concurrent 6000x6000 pages took RSS {rise:.0f} MiB above idle"
    time.sleep(1.5)  # the heap trimmed once idle
    assert settled_rss_mb(pid) - idle < DOCUMENT_BUDGET_MB / 4


def test_a_page_over_the_whole_decode_budget_is_a_413(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.predictors.tiny_layoutlm import build_layoutlm

    root = tmp_path_factory.mktemp("security-document-small-budget")
    config = PredictorConfig(model_name="document", task=Task.DOCUMENT, source=str(build_layoutlm(root / "qa", "qa")),
                             engine_args={"decode_budget_mb": "64"})  # fmt: skip
    with running_predictor(config, root / "logs") as predictor:
        error = openai_error(document_qa(predictor, png(Image.new("RGB", (3000, 3000), "white")), page=1), 413)
        assert error["code"] == "decode_budget_exceeded"
        assert "(64 MiB, the engine argument decode_budget_mb)" in error["message"]
        assert document_qa(predictor, png(Image.new("RGB", (1000, 1000), "white")), page=1).status_code == 200
