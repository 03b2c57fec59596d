"""The simulated cluster end to end: real operator, a KServe stand-in running real predictors, the real gateway.

Manifests go in with the real ``kubectl``, requests with the real ``openai`` client through the gateway.
Nothing is played by the test: the operator renders each InferenceService, the stand-in runs exactly
the container it renders (``tests/support/kserve_processes.py``), and the gateway routes by the
UniversalModel's status. One setup per module, so all-MiniLM-L6-v2 loads as few times as the scaling
behaviour under test allows.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
import yaml
from lightkube import AsyncClient
from openai import AsyncOpenAI

from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually, load_manifest
from tests.support.kserve_processes import (
    DEFAULT_SOURCES,
    STOP_ANNOTATION,
    ProcessKServe,
    kserve_processes,
)
from tests.support.kube_emulator import ServedEmulator, serve_emulator
from universal_gateway.app import Gateway
from universal_gateway.cluster import KubernetesBackends
from universal_operator.config import parse_config

pytestmark = [pytest.mark.operator, pytest.mark.asyncio(loop_scope="module")]

UM = "universalmodels"
ISVC = "inferenceservices"
NS = "default"
#: The example manifest, with idle windows short enough to watch within a test.
KNATIVE_IDLE = "8s"
STANDARD_IDLE = "3s"
#: A storage URI the stand-in "downloads" to an empty folder: a predictor that exits while loading.
BROKEN_SOURCE = "hf://example/not-a-model"
#: A source the stand-in's "hub" serves only with this token (it is empty too: a start that got past the
#: storage initializer fails in the predictor, quickly, without loading a model).
GATED_SOURCE, GATED_TOKEN = "hf://example/gated-model", "hf_test_token"
#: A model start is process start + import + load on a shared 2-core machine: generous, never asserted.
LOAD_WITHIN = 180.0


@dataclass
class SimulatedCluster:
    served: ServedEmulator
    kserve: ProcessKServe
    openai: AsyncOpenAI
    workdir: Path

    def model(self, name: str) -> dict[str, Any]:
        return self.served.emulator.get_object(UM, NS, name) or {}

    def phase(self, name: str) -> str | None:
        return (self.model(name).get("status") or {}).get("phase")

    def isvc(self, name: str) -> dict[str, Any]:
        return self.served.emulator.get_object(ISVC, NS, name) or {}

    async def apply(self, manifest: dict[str, Any]) -> None:
        path = self.workdir / f"{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        result = await self.served.kubectl("apply", "--validate=false", "-f", str(path))
        assert result.returncode == 0, result.stderr

    async def served_names(self) -> set[str]:
        return {m.id for m in (await self.openai.models.list()).data}

    async def embed(self, model: str, texts: list[str]) -> list[list[float]]:
        result = await self.openai.embeddings.create(model=model, input=texts)
        return [item.embedding for item in sorted(result.data, key=lambda d: d.index)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[SimulatedCluster]:
    workdir = tmp_path_factory.mktemp("simulated-cluster")
    with pytest.MonkeyPatch.context() as env:
        async with serve_emulator(workdir, crds=[crd]) as served:
            env.setenv("KUBECONFIG", str(served.kubeconfig))
            client = AsyncClient()
            empty = workdir / "not-a-model"
            empty.mkdir()
            sources = {**DEFAULT_SOURCES, BROKEN_SOURCE: str(empty), GATED_SOURCE: str(empty)}
            try:
                async with (
                    embedded_operator(parse_config(TEST_OPERATOR_CONFIG)),
                    kserve_processes(
                        client, workdir / "kserve", sources=sources, gated={GATED_SOURCE: GATED_TOKEN}, grace_period=10
                    ) as kserve,
                    Gateway(KubernetesBackends([NS], reap_interval=0.2)).serving() as url,
                ):
                    openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=LOAD_WITHIN)
                    yield SimulatedCluster(served, kserve, openai, workdir)
                    await openai.close()
                # Leaving the stand-in terminated every predictor it started: no orphans.
                assert kserve.started_pids
                assert [pid for pid in kserve.started_pids if _alive(pid)] == []
            finally:
                await client.close()


def _minilm(name: str, served_name: str, **scaling: Any) -> dict[str, Any]:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["metadata"]["name"] = name
    manifest["spec"]["servedName"] = served_name
    manifest["spec"]["scaling"] = {**manifest["spec"].get("scaling", {}), **scaling}
    return manifest


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def knative_minilm(cluster: SimulatedCluster) -> str:
    """examples/cluster/minilm-embed.yaml as written (Knative, scale to zero), idle window shortened."""
    manifest = _minilm("minilm", "all-minilm-l6-v2", idleTimeout=KNATIVE_IDLE)
    await cluster.apply(manifest)
    return str(manifest["spec"]["servedName"])


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists (an unreaped zombie counts: the stand-in reaps what it stops)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


async def test_applied_example_becomes_ready_and_serves_correct_embeddings_through_the_gateway(
    cluster: SimulatedCluster, knative_minilm: str
) -> None:
    await eventually(lambda: cluster.phase("minilm") == "Ready", within=LOAD_WITHIN)
    pid = cluster.kserve.pid(NS, "minilm")
    assert _alive(pid)
    # The operator mirrored KServe's address: a loopback port the stand-in serves, not the cluster DNS name.
    assert cluster.model("minilm")["status"]["address"].startswith("http://127.0.0.1:")

    table = await cluster.served.kubectl("get", "um")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line.split() for line in table.stdout.strip().splitlines()[1:]}
    assert rows["minilm"][1:6] == ["embed", "transformers", knative_minilm, "Ready", "True"]

    cat, kitten, revenue = await cluster.embed(
        knative_minilm,
        ["A cat is sleeping on the sofa.", "A kitten naps on the couch.", "Quarterly revenue rose by eight percent."],
    )
    assert len(cat) == len(kitten) == len(revenue) == 384
    assert _cosine(cat, kitten) > _cosine(cat, revenue) + 0.2
    assert cluster.kserve.pid(NS, "minilm") == pid  # served by the process that came up, no restart


async def test_knative_model_idle_past_its_window_scales_to_zero_and_the_next_request_wakes_it(
    cluster: SimulatedCluster, knative_minilm: str
) -> None:
    await eventually(lambda: cluster.phase("minilm") == "Ready", within=LOAD_WITHIN)
    pid = cluster.kserve.pid(NS, "minilm")
    assert _alive(pid)

    # No requests for the rendered retention period: the process is gone and zero copies are reported.
    await eventually(lambda: not _alive(pid), within=120)
    await eventually(lambda: cluster.phase("minilm") == "Idle")
    assert cluster.kserve.pid(NS, "minilm") is None
    # KServe 0.16's zero-pod status: only the target state and the transition change (totalCopies 0, omitted).
    model_status = cluster.isvc("minilm")["status"]["modelStatus"]
    assert model_status["states"] == {"activeModelState": "Loaded", "targetModelState": "Pending"}
    assert (model_status["transitionStatus"], model_status["copies"]) == ("InProgress", {"failedCopies": 0})
    workload = cluster.kserve.workload(NS, "minilm")
    assert workload is not None
    launches = workload.launches

    # Concurrent requests at zero are held by the activator while one process starts, then all succeed.
    results = await asyncio.gather(*(cluster.embed(knative_minilm, [f"wake up {i}"]) for i in range(3)))
    assert all(len(vectors[0]) == 384 for vectors in results)
    assert workload.launches == launches + 1
    assert _alive(cluster.kserve.pid(NS, "minilm"))
    await eventually(lambda: cluster.phase("minilm") == "Ready")


async def test_standard_model_is_stopped_by_the_gateway_when_idle_and_woken_by_the_next_request(
    cluster: SimulatedCluster,
) -> None:
    manifest = _minilm("minilm-standard", "minilm-standard", mode="Standard", minReplicas=0, idleTimeout=STANDARD_IDLE)
    served_name = manifest["spec"]["servedName"]
    await cluster.apply(manifest)
    await eventually(lambda: cluster.phase("minilm-standard") == "Ready", within=LOAD_WITHIN)
    pid = cluster.kserve.pid(NS, "minilm-standard")
    assert _alive(pid)
    [vector] = await cluster.embed(served_name, ["served by a Deployment-style predictor"])
    assert len(vector) == 384

    # Idle past idleTimeout: the gateway sets the stop annotation, KServe deletes the workload.
    await eventually(lambda: cluster.isvc("minilm-standard")["metadata"]["annotations"].get(STOP_ANNOTATION) == "true")
    await eventually(lambda: not _alive(pid), within=60)
    await eventually(lambda: cluster.phase("minilm-standard") == "Idle")

    def stopped() -> list[str]:  # the stand-in reports the stop once the process is gone: poll for it
        return [c["status"] for c in cluster.isvc("minilm-standard")["status"]["conditions"] if c["type"] == "Stopped"]

    await eventually(lambda: stopped() == ["True"])

    # A spec edit while stopped: the InferenceService moves on a generation; KServe makes the Deployment anew
    # on the wake, so the observedGeneration it reports (the Deployment's) starts again at 1.
    manifest["spec"]["engineArgs"] = {**manifest["spec"].get("engineArgs", {}), "max_batch_size": 8}
    await cluster.apply(manifest)
    await eventually(lambda: cluster.isvc("minilm-standard")["metadata"]["generation"] == 2)
    assert cluster.phase("minilm-standard") == "Idle"

    # The next request removes the annotation and is held until the model is back.
    [vector] = await cluster.embed(served_name, ["wake the stopped model"])
    assert len(vector) == 384
    assert STOP_ANNOTATION not in cluster.isvc("minilm-standard")["metadata"].get("annotations", {})
    woken = cluster.kserve.pid(NS, "minilm-standard")
    assert _alive(woken)
    assert woken != pid
    assert cluster.phase("minilm-standard") == "Ready"
    assert cluster.isvc("minilm-standard")["status"]["observedGeneration"] == 1


async def test_kubectl_delete_stops_the_predictor_and_the_model_leaves_the_model_list(
    cluster: SimulatedCluster, knative_minilm: str
) -> None:
    # A request first, so a process is surely running (the model may have scaled to zero meanwhile).
    await cluster.embed(knative_minilm, ["still here"])
    pid = cluster.kserve.pid(NS, "minilm")
    assert _alive(pid)
    assert knative_minilm in await cluster.served_names()

    result = await cluster.served.kubectl("delete", "um", "minilm", "--wait=false")
    assert result.returncode == 0, result.stderr

    await eventually(lambda: not _alive(pid), within=60)
    await eventually(lambda: cluster.kserve.workload(NS, "minilm") is None)

    async def unlisted() -> bool:
        return knative_minilm not in await cluster.served_names()

    await eventually(unlisted)
    assert cluster.isvc("minilm") == {}


async def test_a_predictor_killed_while_serving_is_reported_failed_with_its_exit_code(
    cluster: SimulatedCluster,
) -> None:
    # A Standard-mode model of its own with a long idle timeout: with the short one above the gateway could stop
    # the model as idle before a busy machine reports the crash, and a stopped model is Idle, not Failed.
    manifest = _minilm("minilm-crash", "minilm-crash", mode="Standard", minReplicas=0, idleTimeout="10m")
    await cluster.apply(manifest)
    await eventually(lambda: cluster.phase("minilm-crash") == "Ready", within=LOAD_WITHIN)
    await cluster.embed("minilm-crash", ["make sure it runs"])
    pid = cluster.kserve.pid(NS, "minilm-crash")
    assert pid is not None
    os.kill(pid, 9)

    await eventually(lambda: cluster.phase("minilm-crash") == "Failed", within=60)
    # Killed by SIGKILL: a container's exit code 128 + 9, as the kubelet reports it.
    assert "exit code 137" in cluster.model("minilm-crash")["status"]["message"]
    assert cluster.kserve.pid(NS, "minilm-crash") is None


async def test_a_predictor_that_exits_while_loading_is_reported_failed_with_its_last_log_lines(
    cluster: SimulatedCluster,
) -> None:
    manifest = _minilm("broken", "broken")
    manifest["spec"]["source"] = {"uri": BROKEN_SOURCE}
    await cluster.apply(manifest)

    await eventually(lambda: cluster.phase("broken") == "Failed", within=LOAD_WITHIN)
    message = cluster.model("broken")["status"]["message"]
    # The predictor's own last words reach `kubectl get um`'s model: what was wrong and the exit code.
    assert "is not a transformers model directory" in message
    assert "exit code 1" in message
    assert cluster.kserve.pid(NS, "broken") is None
    with pytest.raises(openai.InternalServerError) as refused:
        await cluster.embed("broken", ["no one serves this"])
    assert (refused.value.status_code, refused.value.code) == (503, "model_failed")


async def test_credentials_secret_reaches_the_storage_initializer_through_the_models_service_account(
    cluster: SimulatedCluster,
) -> None:
    await cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hub-token", "namespace": NS},
            "stringData": {"HF_TOKEN": GATED_TOKEN},  # KServe's key for the Hugging Face store
        }
    )
    without = _minilm("gated-anonymous", "gated-anonymous")
    without["spec"]["source"] = {"uri": GATED_SOURCE}
    with_token = _minilm("gated", "gated")
    with_token["spec"]["source"] = {"uri": GATED_SOURCE, "credentialsSecret": "hub-token"}
    await cluster.apply(without)
    await cluster.apply(with_token)

    # Without credentials the storage initializer is refused by the hub ...
    await eventually(lambda: cluster.phase("gated-anonymous") == "Failed", within=LOAD_WITHIN)
    assert "401" in cluster.model("gated-anonymous")["status"]["message"]
    # ... with them it fetched the source, and the predictor ran on what it fetched (an empty folder here).
    await eventually(lambda: cluster.phase("gated") == "Failed", within=LOAD_WITHIN)
    message = cluster.model("gated")["status"]["message"]
    assert "401" not in message
    assert "is not a transformers model directory" in message

    # A Secret that does not exist: KServe's pod webhook refuses the pods, nothing starts.
    missing = _minilm("gated-missing", "gated-missing")
    missing["spec"]["source"] = {"uri": GATED_SOURCE, "credentialsSecret": "no-such-secret"}
    await cluster.apply(missing)
    await eventually(lambda: cluster.phase("gated-missing") == "Failed", within=LOAD_WITHIN)
    assert "'no-such-secret'" in cluster.model("gated-missing")["status"]["message"]
