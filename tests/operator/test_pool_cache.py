"""A pool's spec.cache: the operator keeps a KServe LocalModelCache of the folder holding its members' sources, by the
single model's machinery, and switches the pool's InferenceService to mount it once every node holds the copy.

The real operator (embedded) against the API emulator with KServe's LocalModelCache webhooks imitated
(:mod:`universal_simcluster.admission`) and its controller and node agent played by
:mod:`universal_simcluster.kserve.localmodel`, as in tests/operator/test_local_model_cache.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient

from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually
from tests.operator.test_local_model_cache import NODES, CacheCluster, cached_minilm, node_group
from universal_operator.config import parse_config
from universal_operator.crd import pool_custom_resource_definition
from universal_operator.reconcile.cache import CacheState, cache_name
from universal_operator.reconcile.pools import desired_pool_inference_service
from universal_operator.spec import SpecError, parse_pool
from universal_simcluster import admission
from universal_simcluster.apiserver import serve_emulator
from universal_simcluster.kserve.localmodel import local_model_standin
from universal_simcluster.kserve.processes import DEFAULT_SOURCES
from universal_simcluster.kserve.standin import kserve_standin

pytestmark = pytest.mark.operator

NS = "default"
#: The folder the pool's members come from (here the MiniLM source the stand-in's "hub" holds).
SOURCE = "hf://sentence-transformers/all-MiniLM-L6-v2"
CACHE = cache_name(SOURCE)
MISSING = "hf://example/not-on-the-hub"
CONFIG = parse_config({**TEST_OPERATOR_CONFIG, "kserve": {"localModelCache": True}})


def pool(uri: str = SOURCE, **cache: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModelPool",
        "metadata": {"name": "small", "namespace": NS, "uid": "u-1"},
        "spec": {
            "resources": {"cpu": "2", "memory": "4Gi"},
            "cache": {"sourceUri": uri, "nodeGroups": ["workers"], "modelSize": "100Mi", **cache},
        },
    }


def pool_status(cluster: CacheCluster) -> dict[str, Any]:
    return (cluster.get("universalmodelpools", "small") or {}).get("status") or {}


def cached_condition(cluster: CacheCluster) -> dict[str, Any]:
    return next((c for c in pool_status(cluster).get("conditions") or [] if c["type"] == "Cached"), {})


def container(cluster: CacheCluster) -> dict[str, Any]:
    isvc = cluster.get("inferenceservices", "small-pool") or {}
    return isvc["spec"]["predictor"]["containers"][0] if isvc else {}


def storage_uri(cluster: CacheCluster) -> str | None:
    return next((e["value"] for e in container(cluster).get("env") or [] if e["name"] == "STORAGE_URI"), None)


@contextlib.asynccontextmanager
async def pool_cache_cluster(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[CacheCluster]:
    """Emulator (both CRDs) + KServe's LocalModelCache stand-in + KServe's status stand-in + the operator."""
    crds = [crd, pool_custom_resource_definition()]
    async with serve_emulator(tmp_path, crds=crds, admission=admission.Cluster(local_model_enabled=True)) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))
        client = AsyncClient()
        try:
            async with local_model_standin(client, tmp_path / "kserve", nodes=NODES, sources=DEFAULT_SOURCES) as lm:
                handle = CacheCluster(served, lm, tmp_path)
                for group in NODES:
                    await handle.apply(node_group(group))
                async with kserve_standin(client), embedded_operator(CONFIG):
                    yield handle
        finally:
            await client.close()


async def test_a_pool_cache_is_made_mounted_once_downloaded_and_kept_while_a_model_still_uses_it(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool_cache_cluster(tmp_path, crd, monkeypatch) as cluster:
        await cluster.apply(pool())
        cache = await eventually(lambda: cluster.get("localmodelcaches", CACHE, None))
        assert cache["spec"] == {"sourceModelUri": SOURCE, "modelSize": "100Mi", "nodeGroups": ["workers"]}

        # Every node holds it: the pool's container names the folder (KServe mounts the claim at /mnt/models for
        # it) and the supervisor loads members under it from there.
        await eventually(lambda: storage_uri(cluster) == SOURCE, within=60)
        assert f"--cached-prefix={SOURCE}=/mnt/models" in container(cluster)["args"]
        meta = cluster.isvc_meta("small-pool")
        assert admission.DISABLE_LOCAL_MODEL_ANNOTATION not in meta["annotations"]
        assert meta["annotations"][admission.NODE_GROUP_ANNOTATION] == "workers"
        await eventually(lambda: meta_label(cluster) == CACHE)
        await eventually(lambda: pool_status(cluster).get("cache", {}).get("mounted"), within=30)
        assert pool_status(cluster)["cache"] == {
            "name": CACHE, "nodesDownloaded": 2, "nodesTotal": 2, "nodesFailed": 0, "mounted": True,
        }  # fmt: skip
        assert cached_condition(cluster)["status"] == "True"

        # A single model with the same source shares the cache; the pool gone, the cache stays for it.
        await cluster.apply(cached_minilm("single", ["workers"]))
        await eventually(lambda: (cluster.get("inferenceservices", "single") or {}).get("metadata"))
        assert [c["metadata"]["name"] for c in cluster.served.emulator.list_objects("localmodelcaches")] == [CACHE]
        assert (await cluster.served.kubectl("delete", "universalmodelpools", "small")).returncode == 0
        await eventually(lambda: cluster.get("universalmodelpools", "small") is None)
        assert cluster.get("localmodelcaches", CACHE, None) is not None
        # The model gone too: nothing uses the source any more, and the operator deletes the cache.
        assert (await cluster.served.kubectl("delete", "universalmodels", "single")).returncode == 0
        await eventually(lambda: cluster.get("localmodelcaches", CACHE, None) is None, within=30)


def meta_label(cluster: CacheCluster) -> str | None:
    return (cluster.isvc_meta("small-pool").get("labels") or {}).get(admission.LOCAL_MODEL_LABEL)


async def test_a_pool_whose_cache_is_not_on_every_node_downloads_as_before_and_its_cache_goes_with_it(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool_cache_cluster(tmp_path, crd, monkeypatch) as cluster:
        await cluster.apply(pool(MISSING))
        name = cache_name(MISSING)
        await eventually(lambda: cluster.get("localmodelcaches", name, None))
        await eventually(lambda: cached_condition(cluster).get("reason") == "DownloadFailed", within=30)
        # Not on the nodes: no STORAGE_URI (KServe would run the initializer on the whole folder), the opt-out,
        # members download into the pool's cache volume as without spec.cache.
        assert storage_uri(cluster) is None
        assert not any(a.startswith("--cached-prefix") for a in container(cluster)["args"])
        meta = cluster.isvc_meta("small-pool")
        assert meta["annotations"][admission.DISABLE_LOCAL_MODEL_ANNOTATION] == "true"
        assert admission.NODE_GROUP_ANNOTATION not in meta["annotations"]
        assert pool_status(cluster)["cache"]["nodesFailed"] == 2

        # The pool is the only user: deleted with it, by hand (a namespaced pool cannot own it).
        assert (await cluster.served.kubectl("delete", "universalmodelpools", "small")).returncode == 0
        await eventually(lambda: cluster.get("localmodelcaches", name, None) is None, within=30)


async def test_an_invalid_pool_cache_is_refused_naming_the_field(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool_cache_cluster(tmp_path, crd, monkeypatch) as cluster:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(pool("pvc://claim/models")))
        refused = await cluster.served.kubectl("apply", "--validate=false", "-f", str(path))
        assert refused.returncode != 0
        assert "spec.cache.sourceUri" in refused.stderr, refused.stderr
        assert "s3://" in refused.stderr


def test_pool_cache_validation_and_rendering_before_and_after_the_nodes_hold_it() -> None:
    with pytest.raises(SpecError) as error:
        parse_pool(pool("/models/pool-a"))
    assert error.value.field == "spec.cache.sourceUri"
    assert "s3://" in str(error.value)
    with pytest.raises(SpecError) as error:
        parse_pool(pool(nodeGroups=[]))
    assert error.value.field == "spec.cache.nodeGroups"

    parsed = parse_pool(pool())
    downloading = CacheState(CACHE, False, "Downloading", "on 1 of 2 nodes", 1, 2)
    before = desired_pool_inference_service(parsed, CONFIG, cache=downloading)
    env = {e["name"] for e in before["spec"]["predictor"]["containers"][0]["env"]}
    assert "STORAGE_URI" not in env
    assert before["metadata"]["annotations"][admission.DISABLE_LOCAL_MODEL_ANNOTATION] == "true"
    ready = CacheState(CACHE, True, "Downloaded", "on all 2 nodes", 2, 2)
    after = desired_pool_inference_service(parsed, CONFIG, cache=ready)
    main = after["spec"]["predictor"]["containers"][0]
    assert {"name": "STORAGE_URI", "value": SOURCE} in main["env"]
    assert main["args"][-1] == f"--cached-prefix={SOURCE}=/mnt/models"
    assert all(m["mountPath"] != "/mnt/models" for m in main["volumeMounts"])
    assert admission.DISABLE_LOCAL_MODEL_ANNOTATION not in after["metadata"]["annotations"]

    # Mounted already, a node joining the group (not every node holds it) does not switch the pool back: that would
    # roll it twice.
    after["metadata"]["labels"][admission.LOCAL_MODEL_LABEL] = CACHE
    joined = CacheState(CACHE, False, "Downloading", "on 2 of 3 nodes", 2, 3)
    kept = desired_pool_inference_service(parsed, CONFIG, cache=joined, live=after)
    assert kept["spec"]["predictor"]["containers"][0] == main
    assert admission.DISABLE_LOCAL_MODEL_ANNOTATION not in kept["metadata"]["annotations"]

    # Without spec.cache (or before a cache exists) the pool's InferenceService is the one it was before spec.cache.
    plain = parse_pool({**pool(), "spec": {"resources": {"cpu": "2", "memory": "4Gi"}}})
    without = desired_pool_inference_service(plain, CONFIG)
    unknown = desired_pool_inference_service(parsed, CONFIG)
    assert unknown["spec"] == without["spec"]
