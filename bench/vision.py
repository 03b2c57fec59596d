"""Images in: pages per second through the document task, and chat time to first token with an image.

1. Document pages: the same rendered page images go through

   - the anchor: the Donut model run in this process by transformers, the Donut recipe
     (``tests/predictors/donut_reference.py``: processor, task prompt, ``generate``, ``token2json``),
     pages in batches of the same size as the predictor's concurrency;
   - a real predictor process (``python -m universal_predictors --task document``), one page per
     request (``POST /v1/document/extract``, base64 JSON over loopback HTTP), that many requests in
     flight at once (the predictor's micro-batcher turns them into batches).

   Interleaved rounds, medians; one line per concurrency with the ratio. Goal (issue #15): >= 0.9x.

2. Chat time to first token: a streamed chat completion with one image against the same request with
   text only, through a real generate predictor serving the tests' tiny vision-language model (LLaVA,
   ``tests/predictors/generation/tiny_vlm.py``) on the transformers engine.

The model is the constructed Donut of ``tests/predictors/tiny_donut.py`` (``--shape tiny``, the tests'
model, a page in tens of milliseconds, so the ratio measures the serving layer's fixed cost per page;
``--shape small``, donut-base's encoder stages and decoder depth at a smaller width, a page in about a
second) unless ``--donut PATH`` names a real checkpoint (e.g. a local copy of
naver-clova-ix/donut-base-finetuned-cord-v2).

    python bench/vision.py
    python bench/vision.py --quick
    python bench/vision.py --shape small --pages 4 --rounds 3 --skip-chat
    python bench/vision.py --donut /models/donut-cord --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
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
# The anchor runs with the OpenMP setting the predictor uses (universal_predictors.__main__): with spinning
# OpenMP workers, a process sharing the machine with another runs several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from PIL import Image  # noqa: E402

from tests.predictors import ocr_samples as samples  # noqa: E402
from tests.predictors.harness import running_predictor  # noqa: E402
from universal_predictors.catalog import Backend, Task  # noqa: E402
from universal_predictors.config import PredictorConfig  # noqa: E402

EXTRACT_PROMPT = "<s_cord-v2>"


def receipt(number: int) -> Image.Image:
    """A receipt-like page: a title, a few item lines and a total."""
    lines = [f"Store {number}", *(f"item {i} x{i + number % 3} {i * 1.25 + number:.2f}" for i in range(6))]
    lines.append(f"TOTAL {number * 3.5:.2f}")
    page = Image.new("RGB", (600, 800), "white")
    page.paste(samples.render(lines, samples.body_font(26)), (30, 40))
    return page


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def anchor_pass(reference: Any, pngs: list[bytes], batch: int) -> float:
    """The page files decoded and read in batches of ``batch`` (the predictor, too, starts from the file)."""
    started = time.perf_counter()
    for start in range(0, len(pngs), batch):
        images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs[start : start + batch]]
        reference.generate(images, EXTRACT_PROMPT)
    return len(pngs) / (time.perf_counter() - started)


def predictor_pass(client: httpx.Client, bodies: list[dict[str, str]], concurrency: int) -> float:
    def one(body: dict[str, str]) -> None:
        client.post("/v1/document/extract", json=body).raise_for_status()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, bodies))
    return len(bodies) / (time.perf_counter() - started)


def document_bench(donut: Path, rounds: int, count: int, concurrencies: list[int], logs: Path) -> None:
    from tests.predictors.donut_reference import DonutReference

    pngs = [png(receipt(n)) for n in range(count)]
    bodies = [{"image": base64.b64encode(data).decode("ascii")} for data in pngs]
    reference = DonutReference(donut)
    config = PredictorConfig(model_name="donut-bench", task=Task.DOCUMENT, source=str(donut))
    rates: dict[str, list[float]] = {f"{kind}{c}": [] for kind in ("anchor", "ours") for c in concurrencies}
    with running_predictor(config, logs) as predictor, httpx.Client(base_url=predictor.url, timeout=600) as client:
        anchor_pass(reference, pngs[:2], 1)  # warm-up both
        predictor_pass(client, bodies[:2], 1)
        for _ in range(rounds):  # interleaved: load from the rest of the machine falls on both alike
            for c in concurrencies:
                rates[f"anchor{c}"].append(anchor_pass(reference, pngs, c))
                rates[f"ours{c}"].append(predictor_pass(client, bodies, c))
    for c in concurrencies:
        ours, anchor = statistics.median(rates[f"ours{c}"]), statistics.median(rates[f"anchor{c}"])
        print(
            f"document: predictor /v1/document/extract {ours:.2f} pages/s (concurrency {c}) vs in-process "
            f"transformers Donut {anchor:.2f} pages/s (batches of {c}): {ours / anchor:.2f}x (goal >= 0.9x)",
            flush=True,
        )


def chat_ttft_bench(rounds: int, logs: Path, work: Path) -> None:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    from tests.predictors.generation.tiny_vlm import build_vlm, data_url, render_image

    model_dir = build_vlm(work / "tiny-vlm")
    config = PredictorConfig(model_name="tiny-vlm", task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(model_dir))  # fmt: skip
    image = data_url(render_image("A1", (64, 48)))
    text = "Describe the picture in one line."
    with_image: list[ChatCompletionMessageParam] = [{"role": "user", "content": [{"type": "text", "text": text},
                                               {"type": "image_url", "image_url": {"url": image}}]}]  # fmt: skip
    text_only: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    with running_predictor(config, logs) as predictor:
        client = openai.OpenAI(base_url=predictor.openai_url, api_key="unused")

        def ttft(messages: list[ChatCompletionMessageParam]) -> float:
            started = time.perf_counter()
            stream = client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=8, stream=True)
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            return first if first is not None else time.perf_counter() - started

        ttft(with_image), ttft(text_only)  # warm-up
        image_times, text_times = [], []
        for _ in range(rounds * 5):
            image_times.append(ttft(with_image))
            text_times.append(ttft(text_only))
    ours, anchor = statistics.median(image_times), statistics.median(text_times)
    print(
        f"chat: time to first token with one image {ours * 1000:.1f} ms vs text only {anchor * 1000:.1f} ms "
        f"(tiny LLaVA, transformers, streamed): {ours / anchor:.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved passes per method (median)")
    parser.add_argument("--pages", type=int, default=16, help="pages per pass")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated concurrencies (= anchor batch sizes)")
    parser.add_argument("--donut", type=Path, default=None, help="a Donut checkpoint (default: one built here)")
    parser.add_argument(
        "--shape", choices=["tiny", "small"], default="tiny",
        help="the Donut built here: tiny (the tests', the serving layer's own costs dominate) or small "
        "(donut-base's stages at a smaller width and page: the model's compute dominates, as with a real one)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 pages: a smoke run")
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--skip-document", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.pages = 2, 8
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    machine = f"{os.cpu_count()} cores, {platform.machine()}, CPU"
    print(f"vision bench: {args.pages} pages, {args.rounds} interleaved passes per method (median), {machine}")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        if not args.skip_document:
            donut = args.donut
            if donut is None:
                from tests.predictors.tiny_donut import SMALL, TINY, build_donut

                donut = build_donut(work / f"{args.shape}-donut", shape=SMALL if args.shape == "small" else TINY)
                print(f"document: a random Donut built here, shape {args.shape}", flush=True)
            document_bench(donut, args.rounds, args.pages, concurrencies, work / "logs")
        if not args.skip_chat:
            chat_ttft_bench(args.rounds, work / "logs", work)


if __name__ == "__main__":
    main()
