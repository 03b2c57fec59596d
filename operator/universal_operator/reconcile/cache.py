"""The model cache: a KServe ``LocalModelCache`` for the model's source, so a wake mounts the weights from the node's
disk instead of downloading them again.

KServe does the caching; the operator only asks for it and reports on it. What KServe does, read from its source
(``pkg/apis/serving/v1alpha1`` shortened to ``v1alpha1/``) at the tags named:

* A ``LocalModelCache`` (cluster-scoped, ``serving.kserve.io/v1alpha1``) names a ``sourceModelUri`` (immutable, CEL
  ``self == oldSelf``), a ``modelSize`` and the ``nodeGroups`` (``LocalModelNodeGroup`` names, at least one) to keep
  a copy on (v0.14.1-v0.20.0 ``v1alpha1/local_model_cache_types.go``). Its controller puts the model on each ready
  node's ``LocalModelNode``; the node agent downloads it with the storage initializer into the node group's volume
  under ``models/<cache name>`` (``models/<sha256(uri)[:16]>`` from v0.18.0); the status counts the nodes
  (``copies.available/total/failed``, ``nodeStatus``) and lists the InferenceServices using it
  (``pkg/controller/v1alpha1/localmodel/controller.go``, ``localmodelnode/controller.go``).
* KServe's validating webhook refuses a second cache with the same ``sourceModelUri`` and the deletion of a cache
  an InferenceService still uses (``pkg/webhook/admission/localmodelcache/local_model_cache_validation.go``). So
  models with one source share one cache, named here from the URI, and the operator deletes it only when no
  model uses it any more.
* When ``localModel.enabled`` is true in ``inferenceservice-config`` and the InferenceService has no
  ``serving.kserve.io/disable-localmodel`` annotation, the defaulting webhook matches the predictor's storage URI
  (a custom container's ``STORAGE_URI`` env) against every cache, by prefix, and labels the InferenceService
  ``internal.serving.kserve.io/localmodel: <cache>`` with the annotations ``.../localmodel-sourceuri`` and
  ``.../localmodel-pvc-name: <cache>-<node group>``; the node group is the InferenceService's
  ``serving.kserve.io/nodegroup`` annotation when the cache lists it (v0.15.0+), else the cache's first
  (``v1beta1/inference_service_defaults.go`` setLocalModelLabel). The pod webhook then mounts that claim at
  /mnt/models instead of running the storage initializer
  (``pkg/webhook/admission/pod/storage_initializer_injector.go`` InjectStorageInitializer).

The mount is there whether or not the node holds the files yet, so the operator renders the
``disable-localmodel`` annotation until every node of the cache reports the model downloaded: until then a wake
downloads as before, and the status says how far the cache is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from universal_operator import kserve
from universal_operator.reconcile.drift import quantity_value
from universal_operator.reconcile.labels import LABEL_MANAGED_BY, MANAGED_BY
from universal_operator.spec import SCHEMES_CACHED, UniversalModel

GROUP, VERSION, KIND, PLURAL = kserve.GROUP, kserve.CACHE_VERSION, kserve.CACHE_KIND, kserve.CACHE_PLURAL
API_VERSION = f"{GROUP}/{VERSION}"
LOCAL_MODEL_LABEL = kserve.LOCAL_MODEL_LABEL
NODE_GROUP_ANNOTATION = kserve.NODE_GROUP_ANNOTATION
DISABLE_ANNOTATION = kserve.DISABLE_LOCAL_MODEL_ANNOTATION
#: The source a cache was made for, on the cache (the name is a hash of it).
ANNOTATION_SOURCE = "serving.universal-runtime.dev/source"
#: v1alpha1/local_model_cache_status.go, NodeStatus values.
NODE_DOWNLOADED, NODE_DOWNLOAD_ERROR = "NodeDownloaded", "NodeDownloadError"

CONDITION = "Cached"


def cache_name(storage_uri: str) -> str:
    """The cache of a source: one per URI (KServe refuses two), short enough for the names KServe derives from it
    (the claim ``<cache>-<node group>``, the download Job ``<cache>-<node>``)."""
    return "um-" + hashlib.sha256(storage_uri.encode()).hexdigest()[:12]


def cached_uri(model: UniversalModel) -> str | None:
    """The storage URI a cache would hold for ``model``, or None when the model asks for none."""
    if model.spec.cache is None or model.spec.source.scheme not in SCHEMES_CACHED:
        return None
    return model.spec.source.storage_uri


def _bytes(size: str) -> Decimal:
    return quantity_value(size) or Decimal(0)


def covers(source: str, storage_uri: str) -> bool:
    """Whether a cache of ``source`` serves ``storage_uri``: the same URI or a path below it, as KServe's webhook
    matches them (v0.16.0 pkg/apis/serving/v1alpha1/local_model_cache_types.go MatchStorageURI)."""
    cached, wanted = source.rstrip("/"), storage_uri.rstrip("/")
    return bool(cached) and (wanted == cached or wanted.startswith(cached + "/"))


def desired_cache(uri: str, users: Iterable[UniversalModel]) -> dict[str, Any]:
    """The LocalModelCache for ``uri``, as the models that use it ask: every node group any of them names (in the
    order the models, sorted by namespace and name, give them), and the largest size any of them gives."""
    ordered = sorted(users, key=lambda m: (m.metadata.namespace, m.metadata.name))
    groups: list[str] = []
    sizes: list[str] = []
    for model in ordered:
        assert model.spec.cache is not None
        groups += [g for g in model.spec.cache.node_groups if g not in groups]
        sizes.append(model.spec.cache.model_size)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": cache_name(uri),
            "labels": {LABEL_MANAGED_BY: MANAGED_BY},
            "annotations": {ANNOTATION_SOURCE: uri},
        },
        "spec": {
            "sourceModelUri": uri,
            "modelSize": max(sizes, key=lambda q: quantity_value(q) or 0),
            "nodeGroups": groups,
        },
    }


def managed(cache: Mapping[str, Any]) -> bool:
    return ((cache.get("metadata") or {}).get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY


@dataclass(frozen=True)
class CacheState:
    """How far a model's cache is, as the status reports it and the render needs it."""

    name: str | None
    #: Whether every node the cache counts holds the model (then the InferenceService may mount it).
    ready: bool
    reason: str
    message: str
    downloaded: int = 0
    total: int = 0
    failed: int = 0

    def status(self, isvc: Mapping[str, Any] | None) -> dict[str, Any]:
        """``status.cache``: the cache, its node counts and whether the InferenceService mounts it now."""
        labels = ((isvc or {}).get("metadata") or {}).get("labels") or {}
        return {
            "name": self.name,
            "nodesDownloaded": self.downloaded,
            "nodesTotal": self.total,
            "nodesFailed": self.failed,
            "mounted": bool(self.name) and labels.get(LOCAL_MODEL_LABEL) == self.name,
        }

    def condition(self, isvc: Mapping[str, Any] | None) -> tuple[str, str, str, str]:
        """The Cached condition. Downloaded but not mounted is KServe not labelling the InferenceService: its
        localModel switch is off though the operator was told it is on."""
        if not self.ready:
            return (CONDITION, "False", self.reason, self.message)
        if isvc is not None and not self.status(isvc)["mounted"]:
            annotations = (isvc.get("metadata") or {}).get("annotations") or {}
            if DISABLE_ANNOTATION in annotations:
                return (CONDITION, "False", "Downloaded", f"{self.message} The next rollout mounts it.")
            return (
                CONDITION, "False", "NotMounted",
                f"{self.message} But KServe did not mount it: the InferenceService has no {LOCAL_MODEL_LABEL} label, "
                "so each wake still downloads. KServe labels it only with localModel.enabled true in its "
                "inferenceservice-config ConfigMap; enable it there, or set the operator's kserve.localModelCache "
                "to false.",
            )  # fmt: skip
        return (CONDITION, "True", "Mounted", f"{self.message} Wakes mount it instead of downloading.")


def not_enabled(model: UniversalModel) -> CacheState:
    return CacheState(
        name=None,
        ready=False,
        reason="NotEnabled",
        message=(
            "spec.cache asks for a node-local copy, but this operator has kserve.localModelCache off: KServe's "
            "LocalModelCache is not enabled in this cluster, so each wake downloads the model. A platform engineer "
            "enables KServe's localModel (inferenceservice-config) and the chart value kserve.localModelCache."
        ),
    )


def unavailable(name: str, why: str) -> CacheState:
    return CacheState(name=name, ready=False, reason="Unavailable", message=f"{why} Each wake downloads the model.")


def cache_state(cache: Mapping[str, Any]) -> CacheState:
    """What a LocalModelCache's status says (``copies`` and ``nodeStatus``, written by KServe's controller)."""
    name = str((cache.get("metadata") or {}).get("name"))
    status = cache.get("status") or {}
    nodes: dict[str, str] = status.get("nodeStatus") or {}
    copies = status.get("copies") or {}
    total = int(copies.get("total") or len(nodes))
    downloaded = int(copies.get("available") or sum(1 for s in nodes.values() if s == NODE_DOWNLOADED))
    failed = int(copies.get("failed") or sum(1 for s in nodes.values() if s == NODE_DOWNLOAD_ERROR))
    counts = {"downloaded": downloaded, "total": total, "failed": failed}
    groups = ", ".join((cache.get("spec") or {}).get("nodeGroups") or [])
    if total == 0:
        return CacheState(
            name, False, "Pending",
            f"LocalModelCache {name} has no node yet (node groups {groups}): KServe's LocalModelCache controller has "
            "not reported on it; is it running, and do the node groups' nodes exist and are they ready?",
            **counts,
        )  # fmt: skip
    if failed:
        broken = sorted(node for node, s in nodes.items() if s == NODE_DOWNLOAD_ERROR)
        return CacheState(
            name, False, "DownloadFailed",
            f"LocalModelCache {name}: the download failed on {failed} of {total} nodes ({', '.join(broken)}); "
            "KServe's node agent retries it (its Job's logs in KServe's localModel jobNamespace say why). "
            "Each wake downloads meanwhile.",
            **counts,
        )  # fmt: skip
    if downloaded < total:
        return CacheState(
            name, False, "Downloading",
            f"LocalModelCache {name}: on {downloaded} of {total} nodes so far; each wake downloads until every node "
            "has it.",
            **counts,
        )  # fmt: skip
    return CacheState(name, True, "Downloaded", f"LocalModelCache {name} holds the model on all {total} nodes.",
                      **counts)  # fmt: skip


def users_of(uri: str, models: Iterable[UniversalModel]) -> list[UniversalModel]:
    """The models (not being deleted) whose cache is ``uri``'s."""
    return [m for m in models if cached_uri(m) == uri and not m.metadata.deleting]
