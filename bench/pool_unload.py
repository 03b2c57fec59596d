"""Memory a shared host gives back when pool members unload (issue 29): what an idle member's unload returns to the
node, measured on the host process itself.

In a pool (``serve --member-processes shared``) a library family's members share one host process; an unloaded
member's weights go back to the allocator (``shared_host._give_back``: a full collection, then ``malloc_trim``),
and what the allocator keeps stays charged to the pod. For each family: a member that stays (idleTimeout 1h) is
loaded alone, then ``--transient`` more of the same task (idleTimeout 15s); when those have unloaded, the host's
resident memory is compared with the anchor measured in the same run, the host with only the staying member:

    given back = (RSS with all loaded - RSS after they unloaded) / (RSS with all loaded - RSS with one member)

Members: ``embed`` (all-MiniLM-L6-v2, the torch family) and ``ocr`` (RapidOCR's ONNX sessions, the ocr family) by
default; ``classify`` and ``ner`` (tiny BERTs, torch) and ``anomaly`` (PyOD, from requests) may be named too, though
their members hold little.

    .venv/bin/python bench/pool_unload.py [--tasks embed,ocr] [--transient 3]

Nothing here is asserted. Measured 2026-12-05 (2 cores; docs/pools.md): torch (embed) +169 MiB with 3 more members,
17 MiB kept after they unloaded (90% given back), +287 with 5, 40 kept (86%); ocr +111 / 24 kept (78%), +179 / 40 kept
(78%); pyod (anomaly) +17 with 5, 12 kept. Once the host collected once after removals in a row: torch +168 / 17 kept
(90%), ocr +168 / 14 kept (92%).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pools import build_sources, ocr_image, request, serve, timed_post

MiB = 2**20
IDLE_S = 15


def resident(pid: int) -> int:
    """The process's own resident memory (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def write(folder: Path, name: str, task: str, source: str, idle: str) -> None:
    backend = "\n  backend: rapidocr" if task == "ocr" else ""
    (folder / f"{name}.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: {name}}}\nspec:\n  task: {task}{backend}\n"
        f'  source: {{uri: "{source}"}}\n  scaling: {{idleTimeout: {idle}}}\n'
    )


def host_pid(log: Path, family: str) -> int:
    found = re.findall(rf"the {family} shared host is up \(pid (\d+)", log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"serve's log names no {family} shared host")
    return int(found[-1])


FAMILY = {"embed": "torch", "classify": "torch", "ner": "torch", "ocr": "ocr", "anomaly": "pyod"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="embed,ocr", help="one staying member and its transient ones per task")
    parser.add_argument("--transient", type=int, default=3, help="members that load, then unload (per task)")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    if len({FAMILY[t] for t in tasks}) != len(tasks):
        parser.error("one task per family (each family's host is measured alone)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sources = build_sources(tmp / "sources")
        folder = tmp / "members"
        folder.mkdir()
        (tmp / "work").mkdir()
        for task in tasks:
            write(folder, f"{task}-stays", task, sources[task], "1h")
            for i in range(args.transient):
                write(folder, f"{task}-goes-{i}", task, sources[task], f"{IDLE_S}s")
        image = ocr_image()
        with (
            serve(folder, tmp / "work", "--member-processes", "shared") as (url, _, log),
            httpx.Client(timeout=600) as client,
        ):

            def ask(name: str, task: str, *, first: bool) -> None:
                path, _, body = request(task, name, image, first=first)
                timed_post(client, url + path, body)

            one: dict[str, int] = {}
            for task in tasks:
                ask(f"{task}-stays", task, first=True)
                ask(f"{task}-stays", task, first=False)
                time.sleep(1)
                one[task] = resident(host_pid(log, FAMILY[task]))
            for task in tasks:
                for i in range(args.transient):
                    ask(f"{task}-goes-{i}", task, first=True)
            peak: dict[str, int] = {}
            for task in tasks:  # every member answers once more: all loaded now
                for i in range(args.transient):
                    ask(f"{task}-goes-{i}", task, first=False)
                peak[task] = resident(host_pid(log, FAMILY[task]))
            deadline = time.monotonic() + IDLE_S + 120
            gone = [f"{task}-goes-{i}" for task in tasks for i in range(args.transient)]
            while True:
                text = log.read_text(errors="replace")
                left = [name for name in gone if f"stopping {name} (" not in text]
                if not left:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not unloaded after {IDLE_S + 120}s: {', '.join(left)}")
                time.sleep(1)
            time.sleep(5)  # the host gives the memory back on a thread after it answered the removal
            for task in tasks:
                after = resident(host_pid(log, FAMILY[task]))
                ask(f"{task}-stays", task, first=False)  # the staying member still answers
                added, kept = peak[task] - one[task], after - one[task]
                share = (peak[task] - after) / added if added > 0 else float("nan")
                print(
                    f"pool_unload[{FAMILY[task]}] {task}: host RSS with one member {one[task] / MiB:.0f} MiB, with "
                    f"{args.transient} more {peak[task] / MiB:.0f} MiB (+{added / MiB:.0f}), after they unloaded "
                    f"{after / MiB:.0f} MiB: {share:.0%} of what they added given back ({kept / MiB:+.0f} MiB kept "
                    "against the host with one member, the anchor)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
