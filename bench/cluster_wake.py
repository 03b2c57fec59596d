"""Waking a model on a cluster: KServe's LocalModelCache against a download each wake, under a burst of requests.

    .venv/bin/python bench/cluster_wake.py [--runs 3] [--model large|minilm] [--burst 32] [--beyond 8]

The simulated cluster in container mode (what tests/images/test_container_cluster.py runs): the real operator
(embedded) against the API emulator with KServe's LocalModelCache admission, KServe's LocalModelCache controller and
node agent (:mod:`universal_simcluster.kserve.localmodel`), every predictor pod a podman container of the predictor
image (:mod:`universal_simcluster.kserve.processes`), the real gateway in front. Two copies of the model
(``bench/cold_start.py``'s ``large``, 528 MB of weights, by default), both Knative-mode, scale to zero,
``scaling.maxHeldRequests`` = ``--burst``:

* download each wake: its source is an HTTP URL of the model as a tar (a server on loopback), which KServe's storage
  code downloads and unpacks into the pod's volume before each start;
* LocalModelCache: ``spec.cache``; the node agent put the model on the node once, and each pod mounts that copy.

Each run scales both to zero (the stand-in's idle clock is stepped past the window), then sends ``--burst`` +
``--beyond`` embeddings requests at once through the gateway. It reports the wake (the first answer), the
predictor's own start-up in the woken pod (its log: process, imports, weights, engine), their ratio, and what the
burst got: answers, 429s from the bound (with their Retry-After), and any 5xx. Goals (the issue's, not asserted): the
cached wake within 1.2x of the in-pod load, no 5xx, 429 only beyond the bound. Needs root, podman and ``make images``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from lightkube import AsyncClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cold_start import PHASES_LINE, BenchModel, bench_model, tar_server  # noqa: E402

from tests.clock import SteppedClock  # noqa: E402
from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator  # noqa: E402
from universal_gateway.app import Gateway  # noqa: E402
from universal_gateway.cluster import KubernetesBackends  # noqa: E402
from universal_operator.config import parse_config  # noqa: E402
from universal_operator.crd import custom_resource_definition  # noqa: E402
from universal_simcluster import admission  # noqa: E402
from universal_simcluster.apiserver import ServedEmulator, serve_emulator  # noqa: E402
from universal_simcluster.kserve.localmodel import local_model_standin  # noqa: E402
from universal_simcluster.kserve.processes import ProcessKServe, kserve_processes  # noqa: E402

NS = "default"
IMAGE = "ghcr.io/universal-runtime/predictor-cpu:0.1.0"
DOWNLOADED, CACHED = "hf://bench/model-downloaded", "hf://bench/model-cached"
IDLE_S = 30
DEADLINE_S = 600.0


@dataclass
class Burst:
    wake_s: float
    statuses: Counter[int]
    retry_after: list[str]
    in_pod_s: float | None


def manifest(bench: BenchModel, name: str, uri: str, burst: int, cache: bool) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(yaml.safe_dump(bench.manifest))
    body["metadata"] = {"name": name, "namespace": NS}
    body["spec"]["servedName"] = name
    body["spec"]["source"] = {"uri": uri}
    body["spec"]["scaling"] = {"idleTimeout": f"{IDLE_S}s", "maxHeldRequests": burst}
    if cache:
        body["spec"]["cache"] = {"nodeGroups": ["workers"], "modelSize": f"{bench.weight_bytes // 2**20 + 64}Mi"}
    return body


async def apply(served: ServedEmulator, scratch: Path, body: dict[str, Any]) -> None:
    path = scratch / f"{body['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    result = await served.kubectl("apply", "--validate=false", "-f", str(path))
    if result.returncode != 0:
        raise SystemExit(result.stderr)


async def until(check: Any, within: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {within:.0f}s: {check}")
        await asyncio.sleep(0.1)


def status(served: ServedEmulator, name: str) -> dict[str, Any]:
    return (served.emulator.get_object("universalmodels", NS, name) or {}).get("status") or {}


def in_pod(kserve: ProcessKServe, name: str) -> float | None:
    """The woken pod's own start-up (process, imports, weights, engine), from its log."""
    workload = kserve.workload(NS, name)
    replica = workload.replica if workload is not None else None
    if replica is None:
        return None
    match = PHASES_LINE.search(replica.log_path.read_text(errors="replace"))
    return sum(float(g) for g in match.groups()) if match else None


async def burst(url: str, name: str, count: int) -> tuple[float, list[httpx.Response]]:
    started = time.monotonic()
    first: list[float] = []

    async def one(http: httpx.AsyncClient) -> httpx.Response:
        response = await http.post(f"{url}/v1/embeddings", json={"model": name, "input": ["wake up"]})
        if response.status_code == 200:
            first.append(time.monotonic() - started)
        return response

    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as http:
        responses = await asyncio.gather(*(one(http) for _ in range(count)))
    return (min(first) if first else float("nan")), list(responses)


async def run(args: argparse.Namespace) -> None:
    config = parse_config({**TEST_OPERATOR_CONFIG, "images": {"cpu": args.image, "cuda": args.image},
                           "kserve": {"localModelCache": True}})  # fmt: skip
    clock = SteppedClock()
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        os.chmod(scratch, 0o755)
        bench = bench_model(args.model, scratch)
        with tar_server(bench.folder, scratch) as tar_url, contextlib.ExitStack():
            cluster = admission.Cluster(local_model_enabled=True)
            async with serve_emulator(scratch, crds=[custom_resource_definition()], admission=cluster) as served:
                os.environ["KUBECONFIG"] = str(served.kubeconfig)
                client = AsyncClient()
                sources = {DOWNLOADED: tar_url, CACHED: str(bench.folder)}
                workdir = scratch / "kserve"
                async with (
                    local_model_standin(client, workdir, nodes={"workers": ["node-a"]}, sources=sources) as lm,
                    embedded_operator(config),
                    kserve_processes(client, workdir, mode="container", sources=sources, grace_period=5,
                                     local_models=lm, clock=clock.monotonic) as kserve,
                    Gateway(KubernetesBackends([NS], reap_interval=0.2)).serving() as url,
                ):  # fmt: skip
                    group = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
                             "metadata": {"name": "workers"}, "spec": {"storageLimit": "100Gi",
                             "persistentVolumeSpec": {}, "persistentVolumeClaimSpec": {}}}  # fmt: skip
                    await apply(served, scratch, group)
                    paths = {"download each wake": ("downloaded", DOWNLOADED, False),
                             "LocalModelCache": ("cached", CACHED, True)}  # fmt: skip
                    for name, uri, cache in paths.values():
                        await apply(served, scratch, manifest(bench, name, uri, args.burst, cache))
                    await until(lambda: (status(served, "cached").get("cache") or {}).get("mounted"))
                    for name, _, _ in paths.values():
                        await until(lambda n=name: status(served, n).get("phase") == "Ready")
                    results: dict[str, list[Burst]] = {label: [] for label in paths}
                    for _ in range(args.runs):
                        clock.advance(IDLE_S + 1)
                        for name, _, _ in paths.values():
                            await until(lambda n=name: kserve.container(NS, n) is None)
                            await until(lambda n=name: status(served, n).get("phase") == "Idle")
                        for label, (name, _, _) in paths.items():
                            wake, responses = await burst(url, name, args.burst + args.beyond)
                            statuses = Counter(r.status_code for r in responses)
                            retry = sorted(
                                {r.headers.get("retry-after", "-") for r in responses if r.status_code == 429}
                            )
                            results[label].append(Burst(wake, statuses, retry, in_pod(kserve, name)))
                    await client.close()
        print(f"{bench.name}: {bench.weight_bytes / 1e6:.0f} MB of weights; {args.runs} wakes per path, "
              f"{args.burst} held + {args.beyond} beyond the bound each; {os.cpu_count()} CPUs")  # fmt: skip
        print("| path | wake (first answer) | in-pod load | wake / in-pod | answered | 429 (Retry-After) | 5xx |")
        print("|---|---|---|---|---|---|---|")
        for label, bursts in results.items():
            wake = statistics.median(b.wake_s for b in bursts)
            pods = [b.in_pod_s for b in bursts if b.in_pod_s is not None]
            load = statistics.median(pods) if pods else float("nan")
            total: Counter[int] = Counter()
            for b in bursts:
                total.update(b.statuses)
            five = sum(n for code, n in total.items() if code >= 500)
            after = ", ".join(sorted({r for b in bursts for r in b.retry_after})) or "-"
            print(f"| {label} | {wake:.2f} s | {load:.2f} s | {wake / load:.2f}x | {total[200]} | {total[429]} "
                  f"({after} s) | {five} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=("minilm", "large"), default="large")
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--beyond", type=int, default=8)
    parser.add_argument("--image", default=IMAGE)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
