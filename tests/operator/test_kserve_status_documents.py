"""status_from_inference_service fed the status documents real KServe releases write, one per situation.

Each document is what KServe's controller writes for the situation, read from its source at the tag (file
names relative to kserve/kserve, ``pkg/apis/serving/v1beta1`` shortened to ``v1beta1/``, the controller's
``pkg/controller/v1beta1/inferenceservice`` to ``controller/``):

* the shape: ``v1beta1/inference_service_status.go`` (InferenceServiceStatus, ComponentStatusSpec, ModelStatus;
  ``activeModelState`` and ``transitionStatus`` have no omitempty, ``totalCopies`` has: a 0 is left out);
* Knative mode: PropagateStatus copies the Knative Service's Ready, RoutesReady and ConfigurationsReady into
  PredictorReady, PredictorRouteReady, PredictorConfigurationReady, its observedGeneration and revisions;
  controller.go adds RoutesReady/LatestDeploymentReady (PropagateCrossComponentStatus); during a rollout
  Knative's Configuration is Unknown while the latest created revision is not the latest ready one
  (knative-v1.16.0 pkg/apis/serving/v1/configuration_lifecycle.go, SetLatestCreatedRevisionName), so Ready is;
* Standard mode: PropagateRawStatus reads the Deployment's Available/Progressing/ReplicaFailure conditions and
  its observedGeneration (v0.14.1 reads Available only and sets latestCreatedRevision from the Deployment's
  revision annotation);
* modelStatus: PropagateModelStatus/UpdateModelRevisionStates (zero pods: target Pending, InProgress, the active
  state untouched; copies kept up to 0.15, ready pods from 0.16); SetModelFailureInfo never clears
  lastFailureInfo;
* the stop: ``controller/components/predictor.go`` wipes the status but deploymentMode and sets PredictorReady
  False (reason Stopped from 0.16) and, in 0.15.x, Stopped True; from 0.16 controller.go sets Stopped and the
  ingress reconcilers IngressReady False/Stopped; the Knative Service (0.15.1+, ksvc_reconciler.go) or the
  Deployment (0.16+, deployment_reconciler.go checkDeploymentExist) is deleted, so a wake creates it anew:
  generation 1, revision 00001;
* the expectations of KServe's own tests: ``v1beta1/inference_service_status_test.go``,
  ``controller/controller_test.go`` ("When creating inference service with `serving.kserve.io/stop`"),
  ``controller/rawkube_controller_test.go`` (the expected InferenceServiceStatus with Stopped False, Severity
  Info, and the stop/resume cases).
"""

from __future__ import annotations

from string import Template
from typing import Any

import pytest

from tests.factories import load, model, pick
from universal_operator.config import OperatorConfig
from universal_operator.reconcile.status import status_from_inference_service

NAME, NAMESPACE = "qwen-chat", "models"
MODEL_GENERATION = 3  # the UniversalModel's and the InferenceService's: KServe's observedGeneration is the child's

#: The releases the table covers: the first supported, the last before the rename, the rename, the newest read.
VERSIONS = ("0.14.1", "0.15.2", "0.16.0", "0.20.0")


def release(version: str) -> tuple[int, int, int]:
    major, minor, patch = (int(part) for part in version.split("."))
    return (major, minor, patch)


def mode_name(version: str, knative: bool) -> str | None:
    """status.deploymentMode: absent in 0.14 (v1beta1/inference_service_status.go has no such field)."""
    if release(version) < (0, 15, 0):
        return None
    if release(version) < (0, 16, 0):
        return "Serverless" if knative else "RawDeployment"
    return "Knative" if knative else "Standard"


def can_stop(version: str, knative: bool) -> bool:
    return release(version) >= ((0, 15, 1) if knative else (0, 16, 0))


# -- the documents, as YAML; $-fields differ between releases -------------------------------------------------

KNATIVE_READY = """
observedGeneration: $ksvc_generation
url: http://qwen-chat-models.example.com
address: {url: http://qwen-chat.models.svc.cluster.local}
$mode
conditions:
- {type: IngressReady, status: "True"}
- {type: LatestDeploymentReady, status: "True"}
- {type: PredictorConfigurationReady, status: "True"}
- {type: PredictorReady, status: "True"}
- {type: PredictorRouteReady, status: "True"}
- {type: Ready, status: "True"}
- {type: RoutesReady, status: "True"}
$stopped_false
components:
  predictor:
    latestCreatedRevision: qwen-chat-predictor-$revision
    latestReadyRevision: qwen-chat-predictor-$revision
    latestRolledoutRevision: qwen-chat-predictor-$revision
    traffic: [{revisionName: qwen-chat-predictor-$revision, percent: 100, latestRevision: true}]
    url: http://qwen-chat-predictor-models.example.com
    address: {url: http://qwen-chat-predictor.models.svc.cluster.local}
modelStatus:
  transitionStatus: UpToDate
  states: {activeModelState: Loaded, targetModelState: Loaded}
  copies: {failedCopies: 0, totalCopies: 1}
  $failure
"""

KNATIVE_CREATING = """
observedGeneration: 1
$mode
conditions:
- {type: IngressReady, status: Unknown}
- {type: LatestDeploymentReady, status: Unknown, reason: PredictorConfigurationReady not ready}
- {type: PredictorConfigurationReady, status: Unknown}
- type: PredictorReady
  status: Unknown
  reason: RevisionMissing
  message: Configuration "qwen-chat-predictor" is waiting for a Revision to become ready.
- {type: PredictorRouteReady, status: Unknown, reason: RevisionMissing}
- type: Ready
  status: Unknown
  reason: RevisionMissing
  message: Configuration "qwen-chat-predictor" is waiting for a Revision to become ready.
- {type: RoutesReady, status: Unknown, reason: PredictorRouteReady not ready}
$stopped_false
components:
  predictor: {latestCreatedRevision: qwen-chat-predictor-00001}
modelStatus:
  transitionStatus: InProgress
  states: {activeModelState: "", targetModelState: Loading}
  copies: {failedCopies: 0}
"""

KNATIVE_ROLLING_OUT = """
observedGeneration: 2
url: http://qwen-chat-models.example.com
address: {url: http://qwen-chat.models.svc.cluster.local}
$mode
conditions:
- {type: IngressReady, status: "True"}
- {type: LatestDeploymentReady, status: Unknown, reason: PredictorConfigurationReady not ready}
- {type: PredictorConfigurationReady, status: Unknown}
- {type: PredictorReady, status: Unknown}
- {type: PredictorRouteReady, status: "True"}
- {type: Ready, status: Unknown}
- {type: RoutesReady, status: "True"}
$stopped_false
components:
  predictor:
    latestCreatedRevision: qwen-chat-predictor-00002
    latestReadyRevision: qwen-chat-predictor-00001
    latestRolledoutRevision: qwen-chat-predictor-00001
    traffic: [{revisionName: qwen-chat-predictor-00001, percent: 100, latestRevision: true}]
modelStatus:
  transitionStatus: InProgress
  states: {activeModelState: Loaded, targetModelState: Loading}
  copies: {failedCopies: 0, totalCopies: 1}
"""

#: Knative scaled the revision to zero: Knative keeps the Service Ready; PropagateModelStatus finds no pod.
KNATIVE_AT_ZERO = """
observedGeneration: 1
url: http://qwen-chat-models.example.com
address: {url: http://qwen-chat.models.svc.cluster.local}
$mode
conditions:
- {type: IngressReady, status: "True"}
- {type: LatestDeploymentReady, status: "True"}
- {type: PredictorConfigurationReady, status: "True"}
- {type: PredictorReady, status: "True"}
- {type: PredictorRouteReady, status: "True"}
- {type: Ready, status: "True"}
- {type: RoutesReady, status: "True"}
$stopped_false
components:
  predictor:
    latestCreatedRevision: qwen-chat-predictor-00001
    latestReadyRevision: qwen-chat-predictor-00001
    latestRolledoutRevision: qwen-chat-predictor-00001
    traffic: [{revisionName: qwen-chat-predictor-00001, percent: 100, latestRevision: true}]
modelStatus:
  transitionStatus: InProgress
  states: {activeModelState: Loaded, targetModelState: Pending}
  copies: $copies_at_zero
"""

KNATIVE_FAILED = """
observedGeneration: 2
url: http://qwen-chat-models.example.com
$mode
conditions:
- {type: IngressReady, status: "True"}
- {type: LatestDeploymentReady, status: "False", reason: PredictorConfigurationReady not ready}
- type: PredictorConfigurationReady
  status: "False"
  reason: RevisionFailed
  message: 'Revision "qwen-chat-predictor-00002" failed with message: Container failed with: out of memory.'
- type: PredictorReady
  status: "False"
  reason: RevisionFailed
  message: 'Revision "qwen-chat-predictor-00002" failed with message: Container failed with: out of memory.'
- {type: PredictorRouteReady, status: "True"}
- type: Ready
  status: "False"
  reason: RevisionFailed
  message: 'Revision "qwen-chat-predictor-00002" failed with message: Container failed with: out of memory.'
- {type: RoutesReady, status: "True"}
$stopped_false
components:
  predictor:
    latestCreatedRevision: qwen-chat-predictor-00002
    latestReadyRevision: qwen-chat-predictor-00001
modelStatus:
  transitionStatus: BlockedByFailedLoad
  states: {activeModelState: Loaded, targetModelState: FailedToLoad}
  copies: {failedCopies: 0, totalCopies: 1}
  lastFailureInfo: {reason: ModelLoadFailed, message: out of memory, exitCode: 137}
"""

STANDARD_READY = """
observedGeneration: $deployment_generation
url: http://qwen-chat-models.example.com
address: {url: http://qwen-chat-predictor.models.svc.cluster.local}
$mode
conditions:
- {type: IngressReady, status: "True"}
- {type: PredictorReady, status: "True", reason: NewReplicaSetAvailable}
- {type: Ready, status: "True"}
$stopped_false
components:
  predictor: {$raw_revision url: http://qwen-chat-predictor-models.example.com}
modelStatus:
  transitionStatus: UpToDate
  states: {activeModelState: Loaded, targetModelState: Loaded}
  copies: {failedCopies: 0, totalCopies: 1}
  $failure
"""

#: A Deployment whose pods are not available yet: Available=False wins over Progressing (0.15+); 0.14 reads
#: Available alone. Either way PredictorReady False for a reason a wait fixes.
STANDARD_STARTING = """
observedGeneration: $deployment_generation
url: http://qwen-chat-models.example.com
$mode
conditions:
- {type: IngressReady, status: "True"}
- type: PredictorReady
  status: "False"
  reason: MinimumReplicasUnavailable
  message: Deployment does not have minimum availability.
- type: Ready
  status: "False"
  reason: MinimumReplicasUnavailable
  message: Deployment does not have minimum availability.
$stopped_false
components:
  predictor: {$raw_revision}
modelStatus:
  transitionStatus: InProgress
  states: {activeModelState: "$active", targetModelState: Loading}
  copies: {failedCopies: 0}
  $failure
"""

STANDARD_FAILED = """
observedGeneration: 2
url: http://qwen-chat-models.example.com
$mode
conditions:
- {type: IngressReady, status: "True"}
- type: PredictorReady
  status: "False"
  reason: MinimumReplicasUnavailable
  message: Deployment does not have minimum availability.
- type: Ready
  status: "False"
  reason: MinimumReplicasUnavailable
  message: Deployment does not have minimum availability.
$stopped_false
components:
  predictor: {$raw_revision}
modelStatus:
  transitionStatus: BlockedByFailedLoad
  states: {activeModelState: Loaded, targetModelState: FailedToLoad}
  copies: {failedCopies: 0, totalCopies: 1}
  lastFailureInfo: {reason: ModelLoadFailed, message: out of memory, exitCode: 137}
"""

#: The stop, as 0.15.x writes it for Serverless (predictor.go: Stopped True; the ingress reconciler: IngressReady
#: False without a reason). ModelStatus is a struct, so it is written with its empty transitionStatus.
STOPPED_0_15 = """
$mode
conditions:
- {type: IngressReady, status: "False"}
- {type: PredictorReady, status: "False"}
- {type: Ready, status: "False"}
- {type: Stopped, status: "True"}
modelStatus: {transitionStatus: ""}
"""

#: The stop from 0.16 (predictor.go: PredictorReady False/Stopped; controller.go: Stopped True; the ingress
#: reconcilers: IngressReady False/Stopped).
STOPPED_0_16 = """
$mode
conditions:
- {type: IngressReady, status: "False", reason: Stopped}
- {type: PredictorReady, status: "False", reason: Stopped}
- {type: Ready, status: "False", reason: Stopped}
- {type: Stopped, status: "True"}
modelStatus: {transitionStatus: ""}
"""

FAILURE_INFO = "lastFailureInfo: {reason: ModelLoadFailed, message: out of memory, exitCode: 137}"


def document(template: str, version: str, knative: bool, **fields: Any) -> dict[str, Any]:
    mode = mode_name(version, knative)
    stopped_false = '- {type: Stopped, status: "False", severity: Info}'
    has_stopped = release(version) >= (0, 16, 0) or (knative and release(version) >= (0, 15, 1))
    values = {
        "mode": f"deploymentMode: {mode}" if mode else "",
        "stopped_false": stopped_false if has_stopped else "",
        "ksvc_generation": 1,
        "deployment_generation": 1,
        "revision": "00001",
        "failure": "",
        "active": "",
        # 0.14/0.15 write copies only with Loaded (kept); 0.16 writes the ready pods, 0 omitted.
        "copies_at_zero": "{failedCopies: 0, totalCopies: 1}" if release(version) < (0, 16, 0) else "{failedCopies: 0}",
        # 0.14.1 PropagateRawStatus: latestCreatedRevision from the Deployment's revision annotation.
        "raw_revision": 'latestCreatedRevision: "1",' if release(version) < (0, 15, 0) else "",
        **fields,
    }
    return dict(load(Template(template).substitute(values)))


def stopped_document(version: str, knative: bool) -> dict[str, Any]:
    template = STOPPED_0_16 if release(version) >= (0, 16, 0) else STOPPED_0_15
    mode = mode_name(version, knative)
    return dict(load(Template(template).substitute(mode=f"deploymentMode: {mode}")))


def isvc(status: dict[str, Any], *, stop: bool = False) -> dict[str, Any]:
    annotations = {"serving.kserve.io/stop": "true"} if stop else {}
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "generation": MODEL_GENERATION, "annotations": annotations},
        "status": status,
    }


def the_model(knative: bool) -> Any:
    mode = "Knative" if knative else "Standard"
    return model(
        f"""
        metadata: {{name: {NAME}, namespace: {NAMESPACE}, generation: {MODEL_GENERATION}}}
        spec:
          task: generate
          source: {{uri: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF, file: "*q4_k_m.gguf"}}
          scaling: {{mode: {mode}}}
        """
    )


# -- the table ---------------------------------------------------------------------------------------------------

IDLE = {"phase": "Idle", "replicas": 0}


def situations(version: str, knative: bool) -> dict[str, tuple[dict[str, Any], str]]:
    """Situation -> (the InferenceService KServe left, the expected UniversalModel status fragment as YAML)."""
    out: dict[str, tuple[dict[str, Any], str]]
    if knative:
        out = {
            "creating": (isvc(document(KNATIVE_CREATING, version, knative)), "phase: Loading"),
            "ready": (
                isvc(document(KNATIVE_READY, version, knative)),
                "{phase: Ready, replicas: 1, address: 'http://qwen-chat.models.svc.cluster.local'}",
            ),
            "rolling out a new spec": (isvc(document(KNATIVE_ROLLING_OUT, version, knative)), "phase: Loading"),
            "scaled to zero": (isvc(document(KNATIVE_AT_ZERO, version, knative)), "{phase: Idle, replicas: 0}"),
            "failed": (
                isvc(document(KNATIVE_FAILED, version, knative)),
                "{phase: Failed, message: 'ModelLoadFailed: out of memory: exit code 137'}",
            ),
            "recovered (lastFailureInfo left behind)": (
                isvc(
                    document(KNATIVE_READY, version, knative, revision="00003", ksvc_generation=3, failure=FAILURE_INFO)
                ),
                "{phase: Ready, message: Serving.}",
            ),
        }
    else:
        out = {
            "creating": (isvc(document(STANDARD_STARTING, version, knative)), "phase: Loading"),
            "ready": (
                isvc(document(STANDARD_READY, version, knative)),
                "{phase: Ready, replicas: 1, address: 'http://qwen-chat-predictor.models.svc.cluster.local'}",
            ),
            "rolling out a new spec": (
                isvc(document(STANDARD_STARTING, version, knative, deployment_generation=2, active="Loaded")),
                "phase: Loading",
            ),
            "failed": (
                isvc(document(STANDARD_FAILED, version, knative)),
                "{phase: Failed, message: 'ModelLoadFailed: out of memory: exit code 137'}",
            ),
            "recovered (lastFailureInfo left behind)": (
                isvc(document(STANDARD_READY, version, knative, deployment_generation=3, failure=FAILURE_INFO)),
                "{phase: Ready, message: Serving.}",
            ),
        }
    if can_stop(version, knative):
        out["stopped"] = (isvc(stopped_document(version, knative), stop=True), "{phase: Idle, replicas: 0}")
        # The wake after a spec edit: the child is new (generation 1, revision 00001) under an InferenceService
        # at generation 3; Stopped is False again.
        woken = document(KNATIVE_READY if knative else STANDARD_READY, version, knative)
        starting = document(KNATIVE_CREATING if knative else STANDARD_STARTING, version, knative, failure="")
        out["woken after a spec edit: starting"] = (isvc(starting), "phase: Loading")
        out["woken after a spec edit: ready"] = (isvc(woken), "{phase: Ready, replicas: 1}")
    return out


CASES = [
    pytest.param(version, knative, kserve_doc, expected, id=f"{version}-{'Knative' if knative else 'Standard'}-{name}")
    for version in VERSIONS
    for knative in (True, False)
    for name, (kserve_doc, expected) in situations(version, knative).items()
]


@pytest.mark.parametrize(("version", "knative", "child", "expected_yaml"), CASES)
def test_status_follows_what_each_kserve_release_writes(
    version: str, knative: bool, child: dict[str, Any], expected_yaml: str
) -> None:
    config = OperatorConfig.model_validate({"kserve": {"version": version}})
    status = status_from_inference_service(child, the_model(knative), config=config)
    expected = load(expected_yaml)
    assert pick(status, expected) == expected
    assert status["observedGeneration"] == MODEL_GENERATION


@pytest.mark.parametrize("version", VERSIONS)
def test_idle_stop_condition_says_whether_this_release_can_stop_a_standard_model(version: str) -> None:
    config = OperatorConfig.model_validate({"kserve": {"version": version}})
    child = isvc(document(STANDARD_READY, version, False))
    conditions = {
        c["type"]: c for c in status_from_inference_service(child, the_model(False), config=config)["conditions"]
    }
    idle_stop = conditions["IdleStop"]
    if can_stop(version, False):
        assert pick(idle_stop, {"status": 0, "reason": 0}) == {"status": "True", "reason": "GatewayStops"}
    else:
        assert pick(idle_stop, {"status": 0, "reason": 0}) == {"status": "False", "reason": "UnsupportedByKServe"}
        assert f"KServe {version} cannot stop a Standard-mode" in idle_stop["message"]
        assert "stays running" in idle_stop["message"]
        assert "0.16.0" in idle_stop["message"]


def test_a_stop_annotation_a_release_ignores_does_not_make_the_model_idle() -> None:
    # 0.15.2 never reads serving.kserve.io/stop in RawDeployment mode: the model keeps serving.
    config = OperatorConfig.model_validate({"kserve": {"version": "0.15.2"}})
    child = isvc(document(STANDARD_READY, "0.15.2", False), stop=True)
    assert status_from_inference_service(child, the_model(False), config=config)["phase"] == "Ready"


def test_idle_stop_says_the_model_keeps_running_when_the_gateway_may_not_stop_it() -> None:
    # The chart's default: gateway.standardMode false, so the gateway has no RBAC to patch InferenceServices.
    config = OperatorConfig.model_validate({"kserve": {"version": "0.16.0"}, "gatewayStopsStandardModels": False})
    child = isvc(document(STANDARD_READY, "0.16.0", False))
    conditions = {
        c["type"]: c for c in status_from_inference_service(child, the_model(False), config=config)["conditions"]
    }
    assert pick(conditions["IdleStop"], {"status": 0, "reason": 0}) == {
        "status": "False", "reason": "GatewayNotPermitted",
    }  # fmt: skip
    assert "gateway.standardMode" in conditions["IdleStop"]["message"]


@pytest.mark.parametrize("version", ["0.15.2", "0.16.0", "0.20.0"])
def test_a_knative_model_stopped_by_hand_says_no_request_wakes_it(version: str) -> None:
    # The gateway sets serving.kserve.io/stop only on Standard-mode models: in Knative mode a person did.
    config = OperatorConfig.model_validate({"kserve": {"version": version}})
    status = status_from_inference_service(isvc(stopped_document(version, True), stop=True), the_model(True),
                                           config=config)  # fmt: skip
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (status["phase"], ready["status"], ready["reason"]) == ("Idle", "False", "StoppedByHand")
    assert "requests get 503 until it is removed" in status["message"]
    assert "wakes it" not in status["message"]


#: A Standard-mode rollout past the Deployment's progress deadline (600 s, KServe's): PropagateRawStatus reports
#: Progressing=False/ProgressDeadlineExceeded as PredictorReady False, while the Deployment keeps rolling.
STANDARD_PAST_DEADLINE = """
observedGeneration: 2
url: http://qwen-chat-models.example.com
deploymentMode: Standard
conditions:
- {type: IngressReady, status: "True"}
- {type: PredictorReady, status: "False", reason: ProgressDeadlineExceeded,
   message: ReplicaSet "qwen-chat-predictor-2" has timed out progressing.}
- {type: Ready, status: "False", reason: ProgressDeadlineExceeded,
   message: ReplicaSet "qwen-chat-predictor-2" has timed out progressing.}
modelStatus:
  transitionStatus: InProgress
  states: {activeModelState: Loaded, targetModelState: Loading}
  copies: {failedCopies: 0, totalCopies: $copies}
"""


@pytest.mark.parametrize(("copies", "phase", "ready"), [(1, "Ready", "True"), (0, "Loading", "False")])
def test_a_standard_rollout_past_the_progress_deadline_is_slow_not_failed(copies: int, phase: str, ready: str) -> None:
    config = OperatorConfig.model_validate({"kserve": {"version": "0.16.0"}})
    child = isvc(load(STANDARD_PAST_DEADLINE.replace("$copies", str(copies))))
    status = status_from_inference_service(child, the_model(False), config=config)
    assert status["phase"] == phase  # the previous replica serves (copies), or the first one still loads
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == ready
    assert "600 s progress deadline" in status["message"]


def test_a_standard_rollout_past_the_deadline_whose_model_failed_to_load_is_failed() -> None:
    config = OperatorConfig.model_validate({"kserve": {"version": "0.16.0"}})
    document_ = load(STANDARD_PAST_DEADLINE.replace("$copies", "1"))
    failed = {"reason": "ModelLoadFailed", "message": "out of memory"}
    states = {"activeModelState": "Loaded", "targetModelState": "FailedToLoad"}
    document_["modelStatus"].update(transitionStatus="BlockedByFailedLoad", lastFailureInfo=failed, states=states)
    status = status_from_inference_service(isvc(document_), the_model(False), config=config)
    assert status["phase"] == "Failed"
