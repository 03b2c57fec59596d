"""Admission as a cluster applies it to InferenceServices (universal_simcluster.admission), and the operator's
renders going through it: what KServe defaults, what KServe, Knative and Kubernetes refuse.

The InferenceServices here are written as users write them (KServe's docs' custom-predictor shape).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    GPU_KNATIVE_FEATURES,
    MODEL_KIND,
    POOL_KIND,
    TEST_OPERATOR_CONFIG,
    cluster_examples,
    cluster_for,
    pooled,
)
from tests.factories import CONFIG, at, load, model, render
from universal_operator.config import OperatorConfig, parse_config
from universal_operator.reconcile.pools import desired_pool_inference_service
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.spec import SpecError, parse_model, parse_pool
from universal_simcluster import admission
from universal_simcluster.admission import Cluster, Denied, admit

DEFAULT = Cluster()

ISVC = """
apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata:
  name: custom-model
  namespace: default
spec:
  predictor:
    minReplicas: 0
    maxReplicas: 1
    containers:
    - name: kserve-container
      image: registry.example/custom-model:1
      ports: [{name: http1, containerPort: 8080, protocol: TCP}]
"""


def isvc(patch: str = "", base: str = ISVC) -> dict[str, Any]:
    """The base InferenceService with ``patch`` (YAML) merged in, maps recursively."""

    def merge(into: Any, extra: Any) -> Any:
        if isinstance(into, dict) and isinstance(extra, dict):
            return {**into, **{k: merge(into.get(k), v) for k, v in extra.items()}}
        return extra

    return merge(load(base), load(patch) or {})  # type: ignore[no-any-return]


def refusal(obj: dict[str, Any], cluster: Cluster = DEFAULT, old: dict[str, Any] | None = None) -> Denied:
    with pytest.raises(Denied) as caught:
        admit(obj, old, cluster)
    return caught.value


# --------------------------------------------------------------------------------------------------
# KServe's defaulting webhook


@pytest.mark.parametrize("version", [(0, 14, 1), (0, 15, 2), (0, 16, 0)])
def test_kserve_fills_missing_requests_and_limits_from_its_configmap(version: tuple[int, int, int]) -> None:
    stored = admit(isvc(), None, Cluster(kserve=version))
    assert at(stored, "spec.predictor.containers[0].resources") == load(
        """
        requests: {cpu: "1", memory: 2Gi}
        limits: {cpu: "1", memory: 2Gi}
        """
    )


def test_kserve_fills_key_by_key_so_a_cpu_request_above_1_without_a_limit_makes_an_invalid_pod() -> None:
    obj = isvc(
        """
        metadata: {annotations: {serving.kserve.io/deploymentMode: RawDeployment}}
        spec:
          predictor:
            minReplicas: 1
            containers: [{name: kserve-container, image: i:1, resources: {requests: {cpu: "2"}}}]
        """
    )
    denied = refusal(obj)
    assert denied.code == 422
    assert "resources.requests: Invalid value: '2': must be less than or equal to cpu limit of 1" in denied.message


def test_an_extended_resource_request_must_equal_its_limit() -> None:
    obj = isvc(
        "spec: {predictor: {containers: [{name: kserve-container, image: i:1, resources: "
        "{requests: {nvidia.com/gpu: '2'}, limits: {nvidia.com/gpu: '1'}}}]}}"
    )
    assert "must be equal to nvidia.com/gpu limit of 1" in refusal(obj).message


# --------------------------------------------------------------------------------------------------
# KServe's validating webhook: 403, "admission webhook ... denied the request: ..."


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ("spec: {predictor: {minReplicas: 3, maxReplicas: 2}}", "'MinReplicas' cannot be greater than MaxReplicas"),
        ("spec: {predictor: {minReplicas: -1}}", "'MinReplicas' cannot be less than 0"),
        (
            "metadata: {annotations: {serving.kserve.io/autoscalerClass: magic}}",
            "[magic] is not a supported autoscaler",
        ),
        ("spec: {predictor: {scaleMetric: cpu}}", "[cpu] is not a supported metric"),
        ("metadata: {name: 9lives}", 'the InferenceService "9lives" is invalid'),
    ],
)
def test_kserve_validation_refuses_as_a_webhook_denial(patch: str, message: str) -> None:
    denied = refusal(isvc(patch))
    assert (denied.code, denied.reason) == (403, "Forbidden")
    assert denied.message.startswith(
        'admission webhook "inferenceservice.kserve-webhook-server.validator" denied the request: '
    )
    assert message in denied.message


def test_kserve_checks_a_raw_deployments_metric_as_hpa_per_release() -> None:
    obj = isvc(
        """
        metadata: {annotations: {serving.kserve.io/deploymentMode: RawDeployment}}
        spec: {predictor: {minReplicas: 1, scaleMetric: concurrency}}
        """
    )
    # 0.14: RawDeployment always means HPA; 0.15: only with autoscalerClass hpa.
    assert "[concurrency] is not a supported metric" in refusal(obj, Cluster(kserve=(0, 14, 1))).message
    assert admit(obj, None, Cluster(kserve=(0, 15, 2)))
    obj["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] = "hpa"
    assert "[concurrency] is not a supported metric" in refusal(obj, Cluster(kserve=(0, 15, 2))).message


def test_kserve_from_0_15_1_refuses_changing_the_deployment_mode_it_recorded() -> None:
    old = isvc("metadata: {annotations: {serving.kserve.io/deploymentMode: Serverless}}")
    old["status"] = {"deploymentMode": "Serverless"}
    new = isvc("metadata: {annotations: {serving.kserve.io/deploymentMode: RawDeployment}}")
    message = refusal(new, Cluster(kserve=(0, 15, 2)), old).message
    assert "deploymentMode cannot be changed from 'Serverless' to 'RawDeployment'" in message
    new["spec"]["predictor"]["minReplicas"] = 1
    assert admit(new, old, Cluster(kserve=(0, 15, 0)))  # 0.15.0 and 0.14 have no such check


# --------------------------------------------------------------------------------------------------
# Knative's webhook on the revision KServe builds: field masks by config-features flag

MASKED = {
    "nodeSelector": ("spec: {predictor: {nodeSelector: {gpu: l4}}}", "kubernetes.podspec-nodeselector"),
    "tolerations": (
        "spec: {predictor: {tolerations: [{key: nvidia.com/gpu, operator: Exists}]}}",
        "kubernetes.podspec-tolerations",
    ),
    "runtimeClassName": ("spec: {predictor: {runtimeClassName: nvidia}}", "kubernetes.podspec-runtimeclassname"),
    "affinity": ("spec: {predictor: {affinity: {nodeAffinity: {}}}}", "kubernetes.podspec-affinity"),
    "securityContext.runAsUser": (
        "spec: {predictor: {securityContext: {runAsUser: 1000}}}",
        "kubernetes.podspec-securitycontext",
    ),
    "securityContext.fsGroup": (
        "spec: {predictor: {securityContext: {fsGroup: 1000}}}",
        "kubernetes.podspec-securitycontext",
    ),
}


@pytest.mark.parametrize(("patch", "flag"), MASKED.values(), ids=MASKED.keys())
def test_a_default_knative_refuses_masked_pod_fields_and_the_flag_admits_them(patch: str, flag: str) -> None:
    obj = isvc(patch)
    denied = refusal(obj)
    assert (denied.code, denied.reason) == (400, "BadRequest")
    assert denied.message.startswith(
        'admission webhook "validation.webhook.serving.knative.dev" denied the request: validation failed: '
        "must not set the field(s): spec.template.spec."
    )
    assert admit(obj, None, Cluster(knative_features=frozenset({flag})))


def test_standard_mode_is_not_subject_to_knatives_masks() -> None:
    obj = isvc(
        """
        metadata: {annotations: {serving.kserve.io/deploymentMode: Standard}}
        spec: {predictor: {minReplicas: 1, nodeSelector: {gpu: l4}, securityContext: {runAsUser: 1000, fsGroup: 1}}}
        """
    )
    assert admit(obj, None, DEFAULT)
    # KServe 0.15 does not know "Standard": it runs the object in its default mode, Serverless.
    assert "nodeSelector" in refusal(obj, Cluster(kserve=(0, 15, 2))).message


def test_secure_pod_defaults_admits_only_a_runtime_default_seccomp_profile_at_pod_level() -> None:
    cluster = Cluster(knative_features=frozenset({"secure-pod-defaults"}))
    assert admit(isvc("spec: {predictor: {securityContext: {seccompProfile: {type: RuntimeDefault}}}}"), None, cluster)
    assert (
        "runAsNonRoot" in refusal(isvc("spec: {predictor: {securityContext: {runAsNonRoot: true}}}"), cluster).message
    )


def test_container_level_security_context_is_admitted_by_a_default_knative_except_privileged() -> None:
    restricted = """
    spec:
      predictor:
        containers:
        - name: kserve-container
          image: i:1
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            runAsNonRoot: true
            runAsUser: 1000
            runAsGroup: 1000
            capabilities: {drop: [ALL]}
            seccompProfile: {type: RuntimeDefault}
    """
    assert admit(isvc(restricted), None, DEFAULT)
    privileged = isvc(restricted.replace("runAsGroup: 1000", "privileged: true"))
    assert "spec.template.spec.containers[0].securityContext.privileged" in refusal(privileged).message
    adds = isvc(restricted.replace("drop: [ALL]", "add: [NET_ADMIN]"))
    assert "securityContext.capabilities.add" in refusal(adds).message


def test_a_writable_claim_needs_both_persistent_volume_flags() -> None:
    obj = isvc(
        """
        spec:
          predictor:
            volumes: [{name: state, persistentVolumeClaim: {claimName: detectors}}]
            containers:
            - {name: kserve-container, image: i:1, volumeMounts: [{name: state, mountPath: /state}]}
        """
    )
    message = refusal(obj).message
    assert "Persistent volume claim support is disabled, but found persistent volume claim detectors" in message
    assert "Persistent volume write support is disabled" in message
    claim_only = Cluster(knative_features=frozenset({"kubernetes.podspec-persistent-volume-claim"}))
    assert "Persistent volume write support is disabled" in refusal(obj, claim_only).message
    both = claim_only.knative_features | {"kubernetes.podspec-persistent-volume-write"}
    assert admit(obj, None, Cluster(knative_features=both))


def test_downward_api_env_needs_the_fieldref_flag() -> None:
    obj = isvc(
        """
        spec:
          predictor:
            containers:
            - name: kserve-container
              image: i:1
              env: [{name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}]
        """
    )
    assert "spec.template.spec.containers[0].env[0].valueFrom.fieldRef" in refusal(obj).message
    assert admit(obj, None, Cluster(knative_features=frozenset({"kubernetes.podspec-fieldref"})))


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        (
            {"autoscaling.knative.dev/scale-to-zero-pod-retention-period": "2h"},
            "expected 0s <= 2h <= 1h0m0s: spec.template.metadata.annotations."
            "autoscaling.knative.dev/scale-to-zero-pod-retention-period",
        ),
        ({"autoscaling.knative.dev/window": "3s"}, "expected 6s <= 3s <= 1h0m0s"),
        ({"autoscaling.knative.dev/window": "2h"}, "expected 6s <= 2h <= 1h0m0s"),
        ({"autoscaling.knative.dev/window": "6500ms"}, "must be specified with at most second precision"),
        ({"serving.knative.dev/progress-deadline": "1500ms"}, "progress-deadline=1500ms is not at second precision"),
        ({"serving.knative.dev/progress-deadline": "soon"}, "invalid value: soon"),
    ],
)
def test_knative_bounds_autoscaling_and_progress_deadline_annotations(
    annotations: dict[str, str], message: str
) -> None:
    obj = isvc()
    obj["spec"]["predictor"]["annotations"] = annotations
    assert message in refusal(obj).message
    # Standard mode: no Knative revision, the annotations mean nothing and nothing checks them.
    obj["metadata"]["annotations"] = {"serving.kserve.io/deploymentMode": "RawDeployment"}
    obj["spec"]["predictor"]["minReplicas"] = 1
    assert admit(obj, None, DEFAULT)


def test_knative_admits_the_bounds_themselves() -> None:
    obj = isvc()
    obj["spec"]["predictor"]["annotations"] = {
        "autoscaling.knative.dev/scale-to-zero-pod-retention-period": "1h",
        "autoscaling.knative.dev/window": "6s",
        "serving.knative.dev/progress-deadline": "1.5m",
    }
    assert admit(obj, None, DEFAULT)


def test_the_predictor_timeout_is_bounded_by_max_revision_timeout_seconds() -> None:
    assert (
        "expected 0 <= 900 <= 600: spec.template.spec.timeoutSeconds"
        in refusal(isvc("spec: {predictor: {timeout: 900}}")).message
    )
    assert admit(isvc("spec: {predictor: {timeout: 900}}"), None, Cluster(max_revision_timeout_seconds=3600))


# --------------------------------------------------------------------------------------------------
# KServe's reconcile: host names from the domain template (Standard mode)


def test_a_standard_mode_host_label_over_63_characters_fails_kserves_reconcile_not_admission() -> None:
    name, namespace = "a" * 30, "n" * 23  # a-...-predictor-n... = 30 + 11 + 23 = 64
    obj = isvc(f"metadata: {{name: {name}, namespace: {namespace}, annotations: {{serving.kserve.io/deploymentMode: "
               "RawDeployment}}\nspec: {predictor: {minReplicas: 1}}")  # fmt: skip
    assert admit(obj, None, DEFAULT)
    [problem] = admission.reconcile_problems(obj, DEFAULT)
    assert f'invalid domain name "{name}-predictor-{namespace}.example.com"' in problem
    assert "must be no more than 63 characters" in problem
    obj["metadata"]["namespace"] = "n" * 22
    assert admission.reconcile_problems(obj, DEFAULT) == []
    # Knative mode: hosts are {name}-predictor.{namespace}.{domain}, separate labels.
    obj["metadata"]["namespace"] = "n" * 23
    obj["metadata"]["annotations"] = {}
    assert admission.reconcile_problems(obj, DEFAULT) == []


# --------------------------------------------------------------------------------------------------
# The operator's renders through admission


#: What in examples/cluster/ gets an InferenceService: each model of its own, and each pool (its members, pooled,
#: get none: the pool's serves them).
RENDERED = {
    id: body
    for id, body in cluster_examples().items()
    if body["kind"] == POOL_KIND or (body["kind"] == MODEL_KIND and not pooled(body))
}
GPU_FLAGS = GPU_KNATIVE_FEATURES


def example_inference_service(body: dict[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """The InferenceService the operator renders for an example model or pool."""
    if body["kind"] == POOL_KIND:
        return desired_pool_inference_service(parse_pool(body), config)
    return desired_inference_service(parse_model(body), config)


def test_the_rendered_examples_are_the_one_model_files_and_the_pool() -> None:
    assert "pool/UniversalModelPool/small" in RENDERED
    assert not [id for id in RENDERED if id.startswith("pool/UniversalModel/")]
    assert len(RENDERED) == len(cluster_examples()) - len([b for b in cluster_examples().values() if pooled(b)])


@pytest.mark.parametrize("body", RENDERED.values(), ids=list(RENDERED))
def test_every_example_is_admitted_by_a_cluster_with_the_flags_the_operator_lists(body: dict[str, Any]) -> None:
    config = parse_config({**TEST_OPERATOR_CONFIG, "knative": {"features": GPU_FLAGS}})
    child = example_inference_service(body, config)
    stored = admit(child, None, cluster_for(config))
    container = at(stored, "spec.predictor.containers[0]")
    for resource, request in container["resources"]["requests"].items():
        assert admission.quantity(request) <= admission.quantity(container["resources"]["limits"][resource])


@pytest.mark.parametrize("body", RENDERED.values(), ids=list(RENDERED))
def test_on_a_default_knative_every_example_is_admitted_or_refused_naming_the_flags(body: dict[str, Any]) -> None:
    config = parse_config(TEST_OPERATOR_CONFIG)
    if body["spec"]["resources"].get("profile") != "gpu-l4":
        assert admit(example_inference_service(body, config), None, cluster_for(config))
        return
    with pytest.raises(SpecError) as caught:
        example_inference_service(body, config)
    assert caught.value.field == "spec.resources.profile"
    for flag in GPU_FLAGS:
        assert flag in caught.value.message
    assert "config-features" in caught.value.message


def test_a_model_without_cpu_or_memory_gets_a_valid_pod_after_kserves_defaults() -> None:
    stored = admit(render("metadata: {name: minilm}\nspec: {task: embed, source: {uri: hf://a/b}}"), None, DEFAULT)
    assert at(stored, "spec.predictor.containers[0].resources") == load(
        """
        requests: {cpu: "1", memory: 2Gi}
        limits: {cpu: "1", memory: 2Gi}
        """
    )


@pytest.mark.parametrize("spec", ["{cpu: '2'}", "{cpu: '4', memory: 8Gi}", "{cpu: 1500m}", "{memory: 4Gi}"])
def test_a_cpu_request_above_kserves_default_limit_is_admitted_with_its_own_limit(spec: str) -> None:
    manifest = f"metadata: {{name: big}}\nspec: {{task: embed, source: {{uri: hf://a/b}}, resources: {spec}}}"
    for mode in ("Knative", "Standard"):
        body = load(manifest)
        body["spec"]["scaling"] = {"mode": mode}
        stored = admit(desired_inference_service(model(json.dumps(body)), CONFIG), None, cluster_for(CONFIG))
        resources = at(stored, "spec.predictor.containers[0].resources")
        assert resources["requests"] == resources["limits"]


KNATIVE_FLAG_CASES = {
    "GPU profile": (
        "resources: {profile: gpu-l4, gpus: 1}",
        "spec.resources.profile",
        GPU_FLAGS,
    ),
    "state on a claim": (
        "state: {claimName: detectors}",
        "spec.state",
        [
            "kubernetes.podspec-persistent-volume-claim",
            "kubernetes.podspec-persistent-volume-write",
            "kubernetes.podspec-securitycontext",
        ],
    ),
    "downward-API env": (
        "env: [{name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}]",
        "spec.env",
        ["kubernetes.podspec-fieldref"],
    ),
}


@pytest.mark.parametrize(("extra", "field", "flags"), KNATIVE_FLAG_CASES.values(), ids=KNATIVE_FLAG_CASES.keys())
def test_knative_mode_needing_a_disabled_flag_is_a_spec_error_naming_it_and_enabling_it_admits(
    extra: str, field: str, flags: list[str]
) -> None:
    manifest = load("metadata: {name: m}\nspec: {task: embed, source: {uri: /opt/a}}")
    manifest["spec"].update(load(extra))
    default = parse_config(TEST_OPERATOR_CONFIG)
    with pytest.raises(SpecError) as caught:
        desired_inference_service(model(json.dumps(manifest)), default)
    assert caught.value.field == field
    for flag in flags:
        assert f"{flag}: enabled" in caught.value.message
    assert "knative.features" in caught.value.message

    enabled = parse_config({**TEST_OPERATOR_CONFIG, "knative": {"features": flags}})
    child = desired_inference_service(model(json.dumps(manifest)), enabled)
    assert admit(child, None, cluster_for(enabled))
    # The same spec in Standard mode needs nothing from Knative.
    manifest["spec"]["scaling"] = {"mode": "Standard"}
    child = desired_inference_service(model(json.dumps(manifest)), default)
    assert admit(child, None, cluster_for(default))


def test_standard_mode_name_and_namespace_too_long_for_kserves_host_label_is_a_spec_error() -> None:
    name, namespace = "m" * 30, "n" * 23
    manifest = {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"task": "embed", "source": {"uri": "hf://a/b"}, "scaling": {"mode": "Standard"}},
    }
    with pytest.raises(SpecError) as caught:
        desired_inference_service(model(json.dumps(manifest)), CONFIG)
    assert caught.value.field == "metadata.name"
    assert name in caught.value.message
    assert namespace in caught.value.message
    assert "at most 52 characters" in caught.value.message
    # One character shorter fits, and KServe's reconcile agrees.
    manifest["metadata"]["namespace"] = "n" * 22
    child = desired_inference_service(model(json.dumps(manifest)), CONFIG)
    assert admission.reconcile_problems(admit(child, None, DEFAULT), DEFAULT) == []
    # Knative mode builds no such label.
    manifest["metadata"]["namespace"] = "n" * 23
    manifest["spec"]["scaling"] = {"mode": "Knative"}
    assert desired_inference_service(model(json.dumps(manifest)), CONFIG)


async def test_the_kserve_standin_reports_a_host_label_too_long_as_kserve_does_with_an_internal_error_event(
    tmp_path: Path,
) -> None:
    from lightkube import AsyncClient, KubeConfig

    from tests.conftest import eventually
    from universal_simcluster.apiserver import serve_emulator
    from universal_simcluster.kserve.standin import kserve_standin

    name, namespace = "m" * 30, "n" * 23
    obj = isvc(
        f"""
        metadata: {{name: {name}, namespace: {namespace}, annotations: {{serving.kserve.io/deploymentMode: Standard}}}}
        spec: {{predictor: {{minReplicas: 1}}}}
        """
    )
    async with serve_emulator(tmp_path) as served:
        served.emulator._create(served.emulator.resolve("inferenceservices"), namespace, obj)
        client = AsyncClient(config=KubeConfig.from_file(served.kubeconfig))
        async with kserve_standin(client):
            events = await eventually(lambda: served.emulator.list_objects("events", namespace))
        await client.close()
        [event] = events
        assert (event["type"], event["reason"]) == ("Warning", "InternalError")
        assert event["involvedObject"]["name"] == name
        assert "must be no more than 63 characters" in event["message"]
        stored = served.emulator.get_object("inferenceservices", namespace, name)
        assert stored is not None
        assert "status" not in stored  # KServe never got as far as a status


# --------------------------------------------------------------------------------------------------
# The emulator answers every kind of write through admission, as the API server does


async def test_the_emulator_admits_inference_service_creates_updates_patches_and_applies(tmp_path: Path) -> None:
    from universal_simcluster.apiserver import serve_emulator

    path = "/apis/serving.kserve.io/v1beta1/namespaces/default/inferenceservices"

    async def call(method: str, url: str, body: Any, content_type: str = "application/json", **params: str) -> Any:
        async with served.emulator.request(
            method, url, data=json.dumps(body), params=params, headers={"Content-Type": content_type}
        ) as response:
            return response.status, await response.json()

    async with serve_emulator(tmp_path) as served:
        # create: defaulted, then stored
        status, stored = await call("POST", path, isvc())
        assert status == 201
        assert at(stored, "spec.predictor.containers[0].resources.limits") == {"cpu": "1", "memory": "2Gi"}
        # merge patch: Knative's mask answers 400 with the webhook's message, nothing stored
        status, answer = await call(
            "PATCH",
            f"{path}/custom-model",
            {"spec": {"predictor": {"nodeSelector": {"gpu": "l4"}}}},
            "application/merge-patch+json",
        )
        assert (status, answer["reason"], answer["code"]) == (400, "BadRequest", 400)
        assert "must not set the field(s): spec.template.spec.nodeSelector" in answer["message"]
        # update (PUT): KServe's validator answers 403
        bad = isvc("spec: {predictor: {minReplicas: 3, maxReplicas: 2}}")
        status, answer = await call("PUT", f"{path}/custom-model", bad)
        assert (status, answer["reason"]) == (403, "Forbidden")
        assert answer["message"].startswith(
            'admission webhook "inferenceservice.kserve-webhook-server.validator" denied the request: '
        )
        # server-side apply of a fixed object goes through, defaulted again
        fixed = isvc("spec: {predictor: {minReplicas: 1, maxReplicas: 2}}")
        status, stored = await call(
            "PATCH", f"{path}/custom-model", fixed, "application/apply-patch+yaml", fieldManager="test"
        )
        assert status == 200
        assert at(stored, "spec.predictor.maxReplicas") == 2
        assert at(stored, "spec.predictor.containers[0].resources.requests") == {"cpu": "1", "memory": "2Gi"}
        # status writes are not admitted (webhooks match the main resource only)
        status, _ = await call(
            "PATCH",
            f"{path}/custom-model/status",
            {"status": {"deploymentMode": "Serverless"}},
            "application/merge-patch+json",
        )
        assert status == 200


async def test_an_emulator_without_admission_stores_inference_services_as_written(tmp_path: Path) -> None:
    from universal_simcluster.apiserver import serve_emulator

    async with serve_emulator(tmp_path, admission=None) as served:
        obj = isvc("spec: {predictor: {nodeSelector: {gpu: l4}}}")
        stored = served.emulator._create(served.emulator.resolve("inferenceservices"), "default", obj)
        assert "resources" not in at(stored, "spec.predictor.containers[0]")
