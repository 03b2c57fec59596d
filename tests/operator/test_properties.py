"""Properties of rendering and status over generated valid UniversalModels (hypothesis)."""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import kserve
import kubernetes.client
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factories import is_dns_1035_label, is_label_value, render, servable_models
from universal_operator.config import OperatorConfig
from universal_operator.predictor import engine_arg_defaults, predictor_config
from universal_operator.reconcile.drift import child_drifted, is_subset
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.status import FAILURE_REASONS, status_from_inference_service
from universal_operator.spec import Phase, ScalingMode, UniversalModelStatus, parse_duration, parse_model
from universal_predictors.config import PredictorConfig
from universal_simcluster import admission
from universal_simcluster.apiserver import schemas
from universal_simcluster.apiserver.registration import kserve_crd

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def rendered(case: tuple[dict[str, Any], OperatorConfig]) -> tuple[Any, OperatorConfig, dict[str, Any]]:
    body, config = case
    model = parse_model(body)
    return model, config, desired_inference_service(model, config)


# --------------------------------------------------------------------------------------------------
# (a) names and labels


@PROPERTY
@given(servable_models())
def test_child_name_and_every_name_kserve_and_knative_derive_are_dns_1035_labels(case: Any) -> None:
    _, _, child = rendered(case)
    name = child["metadata"]["name"]
    for derived in (name, f"{name}-predictor", f"{name}-predictor-00001", f"{name}-predictor-00001-private"):
        assert is_dns_1035_label(derived), derived


@PROPERTY
@given(servable_models())
def test_every_label_value_on_child_and_pods_is_a_valid_label_value(case: Any) -> None:
    model, _, child = rendered(case)
    for labels in (child["metadata"]["labels"], child["spec"]["predictor"]["labels"]):
        assert all(is_label_value(value) for value in labels.values()), labels
    assert child["metadata"]["annotations"]["serving.universal-runtime.dev/served-name"] == model.served_name


# --------------------------------------------------------------------------------------------------
# (b) resources and replicas


@PROPERTY
@given(servable_models())
def test_resources_follow_the_spec_with_the_profiles_gpu_resource(case: Any) -> None:
    model, config, child = rendered(case)
    res = model.spec.resources
    container = child["spec"]["predictor"]["containers"][0]
    requests = container.get("resources", {}).get("requests", {})
    limits = container.get("resources", {}).get("limits", {})
    profile = config.profile(res.profile)
    gpu_resource = profile.gpu_resource if profile else "nvidia.com/gpu"
    expected_requests: dict[str, str] = {}
    expected_limits: dict[str, str] = {}
    if res.cpu:
        expected_requests["cpu"] = expected_limits["cpu"] = res.cpu
    if res.memory:
        expected_requests["memory"] = expected_limits["memory"] = res.memory
    if res.gpus:
        expected_requests[gpu_resource] = expected_limits[gpu_resource] = str(res.gpus)
    assert (requests, limits) == (expected_requests, expected_limits)
    assert ("resources" in container) == bool(expected_requests)
    has_shm = any(v["name"] == "dshm" for v in child["spec"]["predictor"]["volumes"])
    assert has_shm == (res.gpus > 0)


@PROPERTY
@given(servable_models())
def test_every_servable_model_is_admitted_by_a_cluster_with_the_configured_knative_features(case: Any) -> None:
    _, config, child = rendered(case)
    cluster = admission.Cluster(
        kserve=config.kserve.release,
        knative_features=frozenset(config.knative.features),
        max_revision_timeout_seconds=config.knative.max_revision_timeout_seconds,
    )
    stored = admission.admit(child, None, cluster)
    # KServe's defaulting only fills what the operator left out; it never changes what the operator set.
    assert is_subset(child["spec"], stored["spec"])


@PROPERTY
@given(servable_models())
def test_knative_scales_to_zero_after_exactly_the_idle_timeout_where_its_bounds_allow(case: Any) -> None:
    """Idle time in Knative = stable window + max(scale-to-zero grace period (30s), retention)."""
    model, _, child = rendered(case)
    if model.spec.scaling.mode.value != "Knative":
        return
    annotations = child["spec"]["predictor"]["annotations"]
    window = admission.go_duration(annotations["autoscaling.knative.dev/window"])
    retention = admission.go_duration(annotations["autoscaling.knative.dev/scale-to-zero-pod-retention-period"])
    idle = parse_duration(model.spec.scaling.idle_timeout).total_seconds()
    assert window == int(window)
    assert 6 <= window <= 60
    assert 0 <= retention <= 3600
    assert window + max(30.0, retention) == pytest.approx(max(idle, 36.0))


@PROPERTY
@given(servable_models())
def test_replicas_follow_the_scaling_mode_rules(case: Any) -> None:
    model, _, child = rendered(case)
    scaling = model.spec.scaling
    predictor = child["spec"]["predictor"]
    knative = scaling.mode.value == "Knative"
    assert predictor["maxReplicas"] == scaling.max_replicas
    assert predictor["minReplicas"] == (scaling.min_replicas if knative else max(1, scaling.min_replicas))
    assert 0 <= predictor["minReplicas"] <= predictor["maxReplicas"]
    assert child["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == scaling.mode.value
    assert ("annotations" in predictor) == knative
    assert ("scaleTarget" in predictor) == (knative and scaling.target_concurrency is not None)


# --------------------------------------------------------------------------------------------------
# (c) the KServe SDK's model of an InferenceService holds everything we emit

_K8S = kubernetes.client.ApiClient()


def kserve_deserialize(data: Any, type_name: str) -> Any:
    """Deserialize into the KServe SDK's models, delegating Kubernetes types to the Kubernetes client.

    KServe 0.21's own ``ApiClient().deserialize`` cannot do this with the installed kubernetes client (37):
    it looks every nested type up in ``kserve.models`` (which has no ``V1ObjectMeta``), and the kubernetes
    models' type strings (``List[...]``, ``Dict[...]``) are not the ``list[...]``/``dict(...)`` it parses.
    Unknown keys are an error here (the SDK would drop them silently, which the round trip would also catch).
    """
    if data is None:
        return None
    if match := re.fullmatch(r"list\[(.*)\]", type_name):
        return [kserve_deserialize(item, match.group(1)) for item in data]
    if match := re.fullmatch(r"dict\(([^,]*), (.*)\)", type_name):
        return {key: kserve_deserialize(value, match.group(2)) for key, value in data.items()}
    cls = getattr(kserve.models, type_name, None)
    if cls is None:
        return _K8S._ApiClient__deserialize(data, type_name)  # type: ignore[attr-defined]
    unknown = set(data) - set(cls.attribute_map.values())
    assert not unknown, f"{type_name} has no field(s) {sorted(unknown)}"
    return cls(
        **{
            attr: kserve_deserialize(data[key], cls.openapi_types[attr])
            for attr, key in cls.attribute_map.items()
            if key in data
        }
    )


@PROPERTY
@given(servable_models())
def test_child_round_trips_through_the_kserve_sdk_without_loss(case: Any) -> None:
    _, _, child = rendered(case)
    obj = kserve_deserialize(child, "V1beta1InferenceService")
    assert isinstance(obj, kserve.V1beta1InferenceService)
    back = kserve.ApiClient().sanitize_for_serialization(obj)
    assert back == child
    # == treats True == 1 and 1 == 1.0: compare the JSON too, so no value changed type on the way.
    assert json.dumps(back, sort_keys=True) == json.dumps(child, sort_keys=True)


def kserve_admitted(child: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``child`` as an API server with KServe's real CRD stores it (vendored v0.20.0 ``config/crd/full``): defaulted,
    pruned of every field the schema lacks, and the schema's field errors."""
    return schemas.admit(copy.deepcopy(child), None, kserve_crd("inferenceservices")["spec"]["versions"][0]["schema"]
                         ["openAPIV3Schema"])  # fmt: skip


@PROPERTY
@given(servable_models())
def test_kserves_crd_keeps_every_rendered_field_and_its_defaults_are_not_drift(case: Any) -> None:
    _, _, child = rendered(case)
    stored, errors = kserve_admitted(child)
    assert errors == []
    # Nothing the operator renders is pruned: a field KServe's schema lacks would vanish here, silently, in a cluster.
    assert schemas.prune(child, kserve_crd("inferenceservices")["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
                         root=True) == child  # fmt: skip
    # The server's defaults (a container port's protocol, ...) are not read back as drift, or the operator would
    # patch the child on every resync.
    assert not child_drifted(child, stored)


def test_a_rendered_field_kserves_crd_lacks_is_pruned_and_caught() -> None:
    child = render("metadata: {name: qwen-chat}\nspec: {task: generate, source: {uri: hf://Qwen/Qwen2.5-0.5B}}\n")
    child["spec"]["predictor"]["minReplica"] = 1  # misspelt minReplicas
    stored, errors = kserve_admitted(child)
    assert errors == []  # an API server drops it without a word (a warning header at most)
    assert "minReplica" not in stored["spec"]["predictor"]
    assert stored != child
    assert child_drifted(child, stored)  # and the operator would chase it forever


# --------------------------------------------------------------------------------------------------
# (d) predictor arguments


@PROPERTY
@given(servable_models())
def test_rendered_predictor_config_survives_its_command_line(case: Any) -> None:
    model, operator_config, child = rendered(case)
    profile = operator_config.profile(model.spec.resources.profile)
    config = predictor_config(model, engine_arg_defaults=engine_arg_defaults(model, operator_config, profile))
    assert PredictorConfig.from_args(config.to_args()) == config
    assert PredictorConfig.from_args(child["spec"]["predictor"]["containers"][0]["args"]) == config


# --------------------------------------------------------------------------------------------------
# (e) drift


def leaf_paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every scalar and every empty map or list."""
    if isinstance(node, dict) and node:
        return [p for key, value in node.items() for p in leaf_paths(value, (*path, key))]
    if isinstance(node, list) and node:
        return [p for i, value in enumerate(node) for p in leaf_paths(value, (*path, i))]
    return [path]


def owned_leaves(desired: dict[str, Any]) -> list[tuple[Any, ...]]:
    meta = [
        ("metadata", key, *p)
        for key in ("labels", "annotations", "ownerReferences")
        for p in leaf_paths(desired["metadata"][key])
    ]
    return meta + [("spec", *p) for p in leaf_paths(desired["spec"])]


def changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-x"
    return "not-a-map"  # an empty map or list (extra content in it is not drift; a different type is)


@PROPERTY
@given(servable_models(), st.data())
def test_drift_is_any_lost_or_changed_leaf_and_nothing_else(case: Any, data: st.DataObject) -> None:
    _, _, desired = rendered(case)
    assert not child_drifted(desired, copy.deepcopy(desired))
    # Fields added by KServe or the API server are not drift.
    defaulted = copy.deepcopy(desired)
    defaulted["metadata"]["resourceVersion"] = "7"
    defaulted["metadata"]["labels"]["added-by"] = "someone"
    defaulted["spec"]["predictor"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    # ... nor an env entry a mutating webhook adds (env merges by name).
    defaulted["spec"]["predictor"]["containers"][0]["env"].append({"name": "INJECTED_BY_WEBHOOK", "value": "1"})
    defaulted["status"] = {"observedGeneration": 1}
    assert not child_drifted(desired, defaulted)

    path = data.draw(st.sampled_from(owned_leaves(desired)))
    *parents, last = path
    for mutation in ("remove", "change"):
        actual = copy.deepcopy(desired)
        holder = actual
        for key in parents:
            holder = holder[key]
        if mutation == "remove":
            del holder[last]
        else:
            holder[last] = changed(holder[last])
        assert child_drifted(desired, actual), (mutation, path)
    assert child_drifted(desired, None)
    assert child_drifted(desired, {**desired, "metadata": {**desired["metadata"], "deletionTimestamp": "now"}})


def respelled(quantity: str) -> str:
    """The same quantity written another way: 1Gi -> 1024Mi, 2Mi -> 2048Ki, 2 -> 2000m, 1500m -> 1.5."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    if unit == "Gi":
        return f"{int(number) * 1024}Mi"
    if unit == "Mi":
        return f"{int(number) * 1024}Ki"
    if unit == "m":
        return format(Decimal(number) / 1000, "f")
    return f"{int(number) * 1000}m"


@PROPERTY
@given(servable_models())
def test_equal_quantities_written_differently_are_not_drift(case: Any) -> None:
    _, _, desired = rendered(case)
    actual = copy.deepcopy(desired)
    container = actual["spec"]["predictor"]["containers"][0]
    for group in container.get("resources", {}).values():
        for name in ("cpu", "memory"):
            if name in group:
                group[name] = respelled(group[name])
    assert not child_drifted(desired, actual)


def test_a_changed_env_value_that_reads_as_an_equal_quantity_is_still_drift() -> None:
    desired = {"metadata": {}, "spec": {"predictor": {"containers": [{"env": [{"name": "N", "value": "1"}]}]}}}
    actual = {"metadata": {}, "spec": {"predictor": {"containers": [{"env": [{"name": "N", "value": "1.0"}]}]}}}
    assert child_drifted(desired, actual)


def test_the_documented_quantity_respellings_are_not_drift() -> None:
    def child(requests: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {}, "spec": {"predictor": {"containers": [{"resources": {"requests": requests}}]}}}

    desired = child({"memory": "1Gi", "cpu": "0.5"})
    same = child({"memory": "1024Mi", "cpu": "500m"})
    different = child({"memory": "1G", "cpu": "500m"})
    assert not child_drifted(desired, same)
    assert child_drifted(desired, different)


# --------------------------------------------------------------------------------------------------
# (f) status for any child status

_text = st.text(max_size=30)
_conditions = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["Ready", "PredictorReady", "IngressReady", "Stopped", "LatestDeploymentReady"]),
            "status": st.sampled_from(["True", "False", "Unknown"]),
        },
        optional={
            "reason": st.one_of(st.sampled_from(sorted(FAILURE_REASONS)), st.sampled_from(["Stopped", "Deploying"])),
            "message": _text,
            "severity": st.sampled_from(["Info", "Warning"]),
        },
    ),
    max_size=5,
)
_model_status = st.fixed_dictionaries(
    {},
    optional={
        "transitionStatus": st.sampled_from(["UpToDate", "InProgress", "BlockedByFailedLoad", "InvalidSpec"]),
        "states": st.fixed_dictionaries(
            {},
            optional={
                "activeModelState": st.sampled_from(["Pending", "Standby", "Loading", "Loaded", "FailedToLoad"]),
                "targetModelState": st.sampled_from(["Pending", "Loading", "Loaded", "FailedToLoad"]),
            },
        ),
        "copies": st.fixed_dictionaries(
            {}, optional={"totalCopies": st.integers(0, 10), "failedCopies": st.integers(0, 3)}
        ),
        "lastFailureInfo": st.fixed_dictionaries(
            {}, optional={"reason": _text, "message": _text, "exitCode": st.integers(0, 255)}
        ),
    },
)
child_statuses = st.fixed_dictionaries(
    {},
    optional={
        "observedGeneration": st.integers(0, 5),
        "conditions": _conditions,
        "url": st.just("http://m.example.com"),
        "address": st.fixed_dictionaries({}, optional={"url": st.just("http://m.ns.svc.cluster.local")}),
        "components": st.just({"predictor": {"address": {"url": "http://m-predictor.ns.svc"}}}),
        "modelStatus": _model_status,
    },
)


@PROPERTY
@given(
    servable_models(),
    st.none() | st.fixed_dictionaries({}, optional={"status": child_statuses, "generation": st.integers(1, 5)}),
)
def test_status_for_any_child_has_a_known_phase_and_exactly_its_conditions(case: Any, shape: Any) -> None:
    body, _ = case
    model = parse_model(body)
    isvc = None
    if shape is not None:
        isvc = {"metadata": {"name": model.metadata.name}}
        if "generation" in shape:
            isvc["metadata"]["generation"] = shape["generation"]
        if "status" in shape:
            isvc["status"] = shape["status"]
    status = status_from_inference_service(isvc, model, now=NOW)
    assert status["phase"] in {p.value for p in Phase}
    # Standard mode adds IdleStop: whether the cluster's KServe lets the gateway stop the model when idle.
    idle_stop = ["IdleStop"] if model.spec.scaling.mode is ScalingMode.STANDARD else []
    assert [c["type"] for c in status["conditions"]] == ["Ready", "SpecValid", "InferenceServiceReady", *idle_stop]
    assert all(c["observedGeneration"] == model.metadata.generation for c in status["conditions"])
    ready = status["conditions"][0]["status"]
    assert (ready == "True") == (status["phase"] in ("Ready", "Idle", "Waking"))  # a wake answers, if later
    assert status["replicas"] is None or status["replicas"] >= 0
    # What the operator writes fits the CRD's status schema.
    UniversalModelStatus.model_validate({k: v for k, v in status.items() if v is not None})
