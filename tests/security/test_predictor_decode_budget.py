"""One decode budget per predictor across concurrent requests (universal_predictors.decode_budget): a burst of
large pages, each within its request's limits, waits its turn instead of decoding all at once; a request over the
whole budget is a 413, one that waits past ``decode_wait_s`` a 503 with Retry-After, on a real OCR predictor
(RapidOCR). Before: 16 concurrent 6300x6300 pages took an OCR predictor from 680 to 4,915 MB."""

from __future__ import annotations

import base64
import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image, ImageDraw

from tests.predictors import ocr_samples as samples
from tests.predictors.harness import PredictorProcess, running_predictor
from tests.security.memory import peak_rise_mb, settled_rss_mb
from tests.security.predictor_fixtures import openai_error
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.ocr.pages import OCR_BYTES_PER_PIXEL

SIDE = 6000  # 36 megapixels, within the default max_pixels (40,000,000)
PAGE_MB = SIDE * SIDE * OCR_BYTES_PER_PIXEL // 2**20  # what one page reserves: 549 MiB
BUDGET_MB = PAGE_MB + 26  # one page at a time
BURST = 12
#: Detection works at this side at most: the engine's own working memory (a few hundred MB at the default
#: 2000, whatever the page's size) stays small beside the pages this test is about.
MAX_SIDE = 640


def big_page(side: int = SIDE) -> str:
    """A side x side page of ruled lines and boxes (a few hundred KB as PNG), for RapidOCR to look through."""
    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    for y in range(40, side, 60):
        draw.line((40, y, side - 40, y), fill="black", width=3)
    for x in range(80, side, 400):
        draw.rectangle((x, 100, x + 200, 160), outline="black", width=4)
    return base64.b64encode(samples.encode(image)).decode()


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="ocr", task=Task.OCR, backend=Backend.RAPIDOCR, source="builtin",
                             engine_args={"decode_budget_mb": str(BUDGET_MB), "decode_wait_s": "600",
                                          "max_side": str(MAX_SIDE)})  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("decode-budget")) as predictor:
        yield predictor


def ocr(predictor: PredictorProcess, images: list[str], timeout: float = 600) -> httpx.Response:
    with predictor.client(timeout=timeout) as client:
        return client.post("/v1/ocr", json={"images": images})


def test_a_burst_of_large_pages_takes_turns_and_gives_the_memory_back(budgeted: PredictorProcess) -> None:
    page = big_page()
    assert ocr(budgeted, [page]).status_code == 200  # warm: the engine's own buffers exist before measuring
    pid = budgeted.process.pid
    idle = settled_rss_mb(pid)
    answers: list[httpx.Response] = []

    def burst() -> None:
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            answers.extend(pool.map(lambda _: ocr(budgeted, [page]), range(BURST)))

    # Twelve 36-megapixel pages, one decoded and read at a time within the budget: every one answered (none
    # refused for waiting), and the peak within the budget. Before it, the pages were decoded side by side and
    # waited, decoded, for the engine thread: 12 x 103 MiB of RGB and their copies at once.
    rise = peak_rise_mb(pid, idle, burst)
    assert [a.status_code for a in answers] == [200] * BURST
    assert rise < BUDGET_MB, f"{BURST} concurrent {SIDE}x{SIDE} pages took RSS {rise:.0f} MiB above idle"
    time.sleep(1.5)  # the heap trimmed once idle (universal_predictors.allocator)
    after = settled_rss_mb(pid) - idle
    assert after < PAGE_MB / 2, f"the burst's memory was not given back: {after} MiB above idle (peak {rise:.0f})"


def test_a_request_over_the_whole_budget_is_a_413(budgeted: PredictorProcess) -> None:
    page = big_page()
    error = openai_error(ocr(budgeted, [page, page]), 413)
    assert error["code"] == "decode_budget_exceeded"
    assert f"({BUDGET_MB} MiB, the engine argument decode_budget_mb)" in error["message"]


def test_a_request_that_waits_past_decode_wait_s_is_a_503_with_retry_after(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = PredictorConfig(model_name="ocr", task=Task.OCR, backend=Backend.RAPIDOCR, source="builtin",
                             engine_args={"decode_budget_mb": "80", "decode_wait_s": "0.2"})  # fmt: skip
    page = big_page(2000)  # 61 MiB reserved: one at a time
    with (
        running_predictor(config, tmp_path_factory.mktemp("decode-wait")) as predictor,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        answers = list(pool.map(lambda _: ocr(predictor, [page]), range(4)))
    busy = [a for a in answers if a.status_code == 503]
    assert busy, [a.status_code for a in answers]
    assert all(a.status_code in (200, 503) for a in answers)
    assert busy[0].json()["error"]["code"] == "decode_budget_busy"
    assert float(busy[0].headers["retry-after"]) >= 1
