"""OCR throughput: images per second through the predictor's ``POST /v1/ocr`` vs RapidOCR in-process.

The same PNG files (rendered text in several fonts and sizes, a paragraph, rotated lines and a
document page) go through:

- the anchor: ``rapidocr_onnxruntime.RapidOCR`` called in this process on the PNG bytes, one image
  after another, configured as the predictor configures it (detection bounded by the longer side);
- a real predictor process (``python -m universal_predictors --task ocr --backend rapidocr``), one
  image per request, base64 in JSON over loopback HTTP, at concurrency 1 and 4.

Both run on the same machine in the same run, one after the other. One line per comparison, with
the ratio against the anchor. Goal (issue #4): at least 0.9x.

    python bench/ocr.py
    python bench/ocr.py --rounds 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from PIL import Image  # noqa: E402

from tests.predictors import ocr_samples as samples  # noqa: E402
from tests.predictors.harness import running_predictor  # noqa: E402
from universal_predictors.catalog import Backend, Task  # noqa: E402
from universal_predictors.config import PredictorConfig  # noqa: E402


def document_page() -> Image.Image:
    """An A5-ish page at 150 dpi with a title and twelve lines of text."""
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "it",
        "that",
        "for",
        "on",
        "with",
        "as",
        "was",
        "at",
        "by",
        "an",
        "be",
        "this",
        "from",
        "or",
        "have",
        "not",
        "are",
    ]
    lines = [" ".join(words[(i * 5 + j) % len(words)] for j in range(9)) + f" {i + 1}" for i in range(12)]
    page = Image.new("RGB", (874, 1240), "white")
    page.paste(samples.render(["Quarterly report"], samples.body_font(40)), (40, 40))
    page.paste(samples.render(lines, samples.body_font(24)), (40, 160))
    return page


def images() -> list[bytes]:
    pictures = [case.image for case in samples.font_samples()]
    pictures += [samples.paragraph().image, samples.rotated(7).image, samples.rotated(-7).image, document_page()]
    return [samples.encode(picture) for picture in pictures]


def in_process_pass(engine: Any, pngs: list[bytes]) -> float:
    started = time.perf_counter()
    for png in pngs:
        engine(png)
    return len(pngs) / (time.perf_counter() - started)


def predictor_pass(client: httpx.Client, bodies: list[dict[str, list[str]]], concurrency: int) -> float:
    def one(body: dict[str, list[str]]) -> None:
        client.post("/v1/ocr", json=body).raise_for_status()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, bodies))
    return len(bodies) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved passes over the image set per method")
    args = parser.parse_args()
    from rapidocr_onnxruntime import RapidOCR

    pngs = images()
    bodies = [{"images": [samples.b64(png)]} for png in pngs]
    machine = f"{os.cpu_count()} cores, {platform.machine()}, CPU"
    print(f"ocr bench: {len(pngs)} images, {args.rounds} interleaved passes per method (median), {machine}")
    config = PredictorConfig(model_name="rapidocr-bench", task=Task.OCR, backend=Backend.RAPIDOCR, source="builtin")
    # The anchor: RapidOCR configured as the predictor configures it (see universal_predictors.ocr.rapid).
    engine = RapidOCR(det_limit_type="max", det_limit_side_len=2000, max_side_len=2000)
    rates: dict[str, list[float]] = {"anchor": [], "c1": [], "c4": []}
    with (
        tempfile.TemporaryDirectory() as logs,
        running_predictor(config, Path(logs)) as predictor,
        httpx.Client(base_url=predictor.url, timeout=300) as client,
    ):
        in_process_pass(engine, pngs)  # warm-up both
        predictor_pass(client, bodies, 1)
        # Interleaved, so load from anything else on the machine falls on every method alike.
        for _ in range(args.rounds):
            rates["anchor"].append(in_process_pass(engine, pngs))
            rates["c1"].append(predictor_pass(client, bodies, 1))
            rates["c4"].append(predictor_pass(client, bodies, 4))
    anchor = statistics.median(rates["anchor"])
    for concurrency in (1, 4):
        rate = statistics.median(rates[f"c{concurrency}"])
        print(
            f"ocr: predictor /v1/ocr {rate:.2f} images/s (concurrency {concurrency}) vs in-process RapidOCR "
            f"{anchor:.2f} images/s: {rate / anchor:.2f}x (goal >= 0.9x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
