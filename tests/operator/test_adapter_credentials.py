"""The adapters' credentials, as the real operator delivers them (embedded, against the API emulator, manifests and
Secrets applied with the real kubectl): a Secret of the model's, ``NAME-adapter-credentials``, holding a copy of each
Secret ``spec.adapters[].source.credentialsSecret`` names (its data and its ``serving.kserve.io/*`` annotations),
mounted whole into the predictor; re-read at every reconcile (a rotated key follows within a repair interval) and
written only when a copy drifted; a Secret that does not exist is one Warning Event naming it and its adapters; and
an adapter naming a new Secret changes the copies only, never the InferenceService."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import eventually, load_manifest
from universal_operator.handlers import OperatorState
from universal_simcluster.apiserver import ServedEmulator

pytestmark = pytest.mark.operator

NAME = "qwen-chat"
AGGREGATE = f"{NAME}-adapter-credentials"
ISVC = "inferenceservices"


async def kubectl_apply(cluster: ServedEmulator, manifest: dict[str, Any], tmp_path: Path) -> None:
    file = tmp_path / f"{manifest['kind']}-{manifest['metadata']['name']}.yaml"
    file.write_text(yaml.safe_dump(manifest))
    result = await cluster.kubectl("apply", "--validate=false", "-f", str(file))
    assert result.returncode == 0, result.stderr


def s3_secret(name: str, key_id: str, endpoint: str = "minio.store:9000") -> dict[str, Any]:
    """A Secret in KServe's S3 format, its endpoint in KServe's annotations (and one annotation of another tool's)."""
    data = {"awsAccessKeyID": key_id, "awsSecretAccessKey": f"{key_id}-secret"}
    annotations = {"serving.kserve.io/s3-endpoint": endpoint, "serving.kserve.io/s3-usehttps": "0",
                   "example.com/owner": "team-a"}  # fmt: skip
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "annotations": annotations},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}  # fmt: skip


def model(adapters: list[tuple[str, str | None]]) -> dict[str, Any]:
    manifest = load_manifest("cluster/qwen-chat.yaml")
    manifest["spec"]["adapters"] = [
        {"name": name, "source": {"uri": f"s3://adapters/{name}", **({"credentialsSecret": s} if s else {})}}
        for name, s in adapters
    ]
    return manifest


def copies(cluster: ServedEmulator) -> dict[str, Any] | None:
    """The aggregate's keys, each decoded (None: no aggregate yet)."""
    found = cluster.emulator.get_object("secrets", "default", AGGREGATE)
    if found is None:
        return None
    return {k: json.loads(base64.b64decode(v)) for k, v in (found.get("data") or {}).items()}


def listed(cluster: ServedEmulator) -> dict[str, Any]:
    cm = cluster.emulator.get_object("configmaps", "default", f"{NAME}-adapters") or {"data": {}}
    return dict(json.loads(cm["data"].get("adapters.json", "{}")))


def events(cluster: ServedEmulator, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.emulator.list_objects("events", "default") if e["reason"] == reason]


async def test_referenced_secrets_are_copied_with_kserve_s_annotations_into_a_mounted_secret_of_the_model(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await kubectl_apply(cluster, s3_secret("store-keys", "AKID1"), tmp_path)
    await kubectl_apply(cluster, model([("support", "store-keys"), ("public", None)]), tmp_path)

    copied = await eventually(lambda: copies(cluster))
    assert copied == {
        "store-keys.json": {
            "data": {"awsAccessKeyID": base64.b64encode(b"AKID1").decode(),
                     "awsSecretAccessKey": base64.b64encode(b"AKID1-secret").decode()},
            # Only KServe's: not another tool's, nor kubectl's last-applied-configuration (the whole Secret).
            "annotations": {"serving.kserve.io/s3-endpoint": "minio.store:9000", "serving.kserve.io/s3-usehttps": "0"},
        }
    }  # fmt: skip
    aggregate = cluster.emulator.get_object("secrets", "default", AGGREGATE)
    assert aggregate is not None
    [owner] = aggregate["metadata"]["ownerReferences"]
    assert owner["uid"] == cluster.emulator.get_object("universalmodels", "default", NAME)["metadata"]["uid"]  # type: ignore[index]
    assert listed(cluster) == {
        "adapters": [
            {"name": "support", "uri": "s3://adapters/support", "credentials": "store-keys"},
            {"name": "public", "uri": "s3://adapters/public"},
        ]
    }
    child = await eventually(lambda: cluster.emulator.get_object(ISVC, "default", NAME))
    predictor = child["spec"]["predictor"]
    assert "--adapter-credentials-dir=/etc/universal-runtime/adapter-credentials" in predictor["containers"][0]["args"]
    assert {"name": "adapter-credentials", "secret": {"secretName": AGGREGATE}} in predictor["volumes"]
    mount = {"name": "adapter-credentials", "mountPath": "/etc/universal-runtime/adapter-credentials", "readOnly": True}
    assert mount in predictor["containers"][0]["volumeMounts"]  # whole: a subPath mount is never updated


async def test_a_rotated_secret_is_copied_within_a_repair_interval_and_an_unchanged_one_is_never_rewritten(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await kubectl_apply(cluster, s3_secret("store-keys", "AKID1"), tmp_path)
    await kubectl_apply(cluster, model([("support", "store-keys")]), tmp_path)
    await eventually(lambda: copies(cluster))

    # Unchanged over two repair intervals (1 s here): read each time, written never.
    cluster.emulator.reset_writes()
    await asyncio.sleep(2.5 * operator.config.repair_interval_seconds)
    assert cluster.emulator.write_count("secrets", "default", AGGREGATE) == 0

    # Rotated: new keys and another endpoint reach the copy without any change to the model.
    await kubectl_apply(cluster, s3_secret("store-keys", "AKID2", endpoint="https://s3.store"), tmp_path)

    def rotated() -> bool:
        copy = (copies(cluster) or {}).get("store-keys.json") or {}
        return copy.get("annotations", {}).get("serving.kserve.io/s3-endpoint") == "https://s3.store"

    await eventually(rotated, within=10)
    data = (copies(cluster) or {})["store-keys.json"]["data"]
    assert base64.b64decode(data["awsAccessKeyID"]) == b"AKID2"
    assert cluster.emulator.write_count(ISVC, "default", NAME) == 0


async def test_a_missing_secret_is_one_warning_event_and_an_adapter_naming_a_new_secret_rolls_nothing(
    cluster: ServedEmulator, operator: OperatorState, tmp_path: Path
) -> None:
    await kubectl_apply(cluster, s3_secret("store-keys", "AKID1"), tmp_path)
    manifest = model([("support", "store-keys")])
    await kubectl_apply(cluster, manifest, tmp_path)
    await eventually(lambda: copies(cluster))
    await eventually(lambda: cluster.emulator.get_object(ISVC, "default", NAME))
    cluster.emulator.reset_writes()

    # An adapter naming a Secret that does not exist (yet): one Warning naming both, the copies without it.
    manifest = model([("support", "store-keys"), ("legal", "legal-keys")])
    await kubectl_apply(cluster, manifest, tmp_path)
    [warning] = await eventually(lambda: events(cluster, "AdapterCredentialsMissing"))
    assert warning["type"] == "Warning"
    assert "'legal-keys'" in warning["message"]
    assert "legal" in warning["message"]
    await eventually(lambda: [a["name"] for a in listed(cluster)["adapters"]] == ["support", "legal"])
    await asyncio.sleep(2.5 * operator.config.repair_interval_seconds)  # repairs pass: still the one Event
    assert len(events(cluster, "AdapterCredentialsMissing")) == 1
    assert set(copies(cluster) or {}) == {"store-keys.json"}

    # The Secret created: its copy follows; the InferenceService (its pod template) was never written.
    await kubectl_apply(cluster, s3_secret("legal-keys", "AKID3"), tmp_path)
    await eventually(lambda: set(copies(cluster) or {}) == {"store-keys.json", "legal-keys.json"}, within=10)
    assert cluster.emulator.write_count(ISVC, "default", NAME) == 0
