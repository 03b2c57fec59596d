"""What the operator renders for each supported KServe release, and the predictor's request timeout.

The deployment-mode names and the stop support per release are read from KServe's source (see
universal_operator/kserve.py for the files and tags); the KServe stand-in resolves the rendered annotation
as that release's GetDeploymentMode would.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.factories import model
from universal_operator import kserve
from universal_operator.config import OperatorConfig
from universal_operator.reconcile.render import desired_inference_service, request_timeout_seconds
from universal_operator.spec import ScalingMode
from universal_simcluster.kserve.standin import KServeVersion


def config(version: str = "0.16.0", **knative: Any) -> OperatorConfig:
    return OperatorConfig.model_validate({"kserve": {"version": version}, "knative": knative})


def manifest(mode: str, startup: str = "20m") -> Any:
    return model(
        f"""
        metadata: {{name: minilm, namespace: default, uid: u1, generation: 1}}
        spec:
          task: embed
          source: {{uri: hf://sentence-transformers/all-MiniLM-L6-v2}}
          scaling: {{mode: {mode}, startupTimeout: {startup}}}
        """
    )


@pytest.mark.parametrize(
    ("version", "knative_name", "standard_name"),
    [
        ("0.14.1", "Serverless", "RawDeployment"),
        ("0.15.2", "Serverless", "RawDeployment"),
        ("0.16.0", "Knative", "Standard"),
        ("0.20.0", "Knative", "Standard"),
    ],
)
def test_the_deployment_mode_annotation_is_the_name_the_release_knows(
    version: str, knative_name: str, standard_name: str
) -> None:
    for mode, name, on_knative in (("Knative", knative_name, True), ("Standard", standard_name, False)):
        isvc = desired_inference_service(manifest(mode), config(version))
        assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == name
        # That release's GetDeploymentMode runs it in the mode asked for (not its default, Serverless).
        assert KServeVersion(version).resolve_mode(isvc) is on_knative


def test_a_name_a_release_does_not_know_falls_back_to_its_default_mode() -> None:
    # What the operator rendered before: "Standard" on 0.15 became Serverless (the configured default).
    isvc = {"metadata": {"annotations": {"serving.kserve.io/deploymentMode": "Standard"}}}
    assert KServeVersion("0.15.2").resolve_mode(isvc) is True
    assert KServeVersion("0.16.0").resolve_mode(isvc) is False


@pytest.mark.parametrize(
    ("version", "knative_stops", "standard_stops"),
    [("0.14.1", False, False), ("0.15.0", False, False), ("0.15.1", True, False), ("0.15.2", True, False),
     ("0.16.0", True, True), ("0.20.0", True, True)],
)  # fmt: skip
def test_stop_support_per_release_and_mode(version: str, knative_stops: bool, standard_stops: bool) -> None:
    release = config(version).kserve.release
    assert kserve.can_stop(release, ScalingMode.KNATIVE) is knative_stops
    assert kserve.can_stop(release, ScalingMode.STANDARD) is standard_stops
    refusal = kserve.stop_unsupported(release, ScalingMode.STANDARD)
    assert (refusal is None) is standard_stops
    if refusal is not None:
        assert refusal.startswith(f"KServe {version} cannot stop a Standard-mode InferenceService")
        assert "from KServe 0.16.0" in refusal
        assert "stays running" in refusal


@pytest.mark.parametrize(
    ("mode", "startup", "max_timeout", "expected"),
    [
        ("Knative", "1m", 600, 60 + 300),  # startupTimeout + the longest request
        ("Knative", "20m", 600, 600),  # bounded by Knative's max-revision-timeout-seconds
        ("Knative", "1m", 300, 300),  # a cluster with a lower maximum
        ("Knative", "2h", 3600, 3600),
        ("Standard", "20m", 600, 300),  # the gateway holds the cold start: the request alone
    ],
)
def test_the_predictor_timeout_covers_the_cold_start_within_the_clusters_maximum(
    mode: str, startup: str, max_timeout: int, expected: int
) -> None:
    cfg = config(max_revision_timeout_seconds=max_timeout)
    isvc = desired_inference_service(manifest(mode, startup), cfg)
    assert isvc["spec"]["predictor"]["timeout"] == expected
    assert request_timeout_seconds(manifest(mode, startup), cfg) == expected


@pytest.mark.parametrize(
    ("version", "recorded", "rendered"),
    [
        ("0.16.0", "Serverless", "Serverless"),  # kept as recorded, compared verbatim (validateDeploymentMode)
        ("0.18.1", "RawDeployment", "RawDeployment"),
        ("0.19.0", "Serverless", "Knative"),  # ParseDeploymentMode normalises the record
        ("0.16.0", "Knative", "Knative"),
        ("0.16.0", None, "Knative"),
        ("0.16.0", "Standard", "Knative"),  # another mode's record: never copied (KServe refuses the change anyway)
    ],
)
def test_the_annotation_follows_the_live_objects_recorded_mode_where_kserve_compares_it_verbatim(
    version: str, recorded: str | None, rendered: str
) -> None:
    assert kserve.deployment_mode(config(version).kserve.release, ScalingMode.KNATIVE if rendered != "RawDeployment"
                                  else ScalingMode.STANDARD, recorded) == rendered  # fmt: skip
