"""The emulator's KServe LocalModelCache admission, release by release, against what KServe's source does:
:func:`universal_simcluster.admission.set_local_model_label` (KServe
pkg/apis/serving/v1beta1/inference_service_defaults.go setLocalModelLabel at v0.14.1, v0.16.0 and v0.18.0) and the
cache's validating webhook (pkg/webhook/admission/localmodelcache/local_model_cache_validation.go).
"""

from __future__ import annotations

from typing import Any

import pytest

from universal_simcluster import admission

URI = "hf://org/model"


def cache(name: str, uri: str = URI, groups: tuple[str, ...] = ("workers", "gpus")) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"sourceModelUri": uri, "modelSize": "1Gi", "nodeGroups": list(groups)}}


def isvc(uri: str = URI, **annotations: str) -> dict[str, Any]:
    container = {"name": "kserve-container", "env": [{"name": "STORAGE_URI", "value": uri}]}
    return {
        "metadata": {"name": "m", "annotations": dict(annotations)},
        "spec": {"predictor": {"containers": [container]}},
    }


def labelled(obj: dict[str, Any]) -> tuple[str | None, str | None]:
    meta = obj["metadata"]
    return (meta.get("labels") or {}).get(admission.LOCAL_MODEL_LABEL), (meta.get("annotations") or {}).get(
        admission.LOCAL_MODEL_PVC_ANNOTATION
    )


@pytest.mark.parametrize(
    ("release", "expected"),
    [((0, 14, 1), ("c", "c-workers")), ((0, 16, 0), ("c", "c-gpus")), ((0, 18, 0), ("c", "c-gpus"))],
)
def test_the_node_group_annotation_picks_the_claim_from_kserve_0_15(
    release: tuple[int, int, int], expected: tuple[str, str]
) -> None:
    cluster = admission.Cluster(kserve=release, local_model_enabled=True)
    obj = isvc(**{admission.NODE_GROUP_ANNOTATION: "gpus"})
    admission.set_local_model_label(obj, [cache("c")], cluster)
    assert labelled(obj) == expected


def test_a_path_inside_the_cached_source_matches_and_a_longer_name_does_not() -> None:
    cluster = admission.Cluster(local_model_enabled=True)
    inside, sibling = isvc(f"{URI}/sub"), isvc(f"{URI}-v2")
    admission.set_local_model_label(inside, [cache("c")], cluster)
    admission.set_local_model_label(sibling, [cache("c")], cluster)
    assert labelled(inside) == ("c", "c-workers")
    assert labelled(sibling) == (None, None)


def test_an_annotation_naming_a_group_the_cache_lacks_matches_no_cache() -> None:
    obj = isvc(**{admission.NODE_GROUP_ANNOTATION: "cpu-only"})
    admission.set_local_model_label(obj, [cache("c")], admission.Cluster(local_model_enabled=True))
    assert labelled(obj) == (None, None)


@pytest.mark.parametrize(("release", "kept"), [((0, 16, 0), True), ((0, 18, 0), False)])
def test_opting_out_keeps_an_earlier_label_before_kserve_0_18_and_removes_it_from_0_18(
    release: tuple[int, int, int], kept: bool
) -> None:
    cluster = admission.Cluster(kserve=release, local_model_enabled=True)
    obj = isvc()
    admission.set_local_model_label(obj, [cache("c")], cluster)
    obj["metadata"]["annotations"][admission.DISABLE_LOCAL_MODEL_ANNOTATION] = "true"
    admission.set_local_model_label(obj, [cache("c")], cluster)
    assert labelled(obj) == (("c", "c-workers") if kept else (None, None))


def test_with_local_model_disabled_no_cache_is_looked_at() -> None:
    obj = isvc()
    admission.set_local_model_label(obj, [cache("c")], admission.Cluster(local_model_enabled=False))
    assert labelled(obj) == (None, None)


def test_the_folder_on_the_node_is_the_cache_name_until_0_18_then_a_hash_of_the_source() -> None:
    assert admission.cached_folder(cache("c"), (0, 17, 1)) == "models/c"
    assert admission.cached_folder(cache("c"), (0, 18, 0)) == f"models/{admission.storage_key(URI)}"
    assert len(admission.storage_key(URI)) == 16


def test_a_second_cache_of_one_source_and_a_changed_source_are_refused() -> None:
    assert "has the same StorageURI" in (admission.local_model_cache_refusal(cache("b"), None, [cache("a")]) or "")
    assert admission.local_model_cache_refusal(cache("a"), cache("a"), [cache("a")]) is None
    moved = admission.local_model_cache_refusal(cache("a", "hf://org/other"), cache("a"), [cache("a")])
    assert "StorageUri is immutable" in (moved or "")


def test_a_cache_an_inference_service_uses_or_lists_but_is_gone_cannot_be_deleted() -> None:
    used = {**cache("c"), "status": {"inferenceServices": [{"namespace": "ns", "name": "m"}]}}
    labelled_isvc = {"metadata": {"name": "m", "labels": {admission.LOCAL_MODEL_LABEL: "c"}}}
    assert "is being used" in (admission.local_model_cache_delete_refusal(used, {("ns", "m"): labelled_isvc}) or "")
    assert "not found" in (admission.local_model_cache_delete_refusal(used, {}) or "")
    assert admission.local_model_cache_delete_refusal(used, {("ns", "m"): {"metadata": {"name": "m"}}}) is None
