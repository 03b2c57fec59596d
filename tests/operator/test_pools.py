"""UniversalModelPool: the CRD's rules, the one InferenceService and members ConfigMap the operator renders for a pool,
and the status of a pool and its members, with the real kopf operator against the API emulator and the real kubectl.
The tests play KServe (the InferenceService's status) and the gateway (a member's ``predictorReport.pool``)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from tests.conftest import EXAMPLES, MODEL_KIND, POOL_KIND, cluster_examples, eventually
from tests.operator.test_crd import ENV, apply_defaults
from tests.stores import S3Store
from universal_operator.config import OperatorConfig
from universal_operator.crd import pool_custom_resource_definition, render_pool_crd_yaml
from universal_operator.handlers import OperatorState
from universal_operator.reconcile.pools import check_pool, desired_pool_inference_service, stand_in
from universal_operator.reconcile.render import request_timeout_seconds
from universal_operator.spec import SpecError, parse_model, parse_pool
from universal_simcluster.apiserver import ServedEmulator
from universal_simcluster.kserve.standin import ready_status

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
ISVC, UM, POOLS = "inferenceservices", "universalmodels", "universalmodelpools"
POOL_EXAMPLE = EXAMPLES / "cluster" / "pool.yaml"
POOL_ROOT = pool_custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

POOL = """
apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModelPool
metadata: {name: small}
spec:
  resources: {cpu: "2", memory: 4Gi}
  memoryBudget: 3Gi
  scaling: {maxReplicas: 2, idleTimeout: 10m}
"""


def member(name: str, task: str = "embed", uri: str = "hf://sentence-transformers/all-MiniLM-L6-v2") -> dict[str, Any]:
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": name},
        "spec": {"task": task, "source": {"uri": uri}, "pool": "small", "scaling": {"idleTimeout": "2m"}},
    }


# --------------------------------------------------------------------------------------------------
# The CRD


def test_committed_pool_crd_is_the_generated_one_in_both_places() -> None:
    for path in (
        ROOT / "crds" / "universalmodelpools.yaml",
        ROOT / "charts/universal-runtime/files/universalmodelpools.yaml",
    ):
        assert path.read_text() == render_pool_crd_yaml(), f"{path} is out of date: run `make crd`"


def test_every_pool_spec_property_has_a_description_for_kubectl_explain() -> None:
    spec = POOL_ROOT["properties"]["spec"]
    missing = [name for name, node in spec["properties"].items() if not node.get("description")]
    assert missing == []
    columns = [c["name"] for c in pool_custom_resource_definition()["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["Phase", "Members", "Used-MB", "Budget", "Ready", "Age"]


def _pool_cel_failures(body: dict[str, Any]) -> list[str]:
    obj = apply_defaults({"metadata": {"name": body["metadata"]["name"]}, "spec": body.get("spec") or {}}, POOL_ROOT)
    failures = []

    def walk(schema: dict[str, Any], value: Any, path: str) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            program = ENV.program(ENV.compile(rule["rule"]))
            if not program.evaluate({"self": celpy.json_to_cel(value), "oldSelf": celpy.json_to_cel(value)}):
                failures.append(f"{path or '.'}: {rule['message']}")
        if isinstance(value, dict):
            for name, sub in schema.get("properties", {}).items():
                if name in value:
                    walk(sub, value[name], f"{path}.{name}")

    walk(POOL_ROOT, obj, "")
    return failures


POOL_INVALID = {
    "Standard mode (one idle member must not stop its neighbours)": (
        {"scaling": {"mode": "Standard"}}, ".spec: a pool scales with Knative only"),
    "two GPUs": ({"resources": {"gpus": 2}}, ".spec: a pool holds at most one GPU"),
    "an emptyDir size and a claim": (
        {"cacheVolume": {"sizeLimit": "10Gi", "claimName": "models"}}, ".spec.cacheVolume: cacheVolume is an emptyDir"),
}  # fmt: skip


@pytest.mark.parametrize(("spec", "failure"), POOL_INVALID.values(), ids=POOL_INVALID.keys())
def test_an_unhostable_pool_fails_exactly_its_cel_rule_and_pydantic_agrees(spec: dict[str, Any], failure: str) -> None:
    body = {"metadata": {"name": "small"}, "spec": spec}
    failures = _pool_cel_failures(body)
    assert len(failures) == 1, failures
    assert failures[0].startswith(failure)
    with pytest.raises(SpecError):
        parse_pool(body)


def test_a_pool_name_leaves_room_for_its_inference_services_suffix() -> None:
    assert _pool_cel_failures({"metadata": {"name": "p" * 34}, "spec": {}}) == []
    [failure] = _pool_cel_failures({"metadata": {"name": "p" * 35}, "spec": {}})
    assert "'<name>-pool'" in failure
    with pytest.raises(SpecError, match="-pool"):
        parse_pool({"metadata": {"name": "p" * 35}})


def test_a_budget_above_the_pods_memory_is_refused_by_the_operator_naming_both() -> None:
    pool = parse_pool(yaml.safe_load(POOL.replace("memoryBudget: 3Gi", "memoryBudget: 5Gi")))
    with pytest.raises(SpecError, match=r"spec.memoryBudget: 5Gi is more than resources.memory \(4Gi\)"):
        check_pool(pool)


def test_the_example_pool_and_members_pass_cel_and_pydantic() -> None:
    """examples/cluster/pool.yaml: one pool and its members in one file (tests/operator/test_crd.py runs the members
    through the UniversalModel CRD's rules, as every example)."""
    documents = list(yaml.safe_load_all(POOL_EXAMPLE.read_text()))
    pools = [d for d in documents if d["kind"] == POOL_KIND]
    members = [d for d in documents if d["kind"] == MODEL_KIND]
    assert len(pools) == 1
    assert len(members) >= 2
    assert len(documents) == len(pools) + len(members)
    assert _pool_cel_failures(pools[0]) == []
    check_pool(parse_pool(pools[0]))
    assert {parse_model(m).spec.pool for m in members} == {pools[0]["metadata"]["name"]}


@pytest.mark.parametrize(("id", "body"), cluster_examples(POOL_KIND).items(), ids=list(cluster_examples(POOL_KIND)))
def test_every_example_pool_passes_cel_pydantic_and_the_operators_check_and_has_members(
    id: str, body: dict[str, Any]
) -> None:
    assert _pool_cel_failures(body) == []
    pool = parse_pool(body)
    check_pool(pool)
    members = [m for m in cluster_examples(MODEL_KIND).values() if m["spec"].get("pool") == pool.metadata.name]
    assert len(members) >= 2, f"{id}: an example pool without members shows nothing"


# --------------------------------------------------------------------------------------------------
# The render (pure)


def test_the_pools_inference_service_runs_the_supervisor_over_the_mounted_members() -> None:
    pool = parse_pool({**yaml.safe_load(POOL), "metadata": {"name": "small", "namespace": "ml", "uid": "u1"}})
    isvc = desired_pool_inference_service(pool, OperatorConfig())
    assert isvc["metadata"]["name"] == "small-pool"
    assert isvc["metadata"]["ownerReferences"][0]["kind"] == "UniversalModelPool"
    predictor = isvc["spec"]["predictor"]
    [container] = predictor["containers"]
    assert container["command"] == ["universal-runtime"]
    assert container["args"] == ["serve", "/etc/universal-runtime/pool", "--host=0.0.0.0", "--port=8080",
                                 "--memory-budget-mb=3072", "--member-processes=shared",
                                 "--credentials-dir=/etc/universal-runtime/pool-credentials"]  # fmt: skip
    own = parse_pool({**yaml.safe_load(POOL), "metadata": {"name": "small", "namespace": "ml", "uid": "u1"}}
                     | {"spec": {**yaml.safe_load(POOL)["spec"], "memberProcesses": "PerMember"}})  # fmt: skip
    [own_container] = desired_pool_inference_service(own, OperatorConfig())["spec"]["predictor"]["containers"]
    assert "--member-processes=own" in own_container["args"]
    assert {"name": "pool-members", "configMap": {"name": "small-pool-members"}} in predictor["volumes"]
    assert {"name": "pool-members", "mountPath": "/etc/universal-runtime/pool", "readOnly": True} in container[
        "volumeMounts"
    ]
    # The members' credentials: always mounted (with no data while no member names a Secret), whole.
    assert {"name": "pool-credentials", "secret": {"secretName": "small-pool-credentials"}} in predictor["volumes"]
    mount = {"name": "pool-credentials", "mountPath": "/etc/universal-runtime/pool-credentials", "readOnly": True}
    assert mount in container["volumeMounts"]
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (0, 2)
    assert "STORAGE_URI" not in {e["name"] for e in container["env"]}


def test_a_claim_as_the_cache_volume_replaces_the_empty_dir() -> None:
    body = yaml.safe_load(POOL)
    body["spec"]["cacheVolume"] = {"claimName": "pool-cache"}
    volumes = desired_pool_inference_service(parse_pool(body), OperatorConfig())["spec"]["predictor"]["volumes"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "pool-cache"}} in volumes


# --------------------------------------------------------------------------------------------------
# The real operator


async def _apply(cluster: ServedEmulator, tmp_path: Path, *documents: dict[str, Any]) -> None:
    file = tmp_path / "apply.yaml"
    file.write_text(yaml.safe_dump_all(documents))
    result = await cluster.kubectl("apply", "--validate=false", "-f", str(file))
    assert result.returncode == 0, result.stderr


def _get(cluster: ServedEmulator, plural: str, name: str) -> dict[str, Any] | None:
    return cluster.emulator.get_object(plural, "default", name)


def _status(cluster: ServedEmulator, plural: str, name: str) -> dict[str, Any]:
    return dict((_get(cluster, plural, name) or {}).get("status") or {})


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def _members(cluster: ServedEmulator) -> dict[str, str]:
    return dict((_get(cluster, "configmaps", "small-pool-members") or {}).get("data") or {})


async def test_a_pool_renders_one_inference_service_and_its_members_reach_it_through_a_config_map(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await _apply(
        cluster,
        tmp_path,
        yaml.safe_load(POOL),
        member("minilm"),
        member("sentiment", "classify", "hf://distilbert/distilbert-base-uncased-finetuned-sst-2-english"),
    )
    isvc = await eventually(lambda: _get(cluster, ISVC, "small-pool"))
    pool_uid = _get(cluster, POOLS, "small")["metadata"]["uid"]  # type: ignore[index]
    assert [r["uid"] for r in isvc["metadata"]["ownerReferences"]] == [pool_uid]
    assert isvc["spec"]["predictor"]["containers"][0]["args"][:2] == ["serve", "/etc/universal-runtime/pool"]

    data = await eventually(lambda: _members(cluster) if len(_members(cluster)) == 2 else None)
    assert sorted(data) == ["minilm.yaml", "sentiment.yaml"]
    served = parse_model(yaml.safe_load(data["sentiment.yaml"]))  # the manifest as `serve` reads it
    assert (served.metadata.name, served.spec.task.value, served.spec.pool) == ("sentiment", "classify", None)
    assert served.spec.scaling.idle_timeout == "2m"  # each member keeps its own TTL inside the pool

    # Pooled models get no InferenceService of their own; their status names the pool.
    pooled = await eventually(lambda: _condition(_status(cluster, UM, "minilm"), "Pooled"))
    assert pooled["status"] == "True"
    assert "small" in pooled["message"]
    assert _get(cluster, ISVC, "minilm") is None
    assert _get(cluster, ISVC, "sentiment") is None

    # A third member: the ConfigMap changes, the InferenceService is not written (no new revision, no restart).
    await eventually(lambda: _status(cluster, POOLS, "small").get("memberCount") == 2)  # settled on two first
    cluster.emulator.reset_writes()
    await _apply(cluster, tmp_path, member("bge-small"))
    await eventually(lambda: "bge-small.yaml" in _members(cluster))
    await eventually(lambda: _condition(_status(cluster, UM, "bge-small"), "Pooled").get("status") == "True")
    await eventually(lambda: _status(cluster, POOLS, "small").get("memberCount") == 3)
    assert cluster.emulator.write_count(ISVC, "default", "small-pool") == 0

    # A member deleted: it leaves the list, still without a write to the InferenceService.
    result = await cluster.kubectl("delete", "um", "minilm", "--wait=false")
    assert result.returncode == 0, result.stderr
    await eventually(lambda: "minilm.yaml" not in _members(cluster))
    assert cluster.emulator.write_count(ISVC, "default", "small-pool") == 0


async def test_pool_and_member_status_follow_the_inference_service_and_the_gateways_report(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await _apply(cluster, tmp_path, yaml.safe_load(POOL), member("minilm"), member("other"))
    isvc = await eventually(lambda: _get(cluster, ISVC, "small-pool"))
    await eventually(lambda: _status(cluster, UM, "minilm").get("pool"))
    assert _status(cluster, UM, "minilm")["pool"] == {"name": "small", "state": "NotLoaded"}

    await cluster.emulator.put_status(ISVC, "default", "small-pool", ready_status(isvc))
    pool = await eventually(lambda: _status(cluster, POOLS, "small") if _status(cluster, POOLS, "small").get(
        "phase") == "Ready" else None)  # fmt: skip
    assert pool["address"] == "http://small-pool-predictor.default.svc.cluster.local"
    assert pool["memoryBudgetMb"] == 3072
    assert pool["loaded"] == []
    assert pool["inferenceService"] == "small-pool"
    # The gateway routes a member to the pool's address (with the member's own name in "model").
    minilm = await eventually(lambda: _status(cluster, UM, "minilm") if _status(cluster, UM, "minilm").get(
        "phase") == "Ready" else None)  # fmt: skip
    assert minilm["address"] == pool["address"]
    assert minilm["servedName"] == "minilm"
    assert _condition(minilm, "Ready")["status"] == "True"

    # The gateway reports the member's card from the pool's /openai/v1/models: loaded, 120 MiB.
    card = {"state": "ready", "starts": 1, "memoryMb": 120, "evictions": 0}
    await cluster.emulator.put_status(UM, "default", "minilm", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "minilm").get("pool", {}).get("state") == "Loaded")
    await eventually(lambda: _status(cluster, POOLS, "small").get("loaded") == ["minilm"])
    assert _status(cluster, POOLS, "small")["memoryUsedMb"] == 120

    # Evicted for room under the budget: said with its reason, and gone from the loaded set.
    card = {"state": "idle", "starts": 1, "evictions": 1}
    await cluster.emulator.put_status(UM, "default", "minilm", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "minilm").get("pool", {}).get("state") == "Evicted")
    assert _status(cluster, UM, "minilm")["pool"]["reason"] == "MemoryBudget"
    await eventually(lambda: _status(cluster, POOLS, "small").get("loaded") == [])
    assert _status(cluster, POOLS, "small")["evictions"] == 1

    # Its process killed by the OOM killer: Evicted with that reason (its next request loads it again), the exit
    # in the message.
    card = {"state": "idle", "starts": 1, "evictions": 1, "reason": "OOMKilled", "crashes": 1,
            "lastExit": "killed by the OOM killer over its 150 MiB limit", "memoryLimitMb": 150}  # fmt: skip
    await cluster.emulator.put_status(UM, "default", "minilm", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "minilm").get("pool", {}).get("reason") == "OOMKilled")
    assert _status(cluster, UM, "minilm")["pool"]["state"] == "Evicted"
    assert "killed by the OOM killer over its 150 MiB limit (1 crash(es))" in _status(cluster, UM, "minilm")["message"]

    # Loaded again: the reason goes.
    card = {"state": "ready", "starts": 2, "memoryMb": 118, "evictions": 1}
    await cluster.emulator.put_status(UM, "default", "minilm", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "minilm").get("pool") == {"name": "small", "state": "Loaded",
                                                                            "memoryMb": 118})  # fmt: skip
    # The gateway waits for the member as long as the pool's KServe timeout lets a cold start take.
    pool_object = parse_pool(_get(cluster, POOLS, "small") or {})
    expected = request_timeout_seconds(stand_in(pool_object), operator.config)
    assert _status(cluster, UM, "minilm")["requestTimeoutSeconds"] == expected


async def test_a_pooled_member_with_backend_auto_shows_the_backend_it_loaded_with(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    # transcribe with backend auto stays auto in the spec's resolution: only the loaded predictor knows its engine.
    whisper = member("whisper", task="transcribe", uri="hf://openai/whisper-tiny")
    await _apply(cluster, tmp_path, yaml.safe_load(POOL), whisper)
    isvc = await eventually(lambda: _get(cluster, ISVC, "small-pool"))
    await cluster.emulator.put_status(ISVC, "default", "small-pool", ready_status(isvc))
    await eventually(lambda: _status(cluster, UM, "whisper").get("phase") == "Ready")
    assert _status(cluster, UM, "whisper")["backend"] == "auto"

    card = {"state": "ready", "starts": 1, "memoryMb": 200, "evictions": 0, "backend": "faster-whisper"}
    await cluster.emulator.put_status(UM, "default", "whisper", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "whisper").get("backend") == "faster-whisper")

    # Unloaded (idle past its timeout): its status still says the engine it last loaded with.
    card = {"state": "idle", "starts": 1, "evictions": 0, "reason": "IdleTimeout", "backend": "faster-whisper"}
    await cluster.emulator.put_status(UM, "default", "whisper", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "whisper").get("pool", {}).get("state") == "Evicted")
    assert _status(cluster, UM, "whisper")["backend"] == "faster-whisper"

    # A card naming an engine not of the task's says nothing: the spec's resolution again.
    card = {"state": "ready", "starts": 2, "memoryMb": 200, "evictions": 0, "backend": "vllm"}
    await cluster.emulator.put_status(UM, "default", "whisper", {"predictorReport": {"pool": card}})
    await eventually(lambda: _status(cluster, UM, "whisper").get("backend") == "auto")


async def test_a_member_of_a_missing_pool_says_so_with_a_condition_and_an_event(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await _apply(cluster, tmp_path, member("orphan"))
    pooled = await eventually(lambda: _condition(_status(cluster, UM, "orphan"), "Pooled"))
    assert (pooled["status"], pooled["reason"]) == ("False", "PoolMissing")
    assert "create the UniversalModelPool 'small'" in pooled["message"]
    await eventually(lambda: [e for e in cluster.emulator.list_objects("events", "default")
                              if e.get("reason") == "PoolMissing"])  # fmt: skip
    assert _get(cluster, ISVC, "orphan") is None

    # The pool arrives: the member joins it.
    await _apply(cluster, tmp_path, yaml.safe_load(POOL))
    await eventually(lambda: _condition(_status(cluster, UM, "orphan"), "Pooled").get("status") == "True")
    await eventually(lambda: "orphan.yaml" in _members(cluster))

    # The pool goes: the member says so again.
    result = await cluster.kubectl("delete", "ump", "small", "--wait=false")
    assert result.returncode == 0, result.stderr
    await eventually(lambda: _condition(_status(cluster, UM, "orphan"), "Pooled").get("reason") == "PoolMissing")


# --------------------------------------------------------------------------------------------------
# Members' credentials: a copy of each Secret they name, in a Secret of the pool's


def _copies(cluster: ServedEmulator) -> dict[str, Any] | None:
    """The pool's aggregate of its members' Secrets, each copy decoded (None: none yet)."""
    found = _get(cluster, "secrets", "small-pool-credentials")
    if found is None:
        return None
    return {k: json.loads(base64.b64decode(v)) for k, v in (found.get("data") or {}).items()}


def _events(cluster: ServedEmulator, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.emulator.list_objects("events", "default") if e.get("reason") == reason]


def _with_secret(name: str, secret: str) -> dict[str, Any]:
    body = member(name, uri=f"s3://models/{name}")
    body["spec"]["source"]["credentialsSecret"] = secret
    return body


async def test_members_secrets_are_copied_into_the_pools_secret_and_a_new_one_rolls_nothing(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    # No member names a Secret: the pool's aggregate exists all the same, empty, owned by the pool.
    await _apply(cluster, tmp_path, yaml.safe_load(POOL), member("minilm"))
    isvc = await eventually(lambda: _get(cluster, ISVC, "small-pool"))
    assert await eventually(lambda: _copies(cluster) == {})
    pool_uid = _get(cluster, POOLS, "small")["metadata"]["uid"]  # type: ignore[index]
    [owner] = _get(cluster, "secrets", "small-pool-credentials")["metadata"]["ownerReferences"]  # type: ignore[index]
    assert (owner["kind"], owner["uid"]) == ("UniversalModelPool", pool_uid)
    assert (
        "--credentials-dir=/etc/universal-runtime/pool-credentials"
        in isvc["spec"]["predictor"]["containers"][0]["args"]
    )
    await eventually(lambda: _status(cluster, POOLS, "small").get("memberCount") == 1)
    cluster.emulator.reset_writes()

    # A member naming a Secret: the Secret's data and KServe's annotations only (not another tool's) are copied;
    # the member's manifest keeps the name (serve reads its copy by it); the InferenceService is not written.
    keys = S3Store("http://minio.store:9000", "models", "AKID1", "secret1").secret("store-keys")
    keys["metadata"]["annotations"]["example.com/owner"] = "team-a"
    await _apply(cluster, tmp_path, keys, _with_secret("private", "store-keys"))
    copied = await eventually(lambda: _copies(cluster) or None)
    annotations = {"serving.kserve.io/s3-endpoint": "minio.store:9000", "serving.kserve.io/s3-usehttps": "0",
                   "serving.kserve.io/s3-region": "us-east-1"}  # fmt: skip
    assert copied == {"store-keys.json": {"data": keys["data"], "annotations": annotations}}
    assert "example.com/owner" not in json.dumps(copied)
    served = parse_model(yaml.safe_load(await eventually(lambda: _members(cluster).get("private.yaml"))))
    assert served.spec.source.credentials_secret == "store-keys"
    await eventually(lambda: _condition(_status(cluster, UM, "private"), "Pooled").get("status") == "True")
    assert _condition(_status(cluster, UM, "private"), "SpecValid")["status"] == "True"  # no longer refused
    assert cluster.emulator.write_count(ISVC, "default", "small-pool") == 0

    # Unchanged over two repair intervals: read each time, written never.
    cluster.emulator.reset_writes()
    await asyncio.sleep(2.5 * operator.config.repair_interval_seconds)
    assert cluster.emulator.write_count("secrets", "default", "small-pool-credentials") == 0

    # Rotated: the new key reaches the copy without any change to the member.
    rotated = S3Store("http://minio.store:9000", "models", "AKID2", "secret2").secret("store-keys")
    await _apply(cluster, tmp_path, rotated)
    await eventually(lambda: (_copies(cluster) or {}).get("store-keys.json", {}).get("data")
                     == rotated["data"], within=10)  # fmt: skip
    assert cluster.emulator.write_count(ISVC, "default", "small-pool") == 0


async def test_a_members_missing_secret_is_one_warning_event_on_the_member_and_the_pool_serves_on(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await _apply(cluster, tmp_path, yaml.safe_load(POOL), member("minilm"), _with_secret("private", "legal-keys"))
    [warning] = await eventually(lambda: _events(cluster, "CredentialsMissing"))
    assert warning["type"] == "Warning"
    assert warning["involvedObject"]["name"] == "private"
    assert "Secret 'legal-keys', this model's spec.source.credentialsSecret, does not exist" in warning["message"]
    # The member is listed all the same (the pool fails it alone, naming the Secret), its aggregate without it.
    await eventually(lambda: sorted(_members(cluster)) == ["minilm.yaml", "private.yaml"])
    assert await eventually(lambda: _copies(cluster) == {})
    await asyncio.sleep(2.5 * operator.config.repair_interval_seconds)  # repairs pass: still the one Event
    assert len(_events(cluster, "CredentialsMissing")) == 1

    # The pool's card of it says why it failed: the member's status says so too.
    card = {
        "state": "failed",
        "starts": 0,
        "reason": "Failed",
        "message": "cannot fetch s3://models/private: the credentials Secret 'legal-keys' is not available",
    }
    await cluster.emulator.put_status(UM, "default", "private", {"predictorReport": {"pool": card}})
    await eventually(lambda: "'legal-keys' is not available" in (_status(cluster, UM, "private").get("message") or ""))

    # The Secret created: its copy follows.
    await _apply(cluster, tmp_path, S3Store("http://minio.store:9000", "models", "AKID3", "s3").secret("legal-keys"))
    await eventually(lambda: set(_copies(cluster) or {}) == {"legal-keys.json"}, within=10)


async def test_a_secret_of_the_pools_name_not_owned_by_it_is_refused_naming_it(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    taken = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "small-pool-credentials"}, "data": {}}
    await _apply(cluster, tmp_path, taken, yaml.safe_load(POOL))
    valid = await eventually(lambda: _condition(_status(cluster, POOLS, "small"), "SpecValid") or None)
    assert valid["status"] == "False"
    assert "'small-pool-credentials' the pool needs already exists" in valid["message"]
    assert _get(cluster, ISVC, "small-pool") is None
