"""The KServe stand-in writes what the chosen KServe release writes, and the operator reads it so.

The statuses themselves are checked against KServe's source in tests/operator/test_kserve_status_documents.py; here:
the stand-in's builders give the phases those documents give, and play_kserve follows a release through
creation, a spec edit, a stop and a wake (observedGeneration from the child, the status wiped by a stop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.types import PatchType

from tests.conftest import eventually
from tests.factories import model
from universal_operator.config import OperatorConfig
from universal_operator.kube import InferenceService
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.status import status_from_inference_service
from universal_simcluster.apiserver import HARNESS_HEADER, ServedEmulator
from universal_simcluster.kserve.standin import (
    Child,
    KServeVersion,
    failed_status,
    kserve_standin,
    loading_status,
    ready_status,
    stopped_status,
)

VERSIONS = ("0.14.1", "0.15.2", "0.16.0", "0.20.0")
STOP = "serving.kserve.io/stop"


def config(version: str) -> OperatorConfig:
    return OperatorConfig.model_validate({"kserve": {"version": version}})


def the_model(mode: str) -> Any:
    return model(
        f"""
        metadata: {{name: minilm, namespace: default, uid: u1, generation: 3}}
        spec:
          task: embed
          source: {{uri: hf://sentence-transformers/all-MiniLM-L6-v2}}
          scaling: {{mode: {mode}}}
        """
    )


@pytest.mark.parametrize("mode", ["Knative", "Standard"])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_stand_ins_statuses_read_as_the_phases_kserve_means(version: str, mode: str) -> None:
    cfg, um = config(version), the_model(mode)
    kserve = KServeVersion(version)
    isvc = desired_inference_service(um, cfg)
    isvc["metadata"]["generation"] = 3

    def phase(status: dict[str, Any], stop: bool = False) -> str:
        child = {**isvc, "metadata": {**isvc["metadata"], "annotations": {
            **isvc["metadata"]["annotations"], **({STOP: "true"} if stop else {})}}, "status": status}  # fmt: skip
        return str(status_from_inference_service(child, um, config=cfg)["phase"])

    assert phase(loading_status(isvc, version=kserve)) == "Loading"
    assert phase(ready_status(isvc, version=kserve, child=Child(generation=1))) == "Ready"
    rollout = loading_status(isvc, version=kserve, child=Child(generation=2, revision=2), loaded_before=True)
    assert phase(rollout) == "Loading"
    assert phase(failed_status(isvc, "out of memory", exit_code=137, version=kserve)) == "Failed"
    info = {"reason": "ModelLoadFailed", "message": "out of memory", "exitCode": 137}
    assert phase(ready_status(isvc, version=kserve, child=Child(3, 3), failure_info=info)) == "Ready"
    if mode == "Knative":
        assert phase(ready_status(isvc, version=kserve, replicas=0)) == "Idle"
    if kserve.can_stop(mode == "Knative"):
        assert phase(stopped_status(isvc, version=kserve), stop=True) == "Idle"


@pytest.fixture
async def client(cluster: ServedEmulator) -> AsyncIterator[AsyncClient]:
    api = AsyncClient()
    yield api
    await api.close()


async def create_isvc(cluster: ServedEmulator, version: str) -> dict[str, Any]:
    isvc = desired_inference_service(the_model("Standard"), config(version))
    url = cluster.emulator.url_for("inferenceservices", "default")
    async with cluster.emulator.post(url, json=isvc, headers={HARNESS_HEADER: "true"}) as response:
        assert response.status == 201, await response.text()
    return isvc


def status_of(cluster: ServedEmulator) -> dict[str, Any]:
    return dict((cluster.emulator.get_object("inferenceservices", "default", "minilm") or {}).get("status") or {})


def generation_of(cluster: ServedEmulator) -> int:
    return int((cluster.emulator.get_object("inferenceservices", "default", "minilm") or {})["metadata"]["generation"])


async def patch(client: AsyncClient, body: dict[str, Any]) -> None:
    await client.patch(InferenceService, "minilm", body, namespace="default", patch_type=PatchType.MERGE)


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


async def test_kserve_0_16_stops_a_standard_model_by_wiping_its_status_and_wakes_it_as_a_new_deployment(
    cluster: ServedEmulator, client: AsyncClient
) -> None:
    await create_isvc(cluster, "0.16.0")
    async with kserve_standin(client, version=KServeVersion("0.16.0")):
        await eventually(lambda: conditions(status_of(cluster)).get("Ready") == "True")
        assert status_of(cluster)["deploymentMode"] == "Standard"
        assert status_of(cluster)["observedGeneration"] == 1

        await patch(client, {"spec": {"predictor": {"maxReplicas": 2}}})  # the Deployment moves on too
        await eventually(lambda: status_of(cluster).get("observedGeneration") == 2)

        await patch(client, {"metadata": {"annotations": {STOP: "true"}}})
        await eventually(lambda: conditions(status_of(cluster)).get("Stopped") == "True")
        assert status_of(cluster) == stopped_status(
            {"metadata": {"name": "minilm", "annotations": {"serving.kserve.io/deploymentMode": "Standard"}}}
        )

        await patch(client, {"spec": {"predictor": {"maxReplicas": 3}}})  # edited while stopped
        await patch(client, {"metadata": {"annotations": {STOP: None}}})
        await eventually(lambda: conditions(status_of(cluster)).get("Ready") == "True")
        # A new Deployment: generation 1 under an InferenceService at generation 3.
        assert (status_of(cluster)["observedGeneration"], generation_of(cluster)) == (1, 3)
        assert conditions(status_of(cluster))["Stopped"] == "False"


async def test_kserve_0_15_ignores_the_stop_annotation_on_a_raw_deployment(
    cluster: ServedEmulator, client: AsyncClient
) -> None:
    isvc = await create_isvc(cluster, "0.15.2")
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    async with kserve_standin(client, version=KServeVersion("0.15.2")):
        await eventually(lambda: conditions(status_of(cluster)).get("Ready") == "True")
        assert status_of(cluster)["deploymentMode"] == "RawDeployment"

        await patch(client, {"metadata": {"annotations": {STOP: "true"}}})
        # A later change the stand-in reports proves it has seen the annotation (events arrive in order).
        await patch(client, {"spec": {"predictor": {"maxReplicas": 2}}})
        await eventually(lambda: status_of(cluster).get("observedGeneration") == 2)
        assert conditions(status_of(cluster)) == {"IngressReady": "True", "PredictorReady": "True", "Ready": "True"}
