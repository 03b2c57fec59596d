"""Operator scale: apply N UniversalModels and time until every child exists and every parent is Ready.

The operator runs as a real process (`universal-runtime operator`) against the in-process API emulator,
with a KServe stand-in reporting each InferenceService Ready. Printed per N, one line each:

- convergence time, and the ratio against the anchor: a minimal hand-written controller doing the
  least any controller must (one apply per child, one Pending and one Ready status patch per parent)
  against the same emulator in the same run, with no framework;
- API writes and requests per model made by the operator (the harness's own traffic excluded);
- the operator process's peak RSS.

Goals (issue #2): 1000 models in under 60 s, under 200 MB RSS, at most 6 writes per model.

    python bench/operator_scale.py            # N = 100 and 1000
    python bench/operator_scale.py --n 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from lightkube import AsyncClient
from lightkube.types import PatchType

from universal_operator.config import OperatorConfig
from universal_operator.crd import custom_resource_definition
from universal_operator.kube import FIELD_MANAGER, InferenceService, UniversalModelResource
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.spec import parse_model
from universal_simcluster.apiserver import HARNESS_HEADER, KubeEmulator, ServedEmulator, serve_emulator
from universal_simcluster.kserve.standin import ready_status

TIMEOUT = 300.0
CONCURRENCY = 32


@dataclass
class Run:
    seconds: float
    writes: int
    requests: int
    peak_rss: int


def manifest(i: int) -> dict[str, Any]:
    tasks = ["generate", "embed", "rerank", "classify", "ner", "ocr", "anomaly"]
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": f"model-{i:05d}", "namespace": "default"},
        "spec": {
            "task": tasks[i % len(tasks)],
            "source": {"uri": f"hf://org/model-{i}"},
            "resources": {"cpu": "1", "memory": "2Gi"},
            "scaling": {"idleTimeout": "5m"},
        },
    }


async def _harness_post(emulator: KubeEmulator, path: str, body: dict[str, Any]) -> None:
    headers = {"Content-Type": "application/json", HARNESS_HEADER: "true"}
    async with emulator.post(path, data=json.dumps(body), headers=headers) as response:
        if response.status >= 400:
            raise RuntimeError(f"creating {body['metadata']['name']}: {response.status} {await response.text()}")


async def create_models(emulator: KubeEmulator, n: int) -> None:
    path = emulator.url_for("universalmodels", "default")
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with gate:
            await _harness_post(emulator, path, manifest(i))

    await asyncio.gather(*(one(i) for i in range(n)))


async def play_kserve(emulator: KubeEmulator, client: AsyncClient) -> None:
    """Report each new InferenceService generation Ready (status writes go through the harness path)."""
    # KServe's observedGeneration is its child's, not the InferenceService's: remember what was reported.
    reported: set[tuple[str, int]] = set()
    while True:
        with contextlib.suppress(Exception):
            async for kind, obj in client.watch(InferenceService, namespace="*"):
                if kind == "DELETED":
                    continue
                raw: Any = obj  # a lightkube generic resource: to_dict is untyped
                isvc = raw.to_dict()
                meta = isvc["metadata"]
                key = (str(meta.get("uid")), int(meta.get("generation") or 1))
                if key in reported:
                    continue
                reported.add(key)
                await emulator.put_status("inferenceservices", meta["namespace"], meta["name"], ready_status(isvc))
        await asyncio.sleep(0.1)


def converged(emulator: KubeEmulator, n: int) -> bool:
    children = emulator.list_objects("inferenceservices", "default")
    if len(children) < n:
        return False
    models = emulator.list_objects("universalmodels", "default")
    ready: int = sum((m.get("status") or {}).get("phase") == "Ready" for m in models)
    return ready >= n


async def wait_converged(emulator: KubeEmulator, n: int, started: float) -> float:
    while not converged(emulator, n):
        if time.monotonic() - started > TIMEOUT:
            raise TimeoutError(f"{n} models did not converge within {TIMEOUT:.0f}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


def operator_requests(emulator: KubeEmulator) -> int:
    return sum(1 for r in emulator._requests if not r.headers.get(HARNESS_HEADER))


async def run_operator(served: ServedEmulator, n: int, workdir: Path) -> Run:
    """The real operator process against the emulator."""
    emulator = served.emulator
    env = {**os.environ, "KUBECONFIG": str(served.kubeconfig)}
    log = (workdir / "operator.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "universal_operator.cli", "operator", "--liveness", "",
        env=env, stdout=log, stderr=log,
    )  # fmt: skip
    ps = psutil.Process(proc.pid)
    peak = 0

    async def sample_rss() -> None:
        nonlocal peak
        while True:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, ps.memory_info().rss)
            await asyncio.sleep(0.05)

    client = AsyncClient()
    kserve = asyncio.create_task(play_kserve(emulator, client))
    sampler = asyncio.create_task(sample_rss())
    try:
        # Ready when it watches UniversalModels.
        deadline = time.monotonic() + 60
        while not any("universalmodels" in str(r.url) and r.params.get("watch") for r in emulator._requests):
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the operator did not start; see {workdir / 'operator.log'}")
            await asyncio.sleep(0.05)
        emulator.reset_writes()
        requests_before = operator_requests(emulator)
        started = time.monotonic()
        await create_models(emulator, n)
        seconds = await wait_converged(emulator, n, started)
        await asyncio.sleep(1.0)  # let trailing writes land so they are counted
        return Run(seconds, emulator.write_count(), operator_requests(emulator) - requests_before, peak)
    finally:
        for task in (kserve, sampler):
            task.cancel()
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 20)
        if proc.returncode is None:
            proc.kill()
        await client.close()
        log.close()


async def run_anchor(served: ServedEmulator, n: int) -> Run:
    """The anchor: the least a controller must do, hand-written, no framework, no retries, no status logic."""
    emulator = served.emulator
    client = AsyncClient(field_manager=FIELD_MANAGER)
    kserve = asyncio.create_task(play_kserve(emulator, client))
    config = OperatorConfig()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def reconcile_one(obj: dict[str, Any]) -> None:
        async with gate:
            model = parse_model(obj)
            await client.apply(InferenceService.from_dict(desired_inference_service(model, config)), force=True)
            await client.patch(
                UniversalModelResource.Status, model.metadata.name, {"status": {"phase": "Pending"}},
                namespace="default", patch_type=PatchType.MERGE,
            )  # fmt: skip

    async def controller() -> None:
        pending: set[asyncio.Task[None]] = set()
        async for kind, obj in client.watch(UniversalModelResource, namespace="default"):
            raw: Any = obj  # a lightkube generic resource: to_dict is untyped
            if kind == "ADDED":
                task = asyncio.create_task(reconcile_one(raw.to_dict()))
                pending.add(task)
                task.add_done_callback(pending.discard)

    async def mirror() -> None:
        async for kind, obj in client.watch(InferenceService, namespace="default"):
            raw: Any = obj  # a lightkube generic resource: to_dict is untyped
            status = raw.to_dict().get("status") or {}
            if kind != "DELETED" and status.get("observedGeneration"):
                await client.patch(
                    UniversalModelResource.Status, raw.metadata.name, {"status": {"phase": "Ready"}},
                    namespace="default", patch_type=PatchType.MERGE,
                )  # fmt: skip

    tasks = [asyncio.create_task(controller()), asyncio.create_task(mirror())]
    try:
        await asyncio.sleep(0.5)
        emulator.reset_writes()
        requests_before = operator_requests(emulator)
        started = time.monotonic()
        await create_models(emulator, n)
        seconds = await wait_converged(emulator, n, started)
        return Run(seconds, emulator.write_count(), operator_requests(emulator) - requests_before, 0)
    finally:
        for task in (*tasks, kserve):
            task.cancel()
        await client.close()


async def measure(n: int) -> str:
    crd = custom_resource_definition()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        async with serve_emulator(base / "anchor", crds=[crd]) as served:
            os.environ["KUBECONFIG"] = str(served.kubeconfig)
            anchor = await run_anchor(served, n)
        async with serve_emulator(base / "operator", crds=[crd]) as served:
            os.environ["KUBECONFIG"] = str(served.kubeconfig)
            ours = await run_operator(served, n, base)
    mib = ours.peak_rss / 2**20
    return (
        f"operator_scale N={n}: converged {ours.seconds:.1f}s vs anchor (minimal controller) {anchor.seconds:.1f}s, "
        f"ratio {ours.seconds / anchor.seconds:.2f}x; writes/model {ours.writes / n:.2f} "
        f"(anchor {anchor.writes / n:.2f}, goal <= 6); requests/model {ours.requests / n:.2f} "
        f"(anchor {anchor.requests / n:.2f}); peak RSS {mib:.0f} MiB (goal < 200)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, action="append", help="model counts (default: 100 and 1000)")
    args = parser.parse_args()
    for n in args.n or [100, 1000]:
        print(asyncio.run(measure(n)), flush=True)


if __name__ == "__main__":
    main()
