"""The simulated cluster spells KServe's and Knative's names itself (cited from their source); the operator spells
them too. Here, and only here, the two are compared: a name changed on one side fails this test, where a shared
constant would have moved both sides at once and every other test would still pass."""

from __future__ import annotations

from universal_operator import config, kserve, kube, predictor
from universal_simcluster import admission
from universal_simcluster.kserve import InferenceService
from universal_simcluster.kserve.standin import DEFAULT_KSERVE_VERSION


def test_the_stand_ins_kserve_names_are_the_operators() -> None:
    assert admission.CONTAINER_NAME == predictor.CONTAINER_NAME == "kserve-container"
    assert admission.ANNOTATION_DEPLOYMENT_MODE == kserve.DEPLOYMENT_MODE_ANNOTATION
    assert admission.ANNOTATION_STOP == kserve.STOP_ANNOTATION


def test_the_stand_ins_inference_service_resource_is_the_operators() -> None:
    ours, theirs = InferenceService._api_info, kube.InferenceService._api_info  # type: ignore[attr-defined]
    assert (ours.resource, ours.plural) == (theirs.resource, theirs.plural)
    assert ours.resource.group == "serving.kserve.io"


def test_the_default_simulated_kserve_is_the_release_the_operator_targets_by_default() -> None:
    assert DEFAULT_KSERVE_VERSION == config.DEFAULT_KSERVE_VERSION
