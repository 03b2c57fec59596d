"""The real-cluster side of e2e/clusters.py, read against the API emulator (no kind cluster runs here):
which pod is an InferenceService's replica, how launches are counted, how the chart's gateway Service is found."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from lightkube import AsyncClient
from lightkube.models.core_v1 import Container, PodSpec, ServicePort, ServiceSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod, Service
from openai import AsyncOpenAI

from e2e.clusters import GATEWAY_SERVICE_LABELS, ISVC_POD_LABEL, RealCluster, gateway_service
from tests.conftest import eventually
from universal_simcluster.apiserver import ServedEmulator

NS = "default"


@pytest_asyncio.fixture
async def real(cluster: ServedEmulator, tmp_path: Path) -> AsyncIterator[RealCluster]:
    client = AsyncClient()
    unused = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0)
    try:
        yield RealCluster(client, unused, tmp_path, NS)
    finally:
        await unused.close()
        await client.close()


async def _pod(real: RealCluster, name: str, isvc: str, phase: str, *, finalizer: bool = False) -> None:
    meta = ObjectMeta(name=name, namespace=NS, labels={ISVC_POD_LABEL: isvc})
    if finalizer:
        meta.finalizers = ["test.universal-runtime.dev/hold"]
    await real.client.create(Pod(metadata=meta, spec=PodSpec(containers=[Container(name="kserve-container")])))
    await real.client.patch(Pod.Status, name, {"status": {"phase": phase}}, namespace=NS)


async def test_the_replica_is_a_running_pod_of_the_inference_service_not_one_being_deleted(real: RealCluster) -> None:
    await _pod(real, "minilm-1", "minilm", "Running", finalizer=True)
    await _pod(real, "minilm-0", "minilm", "Pending")
    await _pod(real, "other-1", "other", "Running")

    assert await real.replica("minilm") == "minilm-1"
    assert await real.running("minilm-1")
    assert await real.replica("absent") is None
    assert not await real.has_workload("absent")
    assert await real.launches("minilm") == 2

    # Deleted (SIGTERM sent), though still held by a finalizer: no longer the replica, still the workload's.
    await real.client.delete(Pod, "minilm-1", namespace=NS)
    assert not await real.running("minilm-1")
    assert await real.replica("minilm") is None
    assert await real.has_workload("minilm")
    await real.client.delete(Pod, "minilm-0", namespace=NS)
    assert not await real.running("minilm-0")  # gone altogether (404)


async def test_launches_count_a_pod_that_came_and_went_between_two_looks(real: RealCluster) -> None:
    assert await real.launches("minilm") == 0
    watcher = asyncio.create_task(real.watch_pods())
    try:
        # Listed: the watch goes on from the list's resourceVersion, so it sees every pod made from now on,
        # even one gone before the watch request reaches the server.
        await asyncio.wait_for(real.pods_listed.wait(), timeout=15)
        await _pod(real, "minilm-brief", "minilm", "Running")
        await real.client.delete(Pod, "minilm-brief", namespace=NS)
        await eventually(lambda: len(real.pods_seen.get("minilm", set())) == 1)
        assert not await real.has_workload("minilm")
        assert await real.launches("minilm") == 1
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_the_gateway_is_the_one_service_the_chart_labels_and_none_is_an_error_naming_the_chart(
    real: RealCluster,
) -> None:
    with pytest.raises(RuntimeError, match="install charts/universal-runtime"):
        await gateway_service(real.client)
    await real.client.create(
        Service(
            metadata=ObjectMeta(name="ur-gateway", namespace="ur", labels={**GATEWAY_SERVICE_LABELS, "extra": "x"}),
            spec=ServiceSpec(ports=[ServicePort(name="http", port=80)]),
        )
    )
    await real.client.create(
        Service(
            metadata=ObjectMeta(name="ur-operator", namespace="ur", labels={"app.kubernetes.io/component": "operator"}),
            spec=ServiceSpec(ports=[ServicePort(name="http", port=8080)]),
        )
    )
    assert await gateway_service(real.client) == ("ur", "ur-gateway", 80)
