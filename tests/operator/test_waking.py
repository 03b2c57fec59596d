"""The Waking phase and the step a starting predictor is at (issue 23, item 5), read from its pods.

Pod statuses are written as Kubernetes writes them (core/v1 PodStatus; kubelet reasons from
pkg/kubelet/kubelet_pods.go), with KServe's container names (pkg/constants/constants.go, v0.14.1-v0.20.0:
storage-initializer, kserve-container, modelcar). Unit tests pin the step of each pod state and the phase
around a wake; the end-to-end test runs the real operator against the API emulator, writes a predictor pod
through its states and reads ``kubectl get um``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from tests.conftest import EXAMPLES, eventually
from tests.factories import load, model
from universal_operator.handlers import OperatorState
from universal_operator.reconcile.status import status_from_inference_service
from universal_operator.reconcile.waking import POD_LABEL, WakeStep, pod_step, predictor_step
from universal_simcluster.apiserver import ServedEmulator
from universal_simcluster.kserve.standin import ready_status

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

SCHEDULED = {"type": "PodScheduled", "status": "True"}
RUNNING = {"running": {"startedAt": "2026-01-02T03:04:05Z"}}
DONE = {"terminated": {"exitCode": 0, "reason": "Completed"}}


def pod(
    *,
    scheduled: bool = True,
    init: dict[str, Any] | None = None,
    main: dict[str, Any] | None = None,
    ready: bool = False,
    extra: list[dict[str, Any]] | None = None,
    phase: str = "Pending",
    deleting: bool = False,
) -> dict[str, Any]:
    """A predictor pod: ``init`` the storage initializer's state, ``main`` kserve-container's."""
    status: dict[str, Any] = {"phase": phase, "conditions": [SCHEDULED] if scheduled else
                              [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}  # fmt: skip
    if init is not None:
        status["initContainerStatuses"] = [{"name": "storage-initializer", "state": init, "ready": False}]
    if main is not None:
        status["containerStatuses"] = [{"name": "kserve-container", "state": main, "ready": ready}, *(extra or [])]
    meta: dict[str, Any] = {"name": "p", "namespace": "default", "labels": {POD_LABEL: "qwen-chat"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-02T03:04:05Z"
    return {"metadata": meta, "status": status}


WAITING = {"waiting": {"reason": "ContainerCreating"}}
INITIALIZING = {"waiting": {"reason": "PodInitializing"}}


@pytest.mark.parametrize(
    ("the_pod", "step"),
    [
        (pod(scheduled=False), WakeStep.SCHEDULING),
        (pod(init=WAITING, main=INITIALIZING), WakeStep.PULLING),  # the storage initializer's image
        (pod(init=RUNNING, main=INITIALIZING), WakeStep.DOWNLOADING),
        (pod(init=DONE, main=WAITING), WakeStep.PULLING),  # the model server's image
        (pod(init=DONE, main={"waiting": {"reason": "ImagePullBackOff"}}), WakeStep.PULLING),
        (pod(init=DONE, main=RUNNING), WakeStep.LOADING),
        (pod(main=RUNNING, extra=[{"name": "modelcar", "state": WAITING}]), WakeStep.PULLING),  # oci:// model image
        (pod(init=DONE, main=RUNNING, ready=True, phase="Running"), None),
        (pod(init=RUNNING, main=INITIALIZING, deleting=True), None),
        (pod(main={"terminated": {"exitCode": 1}}, phase="Failed"), None),
    ],
    ids=[
        "unschedulable",
        "pulling-initializer",
        "downloading",
        "pulling-server",
        "pull-backoff",
        "loading",
        "pulling-modelcar",
        "ready",
        "being-deleted",
        "failed",
    ],
)
def test_the_step_of_each_pod_state(the_pod: dict[str, Any], step: WakeStep | None) -> None:
    assert pod_step(the_pod) is step


def test_of_several_pods_a_ready_one_means_no_step_and_else_the_furthest_along() -> None:
    downloading, loading = pod(init=RUNNING, main=INITIALIZING), pod(init=DONE, main=RUNNING)
    assert predictor_step([downloading, loading]) is WakeStep.LOADING
    assert predictor_step([downloading, pod(main=RUNNING, ready=True, phase="Running")]) is None
    assert predictor_step([pod(init=RUNNING, main=INITIALIZING, deleting=True)]) is None
    assert predictor_step([]) is None


QWEN = """
metadata: {name: qwen-chat, generation: 3}
spec:
  task: generate
  source: {uri: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF, file: "*q4_k_m.gguf"}
"""
STANDARD = QWEN + "  scaling: {mode: Standard, minReplicas: 0}\n"
SCALED_TO_ZERO = """
conditions:
- {type: PredictorReady, status: "True"}
- {type: Ready, status: "True"}
components:
  predictor: {latestCreatedRevision: qwen-chat-predictor-00001, latestReadyRevision: qwen-chat-predictor-00001}
modelStatus: {transitionStatus: InProgress, states: {activeModelState: Loaded, targetModelState: Pending}}
"""
STARTING = """
conditions:
- {type: PredictorReady, status: "False", reason: MinimumReplicasUnavailable}
- {type: Ready, status: "False", reason: MinimumReplicasUnavailable}
"""


def isvc(status_yaml: str) -> dict[str, Any]:
    return {"metadata": {"name": "qwen-chat", "namespace": "models", "annotations": {}},
            "spec": {"predictor": {}}, "status": load(status_yaml)}  # fmt: skip


def with_phase(manifest: str, phase: str) -> Any:
    return model(manifest + f"status: {{phase: {phase}}}\n")


def test_knative_at_zero_with_a_starting_pod_is_waking_with_its_step() -> None:
    at_zero = isvc(SCALED_TO_ZERO)
    idle = status_from_inference_service(at_zero, model(QWEN), now=T0, pods=[])
    assert (idle["phase"], idle["step"], idle["replicas"]) == ("Idle", None, 0)
    waking = status_from_inference_service(at_zero, model(QWEN), now=T0, pods=[pod(init=RUNNING, main=INITIALIZING)])
    assert (waking["phase"], waking["step"], waking["replicas"]) == ("Waking", "Downloading", 0)
    assert waking["message"] == "Waking from zero: the storage initializer is downloading the model."
    ready = {c["type"]: c for c in waking["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Waking")  # it answers: the request waits for the wake


def test_a_standard_mode_model_starting_after_idle_is_waking_and_a_first_start_is_loading_with_the_step() -> None:
    starting = isvc(STARTING)
    loading_pod = pod(init=DONE, main=RUNNING)
    woken = status_from_inference_service(starting, with_phase(STANDARD, "Idle"), now=T0, pods=[loading_pod])
    assert (woken["phase"], woken["step"]) == ("Waking", "Loading")
    assert woken["message"] == "Waking: the model server is loading the model."
    still = status_from_inference_service(starting, with_phase(STANDARD, "Waking"), now=T0, pods=[loading_pod])
    assert still["phase"] == "Waking"
    first = status_from_inference_service(starting, with_phase(STANDARD, "Pending"), now=T0, pods=[loading_pod])
    assert (first["phase"], first["step"]) == ("Loading", "Loading")
    unknown_pods = status_from_inference_service(starting, with_phase(STANDARD, "Pending"), now=T0)
    assert unknown_pods["step"] is None


# -- end to end: the real operator, the API emulator, kubectl -------------------------------------------------

ISVC, UM = "inferenceservices", "universalmodels"


async def write_pod(cluster: ServedEmulator, the_pod: dict[str, Any], *, create: bool = False) -> None:
    if create:
        manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": the_pod["metadata"],
                    "spec": {"containers": [{"name": "kserve-container", "image": "predictor"}]}}  # fmt: skip
        result = await cluster.kubectl("create", "--validate=false", "-f", "-", input=yaml_text(manifest))
        assert result.returncode == 0, result.stderr
    await cluster.emulator.put_status("pods", "default", the_pod["metadata"]["name"], the_pod["status"], replace=True)


def yaml_text(obj: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(obj)


def um_status(cluster: ServedEmulator) -> dict[str, Any]:
    return (cluster.emulator.get_object(UM, "default", "qwen-chat") or {}).get("status") or {}


async def test_kubectl_get_um_shows_waking_and_the_step_as_the_predictor_pod_starts(
    cluster: ServedEmulator, operator: OperatorState
) -> None:
    applied = await cluster.kubectl("apply", "--validate=false", "-f", str(EXAMPLES / "cluster/qwen-chat.yaml"))
    assert applied.returncode == 0, applied.stderr
    child = await eventually(lambda: cluster.emulator.get_object(ISVC, "default", "qwen-chat"))
    await cluster.emulator.put_status(ISVC, "default", "qwen-chat", ready_status(child, replicas=0))
    await eventually(lambda: um_status(cluster).get("phase") == "Idle")

    def showing(phase: str, step: str | None) -> bool:
        status = um_status(cluster)
        return (status.get("phase"), status.get("step")) == (phase, step)

    # A request reached the activator: Knative starts a pod, which goes through its steps.
    await write_pod(cluster, pod(scheduled=False), create=True)
    await eventually(lambda: showing("Waking", "Scheduling"))
    await write_pod(cluster, pod(init=RUNNING, main=INITIALIZING))
    await eventually(lambda: showing("Waking", "Downloading"))
    table = await cluster.kubectl("get", "um", "qwen-chat")
    header, row = table.stdout.strip().splitlines()
    cells = dict(zip(header.split(), row.split(), strict=False))
    assert (cells["PHASE"], cells["STEP"]) == ("Waking", "Downloading")
    await write_pod(cluster, pod(init=DONE, main=RUNNING))
    await eventually(lambda: showing("Waking", "Loading"))
    # Ready: KServe reports a copy again; the pod serves.
    await write_pod(cluster, pod(init=DONE, main=RUNNING, ready=True, phase="Running"))
    await cluster.emulator.put_status(ISVC, "default", "qwen-chat", ready_status(child))
    await eventually(lambda: showing("Ready", None))
