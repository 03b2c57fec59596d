"""status_from_inference_service: the InferenceService KServe reports on, the UniversalModel status out.

Child statuses are written as KServe writes them (YAML); the expected status fragment is YAML too.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from tests.factories import load, manifest, model, pick
from universal_operator.reconcile.status import status_changed, status_for_invalid_spec, status_from_inference_service
from universal_operator.spec import Phase, SpecError, parse_model

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
T1 = datetime(2026, 1, 2, 4, 0, 0, tzinfo=UTC)
T0_TEXT = "2026-01-02T03:04:05Z"
T1_TEXT = "2026-01-02T04:00:00Z"

QWEN = """
metadata: {name: qwen-chat, generation: 3}
spec:
  task: generate
  source: {uri: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF, file: "*q4_k_m.gguf"}
  servedName: qwen2.5-0.5b-instruct
"""


def child(status_yaml: str | None, generation: int = 2, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """An InferenceService as read back from the API, with KServe's status (None: not written yet)."""
    isvc: dict[str, Any] = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": "qwen-chat",
            "namespace": "models",
            "generation": generation,
            "annotations": annotations or {},
        },
        "spec": {"predictor": {}},
    }
    if status_yaml is not None:
        isvc["status"] = load(status_yaml)
    return isvc


def conditions_by_type(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


READY_2_COPIES = """
observedGeneration: 2
url: http://qwen-chat.models.example.com
address: {url: http://qwen-chat.models.svc.cluster.local}
conditions:
- {type: PredictorReady, status: "True"}
- {type: IngressReady, status: "True"}
- {type: Ready, status: "True"}
modelStatus:
  copies: {totalCopies: 2}
  states: {activeModelState: Loaded, targetModelState: Loaded}
  transitionStatus: UpToDate
"""

CASES: dict[str, tuple[str | None, str]] = {
    "no status yet: Pending": (
        "{}",
        """
        phase: Pending
        replicas: null
        conditions:
          Ready: {status: "False", reason: Pending}
          InferenceServiceReady: {status: Unknown, reason: AwaitingKServe}
        """,
    ),
    "status without conditions: Pending": (
        "observedGeneration: 2",
        """
        phase: Pending
        conditions:
          Ready: {status: "False", reason: Pending}
          InferenceServiceReady: {status: Unknown, reason: AwaitingKServe}
        """,
    ),
    "observedGeneration is the child workload's, not the InferenceService's: Ready all the same": (
        """
        observedGeneration: 1
        url: http://qwen-chat.models.example.com
        conditions: [{type: Ready, status: "True"}]
        modelStatus: {copies: {totalCopies: 1}, states: {activeModelState: Loaded, targetModelState: Loaded}}
        """,
        """
        phase: Ready
        conditions:
          Ready: {status: "True", reason: Serving}
          InferenceServiceReady: {status: "True"}
        """,
    ),
    "Ready=True without any observedGeneration (a Deployment not observed yet): Ready": (
        'conditions: [{type: Ready, status: "True"}]',
        """
        phase: Ready
        conditions:
          Ready: {status: "True", reason: Serving}
        """,
    ),
    "Knative rollout: latestCreatedRevision ahead of latestReadyRevision: Loading": (
        """
        observedGeneration: 3
        components:
          predictor: {latestCreatedRevision: qwen-chat-predictor-00002, latestReadyRevision: qwen-chat-predictor-00001}
        conditions: [{type: Ready, status: "True"}]
        modelStatus:
          copies: {totalCopies: 1}
          states: {activeModelState: Loaded, targetModelState: Loading}
          transitionStatus: InProgress
        """,
        """
        phase: Loading
        message: Rolling out revision qwen-chat-predictor-00002; qwen-chat-predictor-00001 serves meanwhile.
        conditions:
          Ready: {status: "False", reason: Loading}
        """,
    ),
    "fresh Ready=True with two copies: Ready, replicas, url and in-cluster address": (
        READY_2_COPIES,
        """
        phase: Ready
        replicas: 2
        url: http://qwen-chat.models.example.com
        address: http://qwen-chat.models.svc.cluster.local
        message: Serving.
        conditions:
          Ready: {status: "True", reason: Serving}
          InferenceServiceReady: {status: "True", reason: Ready}
        """,
    ),
    "address falls back to the predictor component's address": (
        """
        observedGeneration: 2
        components: {predictor: {address: {url: http://qwen-chat-predictor.models.svc.cluster.local}}}
        conditions: [{type: Ready, status: "True"}]
        modelStatus: {copies: {totalCopies: 1}}
        """,
        """
        phase: Ready
        address: http://qwen-chat-predictor.models.svc.cluster.local
        """,
    ),
    "Knative at zero pods: target Pending, InProgress, active still Loaded, Ready True: Idle": (
        """
        observedGeneration: 2
        components:
          predictor: {latestCreatedRevision: qwen-chat-predictor-00001, latestReadyRevision: qwen-chat-predictor-00001}
        conditions: [{type: Ready, status: "True"}]
        modelStatus:
          copies: {totalCopies: 1}
          states: {activeModelState: Loaded, targetModelState: Pending}
          transitionStatus: InProgress
        """,
        """
        phase: Idle
        replicas: 0
        conditions:
          Ready: {status: "True", reason: ScaledToZero}
          InferenceServiceReady: {status: "True"}
        """,
    ),
    "zero pods before the first load (active state unset): Loading, not Idle": (
        """
        observedGeneration: 1
        components: {predictor: {latestCreatedRevision: qwen-chat-predictor-00001}}
        conditions: [{type: Ready, status: Unknown}]
        modelStatus: {copies: {totalCopies: 0}, states: {targetModelState: Pending}, transitionStatus: InProgress}
        """,
        """
        phase: Loading
        conditions:
          Ready: {status: "False", reason: Loading}
        """,
    ),
    "BlockedByFailedLoad: Failed with lastFailureInfo's reason, message and exit code": (
        """
        observedGeneration: 2
        conditions: [{type: Ready, status: "False", reason: ContainersNotReady}]
        modelStatus:
          transitionStatus: BlockedByFailedLoad
          states: {targetModelState: FailedToLoad}
          lastFailureInfo: {reason: ModelLoadFailed, message: "out of memory", exitCode: 137}
        """,
        """
        phase: Failed
        message: "ModelLoadFailed: out of memory: exit code 137"
        conditions:
          Ready:
            status: "False"
            reason: InferenceServiceFailed
            message: "ModelLoadFailed: out of memory: exit code 137"
          InferenceServiceReady: {status: "False", reason: ContainersNotReady}
        """,
    ),
    "targetModelState FailedToLoad without details: Failed": (
        """
        observedGeneration: 2
        conditions: [{type: Ready, status: "False"}]
        modelStatus:
          states: {activeModelState: Loaded, targetModelState: FailedToLoad}
          transitionStatus: BlockedByFailedLoad
        """,
        """
        phase: Failed
        message: the model failed to load (BlockedByFailedLoad)
        conditions:
          Ready: {status: "False", reason: InferenceServiceFailed}
          InferenceServiceReady: {status: "False", reason: Failed}
        """,
    ),
    "a sticky lastFailureInfo under Ready=True and UpToDate: Ready (KServe never clears it)": (
        """
        observedGeneration: 4
        conditions: [{type: Ready, status: "True"}]
        modelStatus:
          transitionStatus: UpToDate
          states: {activeModelState: Loaded, targetModelState: Loaded}
          copies: {totalCopies: 1}
          lastFailureInfo: {reason: ModelLoadFailed, message: "out of memory", exitCode: 137}
        """,
        """
        phase: Ready
        message: Serving.
        """,
    ),
    "a sticky lastFailureInfo while a fixed spec loads: Loading, not Failed": (
        """
        conditions: [{type: Ready, status: Unknown, reason: RevisionMissing}]
        modelStatus:
          transitionStatus: InProgress
          states: {activeModelState: Loaded, targetModelState: Loading}
          lastFailureInfo: {reason: ModelLoadFailed, message: "out of memory", exitCode: 137}
        """,
        """
        phase: Loading
        """,
    ),
    "Ready=False with reason RevisionFailed: Failed carrying KServe's message": (
        """
        observedGeneration: 2
        conditions:
        - type: Ready
          status: "False"
          reason: RevisionFailed
          message: 'Revision "qwen-chat-predictor-00001" failed with message: Back-off pulling image.'
        """,
        """
        phase: Failed
        message: 'RevisionFailed: Revision "qwen-chat-predictor-00001" failed with message: Back-off pulling image.'
        conditions:
          Ready: {status: "False", reason: InferenceServiceFailed}
          InferenceServiceReady: {status: "False", reason: RevisionFailed}
        """,
    ),
    "Ready=False for a reason a wait will fix: Loading with KServe's message": (
        """
        observedGeneration: 2
        conditions:
        - type: Ready
          status: "False"
          reason: ContainersNotReady
          message: "containers with unready status: [kserve-container]"
        """,
        """
        phase: Loading
        message: "containers with unready status: [kserve-container]"
        conditions:
          Ready: {status: "False", reason: Loading, message: "containers with unready status: [kserve-container]"}
          InferenceServiceReady: {status: "False", reason: ContainersNotReady}
        """,
    ),
    "Ready=Unknown while the predictor starts: Loading": (
        """
        observedGeneration: 2
        conditions: [{type: PredictorReady, status: Unknown}, {type: Ready, status: Unknown}]
        """,
        """
        phase: Loading
        message: The predictor is starting.
        conditions:
          Ready: {status: "False", reason: Loading}
          InferenceServiceReady: {status: Unknown, reason: Starting}
        """,
    ),
}


def assert_status_matches(status: dict[str, Any], expected: dict[str, Any]) -> None:
    want_conditions = expected.pop("conditions", {})
    assert pick(status, expected) == expected
    got = conditions_by_type(status)
    assert {kind: pick(got[kind], want) for kind, want in want_conditions.items()} == want_conditions


@pytest.mark.parametrize(("child_status", "expected_yaml"), CASES.values(), ids=CASES.keys())
def test_phase_replicas_addresses_and_conditions_follow_the_child(child_status: str, expected_yaml: str) -> None:
    status = status_from_inference_service(child(child_status), model(QWEN), now=T0)
    assert_status_matches(status, load(expected_yaml))


def test_no_child_is_pending_with_the_inference_service_missing() -> None:
    status = status_from_inference_service(None, model(QWEN), now=T0)
    assert_status_matches(
        status,
        load(
            """
            phase: Pending
            url: null
            address: null
            replicas: null
            message: Creating the InferenceService.
            conditions:
              Ready: {status: "False", reason: InferenceServiceMissing}
              SpecValid: {status: "True", reason: Valid}
              InferenceServiceReady: {status: Unknown, reason: NotCreated}
            """
        ),
    )


def test_child_without_a_status_key_is_pending() -> None:
    status = status_from_inference_service(child(None), model(QWEN), now=T0)
    assert status["phase"] == "Pending"


@pytest.mark.parametrize("child_status", [None, *[case[0] for case in CASES.values()]])
def test_conditions_are_always_ready_specvalid_isvcready_at_the_models_generation(child_status: str | None) -> None:
    isvc = None if child_status is None else child(child_status)
    status = status_from_inference_service(isvc, model(QWEN), now=T0)
    assert [c["type"] for c in status["conditions"]] == ["Ready", "SpecValid", "InferenceServiceReady"]
    assert {c["observedGeneration"] for c in status["conditions"]} == {3}
    assert status["observedGeneration"] == 3
    assert conditions_by_type(status)["SpecValid"]["status"] == "True"
    assert {c["lastTransitionTime"] for c in status["conditions"]} == {T0_TEXT}


STOPPED = """
deploymentMode: Knative
conditions:
- {type: IngressReady, status: "False", reason: Stopped}
- {type: PredictorReady, status: "False", reason: Stopped}
- {type: Ready, status: "False", reason: Stopped}
- {type: Stopped, status: "True"}
"""


def test_stopped_is_idle_whatever_else_the_wiped_status_lacks() -> None:
    # A Knative-mode model: only a person stops one (the gateway stops Standard-mode models), and no request
    # lifts it, so Ready says so.
    stopped = child(STOPPED, annotations={"serving.kserve.io/stop": "true"})
    status = status_from_inference_service(stopped, model(QWEN), now=T0)
    assert_status_matches(
        status,
        load(
            """
            phase: Idle
            replicas: 0
            conditions:
              Ready: {status: "False", reason: StoppedByHand}
              InferenceServiceReady: {status: "True", reason: Stopped}
            """
        ),
    )


def test_stop_asked_but_not_yet_reported_is_idle_and_a_stale_stopped_after_a_wake_is_waking() -> None:
    stopping = child(READY_2_COPIES, annotations={"serving.kserve.io/stop": "true"})
    assert status_from_inference_service(stopping, model(QWEN), now=T0)["phase"] == "Idle"
    waking = child(STOPPED)  # the annotation is gone; KServe has not reconciled yet
    status = status_from_inference_service(waking, model(QWEN), now=T0, pods=[])
    assert (status["phase"], status["step"]) == ("Waking", "Scheduling")


def test_status_names_served_name_resolved_backend_and_child() -> None:
    status = status_from_inference_service(child(READY_2_COPIES), model(QWEN), now=T0)
    assert pick(status, {"servedName": 0, "backend": 0, "inferenceService": 0}) == {
        "servedName": "qwen2.5-0.5b-instruct",
        "backend": "llamacpp",
        "inferenceService": "qwen-chat",
    }


GPU_AUTO = """
metadata: {name: llama, generation: 4}
spec:
  task: generate
  source: {uri: hf://meta-llama/Llama-3.1-8B-Instruct}
  resources: {gpus: 1}
"""


def gpu_auto_model(report: dict[str, Any] | None, spec_yaml: str = GPU_AUTO) -> Any:
    """The GPU generation model whose backend only its predictor can tell, with the gateway's report if any."""
    body = manifest(spec_yaml)
    if report is not None:
        body["status"] = {"predictorReport": report}
    return parse_model(body)


def backend(model: Any) -> str:
    return str(status_from_inference_service(child(READY_2_COPIES), model, now=T0)["backend"])


def test_a_gpu_generation_model_reports_auto_until_its_predictor_says_which_backend_it_runs() -> None:
    assert backend(gpu_auto_model(None)) == "auto"
    assert backend(gpu_auto_model({"backend": "vllm", "generation": 4})) == "vllm"
    assert backend(gpu_auto_model({"backend": "transformers", "generation": 4})) == "transformers"


@pytest.mark.parametrize(
    "report",
    [
        {"backend": "vllm", "generation": 3},  # seen for the spec before: the current one may run another
        {"backend": "rapidocr", "generation": 4},  # not a generation backend
        {"backend": "auto", "generation": 4},
        {"backend": "a-new-engine", "generation": 4},
        {"backend": "vllm"},  # unreadable (no generation): ignored, never an invalid spec
    ],
    ids=["older-generation", "not-the-tasks", "auto", "unknown", "unreadable"],
)
def test_a_report_for_another_generation_or_backend_leaves_auto(report: dict[str, Any]) -> None:
    assert backend(gpu_auto_model(report)) == "auto"


def test_a_backend_the_spec_decides_is_never_overridden_by_a_report() -> None:
    explicit = GPU_AUTO.replace("task: generate", "task: generate\n  backend: transformers")
    assert backend(gpu_auto_model({"backend": "vllm", "generation": 4}, explicit)) == "transformers"
    gguf = QWEN.replace("generation: 3", "generation: 4")  # auto, decided by the GGUF source
    assert backend(gpu_auto_model({"backend": "vllm", "generation": 4}, gguf)) == "llamacpp"


def model_with_conditions(conditions_yaml: str) -> Any:
    body = manifest(QWEN)
    body["status"] = {"conditions": load(conditions_yaml)}
    return parse_model(body)


def test_last_transition_time_is_kept_when_a_conditions_status_does_not_change() -> None:
    before = model_with_conditions(
        f"""
        - {{type: Ready, status: "True", reason: Serving, lastTransitionTime: "{T0_TEXT}"}}
        - {{type: SpecValid, status: "True", reason: Valid, lastTransitionTime: "{T0_TEXT}"}}
        - {{type: InferenceServiceReady, status: "True", reason: Ready, lastTransitionTime: "{T0_TEXT}"}}
        """
    )
    status = status_from_inference_service(child(READY_2_COPIES), before, now=T1)
    assert {c["type"]: c["lastTransitionTime"] for c in status["conditions"]} == {
        "Ready": T0_TEXT,
        "SpecValid": T0_TEXT,
        "InferenceServiceReady": T0_TEXT,
    }


def test_last_transition_time_is_renewed_when_a_conditions_status_changes() -> None:
    before = model_with_conditions(
        f"""
        - {{type: Ready, status: "False", reason: Loading, lastTransitionTime: "{T0_TEXT}"}}
        - {{type: SpecValid, status: "True", reason: Valid, lastTransitionTime: "{T0_TEXT}"}}
        - {{type: InferenceServiceReady, status: Unknown, reason: Starting, lastTransitionTime: "{T0_TEXT}"}}
        """
    )
    status = status_from_inference_service(child(READY_2_COPIES), before, now=T1)
    assert {c["type"]: c["lastTransitionTime"] for c in status["conditions"]} == {
        "Ready": T1_TEXT,
        "SpecValid": T0_TEXT,
        "InferenceServiceReady": T1_TEXT,
    }


def test_a_reason_change_alone_keeps_the_transition_time() -> None:
    before = model_with_conditions(
        f'- {{type: Ready, status: "True", reason: Serving, lastTransitionTime: "{T0_TEXT}"}}'
    )
    idle = child(
        """
        observedGeneration: 2
        conditions: [{type: Ready, status: "True"}]
        modelStatus: {states: {activeModelState: Loaded, targetModelState: Pending}, transitionStatus: InProgress}
        """
    )
    ready = conditions_by_type(status_from_inference_service(idle, before, now=T1))["Ready"]
    assert pick(ready, {"reason": 0, "lastTransitionTime": 0}) == {
        "reason": "ScaledToZero",
        "lastTransitionTime": T0_TEXT,
    }


def test_invalid_spec_status_is_failed_with_specvalid_false_naming_the_field() -> None:
    body = manifest(QWEN)
    body["metadata"]["generation"] = 7
    status = status_for_invalid_spec(body, SpecError("spec.resources.profile", "profile 'tpu' is unknown"), now=T0)
    assert status["phase"] == Phase.FAILED.value
    assert status["observedGeneration"] == 7
    assert "spec.resources.profile" in status["message"]
    spec_valid = conditions_by_type(status)["SpecValid"]
    assert pick(spec_valid, {"status": 0, "reason": 0, "observedGeneration": 0}) == {
        "status": "False",
        "reason": "InvalidSpec",
        "observedGeneration": 7,
    }
    assert "spec.resources.profile" in spec_valid["message"]
    assert [c["type"] for c in status["conditions"]] == ["Ready", "SpecValid", "InferenceServiceReady"]
    assert conditions_by_type(status)["Ready"]["status"] == "False"


def test_invalid_spec_status_keeps_transition_times_and_skips_malformed_old_conditions() -> None:
    body = manifest(QWEN)
    body["status"] = {
        "conditions": [
            {"type": "SpecValid", "status": "False", "reason": "InvalidSpec", "lastTransitionTime": T0_TEXT},
            {"type": "Ready", "status": "Maybe"},  # not a condition status: ignored, not fatal
        ]
    }
    status = status_for_invalid_spec(body, SpecError("spec.source.uri", "bad"), now=T1)
    assert {c["type"]: c["lastTransitionTime"] for c in status["conditions"]} == {
        "Ready": T1_TEXT,
        "SpecValid": T0_TEXT,
        "InferenceServiceReady": T1_TEXT,
    }


def test_status_changed_ignores_differences_in_transition_times_only() -> None:
    isvc = child(READY_2_COPIES)
    first = status_from_inference_service(isvc, model(QWEN), now=T0)
    second = status_from_inference_service(isvc, model(QWEN), now=T1)
    assert first != second
    assert not status_changed(first, second)


@pytest.mark.parametrize(
    ("field", "value"),
    [("phase", "Idle"), ("replicas", 1), ("url", "http://elsewhere"), ("message", "other")],
)
def test_status_changed_sees_a_change_in_any_field(field: str, value: object) -> None:
    current = status_from_inference_service(child(READY_2_COPIES), model(QWEN), now=T0)
    assert status_changed(current, {**current, field: value})


def test_status_changed_sees_a_changed_condition_and_a_first_write() -> None:
    current = status_from_inference_service(child(READY_2_COPIES), model(QWEN), now=T0)
    changed = {**current, "conditions": [{**current["conditions"][0], "reason": "Other"}, *current["conditions"][1:]]}
    assert status_changed(current, changed)
    assert status_changed(None, current)


def test_status_changed_treats_none_as_absent() -> None:
    new = status_from_inference_service(None, model(QWEN), now=T0)  # url, address, replicas are None
    current = {k: v for k, v in new.items() if v is not None}
    assert not status_changed(current, new)
    assert status_changed({**current, "url": "http://old"}, new)
