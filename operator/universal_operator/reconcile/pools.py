"""A UniversalModelPool: one InferenceService running the universal runtime's supervisor for many small models.

The pool's InferenceService is ``<pool>-pool``: a suffix, not the pool's bare name, because a UniversalModel's
InferenceService takes the model's name, and a pool and a model of the same name in one namespace must not claim
one InferenceService (``kubectl get isvc`` also tells pools apart at a glance). Its container runs
``universal-runtime serve <members> --memory-budget-mb N`` (gateway/universal_gateway/cli.py): the local
supervisor, which starts a member on its first request, unloads it after the member's own idleTimeout, and stops
the least recently used idle member when loading another would exceed the budget.

Members reach the running pod as the adapters do (:mod:`.adapters`): a ConfigMap, ``<pool>-pool-members``, one key
per member (``<member>.yaml``, its UniversalModel manifest), mounted whole as a directory. The kubelet rewrites a
mounted ConfigMap in place (Kubernetes v1.31 ``pkg/volume/configmap/configmap.go`` with
``pkg/volume/util/atomic_writer.go``; not with ``subPath``), and Knative admits configMap volumes with no feature
flag (knative/serving knative-v1.23.0 ``pkg/apis/serving/k8s_validation.go`` validateVolume), so adding or
removing a member changes the ConfigMap only, never the pod template: no new revision, no restart.

Members' credentials reach it as the adapters' do (:mod:`.adapter_credentials`): a Secret of the pool's,
``<pool>-pool-credentials``, holds a copy (``<secret>.json``: data and ``serving.kserve.io/*`` annotations) of each
Secret a member names in ``spec.source.credentialsSecret``, mounted whole and always (with no data while no member
names one), so the first member with a Secret changes that Secret's data, never the pod template. ``serve
--credentials-dir`` downloads each member's source with its own copy, by KServe's storage code
(gateway/universal_gateway/local.py ``fetch_source``), as a single model's storage initializer would with the Secret
on its ServiceAccount. The operator re-reads the Secrets at every reconcile of the pool (its repair timer), so a
rotated key follows.

The pool's pod and its status are read by the same code as a single model's: :func:`stand_in` is the
UniversalModel a pool would be if it were one model (its resources, scaling, image and env), so the probes,
security context, Knative annotations and the reading of KServe's status cannot drift from a model's.

With ``spec.cache`` the pool keeps a KServe LocalModelCache of ``cache.sourceUri`` (the folder holding its members'
sources) by the single model's machinery (:mod:`.cache`: the stand-in carries the URI and the cache, so the cache
is named by the URI, shared with models naming it, and deleted by hand when no model or pool uses it). KServe
v0.20.0 mounts a cache only for a predictor with a storage URI (``pkg/apis/serving/v1beta1/
inference_service_defaults.go`` setLocalModelLabel; a custom container's ``STORAGE_URI`` env,
``pkg/apis/serving/v1beta1/predictor_custom.go``), and its pod webhook then mounts the node group's claim at
/mnt/models instead of running the storage initializer (``pkg/webhook/admission/pod/storage_initializer_injector.go``).
So until every node holds the copy the pool's InferenceService has no STORAGE_URI (and the
``disable-localmodel`` annotation) and members download into the cache volume; once it does, the container gets
``STORAGE_URI=<sourceUri>``, the node group annotation, and ``serve --cached-prefix <sourceUri>=/mnt/models``.
That switch changes the pod template: it rolls the pool once, as a single model's switch does.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import yaml

from universal_operator.config import OperatorConfig
from universal_operator.predictor import CONTAINER_NAME, resolved_backend
from universal_operator.reconcile.adapter_credentials import copies_secret
from universal_operator.reconcile.cache import DISABLE_ANNOTATION, NODE_GROUP_ANNOTATION, CacheState
from universal_operator.reconcile.drift import quantity_value
from universal_operator.reconcile.labels import (
    ANNOTATION_SERVED_NAME,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    MANAGED_BY,
)
from universal_operator.reconcile.render import desired_inference_service, request_timeout_seconds
from universal_operator.reconcile.status import _conditions, status_from_inference_service
from universal_operator.spec import (
    POOL_SUFFIX,
    ObjectMeta,
    Phase,
    PoolMemberProcesses,
    PoolMemberState,
    SpecError,
    UniversalModel,
    UniversalModelPool,
    UniversalModelSpec,
    UniversalModelStatus,
)
from universal_operator.spec import Cache as ModelCache
from universal_predictors.catalog import TASK_BACKENDS, Backend, Task
from universal_predictors.config import DEFAULT_HTTP_PORT

MEMBERS_SUFFIX = f"{POOL_SUFFIX}-members"
MEMBERS_MOUNT_PATH = "/etc/universal-runtime/pool"
MEMBERS_VOLUME = "pool-members"
CREDENTIALS_SUFFIX = f"{POOL_SUFFIX}-credentials"
CREDENTIALS_MOUNT_PATH = "/etc/universal-runtime/pool-credentials"
CREDENTIALS_VOLUME = "pool-credentials"
#: The label naming the pool on its InferenceService, pods and members ConfigMap.
LABEL_POOL = "serving.universal-runtime.dev/pool"
#: The gateway's health routes (universal_gateway.app): /healthz answers while the server runs, /readyz once its
#: models are known; members load on demand, so the pool is ready before any of them is loaded.
LIVE_PATH, READY_PATH = "/healthz", "/readyz"
MIB = 2**20
#: Where KServe's pod webhook mounts a LocalModelCache's claim (storage_initializer_injector.go, v0.20.0); the
#: pool's own cache volume is at render.CACHE_DIR, so the two never share a path.
CACHED_MOUNT_PATH = "/mnt/models"


def pool_service_name(pool: UniversalModelPool) -> str:
    """The pool's InferenceService: ``<pool>-pool`` (the module's docstring says why not the bare name)."""
    return f"{pool.metadata.name}{POOL_SUFFIX}"


def members_config_map_name(pool: UniversalModelPool) -> str:
    return f"{pool.metadata.name}{MEMBERS_SUFFIX}"


def credentials_secret_name(pool: UniversalModelPool) -> str:
    """The pool's copy of its members' credentials Secrets: ``<pool>-pool-credentials``."""
    return f"{pool.metadata.name}{CREDENTIALS_SUFFIX}"


def memory_budget_mb(pool: UniversalModelPool) -> int | None:
    """``spec.memoryBudget`` in MiB (what ``serve --memory-budget-mb`` takes), or None without one."""
    if pool.spec.memory_budget is None:
        return None
    value = quantity_value(pool.spec.memory_budget)
    if value is None:
        raise SpecError("spec.memoryBudget", f"{pool.spec.memory_budget!r} is not a quantity; write it like 6Gi")
    return int(value / MIB)


def check_pool(pool: UniversalModelPool) -> None:
    """What only the operator can judge about a pool: the budget fits in the pod's memory."""
    budget = memory_budget_mb(pool)
    memory = quantity_value(pool.spec.resources.memory) if pool.spec.resources.memory else None
    if budget is not None and memory is not None and budget * MIB > memory:
        raise SpecError(
            "spec.memoryBudget",
            f"{pool.spec.memory_budget} is more than resources.memory ({pool.spec.resources.memory}): the pod would "
            "be killed for memory before the pool evicts anything; lower memoryBudget or raise resources.memory",
        )
    if budget is not None and budget < 1:
        raise SpecError("spec.memoryBudget", "must be at least 1Mi; leave it out for no bound")


def stand_in(pool: UniversalModelPool) -> UniversalModel:
    """The UniversalModel the pool's pod would be as one model: named as its InferenceService, owned by the pool."""
    spec = pool.spec
    # With spec.cache the stand-in names the cached folder as its source, so the single model's cache code names,
    # shares and sizes the LocalModelCache by it; the render below drops what a pool does not download that way.
    source = {"uri": spec.cache.source_uri} if spec.cache is not None else {"uri": MEMBERS_MOUNT_PATH}
    cache = (
        ModelCache(node_groups=spec.cache.node_groups, model_size=spec.cache.model_size)
        if spec.cache is not None
        else None
    )
    return UniversalModel(
        metadata=ObjectMeta(name=pool_service_name(pool), namespace=pool.metadata.namespace, uid=pool.metadata.uid,
                            generation=pool.metadata.generation),
        spec=UniversalModelSpec(
            task=Task.EMBED, source=source,  # without a cache, an absolute path: nothing to download
            cache=cache, resources=spec.resources, scaling=spec.scaling, env=spec.env, image=spec.image,
        ),
    )  # fmt: skip


def pool_owner_reference(pool: UniversalModelPool) -> dict[str, Any]:
    return {
        "apiVersion": pool.api_version,
        "kind": pool.kind,
        "name": pool.metadata.name,
        "uid": pool.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pool_labels(pool: UniversalModelPool) -> dict[str, str]:
    return {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: MANAGED_BY,
        LABEL_NAME: pool.metadata.name,
        LABEL_POOL: pool.metadata.name,
    }


def mounts_cache(pool: UniversalModelPool, cache: CacheState | None, live: dict[str, Any] | None = None) -> bool:
    """Whether the pool's pod mounts its LocalModelCache: it has one and every node holds the copy, or the ``live``
    InferenceService mounts it already (a node joining the group downloads soon; switching back would roll the pool
    twice), as render.cache_annotations keeps a single model's mount."""
    if pool.spec.cache is None or cache is None or cache.name is None:
        return False
    return cache.ready or bool(cache.status(live)["mounted"])


def supervisor_args(
    pool: UniversalModelPool, cache: CacheState | None = None, live: dict[str, Any] | None = None
) -> list[str]:
    """``universal-runtime serve`` over the members' folder, on the port KServe routes to; with the pool's cache
    mounted, members under its source load from /mnt/models (gateway/universal_gateway/cli.py --cached-prefix)."""
    args = ["serve", MEMBERS_MOUNT_PATH, "--host=0.0.0.0", f"--port={DEFAULT_HTTP_PORT}"]
    budget = memory_budget_mb(pool)
    if budget is not None:
        args.append(f"--memory-budget-mb={budget}")
    shared = pool.spec.member_processes is PoolMemberProcesses.SHARED
    args.append(f"--member-processes={'shared' if shared else 'own'}")
    args.append(f"--credentials-dir={CREDENTIALS_MOUNT_PATH}")
    if pool.spec.cache is not None and mounts_cache(pool, cache, live):
        args.append(f"--cached-prefix={pool.spec.cache.source_uri}={CACHED_MOUNT_PATH}")
    return args


def desired_pool_inference_service(
    pool: UniversalModelPool,
    config: OperatorConfig,
    *,
    now: datetime | None = None,
    live: dict[str, Any] | None = None,
    cache: CacheState | None = None,
) -> dict[str, Any]:
    """The pool's one InferenceService. Its members are not in it (they are in the ConfigMap): adding one leaves
    this object, and so the pod template, unchanged. ``cache``: the pool's LocalModelCache as last judged."""
    check_pool(pool)
    isvc = desired_inference_service(stand_in(pool), config, now=now, live=live, cache=cache)
    meta = isvc["metadata"]
    meta["labels"] = {**{k: v for k, v in meta["labels"].items() if k in _KEPT_LABELS}, **pool_labels(pool)}
    meta["annotations"].pop(ANNOTATION_SERVED_NAME, None)
    meta["ownerReferences"] = [pool_owner_reference(pool)]
    predictor = isvc["spec"]["predictor"]
    predictor["labels"] = pool_labels(pool)
    container = predictor["containers"][0]
    assert container["name"] == CONTAINER_NAME
    container["command"] = ["universal-runtime"]
    container["args"] = supervisor_args(pool, cache, live)
    # Members fetch their own sources into the cache (the storage initializer fetches one URI per pod). With the
    # pool's LocalModelCache on every node, STORAGE_URI is what makes KServe mount it (the module's docstring);
    # before that, no STORAGE_URI (KServe would run the initializer on the whole folder) and no node group.
    mounted = mounts_cache(pool, cache, live)
    dropped = ("HF_HUB_OFFLINE",) if mounted else ("STORAGE_URI", "HF_HUB_OFFLINE")
    container["env"] = [e for e in container["env"] if e["name"] not in dropped]
    if pool.spec.cache is not None and not mounted:
        meta["annotations"].pop(NODE_GROUP_ANNOTATION, None)
        if cache is not None and cache.name is not None:
            meta["annotations"][DISABLE_ANNOTATION] = "true"
    container["readinessProbe"]["httpGet"]["path"] = READY_PATH
    for probe in ("livenessProbe", "startupProbe"):
        container[probe]["httpGet"]["path"] = LIVE_PATH
    container["volumeMounts"].append({"name": MEMBERS_VOLUME, "mountPath": MEMBERS_MOUNT_PATH, "readOnly": True})
    # Whole (never subPath: the kubelet would not rewrite it), and always: the first member naming a Secret changes
    # only the Secret's data.
    container["volumeMounts"].append(
        {"name": CREDENTIALS_VOLUME, "mountPath": CREDENTIALS_MOUNT_PATH, "readOnly": True}
    )
    volume = pool.spec.cache_volume
    volumes = [v for v in predictor["volumes"] if v["name"] != "cache"]
    if volume.claim_name is not None:
        volumes.insert(0, {"name": "cache", "persistentVolumeClaim": {"claimName": volume.claim_name}})
    else:
        volumes.insert(0, {"name": "cache", "emptyDir": {"sizeLimit": volume.size_limit} if volume.size_limit else {}})
    volumes.append({"name": MEMBERS_VOLUME, "configMap": {"name": members_config_map_name(pool)}})
    volumes.append({"name": CREDENTIALS_VOLUME, "secret": {"secretName": credentials_secret_name(pool)}})
    predictor["volumes"] = volumes
    return isvc


#: Of a model's InferenceService labels, those that say how Knative or KServe expose it (cluster-local).
_KEPT_LABELS = ("networking.knative.dev/visibility", "networking.kserve.io/visibility")


def member_manifest(model: UniversalModel) -> str:
    """A member as ``universal-runtime serve`` reads it from the folder: its UniversalModel manifest (name and spec;
    ``spec.pool`` left out: inside the pool the model is served, not pooled again)."""
    spec = model.spec.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"pool"})
    document = {"apiVersion": model.api_version, "kind": model.kind, "metadata": {"name": model.metadata.name},
                "spec": spec}  # fmt: skip
    return yaml.safe_dump(document, sort_keys=True)


def desired_members_config_map(pool: UniversalModelPool, members: list[UniversalModel]) -> dict[str, Any]:
    """The members' manifests, one key each (``<member>.yaml``), owned by the pool."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": pool_owned_metadata(pool, members_config_map_name(pool)),
        "data": {f"{m.metadata.name}.yaml": member_manifest(m) for m in sorted(members, key=lambda m: m.metadata.name)},
    }


def pool_owned_metadata(pool: UniversalModelPool, name: str) -> dict[str, Any]:
    """An object of the pool's (garbage-collected with it): its name, the pool's namespace, labels and owner."""
    return {"name": name, "namespace": pool.metadata.namespace, "labels": pool_labels(pool),
            "ownerReferences": [pool_owner_reference(pool)]}  # fmt: skip


def member_secrets(members: list[UniversalModel]) -> dict[str, list[str]]:
    """Each Secret the members name in ``spec.source.credentialsSecret``, with the members naming it (by name)."""
    found: dict[str, list[str]] = {}
    for model in sorted(members, key=lambda m: m.metadata.name):
        if model.spec.source.credentials_secret:
            found.setdefault(model.spec.source.credentials_secret, []).append(model.metadata.name)
    return found


def desired_pool_credentials_secret(
    pool: UniversalModelPool, found: dict[str, dict[str, Any] | None]
) -> dict[str, Any]:
    """The pool's aggregate of its members' Secrets ``found`` (name -> the Secret as read, None when it does not
    exist: left out, and ``serve`` fails the members naming it, naming it), present with no data when none does."""
    return copies_secret(pool_owned_metadata(pool, credentials_secret_name(pool)), found)


def members_of(pool: UniversalModelPool, models: list[UniversalModel]) -> list[UniversalModel]:
    """The UniversalModels naming the pool, in its namespace, not being deleted."""
    return [
        m for m in models
        if m.spec.pool == pool.metadata.name and m.metadata.namespace == pool.metadata.namespace
        and not m.metadata.deleting
    ]  # fmt: skip


def member_state(model: UniversalModel) -> tuple[PoolMemberState, str | None, int | None]:
    """The member's state inside the pool, its reason, and its memory (MiB), from the pool's card of it
    (``status.predictorReport.pool``, written by the gateway): ``serve``'s states are ready, loading, idle and
    failed; an idle member that was loaded before was unloaded (idle past its timeout, or evicted for room)."""
    report = model.status.predictor_report
    card = report.pool if report is not None else None
    if card is None or card.state is None:
        return PoolMemberState.NOT_LOADED, None, None
    memory = card.memory_mb
    if card.state == "ready":
        return PoolMemberState.LOADED, None, memory
    if card.state == "loading":
        return PoolMemberState.LOADING, None, memory
    if card.state == "failed":
        return PoolMemberState.FAILED, "Crashed" if card.reason == "Failed" and card.crashes else "FailedToLoad", memory
    if not card.starts:
        return PoolMemberState.NOT_LOADED, None, None
    # Unloaded: the runtime says why (gateway/universal_gateway/local.py); a crashed or OOM-killed member is loaded
    # again by its next request, as an evicted one is.
    if card.reason in _RUNTIME_REASONS:
        return PoolMemberState.EVICTED, _RUNTIME_REASONS[card.reason], None
    return PoolMemberState.EVICTED, "MemoryBudget" if card.evictions else "IdleTimeout", None


#: The runtime's reasons for a member it stopped, as the member's status says them.
_RUNTIME_REASONS = {"Evicted": "MemoryBudget", "IdleTimeout": "IdleTimeout", "Crashed": "Crashed",
                    "OOMKilled": "OOMKilled"}  # fmt: skip


def pool_status(
    pool: UniversalModelPool,
    isvc: dict[str, Any] | None,
    members: list[UniversalModel],
    now: datetime,
    config: OperatorConfig,
    cache: CacheState | None = None,
) -> dict[str, Any]:
    """The pool's status: its InferenceService read as a model's would be (with ``cache``, its LocalModelCache as
    ``status.cache`` and the Cached condition, as a model reports its own), and its members from their reports."""
    base = status_from_inference_service(isvc, stand_in(pool).model_copy(update={"status": _as_model_status(pool)}),
                                         now, config=config, cache=cache)  # fmt: skip
    listed = []
    loaded, used, evictions = [], 0, 0
    for member in sorted(members, key=lambda m: m.metadata.name):
        state, _, memory = member_state(member)
        card = member.status.predictor_report.pool if member.status.predictor_report else None
        evicted = (card.evictions or 0) if card is not None else 0
        evictions += evicted
        if state is PoolMemberState.LOADED:
            loaded.append(member.metadata.name)
            used += memory or 0
        entry = {"name": member.metadata.name, "servedName": member.served_name, "task": member.spec.task.value,
                 "state": state.value, "memoryMb": memory, "evictions": evicted or None}  # fmt: skip
        listed.append({k: v for k, v in entry.items() if v is not None})
    return {
        "phase": base["phase"],
        "observedGeneration": pool.metadata.generation,
        "inferenceService": pool_service_name(pool),
        "address": base.get("address"),
        "url": base.get("url"),
        "members": listed,
        "memberCount": len(listed),
        "loaded": loaded,
        "memoryUsedMb": used,
        "memoryBudgetMb": memory_budget_mb(pool),
        "evictions": evictions,
        "cache": base.get("cache"),
        "message": base.get("message"),
        "conditions": base["conditions"],
    }


def _as_model_status(pool: UniversalModelPool) -> UniversalModelStatus:
    return UniversalModelStatus.model_validate(
        {"phase": pool.status.phase, "conditions": [c.model_dump(by_alias=True) for c in pool.status.conditions]}
    )


def member_status(
    model: UniversalModel, pool: UniversalModelPool | None, now: datetime, config: OperatorConfig
) -> dict[str, Any]:
    """A pooled member's status: where the pool is (phase, address: the gateway routes there with the member's
    served name, and waits as long as the pool's KServe timeout allows), condition Pooled naming the pool, and the
    member's state inside it."""
    generation = model.metadata.generation
    if pool is None or pool.status.phase is None:
        why = "does not exist" if pool is None else "has not reported yet"
        message = f"Pool {model.spec.pool!r} {why} in {model.metadata.namespace!r}"
        if pool is None:
            message += f"; create the UniversalModelPool {model.spec.pool!r} or fix spec.pool"
        return {
            "phase": Phase.PENDING.value, "observedGeneration": generation, "servedName": model.served_name,
            "backend": model.spec.backend.value, "address": None, "url": None, "inferenceService": None,
            "requestTimeoutSeconds": None, "message": message,
            "pool": {"name": model.spec.pool, "state": PoolMemberState.NOT_LOADED.value, "reason": None,
                     "memoryMb": None},
            "conditions": pooled_conditions(model, now, ready=("False", "PoolMissing" if pool is None else
                                            "PoolPending", message), pooled=("False", "PoolMissing" if pool is None
                                            else "PoolPending", message)),
        }  # fmt: skip
    state, reason, memory = member_state(model)
    phase = pool.status.phase
    ready = "True" if phase is Phase.READY or phase is Phase.IDLE else "False"
    where = f"Served by pool {pool.metadata.name!r} ({pool_service_name(pool)}); {state.value} there"
    message = f"{where} ({reason})." if reason else f"{where}."
    card = model.status.predictor_report.pool if model.status.predictor_report is not None else None
    if reason in ("Crashed", "OOMKilled") and card is not None and card.last_exit:
        message += f" Its process {card.last_exit} ({card.crashes or 1} crash(es)); its next request starts it again."
    if state is PoolMemberState.FAILED and card is not None and card.message:
        message += f" {card.message}"  # what failed: its source unreachable, its credentials Secret missing
    pool_entry = {"name": pool.metadata.name, "state": state.value, "reason": reason, "memoryMb": memory}
    return {
        "phase": phase.value, "observedGeneration": generation, "servedName": model.served_name,
        "backend": pooled_backend(model), "address": pool.status.address, "url": pool.status.url,
        "inferenceService": pool_service_name(pool), "message": message,
        "requestTimeoutSeconds": request_timeout_seconds(stand_in(pool), config),
        "pool": pool_entry,  # None values: a merge patch removes what no longer holds (an earlier reason)
        "conditions": pooled_conditions(model, now, ready=(ready, f"Pool{phase.value}", pool.status.message or ""),
                                        pooled=("True", "InPool", message)),
    }  # fmt: skip


def pooled_backend(model: UniversalModel) -> str:
    """The backend a member's status reports: the spec's resolution, or, where that is ``auto``, the one it last
    loaded with in its pool (its pool card's), as ``reported_backend`` does for a model of its own."""
    backend = resolved_backend(model)
    report = model.status.predictor_report
    card = report.pool if report is not None else None
    if backend is not Backend.AUTO or card is None or card.backend is None:
        return backend.value
    try:
        running = Backend(card.backend)
    except ValueError:
        return backend.value
    return running.value if running in TASK_BACKENDS[model.spec.task] else backend.value


def pooled_conditions(
    model: UniversalModel, now: datetime, *, ready: tuple[str, str, str], pooled: tuple[str, str, str]
) -> list[dict[str, Any]]:
    """Ready, SpecValid and Pooled of a member (it has no InferenceService of its own to report on)."""
    return _conditions(
        model.status.conditions, model.metadata.generation, now,
        ("Ready", *ready), ("SpecValid", "True", "Valid", "The spec is valid."), ("Pooled", *pooled),
    )  # fmt: skip
