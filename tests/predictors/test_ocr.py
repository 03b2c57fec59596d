"""OCR: real predictor processes (RapidOCR's packaged PP-OCRv4 models, Debian's Tesseract) reading
text that the tests render with Pillow, over HTTP.

A reading passes when its similarity to the rendered text (difflib ratio, case- and whitespace-
insensitive, see ``ocr_samples.similarity``) is at least ``SIMILARITY_THRESHOLD`` (0.9).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.predictors import ocr_samples as samples
from tests.predictors.harness import PredictorProcess, free_port, run_predictor_cli, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

ENGINES = ("rapidocr", "tesseract")
#: Small limits on the rapidocr predictor so the 413 tests stay cheap.
LIMITS = {"max_image_bytes": "2097152", "max_pixels": "4000000", "max_pages": "3", "max_images": "8",
          "max_body_bytes": "8388608"}  # fmt: skip


@pytest.fixture(scope="session")
def rapidocr_predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="rapidocr", task=Task.OCR, backend=Backend.AUTO, source="builtin",
                             engine_args=LIMITS)  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("ocr-rapidocr")) as predictor:
        yield predictor


@pytest.fixture(scope="session")
def tesseract_predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="tesseract", task=Task.OCR, backend=Backend.TESSERACT, source="builtin")
    with running_predictor(config, tmp_path_factory.mktemp("ocr-tesseract")) as predictor:
        yield predictor


@pytest.fixture(params=ENGINES)
def predictor(request: pytest.FixtureRequest) -> PredictorProcess:
    return request.getfixturevalue(f"{request.param}_predictor")  # type: ignore[no-any-return]


def ocr(predictor: PredictorProcess, **body: Any) -> httpx.Response:
    with predictor.client(timeout=120) as client:
        return client.post("/v1/ocr", json=body)


def read(predictor: PredictorProcess, images: list[Image.Image], **body: Any) -> list[dict[str, Any]]:
    response = ocr(predictor, images=[samples.b64(samples.encode(image)) for image in images], **body)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["object"] == "list"
    assert payload["model"] == predictor.config.model_name
    return payload["data"]  # type: ignore[no-any-return]


def assert_reads(expected: str, actual: str) -> None:
    score = samples.similarity(expected, actual)
    assert score >= samples.SIMILARITY_THRESHOLD, f"read {actual!r} for {expected!r} (similarity {score:.2f})"


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    return response.json()["error"]  # type: ignore[no-any-return]


# -- reading ---------------------------------------------------------------------------------------


def test_text_in_several_fonts_and_sizes_is_read_back(predictor: PredictorProcess) -> None:
    cases = samples.font_samples()
    data = read(predictor, [case.image for case in cases])
    assert [item["index"] for item in data] == list(range(len(cases)))
    for case, item in zip(cases, data, strict=True):
        assert_reads(case.text, item["text"])
        assert 0.5 < item["confidence"] <= 1.0, case.name
        assert "page" not in item


def test_lines_come_back_top_to_bottom_one_per_row(predictor: PredictorProcess) -> None:
    case = samples.paragraph()
    [item] = read(predictor, [case.image])
    rows = item["text"].split("\n")
    assert len(rows) == len(case.lines), item["text"]
    for expected, row in zip(case.lines, rows, strict=True):
        assert_reads(expected, row)


@pytest.mark.parametrize("angle", [7, -10])
def test_a_line_rotated_by_a_few_degrees_is_read_as_one_line(predictor: PredictorProcess, angle: float) -> None:
    # RapidOCR's detector returns slanted quadrilaterals; Tesseract reads it after our deskew.
    case = samples.rotated(angle)
    [item] = read(predictor, [case.image], return_boxes=True)
    assert "\n" not in item["text"]
    assert_reads(case.text, item["text"])
    # The boxes follow the slant: the top edge rises (angle > 0) or falls to the right.
    (_, y0), (_, y1) = item["boxes"][0]["box"][:2]
    assert (y1 - y0) * angle < 0


def test_a_two_page_pdf_comes_back_page_by_page(predictor: PredictorProcess) -> None:
    response = ocr(predictor, document=samples.b64(samples.pdf()))
    assert response.status_code == 200, response.text
    payload = response.json()
    assert [(item["index"], item["page"]) for item in payload["data"]] == [(0, 1), (0, 2)]
    for lines, item in zip(samples.PDF_PAGES, payload["data"], strict=True):
        assert_reads(" ".join(lines), item["text"])
    assert payload["usage"] == {"images": 1, "pages": 2}


def test_pdf_is_accepted_under_its_alias_and_as_a_data_url(rapidocr_predictor: PredictorProcess) -> None:
    response = ocr(rapidocr_predictor, pdf="data:application/pdf;base64," + samples.b64(samples.pdf()))
    assert response.status_code == 200, response.text
    assert [item["page"] for item in response.json()["data"]] == [1, 2]


@pytest.mark.parametrize(("fmt", "params"), [("PNG", {}), ("JPEG", {"quality": 90}), ("TIFF", {}), ("WEBP", {})])
def test_every_accepted_format_reads_the_same_text(
    rapidocr_predictor: PredictorProcess, fmt: str, params: dict[str, Any]
) -> None:
    case = samples.font_samples()[0]
    response = ocr(rapidocr_predictor, images=[samples.b64(samples.encode(case.image, fmt, **params))])
    assert response.status_code == 200, response.text
    assert_reads(case.text, response.json()["data"][0]["text"])


def test_a_transparent_png_with_black_text_is_read(rapidocr_predictor: PredictorProcess) -> None:
    case = samples.font_samples()[1]
    mask = case.image.convert("L").point(lambda v: 255 - v)
    transparent = Image.new("RGBA", case.image.size, (0, 0, 0, 0))
    transparent.putalpha(mask)  # black where the text is, fully transparent elsewhere
    [item] = read(rapidocr_predictor, [transparent])
    assert_reads(case.text, item["text"])


def test_a_multi_page_tiff_comes_back_frame_by_frame(tesseract_predictor: PredictorProcess) -> None:
    first, second = samples.font_samples()[:2]
    buffer = io.BytesIO()
    first.image.save(buffer, "TIFF", save_all=True, append_images=[second.image])
    response = ocr(tesseract_predictor, images=[samples.b64(buffer.getvalue())])
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(item["index"], item["page"]) for item in data] == [(0, 1), (0, 2)]
    assert_reads(first.text, data[0]["text"])
    assert_reads(second.text, data[1]["text"])


def test_return_boxes_gives_a_quadrilateral_per_line_in_reading_order(predictor: PredictorProcess) -> None:
    case = samples.paragraph()
    [item] = read(predictor, [case.image], return_boxes=True)
    assert (item["width"], item["height"]) == case.image.size
    boxes = item["boxes"]
    assert " ".join(box["text"] for box in boxes).split() == item["text"].split()
    for box in boxes:
        assert set(box) == {"text", "confidence", "box"}
        assert 0 <= box["confidence"] <= 1
        assert len(box["box"]) == 4
        for x, y in box["box"]:
            assert -2 <= x <= case.image.width + 2
            assert -2 <= y <= case.image.height + 2
    tops = [min(y for _, y in box["box"]) for box in boxes]
    assert tops == sorted(tops)
    assert "boxes" not in read(predictor, [case.image])[0]


def test_concurrent_requests_each_get_their_own_text(predictor: PredictorProcess) -> None:
    cases = samples.font_samples()

    def one(case: samples.Sample) -> str:
        return read(predictor, [case.image])[0]["text"]  # type: ignore[no-any-return]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(one, cases))
    for case, text in zip(cases, texts, strict=True):
        assert_reads(case.text, text)


# -- languages and model card ------------------------------------------------------------------------


def test_model_list_reports_engine_languages_and_limits(predictor: PredictorProcess) -> None:
    with predictor.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    engine = predictor.config.model_name
    assert card["task"] == "ocr"
    assert card["backend"] == engine
    assert card["engine"] == engine
    assert "eng" in card["languages"]
    assert card["limits"]["pdf_dpi"] == 200


def test_unknown_language_is_a_400_listing_the_installed_ones(predictor: PredictorProcess) -> None:
    image = samples.b64(samples.encode(samples.font_samples()[0].image))
    error = error_of(ocr(predictor, images=[image], languages=["eng", "tlh"]), 400)
    assert error["param"] == "languages[1]"
    assert "'tlh'" in error["message"]
    assert "installed: " in error["message"]
    assert "eng" in error["message"].split("installed: ")[1]


def test_language_codes_accept_iso_aliases(tesseract_predictor: PredictorProcess) -> None:
    case = samples.font_samples()[0]
    [item] = read(tesseract_predictor, [case.image], languages=["en"])
    assert_reads(case.text, item["text"])


# -- KServe protocols ------------------------------------------------------------------------------


def test_kserve_v1_and_v2_read_base64_images_and_pdfs(rapidocr_predictor: PredictorProcess) -> None:
    case = samples.font_samples()[0]
    image = samples.b64(samples.encode(case.image))
    with rapidocr_predictor.client(timeout=120) as client:
        v1 = client.post("/v1/models/rapidocr:predict", json={"instances": [image, samples.b64(samples.pdf())]})
        v2 = client.post(
            "/v2/models/rapidocr/infer",
            json={"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [image]}]},
        )
    assert v1.status_code == 200, v1.text
    single, document = v1.json()["predictions"]
    assert_reads(case.text, single["text"])
    assert [page["page"] for page in document["pages"]] == [1, 2]
    assert v2.status_code == 200, v2.text
    assert_reads(case.text, json.loads(v2.json()["outputs"][0]["data"][0])["text"])


# -- limits: 413 naming the limit --------------------------------------------------------------------


def test_an_image_over_max_image_bytes_is_a_413_naming_the_limit(rapidocr_predictor: PredictorProcess) -> None:
    blob = base64.b64encode(b"\x00" * (3 * 2**20)).decode()
    error = error_of(ocr(rapidocr_predictor, images=[blob]), 413)
    assert error["param"] == "images[0]"
    assert "max_image_bytes" in error["message"]
    assert "2.0 MiB" in error["message"]


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (samples.png_claiming_size(2500, 2000), "a header over max_pixels"),
        (samples.png_claiming_size(50000, 50000), "a decompression bomb's header"),
        (samples.encode(Image.new("L", (2500, 2000), 255)), "a real image over max_pixels"),
    ],
)
def test_an_image_over_max_pixels_is_a_413_naming_the_limit(
    rapidocr_predictor: PredictorProcess, data: bytes, what: str
) -> None:
    error = error_of(ocr(rapidocr_predictor, images=[samples.b64(data)]), 413)
    assert error["param"] == "images[0]", what
    assert "max_pixels" in error["message"]
    assert "4000000" in error["message"]


def test_a_pdf_page_over_max_pixels_is_a_413_before_rendering(rapidocr_predictor: PredictorProcess) -> None:
    poster = samples.pdf([["tiny"]], resolution=10.0)  # 24 x 27 inches: 4880 x 5440 px at 200 dpi
    error = error_of(ocr(rapidocr_predictor, document=samples.b64(poster)), 413)
    assert "max_pixels" in error["message"]
    assert "page 1" in error["message"]


def test_a_pdf_over_max_pages_is_a_413_naming_the_limit(rapidocr_predictor: PredictorProcess) -> None:
    document = samples.pdf([["one"], ["two"], ["three"], ["four"]])
    error = error_of(ocr(rapidocr_predictor, document=samples.b64(document)), 413)
    assert error["param"] == "document"
    assert "max_pages is 3" in error["message"]


def test_too_many_images_is_a_413_naming_max_images(rapidocr_predictor: PredictorProcess) -> None:
    image = samples.b64(samples.encode(Image.new("L", (40, 40), 255)))
    error = error_of(ocr(rapidocr_predictor, images=[image] * 9), 413)
    assert "max_images is 8" in error["message"]


def test_a_body_over_max_body_bytes_is_a_413(rapidocr_predictor: PredictorProcess) -> None:
    blob = "A" * (9 * 2**20)
    error = error_of(ocr(rapidocr_predictor, images=[blob]), 413)
    assert "8 MiB" in error["message"]


# -- client mistakes: 400 naming the field -----------------------------------------------------------


def _gif() -> bytes:
    return samples.encode(Image.new("P", (30, 30)), "GIF")


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("!!! not base64 !!!", "not valid base64"),
        (samples.b64(b"hello, this is plain text and not an image"), "not a PNG, JPEG, TIFF or WebP image"),
        (samples.b64(_gif()), "received GIF"),
        (samples.b64(samples.encode(Image.new("RGB", (300, 300), "white"))[:120]), "corrupt or truncated"),
        ("", "is empty"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_index(predictor: PredictorProcess, bad: str, says: str) -> None:
    good = samples.b64(samples.encode(Image.new("L", (40, 40), 255)))
    error = error_of(ocr(predictor, images=[good, bad]), 400)
    assert error["param"] == "images[1]"
    assert error["message"].startswith("images[1]: ")
    assert says in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "images"),
        ({"images": []}, "images"),
        ({"images": "abc"}, "images"),
        ({"images": ["abc"], "document": "abc"}, "document"),
        ({"document": samples.b64(b"not a pdf at all")}, "document"),
        ({"document": samples.b64(b"%PDF-1.4 but then garbage")}, "document"),
        ({"images": [samples.b64(b"x")], "return_boxes": "maybe"}, "return_boxes"),
        ({"images": [samples.b64(b"x")], "languages": [3]}, "languages[0]"),
    ],
)
def test_malformed_requests_are_400s_naming_the_field(
    rapidocr_predictor: PredictorProcess, body: dict[str, Any], param: str
) -> None:
    error = error_of(ocr(rapidocr_predictor, **body), 400)
    assert error["param"] == param


def test_another_model_name_is_a_404(rapidocr_predictor: PredictorProcess) -> None:
    error = error_of(ocr(rapidocr_predictor, model="gpt-4o", images=["x"]), 404)
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("backend", "says"),
    [("rapidocr", "neither a directory of ONNX models nor one of builtin"),
     ("tesseract", "neither a directory of *.traineddata files nor one of builtin")],
)  # fmt: skip
def test_a_source_that_is_not_a_model_directory_stops_start_up_with_one_line(backend: str, says: str) -> None:
    result = run_predictor_cli(
        ["--model_name=x", "--task=ocr", f"--backend={backend}", "--source=/nonexistent/ocr-models",
         f"--http_port={free_port()}"]
    )  # fmt: skip
    assert result.returncode == 2
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# -- uploads: multipart/form-data through the real gateway ----------------------------------------


@pytest.fixture
async def gateway_url(rapidocr_predictor: PredictorProcess) -> AsyncIterator[str]:
    """The real gateway in front of the rapidocr predictor process (routing uploads by their model field)."""
    from tests.gateway.harness import OneUpstream
    from universal_gateway.app import Gateway

    gateway = Gateway(OneUpstream(rapidocr_predictor.url, rapidocr_predictor.config.model_name, Task.OCR))
    async with gateway.serving() as url:
        yield url


async def upload(url: str, files: list[tuple[str, tuple[str | None, bytes, str]]], **fields: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{url}/v1/ocr", files=files, data={"model": "rapidocr", **fields})


def png(image: Image.Image) -> tuple[str, bytes, str]:
    return ("page.png", samples.encode(image), "image/png")


async def test_an_image_uploaded_as_a_form_file_is_read_through_the_gateway(gateway_url: str) -> None:
    case = samples.paragraph()
    response = await upload(gateway_url, [("file", png(case.image))], return_boxes="true", languages="en")
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    assert_reads(case.text, item["text"])
    assert len(item["boxes"]) == len(case.lines)
    assert (item["width"], item["height"]) == case.image.size


async def test_curl_uploads_the_way_users_send_files(gateway_url: str, tmp_path: Path) -> None:
    case = samples.paragraph()
    page = tmp_path / "page.png"
    page.write_bytes(samples.encode(case.image))
    done = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-F", f"file=@{page}", "-F", "model=rapidocr", f"{gateway_url}/v1/ocr",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await done.communicate()
    assert done.returncode == 0
    assert_reads(case.text, json.loads(out)["data"][0]["text"])


async def test_several_images_and_an_uploaded_pdf_read_as_their_json_twins(gateway_url: str) -> None:
    cases = samples.font_samples()[:2]
    images = await upload(gateway_url, [("images", png(case.image)) for case in cases])
    assert images.status_code == 200, images.text
    assert [item["index"] for item in images.json()["data"]] == [0, 1]
    for case, item in zip(cases, images.json()["data"], strict=True):
        assert_reads(case.text, item["text"])
    document = await upload(gateway_url, [("file", ("report.pdf", samples.pdf(), "application/pdf"))])
    assert document.status_code == 200, document.text
    pages = document.json()["data"]
    assert [item["page"] for item in pages] == [1, 2]
    for lines, item in zip(samples.PDF_PAGES, pages, strict=True):
        assert_reads(" ".join(lines), item["text"])


@pytest.mark.parametrize(
    ("field", "data", "json_field"),
    [
        ("file", b"\x00" * (3 * 2**20), "images"),
        ("file", samples.png_claiming_size(2500, 2000), "images"),
        ("document", samples.pdf([["one"], ["two"], ["three"], ["four"]]), "document"),
    ],
    ids=["max_image_bytes", "max_pixels", "max_pages"],
)
async def test_an_upload_over_a_limit_gets_the_json_requests_413(
    gateway_url: str, rapidocr_predictor: PredictorProcess, field: str, data: bytes, json_field: str
) -> None:
    uploaded = error_of(await upload(gateway_url, [(field, ("input.bin", data, "application/octet-stream"))]), 413)
    value = samples.b64(data)
    sent = error_of(ocr(rapidocr_predictor, **{json_field: [value] if json_field == "images" else value}), 413)
    assert uploaded["param"] == field
    assert uploaded["code"] == sent["code"]
    assert uploaded["message"].startswith(f"{field}: ")
    # Sized before decoding, base64 is "about" its size; the tail naming the limit is the same.
    assert uploaded["message"].split("; the limit ")[1] == sent["message"].split("; the limit ")[1]


async def test_an_upload_over_max_body_bytes_is_the_same_413(gateway_url: str) -> None:
    error = error_of(await upload(gateway_url, [("file", ("big.png", b"\x00" * (9 * 2**20), "image/png"))]), 413)
    assert "8 MiB" in error["message"]


@pytest.mark.parametrize(
    ("files", "fields", "param", "says"),
    [
        ([("languages", (None, b"en", "text/plain"))], {}, "images", "form field 'file'"),  # a form without a file
        ([("attachment", ("a.png", b"x", "image/png"))], {}, "attachment", "sends its files as one of"),
        ([("file", ("a.png", b"not an image", "image/png"))], {}, "file", "not a PNG"),
        ([("file", ("a.pdf", samples.pdf([["one"]]), "application/pdf")), ("file", ("b.png", b"x", "image/png"))],
         {}, "file[0]", "not both"),
        ([("file", ("a.png", b"x", "image/png"))], {"return_boxes": "perhaps"}, "return_boxes", "boolean"),
    ],
)  # fmt: skip
async def test_a_bad_upload_is_a_400_naming_the_form_field(
    gateway_url: str,
    files: list[tuple[str, tuple[str | None, bytes, str]]],
    fields: dict[str, str],
    param: str,
    says: str,
) -> None:
    error = error_of(await upload(gateway_url, files, **fields), 400)
    assert error["param"] == param
    assert says in error["message"]


def test_a_multipart_body_that_does_not_parse_is_a_400(rapidocr_predictor: PredictorProcess) -> None:
    with rapidocr_predictor.client() as client:
        response = client.post("/v1/ocr", content=b"--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nr",
                               headers={"Content-Type": "multipart/form-data; boundary=xyz"})  # fmt: skip
    error = error_of(response, 400)
    assert (error["code"], error["message"]) == ("invalid_body", "The multipart body cannot be parsed: it ends "
                                                 "before the closing boundary.")  # fmt: skip
