"""The real kopf operator, embedded, against the API emulator; manifests applied with the real kubectl.

The tests play KServe: they write the InferenceService's status the way KServe's controller would.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient

from tests.conftest import (
    EXAMPLES,
    GPU_KNATIVE_FEATURES,
    MODEL_KIND,
    POOL_KIND,
    cluster_examples,
    eventually,
    load_manifest,
    pooled,
)
from universal_operator.handlers import OperatorState
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.spec import parse_model
from universal_simcluster.apiserver import ServedEmulator
from universal_simcluster.kserve.standin import Child, loading_status, ready_status

pytestmark = pytest.mark.operator

UM = "universalmodels"
ISVC = "inferenceservices"
POOLS = "universalmodelpools"

#: examples/cluster/ as `kubectl apply -f examples/cluster/` creates it: the models with an InferenceService of their
#: own, and pool.yaml's pool with its members (pooled: the pool's InferenceService serves them).
OWN = sorted(b["metadata"]["name"] for b in cluster_examples(MODEL_KIND).values() if not pooled(b))
MEMBERS = {b["metadata"]["name"]: b["spec"]["pool"] for b in cluster_examples(MODEL_KIND).values() if pooled(b)}
EXAMPLE_POOLS = sorted(b["metadata"]["name"] for b in cluster_examples(POOL_KIND).values())


def _condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


async def _apply(cluster: ServedEmulator, path: Path | str) -> None:
    result = await cluster.kubectl("apply", "--validate=false", "-f", str(path))
    assert result.returncode == 0, result.stderr


async def _apply_text(cluster: ServedEmulator, manifest: dict[str, Any], tmp_path: Path) -> None:
    file = tmp_path / f"{manifest['metadata']['name']}.yaml"
    file.write_text(yaml.safe_dump(manifest))
    await _apply(cluster, file)


def _child(cluster: ServedEmulator, name: str) -> dict[str, Any] | None:
    return cluster.emulator.get_object(ISVC, "default", name)


def _model(cluster: ServedEmulator, name: str) -> dict[str, Any] | None:
    return cluster.emulator.get_object(UM, "default", name)


async def test_create_renders_owned_inference_service_with_expected_spec(
    cluster: ServedEmulator, operator: OperatorState
) -> None:
    await _apply(cluster, EXAMPLES / "cluster/minilm-embed.yaml")

    child = await eventually(lambda: _child(cluster, "minilm"))
    model = _model(cluster, "minilm")
    assert model is not None
    [owner] = child["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "name": "minilm",
        "uid": model["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    expected = desired_inference_service(parse_model(model), operator.config)
    assert child["spec"] == expected["spec"]
    assert child["metadata"]["labels"]["serving.universal-runtime.dev/task"] == "embed"
    # Nothing of kopf's lands on the child.
    assert not [k for k in child["metadata"].get("annotations", {}) if "kopf" in k or "last-handled" in k]
    assert "finalizers" not in child["metadata"]

    status = await eventually(lambda: (_model(cluster, "minilm") or {}).get("status"))
    assert status["phase"] == "Pending"
    assert status["servedName"] == "all-minilm-l6-v2"
    assert status["backend"] == "transformers"
    assert _condition(_model(cluster, "minilm"), "SpecValid")["status"] == "True"


async def test_status_and_printer_columns_follow_kserve(cluster: ServedEmulator, operator: OperatorState) -> None:
    await _apply(cluster, EXAMPLES / "cluster/qwen-chat.yaml")
    child = await eventually(lambda: _child(cluster, "qwen-chat"))

    # KServe reports the predictor up.
    await cluster.emulator.put_status(ISVC, "default", "qwen-chat", ready_status(child))

    def ready() -> dict[str, Any]:
        status = (_model(cluster, "qwen-chat") or {}).get("status") or {}
        assert status.get("phase") == "Ready"
        return status

    status = await eventually(ready)
    assert status["url"] == "http://qwen-chat-default.example.com"
    assert status["address"] == "http://qwen-chat-predictor.default.svc.cluster.local"
    assert status["replicas"] == 1
    assert status["observedGeneration"] == _model(cluster, "qwen-chat")["metadata"]["generation"]  # type: ignore[index]
    # The wait the gateway grants a request: the rendered predictor timeout (startupTimeout 20m + 5m, at most 600 s).
    assert status["requestTimeoutSeconds"] == child["spec"]["predictor"]["timeout"] == 600
    assert _condition(_model(cluster, "qwen-chat"), "Ready")["status"] == "True"
    assert _condition(_model(cluster, "qwen-chat"), "InferenceServiceReady")["status"] == "True"

    table = await cluster.kubectl("get", "um")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.strip().splitlines()
    assert header.split() == ["NAME", "TASK", "BACKEND", "SERVED", "PHASE", "STEP", "READY", "URL", "AGE"]
    # STEP is empty: there is a step only while a predictor pod starts (tests/operator/test_waking.py).
    assert [cell for cell in row.split() if cell != "<none>"][:7] == [
        "qwen-chat",
        "generate",
        "llamacpp",
        "qwen2.5-0.5b-instruct",
        "Ready",
        "True",
        "http://qwen-chat-default.example.com",
    ]

    # Scaled to zero: KServe keeps Ready but reports no copies.
    await cluster.emulator.put_status(ISVC, "default", "qwen-chat", ready_status(child, replicas=0))
    await eventually(lambda: ((_model(cluster, "qwen-chat") or {}).get("status") or {}).get("phase") == "Idle")
    assert _model(cluster, "qwen-chat")["status"]["replicas"] == 0  # type: ignore[index]


async def test_spec_update_updates_child_and_follows_kserves_rollout(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    await _apply_text(cluster, manifest, tmp_path)
    child = await eventually(lambda: _child(cluster, "minilm"))
    await cluster.emulator.put_status(ISVC, "default", "minilm", ready_status(child), replace=True)
    await eventually(lambda: (_model(cluster, "minilm") or {}).get("status", {}).get("phase") == "Ready")

    manifest["spec"]["engineArgs"]["max_batch_size"] = 16
    manifest["spec"]["scaling"]["maxReplicas"] = 3
    await _apply_text(cluster, manifest, tmp_path)

    def updated() -> dict[str, Any]:
        child = _child(cluster, "minilm") or {}
        predictor = child.get("spec", {}).get("predictor", {})
        assert predictor.get("maxReplicas") == 3
        assert "--engine-arg=max_batch_size=16" in predictor["containers"][0]["args"]
        return child

    child = await eventually(updated)
    # KServe rolls the new spec out as revision 2; its observedGeneration is the Knative Service's (4 here).
    rolling = loading_status(child, child=Child(generation=4, revision=2), loaded_before=True)
    await cluster.emulator.put_status(ISVC, "default", "minilm", rolling, replace=True)
    model = await eventually(lambda: (m := _model(cluster, "minilm")) and m["status"]["phase"] == "Loading" and m)
    assert model["status"]["observedGeneration"] == model["metadata"]["generation"]
    assert _condition(model, "Ready")["status"] == "False"

    # Ready again once the revisions agree, whatever the two generations.
    done = ready_status(child, child=Child(generation=4, revision=2))
    await cluster.emulator.put_status(ISVC, "default", "minilm", done, replace=True)
    await eventually(lambda: (_model(cluster, "minilm") or {}).get("status", {}).get("phase") == "Ready")


async def test_child_deleted_out_of_band_is_recreated(cluster: ServedEmulator, operator: OperatorState) -> None:
    await _apply(cluster, EXAMPLES / "cluster/bert-ner.yaml")
    first = await eventually(lambda: _child(cluster, "bert-ner"))

    result = await cluster.kubectl("delete", "isvc", "bert-ner")
    assert result.returncode == 0, result.stderr

    second = await eventually(
        lambda: (c := _child(cluster, "bert-ner")) and c["metadata"]["uid"] != first["metadata"]["uid"] and c
    )
    assert second["spec"] == first["spec"]
    assert second["metadata"]["ownerReferences"] == first["metadata"]["ownerReferences"]


async def test_out_of_band_edit_of_child_is_repaired(cluster: ServedEmulator, operator: OperatorState) -> None:
    await _apply(cluster, EXAMPLES / "cluster/sentiment-classify.yaml")
    child = await eventually(lambda: _child(cluster, "sentiment"))
    wanted_image = child["spec"]["predictor"]["containers"][0]["image"]

    patch = {
        "spec": {
            "predictor": {
                "maxReplicas": 9,
                "containers": [{**child["spec"]["predictor"]["containers"][0], "image": "evil/image:latest"}],
            }
        }
    }
    result = await cluster.kubectl("patch", "isvc", "sentiment", "--type=merge", "-p", yaml.safe_dump(patch))
    assert result.returncode == 0, result.stderr
    assert _child(cluster, "sentiment")["spec"]["predictor"]["maxReplicas"] == 9  # type: ignore[index]

    def repaired() -> bool:
        predictor = (_child(cluster, "sentiment") or {})["spec"]["predictor"]
        return predictor["maxReplicas"] == 1 and predictor["containers"][0]["image"] == wanted_image

    await eventually(repaired, within=10)


@pytest.mark.parametrize("operator_config", [{"knative": {"features": GPU_KNATIVE_FEATURES}}], indirect=True)
async def test_invalid_spec_sets_spec_valid_false_with_event_and_no_child(
    cluster: ServedEmulator, operator: OperatorState
) -> None:
    await _apply(cluster, EXAMPLES / "invalid/unknown-profile.yaml")

    def rejected() -> dict[str, Any]:
        cond = _condition(_model(cluster, "needs-h100"), "SpecValid")
        assert cond.get("status") == "False"
        return cond

    cond = await eventually(rejected)
    assert cond["reason"] == "InvalidSpec"
    assert "spec.resources.profile" in cond["message"]
    assert "gpu-h100" in cond["message"]
    assert _model(cluster, "needs-h100")["status"]["phase"] == "Failed"  # type: ignore[index]

    events = await eventually(
        lambda: [
            e
            for e in cluster.emulator.list_objects("events", "default")
            if e.get("reason") == "InvalidSpec" and e.get("involvedObject", {}).get("name") == "needs-h100"
        ]
    )
    assert events[0]["type"] == "Warning"
    assert "spec.resources.profile" in events[0]["message"]
    assert _child(cluster, "needs-h100") is None

    # No retry storm: over several repair intervals the operator does not keep writing.
    writes_before = cluster.emulator.write_count(UM, "default", "needs-h100")
    await asyncio.sleep(3)
    assert cluster.emulator.write_count(UM, "default", "needs-h100") == writes_before
    assert cluster.emulator.write_count(ISVC) == 0

    # Fixing the spec recovers.
    result = await cluster.kubectl(
        "patch", "um", "needs-h100", "--type=merge", "-p", '{"spec": {"resources": {"profile": "gpu-l4"}}}'
    )
    assert result.returncode == 0, result.stderr
    child = await eventually(lambda: _child(cluster, "needs-h100"))
    assert child["spec"]["predictor"]["runtimeClassName"] == "nvidia"
    assert child["spec"]["predictor"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    await eventually(lambda: _condition(_model(cluster, "needs-h100"), "SpecValid").get("status") == "True")


@pytest.mark.parametrize("code", [409, 500])
async def test_api_errors_converge_to_one_child_without_a_write_storm(
    cluster: ServedEmulator, operator: OperatorState, code: int
) -> None:
    cluster.emulator.inject_failures(status=code, times=3, resource=ISVC)
    cluster.emulator.inject_failures(status=code, times=2, resource=UM, subresource="status")
    await _apply(cluster, EXAMPLES / "cluster/bge-rerank.yaml")

    child = await eventually(lambda: _child(cluster, "bge-reranker"), within=30)
    await cluster.emulator.put_status(ISVC, "default", "bge-reranker", ready_status(child))
    await eventually(
        lambda: (_model(cluster, "bge-reranker") or {}).get("status", {}).get("phase") == "Ready", within=30
    )
    assert [c["metadata"]["name"] for c in cluster.emulator.list_objects(ISVC)] == ["bge-reranker"]
    # 3 refused applies + 1 that landed; a retry storm would be dozens.
    assert cluster.emulator.write_count(ISVC, "default", "bge-reranker") <= 5
    assert cluster.emulator.write_count(UM, "default", "bge-reranker") <= 10


def _assert_pooled(cluster: ServedEmulator) -> None:
    """Each pool.yaml member: condition Pooled naming its pool, no InferenceService of its own; each pool lists them."""
    for name, pool in MEMBERS.items():
        model = _model(cluster, name)
        assert model is not None
        condition = _condition(model, "Pooled")
        assert (condition.get("status"), condition.get("reason")) == ("True", "InPool"), (name, condition)
        assert f"pool {pool!r} ({pool}-pool)" in condition["message"]
        assert model["status"]["inferenceService"] == f"{pool}-pool"
        assert model["status"]["pool"]["name"] == pool
        assert _child(cluster, name) is None
    for pool in EXAMPLE_POOLS:
        status = (cluster.emulator.get_object(POOLS, "default", pool) or {}).get("status") or {}
        assert sorted(m["name"] for m in status.get("members") or []) == sorted(
            n for n, p in MEMBERS.items() if p == pool
        )
        members = cluster.emulator.get_object("configmaps", "default", f"{pool}-pool-members") or {}
        assert sorted(members.get("data") or {}) == sorted(f"{n}.yaml" for n, p in MEMBERS.items() if p == pool)


@pytest.mark.parametrize("operator_config", [{"knative": {"features": GPU_KNATIVE_FEATURES}}], indirect=True)
async def test_every_example_is_served_and_reaches_ready(cluster: ServedEmulator, operator: OperatorState) -> None:
    """On a cluster whose Knative enables what the GPU profile needs (and the operator knows it). pool.yaml's members
    are Ready when their pool is: its one InferenceService serves them."""
    from universal_simcluster.kserve.standin import kserve_standin

    names = sorted([*OWN, *MEMBERS])
    assert len(OWN) >= 7
    assert MEMBERS
    assert EXAMPLE_POOLS == ["small"]
    client = AsyncClient()
    async with kserve_standin(client):
        await _apply(cluster, EXAMPLES / "cluster")

        def all_ready() -> bool:
            phases = {
                m["metadata"]["name"]: (m.get("status") or {}).get("phase") for m in cluster.emulator.list_objects(UM)
            }
            assert phases == dict.fromkeys(names, "Ready")
            pools = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in cluster.emulator.list_objects(
                POOLS)}  # fmt: skip
            assert pools == dict.fromkeys(EXAMPLE_POOLS, "Ready")
            _assert_pooled(cluster)
            return True

        await eventually(all_ready, within=30)
    await client.close()
    children = cluster.emulator.list_objects(ISVC)
    assert sorted(c["metadata"]["name"] for c in children) == sorted([*OWN, *(f"{p}-pool" for p in EXAMPLE_POOLS)])
    tasks = {c["metadata"]["labels"]["serving.universal-runtime.dev/task"] for c in children
             if not c["metadata"]["name"].endswith("-pool")}  # fmt: skip
    assert tasks == {"generate", "embed", "rerank", "classify", "ner", "ocr", "document", "anomaly", "transcribe"}
    standard = _child(cluster, "anomaly")
    assert standard is not None
    assert standard["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    for pool in EXAMPLE_POOLS:
        child = _child(cluster, f"{pool}-pool")
        assert child is not None
        assert child["metadata"]["labels"]["serving.universal-runtime.dev/pool"] == pool
        assert child["metadata"]["ownerReferences"][0]["kind"] == "UniversalModelPool"


async def test_on_a_default_knative_every_example_is_admitted_but_the_gpu_profile_names_its_flags(
    cluster: ServedEmulator, operator: OperatorState
) -> None:
    """A default Knative install (no config-features flags): the emulator refuses what Knative would. pool.yaml's pool
    (no GPU profile) is admitted; its members are valid and get no InferenceService of their own."""
    await _apply(cluster, EXAMPLES / "cluster")
    names = sorted([*OWN, *MEMBERS])

    def settled() -> dict[str, str]:
        valid = {
            m["metadata"]["name"]: _condition(m, "SpecValid").get("status") for m in cluster.emulator.list_objects(UM)
        }
        assert valid == {name: "False" if name == "llama-8b" else "True" for name in names}
        _assert_pooled(cluster)
        return valid

    await eventually(settled, within=30)
    children = sorted(c["metadata"]["name"] for c in cluster.emulator.list_objects(ISVC))
    assert children == sorted([*(name for name in OWN if name != "llama-8b"), *(f"{p}-pool" for p in EXAMPLE_POOLS)])
    for child in cluster.emulator.list_objects(ISVC):
        if child["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] != "Standard":
            assert "securityContext" not in child["spec"]["predictor"]
        container = child["spec"]["predictor"]["containers"][0]
        assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"]
    message = _condition(_model(cluster, "llama-8b"), "SpecValid")["message"]
    assert "spec.resources.profile" in message
    for flag in GPU_KNATIVE_FEATURES:
        assert f"{flag}: enabled" in message


async def test_deleting_the_model_deletes_its_child(cluster: ServedEmulator, operator: OperatorState) -> None:
    await _apply(cluster, EXAMPLES / "cluster/rapidocr.yaml")
    await eventually(lambda: _child(cluster, "ocr"))

    result = await cluster.kubectl("delete", "um", "ocr", "--wait=false")
    assert result.returncode == 0, result.stderr

    await eventually(lambda: _model(cluster, "ocr") is None)
    await eventually(lambda: _child(cluster, "ocr") is None)


async def test_a_foreign_inference_service_with_the_same_name_is_left_alone(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    foreign = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": "minilm", "namespace": "default"},
        "spec": {"predictor": {"model": {"modelFormat": {"name": "sklearn"}, "storageUri": "gs://bucket/model"}}},
    }
    file = tmp_path / "foreign.yaml"
    file.write_text(yaml.safe_dump(foreign))
    await _apply(cluster, file)
    before = _child(cluster, "minilm")

    await _apply(cluster, EXAMPLES / "cluster/minilm-embed.yaml")

    def refused() -> dict[str, Any]:
        cond = _condition(_model(cluster, "minilm"), "Ready")
        assert cond.get("status") == "False"
        return cond

    cond = await eventually(refused)
    assert "already exists" in cond["message"]
    assert _child(cluster, "minilm") == before


async def test_a_403_from_the_api_server_is_reported_as_rbac_and_retried_never_as_an_invalid_spec(
    cluster: ServedEmulator, operator: OperatorState
) -> None:
    refusal = cluster.emulator.inject_failures(status=403, times=1000, resource=ISVC, methods=["PATCH"])
    await _apply(cluster, EXAMPLES / "cluster/bert-ner.yaml")

    def refused() -> dict[str, Any]:
        cond = _condition(_model(cluster, "bert-ner"), "Ready")
        assert cond.get("reason") == "Forbidden"
        return cond

    cond = await eventually(refused)
    assert "RBAC, not the spec" in cond["message"]
    assert _condition(_model(cluster, "bert-ner"), "SpecValid")["status"] == "True"
    assert _child(cluster, "bert-ner") is None
    refusal.remaining = 0  # the grant arrives: a retry creates the child
    await eventually(lambda: _child(cluster, "bert-ner"), within=30)
    await eventually(lambda: _condition(_model(cluster, "bert-ner"), "Ready").get("reason") != "Forbidden")


async def test_credentials_reach_kserve_through_an_owned_service_account_repaired_and_collected_with_the_model(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["spec"]["source"]["credentialsSecret"] = "hub-token"
    await _apply_text(cluster, manifest, tmp_path)

    child = await eventually(lambda: _child(cluster, "minilm"))
    account = cluster.emulator.get_object("serviceaccounts", "default", "minilm-storage")
    assert account is not None
    assert child["spec"]["predictor"]["serviceAccountName"] == "minilm-storage"
    assert account["secrets"] == [{"name": "hub-token"}]
    assert account["automountServiceAccountToken"] is False
    [owner] = account["metadata"]["ownerReferences"]
    assert owner["uid"] == _model(cluster, "minilm")["metadata"]["uid"]  # type: ignore[index]

    # Deleted out of band: the repair timer puts it back.
    result = await cluster.kubectl("delete", "serviceaccount", "minilm-storage")
    assert result.returncode == 0, result.stderr
    await eventually(lambda: cluster.emulator.get_object("serviceaccounts", "default", "minilm-storage"), within=10)

    # It goes with its model (garbage collection).
    result = await cluster.kubectl("delete", "um", "minilm", "--wait=false")
    assert result.returncode == 0, result.stderr
    await eventually(lambda: cluster.emulator.get_object("serviceaccounts", "default", "minilm-storage") is None)


async def test_adapters_reach_the_predictor_through_a_mounted_config_map_and_change_without_a_new_revision(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    manifest = load_manifest("cluster/qwen-chat.yaml")
    name = manifest["metadata"]["name"]
    manifest["spec"]["adapters"] = [{"name": "support", "source": {"uri": "hf://acme/support-lora", "revision": "v2"}}]
    await _apply_text(cluster, manifest, tmp_path)

    child = await eventually(lambda: _child(cluster, name))
    listing = await eventually(lambda: cluster.emulator.get_object("configmaps", "default", f"{name}-adapters"))
    assert json.loads(listing["data"]["adapters.json"]) == {
        "adapters": [{"name": "support", "uri": "hf://acme/support-lora:v2"}]
    }
    [owner] = listing["metadata"]["ownerReferences"]
    assert owner["uid"] == _model(cluster, name)["metadata"]["uid"]  # type: ignore[index]
    predictor = child["spec"]["predictor"]
    container = predictor["containers"][0]
    assert "--adapters-file=/etc/universal-runtime/adapters/adapters.json" in container["args"]
    assert {"name": "adapters", "configMap": {"name": f"{name}-adapters"}} in predictor["volumes"]
    assert {"name": "adapters", "mountPath": "/etc/universal-runtime/adapters", "readOnly": True} in container[
        "volumeMounts"
    ]

    # Another adapter: the list changes, the pod template does not (no new Knative revision, no restart).
    cluster.emulator.reset_writes()
    manifest["spec"]["adapters"].append({"name": "legal", "source": {"uri": "s3://adapters/legal"}})
    await _apply_text(cluster, manifest, tmp_path)

    def listed() -> list[str]:
        cm = cluster.emulator.get_object("configmaps", "default", f"{name}-adapters") or {"data": {}}
        return [a["name"] for a in json.loads(cm["data"].get("adapters.json", "{}")).get("adapters", [])]

    await eventually(lambda: listed() == ["support", "legal"])
    await eventually(lambda: (_model(cluster, name) or {}).get("status", {}).get("observedGeneration") == 2)
    assert cluster.emulator.write_count(ISVC, "default", name) == 0


async def test_another_writers_env_entry_is_kept_and_causes_no_rewrite_over_two_repair_intervals(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["spec"]["source"]["credentialsSecret"] = "hub-token"  # each repair pass reads its ServiceAccount
    await _apply_text(cluster, manifest, tmp_path)
    child = await eventually(lambda: _child(cluster, "minilm"))

    # A mutating webhook (or a person with kubectl) adds an env entry of its own to the predictor.
    container = child["spec"]["predictor"]["containers"][0]
    container["env"].append({"name": "OTEL_SERVICE_NAME", "value": "minilm"})
    patch = {"spec": {"predictor": {"containers": [container]}}}
    result = await cluster.kubectl("patch", "isvc", "minilm", "--type=merge", "-p", yaml.safe_dump(patch))
    assert result.returncode == 0, result.stderr
    cluster.emulator.reset_writes()

    def repair_passes() -> int:
        return sum(1 for a in cluster.emulator.access_log if (a.verb, a.plural) == ("get", "serviceaccounts"))

    seen = repair_passes()
    await eventually(lambda: repair_passes() >= seen + 2, within=10)  # two repair intervals went by

    assert cluster.emulator.write_count(ISVC, "default", "minilm") == 0
    env = _child(cluster, "minilm")["spec"]["predictor"]["containers"][0]["env"]  # type: ignore[index]
    assert {"name": "OTEL_SERVICE_NAME", "value": "minilm"} in env


def _backend_column(table: str, name: str) -> str:
    header, *rows = table.strip().splitlines()
    column = header.split().index("BACKEND")
    [row] = [r.split() for r in rows if r.split()[0] == name]
    return row[column]


# The repair timer would also get there, a repair interval later: it is kept out of the way, so the status follows
# the report because the operator reacts to it.
@pytest.mark.parametrize("operator_config", [{"repairIntervalSeconds": 600.0}], indirect=True)
async def test_the_backend_the_predictor_reports_replaces_auto_in_kubectl_get_um_for_that_generation_only(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    """Generation on a GPU with backend auto: only the predictor knows; the gateway's status.predictorReport says."""
    manifest: dict[str, Any] = {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": "gpu-llama", "namespace": "default"},
        "spec": {
            "task": "generate",
            "source": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"},
            "resources": {"gpus": 1},
        },
    }
    await _apply_text(cluster, manifest, tmp_path)
    child = await eventually(lambda: _child(cluster, "gpu-llama"))
    await cluster.emulator.put_status(ISVC, "default", "gpu-llama", ready_status(child))

    def status_of() -> dict[str, Any]:
        return dict((_model(cluster, "gpu-llama") or {}).get("status") or {})

    await eventually(lambda: status_of().get("phase") == "Ready")
    model = _model(cluster, "gpu-llama") or {}
    assert model["status"]["backend"] == "auto"
    table = await cluster.kubectl("get", "um", "gpu-llama")
    assert _backend_column(table.stdout, "gpu-llama") == "auto"

    # The gateway's write, after it served a request: what the predictor's card said, for this generation.
    generation = model["metadata"]["generation"]
    child_before = _child(cluster, "gpu-llama")
    child_writes = cluster.emulator.write_count(ISVC, "default", "gpu-llama")
    report = {"backend": "vllm", "generation": generation}
    await cluster.emulator.put_status(UM, "default", "gpu-llama", {"predictorReport": report})

    await eventually(lambda: status_of().get("backend") == "vllm")
    table = await cluster.kubectl("get", "um", "gpu-llama")
    assert _backend_column(table.stdout, "gpu-llama") == "vllm"
    # The report changes no spec: nothing re-rendered, the InferenceService (and so its pods) untouched.
    assert _child(cluster, "gpu-llama") == child_before
    assert cluster.emulator.write_count(ISVC, "default", "gpu-llama") == child_writes
    assert status_of()["predictorReport"] == report

    # A new spec may run another engine: auto again until the predictor is asked for that generation.
    patched = await cluster.kubectl(
        "patch", "um", "gpu-llama", "--type=merge", "-p", '{"spec": {"engineArgs": {"max_model_len": 4096}}}'
    )
    assert patched.returncode == 0, patched.stderr

    def reconciled() -> dict[str, Any]:
        status = status_of()
        assert status.get("observedGeneration") == generation + 1
        return status

    status = await eventually(reconciled)
    assert status["backend"] == "auto"
    assert _backend_column((await cluster.kubectl("get", "um", "gpu-llama")).stdout, "gpu-llama") == "auto"
