"""End to end: real operator, KServe running real predictors, the real gateway, the real ``openai`` client.

Manifests go in with the real ``kubectl``, requests with the real ``openai`` client through the gateway.
Nothing is played by the test: the operator renders each InferenceService, KServe runs exactly the container
it renders, and the gateway routes by the UniversalModel's status. One setup per module, so all-MiniLM-L6-v2
loads as few times as the scaling behaviour under test allows.

By default the cluster is the simulated one (the API emulator and a KServe stand-in running predictor
processes, :mod:`universal_simcluster.kserve.processes`); ``UNIVERSAL_RUNTIME_E2E=kubeconfig`` runs the same tests
against the cluster ``$KUBECONFIG`` names (``e2e/kind/up.sh``), skipping those marked ``stand_in``
(``e2e/clusters.py``).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from e2e.clusters import SIMULATED, EndToEndCluster, SimulatedCluster, mode, real_cluster, simulated_cluster
from tests.conftest import eventually, load_manifest
from universal_operator.kserve import STOP_ANNOTATION
from universal_operator.spec import parse_duration

pytestmark = [pytest.mark.operator, pytest.mark.asyncio(loop_scope="module")]

#: The example manifest, with idle windows short enough to wait out on a real cluster. The simulated one counts
#: idle time only when a test lets it pass (EndToEndCluster.idle_for): a slow step cannot make a window pass.
KNATIVE_IDLE = "8s"
STANDARD_IDLE = "3s"
#: A storage URI the stand-in "downloads" to an empty folder: a predictor that exits while loading.
BROKEN_SOURCE = "hf://example/not-a-model"
#: A source the stand-in's "hub" serves only with this token (it is empty too: a start that got past the
#: storage initializer fails in the predictor, quickly, without loading a model).
GATED_SOURCE, GATED_TOKEN = "hf://example/gated-model", "hf_test_token"
#: A model start is process start + import + load on a shared 2-core machine: generous, never asserted.
LOAD_WITHIN = 180.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[EndToEndCluster]:
    workdir = tmp_path_factory.mktemp("e2e-cluster")
    if mode() == SIMULATED:
        empty = workdir / "not-a-model"
        empty.mkdir()
        async with simulated_cluster(
            workdir,
            crd,
            sources={BROKEN_SOURCE: str(empty), GATED_SOURCE: str(empty)},
            gated={GATED_SOURCE: GATED_TOKEN},
            openai_timeout=LOAD_WITHIN,
        ) as simulated:
            yield simulated
    else:
        async with real_cluster(workdir, openai_timeout=LOAD_WITHIN * 3) as real:
            yield real


@pytest.fixture
def stand_in(cluster: EndToEndCluster) -> SimulatedCluster:
    """The simulated cluster, for tests marked ``stand_in`` (skipped on a real cluster)."""
    assert isinstance(cluster, SimulatedCluster)
    return cluster


def within(cluster: EndToEndCluster, seconds: float) -> float:
    """A deadline for ``cluster`` (never asserted as a timing: a bound on waiting)."""
    return seconds * cluster.patience


def _minilm(name: str, served_name: str, **scaling: Any) -> dict[str, Any]:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["metadata"]["name"] = name
    manifest["spec"]["servedName"] = served_name
    manifest["spec"]["scaling"] = {**manifest["spec"].get("scaling", {}), **scaling}
    return manifest


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def knative_minilm(cluster: EndToEndCluster) -> str:
    """examples/cluster/minilm-embed.yaml as written (Knative, scale to zero), idle window shortened."""
    manifest = _minilm("minilm", "all-minilm-l6-v2", idleTimeout=KNATIVE_IDLE)
    await cluster.apply(manifest)
    return str(manifest["spec"]["servedName"])


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


async def test_applied_example_becomes_ready_and_serves_correct_embeddings_through_the_gateway(
    cluster: EndToEndCluster, knative_minilm: str
) -> None:
    await eventually(lambda: cluster.has_phase("minilm", "Ready"), within=within(cluster, LOAD_WITHIN))
    replica = await cluster.replica("minilm")
    assert await cluster.running(replica)
    # The operator mirrored KServe's address (the stand-in's: a loopback port it serves, not the cluster DNS name).
    assert (await cluster.model("minilm"))["status"]["address"].startswith(cluster.address_prefix("minilm"))

    table = await cluster.kubectl("get", "um")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line.split() for line in table.stdout.strip().splitlines()[1:]}
    assert rows["minilm"][1:6] == ["embed", "transformers", knative_minilm, "Ready", "True"]

    cat, kitten, revenue = await cluster.embed(
        knative_minilm,
        ["A cat is sleeping on the sofa.", "A kitten naps on the couch.", "Quarterly revenue rose by eight percent."],
    )
    assert len(cat) == len(kitten) == len(revenue) == 384
    assert _cosine(cat, kitten) > _cosine(cat, revenue) + 0.2
    assert await cluster.replica("minilm") == replica  # served by the replica that came up, no restart


async def test_knative_model_idle_past_its_window_scales_to_zero_and_the_next_request_wakes_it(
    cluster: EndToEndCluster, knative_minilm: str
) -> None:
    await eventually(lambda: cluster.has_phase("minilm", "Ready"), within=within(cluster, LOAD_WITHIN))
    replica = await cluster.replica("minilm")
    assert await cluster.running(replica)

    # No requests for the rendered retention period: the replica is gone and zero copies are reported.
    await cluster.idle_for(parse_duration(KNATIVE_IDLE).total_seconds())
    await eventually(lambda: cluster.gone(replica), within=within(cluster, 120))
    await eventually(lambda: cluster.has_phase("minilm", "Idle"), within=within(cluster, 15))
    assert await cluster.replica("minilm") is None
    # KServe 0.16's zero-pod status: only the target state and the transition change (totalCopies 0, omitted).
    model_status = (await cluster.isvc("minilm"))["status"]["modelStatus"]
    assert model_status["states"] == {"activeModelState": "Loaded", "targetModelState": "Pending"}
    assert (model_status["transitionStatus"], model_status["copies"]) == ("InProgress", {"failedCopies": 0})
    launches = await cluster.launches("minilm")

    # Concurrent requests at zero are held by the activator while one replica starts, then all succeed.
    results = await asyncio.gather(*(cluster.embed(knative_minilm, [f"wake up {i}"]) for i in range(3)))
    assert all(len(vectors[0]) == 384 for vectors in results)
    assert await cluster.launches("minilm") == launches + 1
    assert await cluster.running(await cluster.replica("minilm"))
    await eventually(lambda: cluster.has_phase("minilm", "Ready"), within=within(cluster, 15))


async def test_standard_model_is_stopped_by_the_gateway_when_idle_and_woken_by_the_next_request(
    cluster: EndToEndCluster,
) -> None:
    manifest = _minilm("minilm-standard", "minilm-standard", mode="Standard", minReplicas=0, idleTimeout=STANDARD_IDLE)
    served_name = manifest["spec"]["servedName"]
    await cluster.apply(manifest)
    await eventually(lambda: cluster.has_phase("minilm-standard", "Ready"), within=within(cluster, LOAD_WITHIN))
    replica = await cluster.replica("minilm-standard")
    assert await cluster.running(replica)
    [vector] = await cluster.embed(served_name, ["served by a Deployment-style predictor"])
    assert len(vector) == 384

    async def annotations() -> dict[str, str]:
        return dict((await cluster.isvc("minilm-standard"))["metadata"].get("annotations") or {})

    # Idle past idleTimeout: the gateway sets the stop annotation, KServe deletes the workload.
    async def stop_set() -> bool:
        return (await annotations()).get(STOP_ANNOTATION) == "true"

    await cluster.idle_for(parse_duration(STANDARD_IDLE).total_seconds())
    await eventually(stop_set, within=within(cluster, 15))
    await eventually(lambda: cluster.gone(replica), within=within(cluster, 60))
    await eventually(lambda: cluster.has_phase("minilm-standard", "Idle"), within=within(cluster, 15))

    async def stopped() -> list[str]:  # KServe reports the stop once the replica is gone: poll for it
        conditions = (await cluster.isvc("minilm-standard"))["status"]["conditions"]
        return [c["status"] for c in conditions if c["type"] == "Stopped"]

    async def reported_stopped() -> bool:
        return await stopped() == ["True"]

    await eventually(reported_stopped, within=within(cluster, 15))

    # A spec edit while stopped: the InferenceService moves on a generation; KServe makes the Deployment anew
    # on the wake, so the observedGeneration it reports (the Deployment's) starts again at 1.
    manifest["spec"]["engineArgs"] = {**manifest["spec"].get("engineArgs", {}), "max_batch_size": 8}
    await cluster.apply(manifest)

    async def second_generation() -> bool:
        return (await cluster.isvc("minilm-standard"))["metadata"]["generation"] == 2

    await eventually(second_generation, within=within(cluster, 15))
    assert await cluster.phase("minilm-standard") == "Idle"

    # The next request removes the annotation and is held until the model is back.
    [vector] = await cluster.embed(served_name, ["wake the stopped model"])
    assert len(vector) == 384
    assert STOP_ANNOTATION not in await annotations()
    woken = await cluster.replica("minilm-standard")
    assert await cluster.running(woken)
    assert woken != replica
    assert await cluster.phase("minilm-standard") == "Ready"
    assert (await cluster.isvc("minilm-standard"))["status"]["observedGeneration"] == 1


async def test_kubectl_delete_stops_the_predictor_and_the_model_leaves_the_model_list(
    cluster: EndToEndCluster, knative_minilm: str
) -> None:
    # A request first, so a replica is surely running (the model may have scaled to zero meanwhile).
    await cluster.embed(knative_minilm, ["still here"])
    replica = await cluster.replica("minilm")
    assert await cluster.running(replica)
    assert knative_minilm in await cluster.served_names()

    result = await cluster.kubectl("delete", "um", "minilm", "--wait=false")
    assert result.returncode == 0, result.stderr

    await eventually(lambda: cluster.gone(replica), within=within(cluster, 60))

    async def no_workload() -> bool:
        return not await cluster.has_workload("minilm")

    await eventually(no_workload, within=within(cluster, 15))

    async def unlisted() -> bool:
        return knative_minilm not in await cluster.served_names()

    await eventually(unlisted, within=within(cluster, 15))
    assert await cluster.isvc("minilm") == {}


@pytest.mark.stand_in
async def test_a_predictor_killed_while_serving_is_reported_failed_with_its_exit_code(
    stand_in: SimulatedCluster,
) -> None:
    # A Standard-mode model of its own with a long idle timeout: with the short one above the gateway could stop
    # the model as idle before a busy machine reports the crash, and a stopped model is Idle, not Failed.
    manifest = _minilm("minilm-crash", "minilm-crash", mode="Standard", minReplicas=0, idleTimeout="10m")
    await stand_in.apply(manifest)
    await eventually(lambda: stand_in.has_phase("minilm-crash", "Ready"), within=LOAD_WITHIN)
    await stand_in.embed("minilm-crash", ["make sure it runs"])
    pid = stand_in.pid("minilm-crash")
    assert pid is not None
    os.kill(pid, 9)

    await eventually(lambda: stand_in.has_phase("minilm-crash", "Failed"), within=60)
    # Killed by SIGKILL: a container's exit code 128 + 9, as the kubelet reports it.
    assert "exit code 137" in (await stand_in.model("minilm-crash"))["status"]["message"]
    assert stand_in.pid("minilm-crash") is None


@pytest.mark.stand_in
async def test_a_predictor_that_exits_while_loading_is_reported_failed_with_its_last_log_lines(
    stand_in: SimulatedCluster,
) -> None:
    manifest = _minilm("broken", "broken")
    manifest["spec"]["source"] = {"uri": BROKEN_SOURCE}
    await stand_in.apply(manifest)

    await eventually(lambda: stand_in.has_phase("broken", "Failed"), within=LOAD_WITHIN)
    message = (await stand_in.model("broken"))["status"]["message"]
    # The predictor's own last words reach `kubectl get um`'s model: what was wrong and the exit code.
    assert "is not a transformers model directory" in message
    assert "exit code 1" in message
    assert stand_in.pid("broken") is None
    with pytest.raises(openai.InternalServerError) as refused:
        await stand_in.embed("broken", ["no one serves this"])
    assert (refused.value.status_code, refused.value.code) == (503, "model_failed")


@pytest.mark.stand_in
async def test_credentials_secret_reaches_the_storage_initializer_through_the_models_service_account(
    stand_in: SimulatedCluster,
) -> None:
    await stand_in.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hub-token", "namespace": stand_in.namespace},
            "stringData": {"HF_TOKEN": GATED_TOKEN},  # KServe's key for the Hugging Face store
        }
    )
    without = _minilm("gated-anonymous", "gated-anonymous")
    without["spec"]["source"] = {"uri": GATED_SOURCE}
    with_token = _minilm("gated", "gated")
    with_token["spec"]["source"] = {"uri": GATED_SOURCE, "credentialsSecret": "hub-token"}
    await stand_in.apply(without)
    await stand_in.apply(with_token)

    # Without credentials the storage initializer is refused by the hub ...
    await eventually(lambda: stand_in.has_phase("gated-anonymous", "Failed"), within=LOAD_WITHIN)
    assert "401" in (await stand_in.model("gated-anonymous"))["status"]["message"]
    # ... with them it fetched the source, and the predictor ran on what it fetched (an empty folder here).
    await eventually(lambda: stand_in.has_phase("gated", "Failed"), within=LOAD_WITHIN)
    message = (await stand_in.model("gated"))["status"]["message"]
    assert "401" not in message
    assert "is not a transformers model directory" in message

    # A Secret that does not exist: KServe's pod webhook refuses the pods, nothing starts.
    missing = _minilm("gated-missing", "gated-missing")
    missing["spec"]["source"] = {"uri": GATED_SOURCE, "credentialsSecret": "no-such-secret"}
    await stand_in.apply(missing)
    await eventually(lambda: stand_in.has_phase("gated-missing", "Failed"), within=LOAD_WITHIN)
    assert "'no-such-secret'" in (await stand_in.model("gated-missing"))["status"]["message"]
