"""A stand-in for KServe's LocalModelCache controller and its node agent: each cache's model is put on the disks of
its node groups' nodes, and its status says how far that is.

What it imitates, from KServe's source (``pkg/controller/v1alpha1`` shortened to ``controller/``; the tags named):

* The controller (``controller/localmodel/controller.go``, v0.16.0 Reconcile): it reads each of the cache's
  LocalModelNodeGroups (a missing one stops the reconcile: no status), puts the model on the LocalModelNode of every
  ready node of the groups (ReconcileLocalModelNode: ``spec.localModels`` gains ``{modelName, sourceModelUri}``), and
  writes the cache's status whole: ``nodeStatus`` per node from the node's ``modelStatus``
  (nodeStatusFromLocalModelStatus), ``copies`` {available, total, failed}, and ``inferenceServices``, the
  InferenceServices labelled with the cache (ReconcileForIsvcs).
* The node agent (``controller/localmodelnode/controller.go``): it downloads each model its node lists into the node
  group's volume, ``models/<cache name>`` (``models/<sha256(uri)[:16]>`` from v0.18.0), and reports
  ModelDownloadPending, ModelDownloading, ModelDownloaded or ModelDownloadError in ``status.modelStatus``; a model no
  longer listed is deleted from the disk (deleteModels).

Which nodes a group has is given (``nodes``: group -> node names): KServe finds them by the group's PersistentVolume
node affinity (CheckNodeAffinity), which needs real nodes. No model hub is reachable, so a "download" copies the
source's local copy (``sources``: storage URI -> a local source, as the predictor stand-in has them) into the
node's folder: real bytes on the node's disk, as the agent's storage-initializer Job would leave them. The
PersistentVolumes and claims the controller makes per namespace are not made (the emulator serves neither kind): the
predictor stand-in mounts the node folder the claim would name (:meth:`LocalModelStandin.mounted_folder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource
from lightkube.types import PatchType

from universal_predictors.config import resolve_source
from universal_simcluster import admission
from universal_simcluster.kserve import InferenceService
from universal_simcluster.kserve.standin import DEFAULT_VERSION, KServeVersion

logger = logging.getLogger(__name__)

#: KServe v0.16.0 pkg/apis/serving/v1alpha1: the three cluster-scoped kinds (spelled here, not taken from the operator).
LocalModelCache = create_global_resource("serving.kserve.io", "v1alpha1", "LocalModelCache", "localmodelcaches")
LocalModelNodeGroup = create_global_resource(
    "serving.kserve.io", "v1alpha1", "LocalModelNodeGroup", "localmodelnodegroups"
)
LocalModelNode = create_global_resource("serving.kserve.io", "v1alpha1", "LocalModelNode", "localmodelnodes")

#: v1alpha1/local_model_node_status.go ModelStatus -> local_model_cache_status.go NodeStatus
#: (controller/localmodel/controller.go nodeStatusFromLocalModelStatus; "" is NodeDownloadPending).
NODE_STATUS = {
    "ModelDownloadPending": "NodeDownloadPending",
    "ModelDownloading": "NodeDownloading",
    "ModelDownloaded": "NodeDownloaded",
    "ModelDownloadError": "NodeDownloadError",
}


def _dict(obj: Any) -> dict[str, Any]:
    return dict(obj.to_dict())


class LocalModelStandin:
    """KServe's LocalModelCache controller and node agents, for the nodes of ``nodes``."""

    def __init__(
        self,
        client: AsyncClient,
        workdir: Path,
        *,
        nodes: Mapping[str, Sequence[str]],
        sources: Mapping[str, str] | None = None,
        version: KServeVersion = DEFAULT_VERSION,
        poll: float = 0.1,
    ) -> None:
        self.client = client
        self.root = workdir / "nodes"
        self.nodes = {group: list(names) for group, names in nodes.items()}
        self.sources = dict(sources or {})
        self.version = version
        self.poll = poll
        #: (node, cache) -> the agent's ModelStatus for it.
        self.model_status: dict[tuple[str, str], str] = {}
        #: Every download the agents made, as (node, cache): a test counts them.
        self.downloads: list[tuple[str, str]] = []
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._folders: dict[tuple[str, str], Path] = {}

    # -- where the files are ---------------------------------------------------------------------------

    def node_folder(self, node: str) -> Path:
        """The node's local-model volume (the agent's /mnt/models)."""
        return self.root / node

    def model_folder(self, node: str, cache: Mapping[str, Any]) -> Path:
        return self.node_folder(node) / admission.cached_folder(dict(cache), self.version.release)

    def mounted_folder(self, isvc: Mapping[str, Any]) -> Path | None:
        """The folder KServe's pod webhook mounts at /mnt/models for a labelled InferenceService: the claim
        ``<cache>-<group>`` at ``models/<cache or storage key><subpath>`` (v0.16.0
        pkg/webhook/admission/pod/storage_initializer_injector.go InjectStorageInitializer), on the first node of the
        group (where the pod is scheduled: the claim's volume is pinned to the group's nodes)."""
        meta = isvc.get("metadata") or {}
        name = (meta.get("labels") or {}).get(admission.LOCAL_MODEL_LABEL)
        annotations = meta.get("annotations") or {}
        claim = annotations.get(admission.LOCAL_MODEL_PVC_ANNOTATION)
        source = str(annotations.get(admission.LOCAL_MODEL_SOURCE_ANNOTATION) or "")
        if not name or not claim or not claim.startswith(f"{name}-"):
            return None
        nodes = self.nodes.get(claim[len(name) + 1 :]) or []
        if not nodes:
            return None
        uri = admission.custom_storage_uri(dict(isvc)) or ""
        sub_path = uri[len(source) :].strip("/")
        folder = self.model_folder(nodes[0], {"metadata": {"name": name}, "spec": {"sourceModelUri": source}})
        return folder / sub_path if sub_path else folder

    # -- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile every cache each ``poll`` seconds (KServe's controllers react to watch events; polling the
        emulator gives the same states, a little later)."""
        while True:
            try:
                await self.reconcile_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server went away for a moment: as a controller, try again
                logger.debug("LocalModelCache stand-in: %s", exc)
            await asyncio.sleep(self.poll)

    async def reconcile_all(self) -> None:
        caches = [_dict(c) async for c in self.client.list(LocalModelCache)]
        groups = {str(_dict(g)["metadata"]["name"]) async for g in self.client.list(LocalModelNodeGroup)}
        isvcs = [_dict(i) async for i in self.client.list(InferenceService, namespace="*")]
        wanted: dict[str, set[str]] = {}  # node -> caches it holds
        for cache in caches:
            for node in await self._reconcile(cache, groups, isvcs):
                wanted.setdefault(node, set()).add(cache["metadata"]["name"])
        # The agent deletes a model its node no longer lists (a deleted cache: deleteModelFromNodes).
        for (node, name), folder in list(self._folders.items()):
            if name not in wanted.get(node, set()):
                task = self._tasks.pop((node, name), None)
                if task is not None:
                    task.cancel()
                await asyncio.to_thread(shutil.rmtree, folder, True)
                self._folders.pop((node, name), None)
                self.model_status.pop((node, name), None)
        await self._write_nodes(caches, wanted)

    async def _reconcile(self, cache: dict[str, Any], groups: set[str], isvcs: list[dict[str, Any]]) -> list[str]:
        name = cache["metadata"]["name"]
        spec = cache.get("spec") or {}
        if any(group not in groups for group in spec.get("nodeGroups") or []):
            return []  # Reconcile: c.Get of a node group fails, so the cache is left as it is
        nodes = [node for group in spec["nodeGroups"] for node in self.nodes.get(group, [])]
        node_status: dict[str, str] = {}
        for node in dict.fromkeys(nodes):
            key = (node, name)
            if key not in self._tasks:
                self.model_status[key] = "ModelDownloadPending"
                self._folders[key] = self.model_folder(node, cache)
                self._tasks[key] = asyncio.create_task(self._download(node, cache))
            node_status[node] = NODE_STATUS[self.model_status[key]]
        status: dict[str, Any] = {
            "nodeStatus": node_status,
            "copies": {
                "available": sum(1 for s in node_status.values() if s == "NodeDownloaded"),
                "total": len(node_status),
                "failed": sum(1 for s in node_status.values() if s == "NodeDownloadError"),
            },
            "inferenceServices": [
                {"namespace": i["metadata"]["namespace"], "name": i["metadata"]["name"]}
                for i in isvcs
                if (i["metadata"].get("labels") or {}).get(admission.LOCAL_MODEL_LABEL) == name
            ],
        }
        # Go's omitempty: zero counts and empty lists are not written.
        copies: dict[str, int] = status["copies"]
        status["copies"] = {k: v for k, v in copies.items() if v} or None
        status = {k: v for k, v in status.items() if v}
        if (cache.get("status") or {}) != status:
            with contextlib.suppress(ApiError):  # gone meanwhile
                await self.client.patch(  # the whole status, as Status().Update writes it
                    LocalModelCache.Status,
                    name,
                    [{"op": "add", "path": "/status", "value": status}],
                    patch_type=PatchType.JSON,
                )
        return list(node_status)

    async def _download(self, node: str, cache: dict[str, Any]) -> None:
        """The node agent's download Job: the source's files into the node's folder, then ModelDownloaded (or
        ModelDownloadError: the Job failed)."""
        name = cache["metadata"]["name"]
        uri = str(cache["spec"]["sourceModelUri"])
        key = (node, name)
        self.model_status[key] = "ModelDownloading"
        source = self.sources.get(uri.rstrip("/"))
        target = self.model_folder(node, cache)
        try:
            if source is None:
                raise FileNotFoundError(f"cannot fetch {uri}: no model hub is reachable")
            path = Path(resolve_source(source))
            await asyncio.to_thread(shutil.copytree, path, target, dirs_exist_ok=True)
        except (OSError, FileNotFoundError) as exc:
            logger.info("LocalModelCache stand-in: download of %s to %s failed: %s", uri, node, exc)
            self.model_status[key] = "ModelDownloadError"
            return
        self.downloads.append(key)
        self.model_status[key] = "ModelDownloaded"

    async def _write_nodes(self, caches: list[dict[str, Any]], wanted: dict[str, set[str]]) -> None:
        """The LocalModelNode of each node: the models it holds and their state (UpdateLocalModelNode, the agent's
        status update)."""
        by_name = {c["metadata"]["name"]: c for c in caches}
        for node, names in wanted.items():
            body = {
                "apiVersion": "serving.kserve.io/v1alpha1",
                "kind": "LocalModelNode",
                "metadata": {"name": node},
                "spec": {
                    "localModels": [
                        {"modelName": n, "sourceModelUri": by_name[n]["spec"]["sourceModelUri"]} for n in sorted(names)
                    ]
                },
            }
            status = {"modelStatus": {n: self.model_status[(node, n)] for n in sorted(names)}}
            with contextlib.suppress(ApiError):
                stored = await self.client.apply(
                    LocalModelNode.from_dict(body), field_manager="kserve-localmodel", force=True
                )
                if (_dict(stored).get("status") or {}) != status:
                    await self.client.patch(
                        LocalModelNode.Status,
                        node,
                        [{"op": "add", "path": "/status", "value": status}],
                        patch_type=PatchType.JSON,
                    )

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def local_model_standin(client: AsyncClient, workdir: Path, **options: Any) -> AsyncIterator[LocalModelStandin]:
    """Run a :class:`LocalModelStandin` for the block."""
    standin = LocalModelStandin(client, workdir, **options)
    task = asyncio.create_task(standin.run(), name="kserve-localmodel")
    try:
        yield standin
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await standin.close()
