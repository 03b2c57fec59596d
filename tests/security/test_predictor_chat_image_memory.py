"""Issue 31, item 4: concurrent chat requests with large images decode within one predictor-wide budget
(universal_predictors.decode_budget), measured as the RSS of a real vision predictor (the tiny LLaVA on
transformers). Before the budget, 8 concurrent requests of 8 inline 5000x5000 PNGs took a vision model from
937 to 3,883 MB and kept 2,906 MB: every request decoded its image at full size at the same time."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.predictors.generation.conftest import tiny_vlm_dir
from tests.predictors.generation.tiny_vlm import data_url
from tests.predictors.harness import PredictorProcess, running_predictor
from tests.security.memory import peak_rise_mb, settled_rss_mb
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.chat_images import DECODE_BYTES_PER_PIXEL

__all__ = ["tiny_vlm_dir"]

SIDE = 4800  # 23 megapixels, within the default max_image_pixels (25,000,000)
IMAGE_MB = SIDE * SIDE * DECODE_BYTES_PER_PIXEL // 2**20  # what one image reserves: 263 MiB
BUDGET_MB = IMAGE_MB + 32  # one image decoded at a time
REQUESTS, IMAGES = 8, 4


def large_picture() -> str:
    """A SIDE x SIDE picture (ruled lines and boxes) as a PNG data URL: a few hundred KB to send, 66 MiB of RGB
    decoded."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), "white")
    draw = ImageDraw.Draw(image)
    for y in range(30, SIDE, 90):
        draw.line((30, y, SIDE - 30, y), fill="navy", width=5)
    for x in range(60, SIDE, 500):
        draw.ellipse((x, 200, x + 300, 500), fill="orange", outline="black", width=6)
    return data_url(image)


@pytest.fixture(scope="module")
def vision(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="tiny-vlm", task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(tiny_vlm_dir),
                             engine_args={"decode_budget_mb": str(BUDGET_MB), "decode_wait_s": "600"})  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("chat-image-memory")) as predictor:
        yield predictor


def chat(predictor: PredictorProcess, picture: str, images: int) -> httpx.Response:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": picture}} for _ in range(images)]
    content.append({"type": "text", "text": "What is in these pictures?"})
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with predictor.client(timeout=600) as client:
        return client.post("/openai/v1/chat/completions", json=body)


def test_concurrent_large_images_decode_within_the_budget_and_the_memory_is_given_back(
    vision: PredictorProcess,
) -> None:
    picture = large_picture()
    assert chat(vision, picture, 1).status_code == 200  # warm: the engine's own buffers exist before measuring
    pid = vision.process.pid
    idle = settled_rss_mb(pid)
    answers: list[httpx.Response] = []

    def burst() -> None:
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            answers.extend(pool.map(lambda _: chat(vision, picture, IMAGES), range(REQUESTS)))

    rise = peak_rise_mb(pid, idle, burst)
    assert [a.status_code for a in answers] == [200] * REQUESTS, answers[0].text
    # 32 images of 23 megapixels, one decoded at a time: the peak stays within the budget (without it, the
    # requests decode side by side, several budgets' worth at once).
    assert rise < BUDGET_MB, f"{REQUESTS} requests of {IMAGES} large images took RSS {rise:.0f} MiB above idle"
    time.sleep(1.5)  # the heap trimmed once idle (universal_predictors.allocator)
    after = settled_rss_mb(pid) - idle
    assert after < IMAGE_MB / 2, f"the burst's memory was not given back: {after} MiB above idle (peak {rise:.0f})"
