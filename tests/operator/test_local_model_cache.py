"""spec.cache: the operator owns a KServe LocalModelCache for the model's source; a wake mounts the nodes' copy.

The real operator (embedded) against the API emulator, whose admission imitates KServe's LocalModelCache webhooks
(:mod:`universal_simcluster.admission`: the defaulting webhook's label, the cache's validator), with KServe's
LocalModelCache controller and node agent played by :mod:`universal_simcluster.kserve.localmodel` and, where a model
must really serve, its predictor run as a real process by :mod:`universal_simcluster.kserve.processes`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lightkube import AsyncClient

from tests.clock import SteppedClock
from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually, load_manifest
from universal_operator.config import parse_config
from universal_operator.reconcile.cache import cache_name
from universal_simcluster import admission
from universal_simcluster.apiserver import ServedEmulator, serve_emulator
from universal_simcluster.kserve.localmodel import LocalModelStandin, local_model_standin
from universal_simcluster.kserve.processes import DEFAULT_SOURCES, ProcessKServe, kserve_processes
from universal_simcluster.kserve.standin import kserve_standin

NS = "default"
SOURCE = "hf://sentence-transformers/all-MiniLM-L6-v2"
CACHE = cache_name(SOURCE)
NODES = {"workers": ["node-a", "node-b"], "gpus": ["node-g"]}
#: A source the stand-in's "hub" cannot provide: its download fails on every node.
MISSING_SOURCE = "hf://example/not-on-the-hub"


def node_group(name: str) -> dict[str, Any]:
    """A LocalModelNodeGroup as a platform team writes it (KServe v0.16.0 local_model_node_group_types.go)."""
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "LocalModelNodeGroup",
        "metadata": {"name": name},
        "spec": {
            "storageLimit": "10Gi",
            "persistentVolumeSpec": {"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "10Gi"},
                                     "hostPath": {"path": "/models", "type": ""}},
            "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"],
                                          "resources": {"requests": {"storage": "10Gi"}}},
        },
    }  # fmt: skip


def cached_minilm(name: str, groups: list[str], *, uri: str = SOURCE, idle: str = "5m") -> dict[str, Any]:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["metadata"]["name"] = name
    manifest["spec"]["servedName"] = name
    manifest["spec"]["source"] = {"uri": uri}
    manifest["spec"]["scaling"] = {"idleTimeout": idle}
    manifest["spec"]["cache"] = {"nodeGroups": groups, "modelSize": "100Mi"}
    return manifest


@dataclass
class CacheCluster:
    served: ServedEmulator
    local_models: LocalModelStandin
    workdir: Path

    async def apply(self, manifest: dict[str, Any]) -> None:
        path = self.workdir / f"{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        result = await self.served.kubectl("apply", "--validate=false", "-f", str(path))
        assert result.returncode == 0, result.stderr

    def get(self, plural: str, name: str, namespace: str | None = NS) -> dict[str, Any] | None:
        return self.served.emulator.get_object(plural, namespace, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.get("universalmodels", name) or {}).get("status") or {}

    def condition(self, name: str, kind: str = "Cached") -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == kind), {})

    def isvc_meta(self, name: str) -> dict[str, Any]:
        return (self.get("inferenceservices", name) or {}).get("metadata") or {}


@contextlib.asynccontextmanager
async def cache_cluster(
    tmp_path: Path,
    crd: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    *,
    operator: dict[str, Any] | None = None,
    kserve_enabled: bool = True,
    crds_served: bool = True,
    kserve: str = "status",
    clock: SteppedClock | None = None,
) -> AsyncIterator[tuple[CacheCluster, ProcessKServe | None]]:
    """Emulator + KServe's LocalModelCache stand-in + the operator (kserve.localModelCache on unless ``operator``
    says); ``kserve``: "status" (statuses only) or "processes" (real predictor processes)."""
    config = parse_config({**TEST_OPERATOR_CONFIG, "kserve": {"localModelCache": True}, **(operator or {})})
    cluster = admission.Cluster(local_model_enabled=kserve_enabled)
    async with serve_emulator(tmp_path, crds=[crd], admission=cluster, local_model_caches=crds_served) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))
        client = AsyncClient()
        try:
            async with local_model_standin(client, tmp_path / "kserve", nodes=NODES, sources=DEFAULT_SOURCES) as lm:
                handle = CacheCluster(served, lm, tmp_path)
                if crds_served:
                    for group in NODES:
                        await handle.apply(node_group(group))
                if kserve == "processes":
                    async with (
                        kserve_processes(
                            client, tmp_path / "kserve", local_models=lm,
                            clock=(clock or SteppedClock()).monotonic, grace_period=5,
                        ) as processes,
                        embedded_operator(config),
                    ):  # fmt: skip
                        yield handle, processes
                else:
                    async with kserve_standin(client), embedded_operator(config):
                        yield handle, None
        finally:
            await client.close()


async def test_a_cached_model_is_downloaded_to_its_nodes_once_and_each_wake_mounts_it_without_a_download(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppedClock()
    async with cache_cluster(tmp_path, crd, monkeypatch, kserve="processes", clock=clock) as (cluster, kserve):
        assert kserve is not None
        await cluster.apply(cached_minilm("minilm", ["workers"], idle="30s"))

        # The operator's cache: named from the source, on the model's node groups; KServe's agents put it on both
        # nodes of the group, as real files (not links into the "hub").
        cache = await eventually(lambda: cluster.get("localmodelcaches", CACHE, None))
        assert cache["spec"] == {"sourceModelUri": SOURCE, "modelSize": "100Mi", "nodeGroups": ["workers"]}
        await eventually(lambda: cluster.status("minilm").get("cache", {}).get("mounted"), within=60)
        assert cluster.status("minilm")["cache"] == {
            "name": CACHE, "nodesDownloaded": 2, "nodesTotal": 2, "nodesFailed": 0, "mounted": True,
        }  # fmt: skip
        assert cluster.condition("minilm")["status"] == "True"
        assert cluster.condition("minilm")["reason"] == "Mounted"
        for node in NODES["workers"]:
            weights = tmp_path / "kserve" / "nodes" / node / "models" / CACHE / "model.safetensors"
            assert weights.is_file()
            assert not weights.is_symlink()
        assert sorted(cluster.local_models.downloads) == [("node-a", CACHE), ("node-b", CACHE)]

        # KServe's webhook labelled the InferenceService: the claim of the model's node group; the opt-out the
        # operator rendered while the nodes downloaded is gone.
        meta = cluster.isvc_meta("minilm")
        assert meta["labels"][admission.LOCAL_MODEL_LABEL] == CACHE
        assert meta["annotations"][admission.LOCAL_MODEL_PVC_ANNOTATION] == f"{CACHE}-workers"
        assert meta["annotations"][admission.NODE_GROUP_ANNOTATION] == "workers"
        assert admission.DISABLE_LOCAL_MODEL_ANNOTATION not in meta["annotations"]

        # Serving, idle past the window (the stand-in's clock), woken by a request: the new process reads
        # /mnt/models from the node's copy, and no storage initializer ran for the wake.
        await eventually(lambda: cluster.status("minilm").get("phase") == "Ready", within=120)
        workload = kserve.workload(NS, "minilm")
        assert workload is not None
        downloads_before = kserve.initializer_runs.count((NS, "minilm"))
        clock.advance(31)
        await eventually(lambda: kserve.pid(NS, "minilm") is None, within=60)
        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(
                f"{workload.address}/openai/v1/embeddings", json={"model": "minilm", "input": ["a cat on a mat"]}
            )
        assert response.status_code == 200, response.text
        assert len(response.json()["data"][0]["embedding"]) == 384
        pid = kserve.pid(NS, "minilm")
        assert pid is not None
        argv = (await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_text)).split("\0")
        assert any(str(tmp_path / "kserve" / "nodes" / "node-a" / "models" / CACHE) in arg for arg in argv), argv
        assert kserve.initializer_runs.count((NS, "minilm")) == downloads_before
        assert sorted(cluster.local_models.downloads) == [("node-a", CACHE), ("node-b", CACHE)]


async def test_models_with_one_source_share_one_cache_which_goes_when_the_last_of_them_does(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cache_cluster(tmp_path, crd, monkeypatch) as (cluster, _):
        await cluster.apply(cached_minilm("first", ["workers"]))
        await cluster.apply(cached_minilm("second", ["gpus", "workers"]))

        # One cache (KServe refuses a second with the same URI), on every group either model names.
        def both_groups() -> bool:
            cache = cluster.get("localmodelcaches", CACHE, None) or {}
            return (cache.get("spec") or {}).get("nodeGroups") == ["workers", "gpus"]

        await eventually(both_groups)
        assert [c["metadata"]["name"] for c in cluster.served.emulator.list_objects("localmodelcaches")] == [CACHE]
        await eventually(lambda: cluster.status("second").get("cache", {}).get("nodesDownloaded") == 3, within=30)
        await eventually(lambda: cluster.isvc_meta("second").get("labels", {}).get(admission.LOCAL_MODEL_LABEL))
        # Each InferenceService mounts the claim of its own first node group.
        assert cluster.isvc_meta("first")["annotations"][admission.LOCAL_MODEL_PVC_ANNOTATION] == f"{CACHE}-workers"
        assert cluster.isvc_meta("second")["annotations"][admission.LOCAL_MODEL_PVC_ANNOTATION] == f"{CACHE}-gpus"

        # KServe's validator refuses deleting a cache an InferenceService uses (its controller lists them).
        def users() -> list[str]:
            cache = cluster.get("localmodelcaches", CACHE, None) or {}
            return sorted(i["name"] for i in (cache.get("status") or {}).get("inferenceServices") or [])

        await eventually(lambda: users() == ["first", "second"])
        refused = await cluster.served.kubectl("delete", "localmodelcaches", CACHE)
        assert refused.returncode != 0
        assert "is being used by InferenceService" in refused.stderr

        # One model gone: the cache stays for the other. Both gone: the operator deletes it once KServe lets it.
        assert (await cluster.served.kubectl("delete", "universalmodels", "first")).returncode == 0
        await eventually(lambda: cluster.get("inferenceservices", "first") is None)
        assert cluster.get("localmodelcaches", CACHE, None) is not None
        assert (await cluster.served.kubectl("delete", "universalmodels", "second")).returncode == 0
        await eventually(lambda: cluster.get("localmodelcaches", CACHE, None) is None, within=30)
        # The node agents removed the copies (deleteModels).
        await eventually(lambda: not (tmp_path / "kserve" / "nodes" / "node-g" / "models" / CACHE).exists())


async def test_a_failed_download_keeps_the_model_downloading_on_each_wake_and_says_which_nodes_failed(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cache_cluster(tmp_path, crd, monkeypatch) as (cluster, _):
        await cluster.apply(cached_minilm("missing", ["workers"], uri=MISSING_SOURCE))
        await eventually(lambda: cluster.condition("missing").get("reason") == "DownloadFailed", within=30)
        message = cluster.condition("missing")["message"]
        assert "failed on 2 of 2 nodes (node-a, node-b)" in message
        assert cluster.status("missing")["cache"]["nodesFailed"] == 2
        # Not mounted: the opt-out stays, so KServe's storage initializer still runs for each pod.
        meta = cluster.isvc_meta("missing")
        assert meta["annotations"][admission.DISABLE_LOCAL_MODEL_ANNOTATION] == "true"
        assert admission.LOCAL_MODEL_LABEL not in meta.get("labels", {})


async def test_without_kserves_local_model_cache_the_model_serves_and_its_condition_says_why_it_is_not_cached(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator told the feature is off: no cache is made, the model serves, Cached says what to do.
    async with cache_cluster(tmp_path, crd, monkeypatch, operator={"kserve": {}}) as (cluster, _):
        await cluster.apply(cached_minilm("plain", ["workers"]))
        await eventually(lambda: cluster.condition("plain").get("reason") == "NotEnabled")
        assert "kserve.localModelCache" in cluster.condition("plain")["message"]
        await eventually(lambda: cluster.status("plain").get("phase") == "Ready")
        assert cluster.served.emulator.list_objects("localmodelcaches") == []


async def test_a_cluster_without_the_local_model_cache_crd_gets_a_condition_naming_it(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cache_cluster(tmp_path, crd, monkeypatch, crds_served=False) as (cluster, _):
        await cluster.apply(cached_minilm("nocrd", ["workers"]))
        await eventually(lambda: cluster.condition("nocrd").get("reason") == "Unavailable")
        assert "localmodelcaches" in cluster.condition("nocrd")["message"]
        await eventually(lambda: cluster.status("nocrd").get("phase") == "Ready")


async def test_a_cache_kserve_does_not_mount_is_reported_not_mounted(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator is told the feature is on, but KServe's localModel.enabled is false: downloaded, never mounted.
    async with cache_cluster(tmp_path, crd, monkeypatch, kserve_enabled=False) as (cluster, _):
        await cluster.apply(cached_minilm("unmounted", ["workers"]))
        await eventually(lambda: cluster.condition("unmounted").get("reason") == "NotMounted", within=30)
        assert "localModel.enabled" in cluster.condition("unmounted")["message"]
        assert cluster.status("unmounted")["cache"]["mounted"] is False


def test_a_shared_cache_takes_every_group_and_the_largest_size_and_covers_paths_below_its_source() -> None:
    from tests.factories import model
    from universal_operator.reconcile.cache import covers, desired_cache

    def cached(name: str, groups: str, size: str) -> Any:
        return model(f"""
        metadata: {{name: {name}, namespace: ml}}
        spec: {{task: embed, source: {{uri: "{SOURCE}"}}, cache: {{nodeGroups: {groups}, modelSize: {size}}}}}
        """)

    spec = desired_cache(SOURCE, [cached("b", "[gpus]", "900Mi"), cached("a", "[workers, gpus]", "1Gi")])["spec"]
    assert spec == {"sourceModelUri": SOURCE, "modelSize": "1Gi", "nodeGroups": ["workers", "gpus"]}
    assert covers(SOURCE, SOURCE + "/")
    assert covers(SOURCE + "/", SOURCE + "/onnx")
    assert not covers(SOURCE, SOURCE + "-v2")
    assert not covers("", SOURCE)
