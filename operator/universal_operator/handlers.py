"""kopf handlers: thin glue between watch events and the pure functions in :mod:`reconcile`.

Handlers are registered on a registry built by :func:`build_registry`, so an embedded operator (tests,
the benchmark) and the CLI get the same set with their own configuration. Each handler can also be
called as a plain function with an :class:`OperatorState`.

Who writes what:
- the child InferenceService: server-side apply, one field manager, only when it drifted or is missing;
- the model's ServiceAccount (only with spec.source.credentialsSecret): read, then server-side applied
  before the InferenceService when it drifted or is missing;
- with spec.adapters, their list (a ConfigMap) and a copy of the Secrets they name (a Secret): read, then
  server-side applied before the InferenceService when they drifted or are missing;
- the parent's status: one merge patch to ``/status`` when what it says would change (all of it but
  ``predictorReport``, which the gateway writes and the operator reads for ``backend``);
- for a UniversalModelPool: its members' manifests (a ConfigMap, NAME-pool-members), a copy of the Secrets they
  name in spec.source.credentialsSecret (a Secret, NAME-pool-credentials) and its one InferenceService (NAME-pool),
  server-side applied when they drifted, and its status; a model with spec.pool gets no child, only
  a status saying where its pool is (reconcile/pools.py);
- kopf's own bookkeeping on the parent (diff-base, progress on retries, and the finalizer its repair
  timer needs) under this project's prefix; nothing of kopf's ever lands on the InferenceService.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn, cast

import kopf
from lightkube.core.exceptions import ApiError

from universal_operator import kserve
from universal_operator.config import OperatorConfig
from universal_operator.kube import KubeApi, api_error_code, denied_by_webhook
from universal_operator.predictor import reported_backend
from universal_operator.reconcile import cache as local_model
from universal_operator.reconcile.adapter_credentials import (
    adapter_credentials_secret_name,
    desired_adapter_credentials_secret,
    referenced_secrets,
)
from universal_operator.reconcile.adapters import desired_adapters_config_map
from universal_operator.reconcile.cache import CacheState
from universal_operator.reconcile.checks import check_servable
from universal_operator.reconcile.drift import child_drifted, data_drifted, is_subset, service_account_drifted
from universal_operator.reconcile.labels import LABEL_MANAGED_BY, MANAGED_BY, owned_by
from universal_operator.reconcile.pools import (
    LABEL_POOL,
    credentials_secret_name,
    desired_members_config_map,
    desired_pool_credentials_secret,
    desired_pool_inference_service,
    member_secrets,
    member_status,
    members_of,
    pool_service_name,
    pool_status,
    stand_in,
)
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.service_account import desired_service_account
from universal_operator.reconcile.status import (
    adapter_statuses,
    status_changed,
    status_for_forbidden,
    status_for_invalid_spec,
    status_from_inference_service,
)
from universal_operator.reconcile.waking import POD_LABEL, compact
from universal_operator.spec import (
    GROUP,
    PLURAL,
    POOL_PLURAL,
    POOL_SUFFIX,
    VERSION,
    SpecError,
    UniversalModel,
    UniversalModelPool,
    parse_model,
    parse_pool,
)
from universal_operator.warm import warm_at

logger = logging.getLogger(__name__)

MANAGED = {LABEL_MANAGED_BY: MANAGED_BY}
FINALIZER = f"{GROUP}/kopf-finalizer"
#: Retry delay after the API server refused a write (409 conflict, 5xx, 429).
RETRY_DELAY = 2.0
#: Retry delays while RBAC refuses the operator (403): doubling from the first to the last.
FORBIDDEN_RETRY_FIRST, FORBIDDEN_RETRY_LAST = 5.0, 300.0

Key = tuple[str, str]


@dataclass
class OperatorState:
    """What the handlers share: config, API client, per-model locks and the last status written."""

    config: OperatorConfig
    api: KubeApi
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    #: One reconcile per model at a time: kopf runs the create/update handlers and the repair timer in
    #: separate tasks, and two of them applying a missing child at once would both announce it.
    reconciling: dict[Key, asyncio.Lock] = field(default_factory=dict)
    written_status: dict[Key, dict[str, Any]] = field(default_factory=dict)
    latest_child: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: The operator's time: what a warm window is judged by (tests pass their own).
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    #: Each model's predictor pods by name, as much of them as the step reads (reconcile.waking.compact).
    pods: dict[Key, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: LocalModelCaches by name, as last seen (the watch, or this operator's own apply).
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What each model's cache was last judged to be (the status reads it between reconciles).
    cache_states: dict[Key, CacheState | None] = field(default_factory=dict)
    #: Deletions of caches no model uses any more, retried while KServe refuses them (a cache still in use).
    cache_deletions: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    #: The adapters' credentials Secrets each model names that were missing at its last reconcile (one Event each).
    missing_secrets: dict[Key, frozenset[str]] = field(default_factory=dict)
    #: Pools: the status last written, and their InferenceServices as last seen (by the pool's key).
    written_pool_status: dict[Key, dict[str, Any]] = field(default_factory=dict)
    pool_children: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: Every UniversalModelPool as last seen (its event handler). Not a kopf index: kopf holds every handler back
    #: until each index has listed its resource, so an index over a CRD not installed yet would stall every model.
    pools: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: kopf's live index of every UniversalModel (kept from the first handler call that passes it: the object stays
    #: the same, updated in place).
    model_index: Mapping[Key, Any] | None = None

    def pods_of(self, key: Key) -> list[dict[str, Any]]:
        return list(self.pods.get(key, {}).values())

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: Key) -> None:
        self.locks.pop(key, None)
        self.reconciling.pop(key, None)
        self.written_status.pop(key, None)
        self.latest_child.pop(key, None)
        self.cache_states.pop(key, None)
        self.missing_secrets.pop(key, None)


def _key(body: Mapping[str, Any]) -> Key:
    meta = body.get("metadata", {})
    return str(meta.get("namespace") or "default"), str(meta["name"])


def _plain(body: Any) -> dict[str, Any]:
    """A deep plain-dict copy of a kopf body (kopf's bodies are live views)."""
    if isinstance(body, Mapping):
        return {str(k): _plain(v) for k, v in body.items()}
    if isinstance(body, list):
        return [_plain(v) for v in body]  # type: ignore[return-value]
    return body  # type: ignore[no-any-return]


def _newer(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The later of two views of one child: the higher generation, ties to ``a`` (the watched one)."""
    if a is None or b is None:
        return a or b
    gen_a = a.get("metadata", {}).get("generation") or 0
    gen_b = b.get("metadata", {}).get("generation") or 0
    return b if gen_b > gen_a else a


async def write_status(state: OperatorState, key: Key, current: dict[str, Any] | None, status: dict[str, Any]) -> bool:
    """Patch the parent's status if it would change; returns whether a write happened."""
    known = state.written_status.get(key, current)
    if not status_changed(known, status):
        return False
    try:
        await state.api.patch_model_status(key[0], key[1], status)
    except ApiError as exc:
        if api_error_code(exc) == 404:
            return False  # the model is gone; nothing to report on
        raise kopf.TemporaryError(f"writing the status failed: {exc}", delay=RETRY_DELAY) from exc
    state.written_status[key] = status
    return True


async def sync_status(state: OperatorState, body: Mapping[str, Any], child: dict[str, Any] | None) -> None:
    """Recompute the parent's status from the freshest view of its child and write it if it changed."""
    key = _key(body)
    async with state.lock(key):
        model = parse_model(_plain(body))
        freshest = _newer(state.latest_child.get(key), child)
        status = status_from_inference_service(
            freshest, model, state.clock(), config=state.config, pods=state.pods_of(key),
            cache=state.cache_states.get(key),
        )  # fmt: skip
        await write_status(state, key, _plain(body.get("status") or {}), status)


async def reconcile_model(
    state: OperatorState,
    body: Mapping[str, Any],
    children: Mapping[Key, Any] | None = None,
    *,
    reason: str = "reconcile",
    retry: int = 0,
    models: Mapping[Key, Any] | None = None,
) -> dict[str, Any] | None:
    """Make the child match the spec and the status match the child. Returns the applied child if any.

    ``retry`` is kopf's count of earlier failed attempts (it sets the back-off while RBAC refuses us).
    ``models``: kopf's index of every UniversalModel (the users a shared cache is made for).
    """
    async with state.reconciling.setdefault(_key(body), asyncio.Lock()):
        return await _reconcile_model(state, body, children, reason=reason, retry=retry, models=models)


async def _reconcile_model(
    state: OperatorState,
    body: Mapping[str, Any],
    children: Mapping[Key, Any] | None,
    *,
    reason: str,
    retry: int,
    models: Mapping[Key, Any] | None,
) -> dict[str, Any] | None:
    key = _key(body)
    plain = _plain(body)
    try:
        model = parse_model(plain)
        if model.spec.pool is not None:
            await reconcile_member(state, plain, model)
            return None
        check_servable(model, state.config)
    except SpecError as error:
        await report_invalid_spec(state, plain, error)
        return None
    cache = await ensure_cache(state, plain, model, models, retry)
    state.cache_states[key] = cache

    actual = _index_value(children, key)
    if actual is None and key not in state.latest_child:
        # Not one of ours as far as the watch knows: never take over someone else's InferenceService.
        try:
            existing = await state.api.get_inference_service(*key)
        except ApiError as exc:
            if api_error_code(exc) == 403:
                await report_forbidden(state, plain, model, exc, retry)
            raise kopf.TemporaryError(f"reading the InferenceService failed: {exc}", delay=RETRY_DELAY) from exc
        if existing is not None and not _owned_by(existing, plain):
            await report_invalid_spec(
                state,
                plain,
                SpecError(
                    "metadata.name",
                    f"an InferenceService named {key[1]!r} already exists in {key[0]!r} and is not owned by this "
                    "UniversalModel; rename the model or remove that InferenceService",
                ),
            )
            return None
        actual = existing
    if actual is not None:
        state.latest_child[key] = _newer(state.latest_child.get(key), actual) or actual
    live = state.latest_child.get(key) if actual is None else actual
    try:
        desired = desired_inference_service(model, state.config, now=state.clock(), cache=cache, live=live)
    except SpecError as error:
        await report_invalid_spec(state, plain, error)
        return None
    if not await ensure_service_account(state, plain, model, retry):
        return None
    if not await ensure_adapters_config_map(state, plain, model, retry):
        return None
    if not await ensure_adapter_credentials(state, plain, model, retry):
        return None
    applied: dict[str, Any] | None = None
    if child_drifted(desired, live):
        try:
            applied = await state.api.apply_inference_service(desired)
        except ApiError as exc:
            await report_refused_write(state, plain, model, exc, retry, "spec", "the InferenceService")
            return None
        if actual is None:
            # kopf.event, not kopf.info: posting.level (WARNING, below) would drop a Normal one.
            kopf.event(
                cast(kopf.Body, plain),
                type="Normal",
                reason="InferenceServiceApplied",
                message=f"Applied InferenceService {key[1]} ({reason}).",
            )
        logger.info("applied InferenceService %s/%s (%s)", key[0], key[1], reason)
        state.latest_child[key] = _newer(state.latest_child.get(key), applied) or applied
    async with state.lock(key):
        status = status_from_inference_service(
            state.latest_child.get(key), model, state.clock(), config=state.config, pods=state.pods_of(key),
            cache=cache,
        )  # fmt: skip
        await write_status(state, key, _plain(plain.get("status") or {}), status)
    return applied


def _models_of(models: Mapping[Key, Any] | None, also: UniversalModel) -> list[UniversalModel]:
    """Every UniversalModel kopf's index holds that parses, with ``also`` (the one being reconciled) fresh."""
    found: dict[Key, UniversalModel] = {}
    for key in models or {}:
        body = _index_value(models, key)
        if body is None:
            continue
        try:
            found[key] = parse_model(body)
        except SpecError:
            continue
    found[(also.metadata.namespace, also.metadata.name)] = also
    return list(found.values())


def _pool_stand_ins(state: OperatorState) -> list[UniversalModel]:
    """The pools (not being deleted) as the single models they would be (reconcile/pools.py ``stand_in``): with
    spec.cache, a model whose source is the cached folder, so the cache code counts them as users of it."""
    found = []
    for body in state.pools.values():
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            found.append(stand_in(parse_pool(body)))
        except SpecError:
            continue
    return found


def _pool_cache_users(state: OperatorState, uri: str) -> list[dict[str, Any]]:
    """The pools (bodies) whose spec.cache is ``uri``'s: the cluster-scoped cache cannot be owned by a namespaced
    pool, so the operator deletes it by hand once neither a model nor a pool names it."""
    return [
        state.pools[(m.metadata.namespace, m.metadata.name.removesuffix(POOL_SUFFIX))]
        for m in _pool_stand_ins(state)
        if local_model.cached_uri(m) == uri
    ]


def _matching_cache(state: OperatorState, storage_uri: str) -> dict[str, Any] | None:
    """The LocalModelCache KServe's webhook would pick for ``storage_uri``: the first whose source is the URI or a
    folder above it (KServe v0.16.0 pkg/apis/serving/v1alpha1/local_model_cache_types.go MatchStorageURI)."""
    for cache in state.caches.values():
        if local_model.covers(str((cache.get("spec") or {}).get("sourceModelUri") or ""), storage_uri):
            return cache
    return None


async def ensure_cache(
    state: OperatorState, body: dict[str, Any], model: UniversalModel, models: Mapping[Key, Any] | None, retry: int
) -> CacheState | None:
    """The LocalModelCache of the model's source (:mod:`universal_operator.reconcile.cache`): applied when the model
    asks for one and KServe's is enabled; None when no cache concerns the model.

    A cache another party made for the same source is used as it is (KServe allows one per source). A source some
    other model caches concerns this model too: KServe's webhook mounts it for every InferenceService it matches.
    """
    uri = local_model.cached_uri(model)
    if not state.config.kserve.local_model_cache:
        return local_model.not_enabled(model) if uri is not None else None
    if uri is None:
        if not model.spec.source.is_remote:
            return None
        found = _matching_cache(state, model.spec.source.storage_uri)
        return local_model.cache_state(found) if found is not None else None
    name = local_model.cache_name(uri)
    foreign = next(
        (c for n, c in state.caches.items() if n != name and (c.get("spec") or {}).get("sourceModelUri") == uri), None
    )
    if foreign is not None:
        return local_model.cache_state(foreign)
    users = {(m.metadata.namespace, m.metadata.name): m for m in [*_pool_stand_ins(state), *_models_of(models, model)]}
    desired = local_model.desired_cache(uri, local_model.users_of(uri, users.values()))
    current = state.caches.get(name)
    if current is not None and is_subset(desired["spec"], current.get("spec") or {}) and local_model.managed(current):
        return local_model.cache_state(current)
    try:
        applied = await state.api.apply_local_model_cache(desired)
    except ApiError as exc:
        code = api_error_code(exc)
        if code == 404:
            why = (
                "The operator is set to use KServe's LocalModelCache (kserve.localModelCache), but the cluster does "
                "not serve serving.kserve.io/v1alpha1 localmodelcaches: install KServe's LocalModelCache CRDs and "
                "controller, or turn kserve.localModelCache off."
            )
        elif code == 403:
            why = (
                f"The API server refused the operator a LocalModelCache ({exc}): grant it (the chart does with "
                "operator.config.kserve.localModelCache true)."
            )
        elif code in (400, 409, 422) or denied_by_webhook(exc):
            why = f"KServe refused the LocalModelCache {name}: {exc}"
        else:
            raise kopf.TemporaryError(f"applying the LocalModelCache failed ({code})", delay=RETRY_DELAY) from exc
        logger.warning("UniversalModel %s/%s: no cache: %s", model.metadata.namespace, model.metadata.name, why)
        return local_model.unavailable(name, why)
    if current is None:
        groups = ", ".join(desired["spec"]["nodeGroups"])
        message = f"Applied LocalModelCache {name} for {uri} on node groups {groups}."
        kopf.event(cast(kopf.Body, body), type="Normal", reason="CacheApplied", message=message)
    state.caches[name] = applied
    return local_model.cache_state(applied)


async def ensure_service_account(state: OperatorState, body: dict[str, Any], model: UniversalModel, retry: int) -> bool:
    """Apply the model's ServiceAccount (credentials for KServe's storage initializer) if it is missing or drifted.

    Runs before the InferenceService is applied, so its pods never start under an account that is not
    there yet. Returns False when the model cannot be served (the name is taken), which it reports.
    """
    desired = desired_service_account(model)
    if desired is None:
        return True
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    try:
        actual = await state.api.get_service_account(namespace, name)
    except ApiError as exc:
        if api_error_code(exc) == 403:
            await report_forbidden(state, body, model, exc, retry)
        raise kopf.TemporaryError(f"reading the ServiceAccount failed: {exc}", delay=RETRY_DELAY) from exc
    if actual is not None and not owned_by(actual, model):
        await report_invalid_spec(
            state,
            body,
            SpecError(
                "spec.source.credentialsSecret",
                f"the ServiceAccount {name!r} that would carry the credentials already exists in {namespace!r} and "
                "is not owned by this UniversalModel; rename the model or remove that ServiceAccount",
            ),
        )
        return False
    if not service_account_drifted(desired, actual):
        return True
    try:
        await state.api.apply_service_account(desired)
    except ApiError as exc:
        await report_refused_write(state, body, model, exc, retry, "spec.source", "the ServiceAccount")
        return False
    logger.info("applied ServiceAccount %s/%s for the storage initializer's credentials", namespace, name)
    return True


async def ensure_adapters_config_map(
    state: OperatorState, body: dict[str, Any], model: UniversalModel, retry: int
) -> bool:
    """Apply the model's adapter list (a ConfigMap its predictors mount, :mod:`.reconcile.adapters`) if it is
    missing or differs; before the InferenceService, so a pod never waits on a volume that is not there.
    Returns False when the model cannot be served (the name is taken), which it reports."""
    desired = desired_adapters_config_map(model)
    if desired is None:
        return True
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    try:
        actual = await state.api.get_config_map(namespace, name)
    except ApiError as exc:
        if api_error_code(exc) == 403:
            await report_forbidden(state, body, model, exc, retry)
        raise kopf.TemporaryError(f"reading the adapters ConfigMap failed: {exc}", delay=RETRY_DELAY) from exc
    if actual is not None and not owned_by(actual, model):
        await report_invalid_spec(
            state,
            body,
            SpecError(
                "spec.adapters",
                f"the ConfigMap {name!r} that would carry the adapter list already exists in {namespace!r} and is "
                "not owned by this UniversalModel; rename the model or remove that ConfigMap",
            ),
        )
        return False
    if actual is not None and not data_drifted(desired, actual):
        return True
    try:
        await state.api.apply_config_map(desired)
    except ApiError as exc:
        await report_refused_write(state, body, model, exc, retry, "spec.adapters", "the adapters ConfigMap")
        return False
    logger.info("applied ConfigMap %s/%s: %d adapters", namespace, name, len(model.spec.adapters))
    return True


async def ensure_adapter_credentials(
    state: OperatorState, body: dict[str, Any], model: UniversalModel, retry: int
) -> bool:
    """Copy the Secrets the model's adapters name into its own Secret (:mod:`.reconcile.adapter_credentials`): each
    referenced Secret read afresh (every reconcile, so a rotated key follows within a repair interval), the aggregate
    applied when it drifted. A referenced Secret that does not exist is left out and named in a Warning Event (once
    while it stays missing); the base model serves on and the predictor fails the adapters that name it. Returns
    False when the model cannot be served (the aggregate's name is taken), which it reports."""
    name = adapter_credentials_secret_name(model)
    if name is None:
        return True
    key = _key(body)
    namespace = key[0]
    referenced = referenced_secrets(model)
    try:
        found, actual = await read_credentials(state, namespace, referenced, name)
    except ApiError as exc:
        if api_error_code(exc) == 403:
            await report_forbidden(state, body, model, exc, retry)
        raise kopf.TemporaryError(f"reading the adapters' credentials failed: {exc}", delay=RETRY_DELAY) from exc
    warn_missing_secrets(
        state, key, body, frozenset(s for s, got in found.items() if got is None), "AdapterCredentialsMissing",
        lambda secret: f"Secret {secret!r}, the credentialsSecret of adapter(s) {', '.join(referenced[secret])}, does "
        f"not exist in {namespace!r}: those adapters fail until it does (the base model serves on); create it, or fix "
        "the name",
    )  # fmt: skip
    desired = desired_adapter_credentials_secret(model, found)
    assert desired is not None  # the model lists adapters
    if actual is not None and not owned_by(actual, model):
        await report_invalid_spec(
            state,
            body,
            SpecError(
                "spec.adapters",
                f"the Secret {name!r} that would carry the adapters' credentials already exists in {namespace!r} and "
                "is not owned by this UniversalModel; rename the model or remove that Secret",
            ),
        )
        return False
    if not data_drifted(desired, actual):
        return True
    try:
        await state.api.apply_secret(desired)
    except ApiError as exc:
        await report_refused_write(state, body, model, exc, retry, "spec.adapters", "the adapter credentials Secret")
        return False
    logger.info("applied Secret %s/%s: copies of %d credentials Secrets", namespace, name, len(desired["data"]))
    return True


async def read_credentials(
    state: OperatorState, namespace: str, referenced: Iterable[str], aggregate: str
) -> tuple[dict[str, dict[str, Any] | None], dict[str, Any] | None]:
    """Each referenced Secret as it is now (None: it does not exist), and the aggregate of copies as it is."""
    found = {secret: await state.api.get_secret(namespace, secret) for secret in referenced}
    return found, await state.api.get_secret(namespace, aggregate)


def warn_missing_secrets(
    state: OperatorState,
    key: Key,
    body: Mapping[str, Any],
    missing: frozenset[str],
    reason: str,
    message: Callable[[str], str],
) -> None:
    """One Warning Event on ``body`` per credentials Secret of its that is missing, once while the set stays so."""
    if missing and state.missing_secrets.get(key) != missing:
        for secret in sorted(missing):
            kopf.warn(cast(kopf.Body, body), reason=reason, message=message(secret))
        logger.warning("%s/%s: credentials Secrets missing: %s", *key, ", ".join(sorted(missing)))
    state.missing_secrets[key] = missing


async def report_refused_write(
    state: OperatorState, body: dict[str, Any], model: UniversalModel, exc: ApiError, retry: int, field: str, what: str
) -> None:
    """An apply of ``what`` failed: a webhook's denial is the spec's problem (reported, no retry); anything else
    raises kopf.TemporaryError, after reporting a 403 as a missing grant (RBAC or OwnerReferencesPermissionEnforcement,
    never the spec's fault)."""
    code = api_error_code(exc)
    if code in (400, 422) or denied_by_webhook(exc):
        await report_invalid_spec(state, body, SpecError(field, f"{what} was rejected: {exc}"))
        return
    if code == 403:
        await report_forbidden(state, body, model, exc, retry)
    raise kopf.TemporaryError(f"applying {what} failed ({code}): {exc}", delay=RETRY_DELAY) from exc


async def report_invalid_spec(state: OperatorState, body: dict[str, Any], error: SpecError) -> None:
    """SpecValid=False with the field and what to do, one Warning Event; no retry (the spec must change)."""
    key = _key(body)
    status = status_for_invalid_spec(body, error)
    async with state.lock(key):
        changed = await write_status(state, key, _plain(body.get("status") or {}), status)
    if changed:
        kopf.warn(cast(kopf.Body, body), reason="InvalidSpec", message=str(error))
    logger.warning("UniversalModel %s/%s has an invalid spec: %s", key[0], key[1], error)


def forbidden_retry_delay(retry: int) -> float:
    """Seconds before the next attempt while the API server answers 403: doubling, capped."""
    return float(min(FORBIDDEN_RETRY_FIRST * 2 ** min(retry, 16), FORBIDDEN_RETRY_LAST))


async def report_forbidden(
    state: OperatorState, body: dict[str, Any], model: UniversalModel, error: ApiError, retry: int
) -> NoReturn:
    """Say in the status which permission is missing (one Warning Event), then retry with back-off."""
    key = _key(body)
    status = status_for_forbidden(model, str(error))
    async with state.lock(key):
        changed = await write_status(state, key, _plain(body.get("status") or {}), status)
    if changed:
        kopf.warn(cast(kopf.Body, body), reason="Forbidden", message=status["message"])
    delay = forbidden_retry_delay(retry)
    logger.warning("UniversalModel %s/%s: the API server refused the operator: %s", key[0], key[1], error)
    raise kopf.TemporaryError(f"forbidden by the API server (RBAC), retrying in {delay:.0f}s: {error}", delay=delay)


def _index_value(index: Mapping[Key, Any] | None, key: Key) -> dict[str, Any] | None:
    if index is None or key not in index:
        return None
    values = list(index[key])
    return _plain(values[-1]) if values else None


def _remember(kw: Mapping[str, Any]) -> Mapping[Key, Any] | None:
    """Keep kopf's live indexes in the state (for calls that come without them); returns the models index."""
    state: OperatorState = kw["memo"]["state"]
    if kw.get("models") is not None:
        state.model_index = kw["models"]
    return cast("Mapping[Key, Any] | None", kw.get("models"))


def build_registry(config: OperatorConfig, *, namespaced: bool = False) -> kopf.OperatorRegistry:
    """Every handler, registered on a fresh registry with this configuration's settings.

    ``namespaced``: the operator watches named namespaces only, and may hold nothing cluster-scoped
    (the chart's namespaced RBAC), so kopf must not list namespaces or watch CRDs cluster-wide.
    """
    registry = kopf.OperatorRegistry()
    um = (GROUP, VERSION, PLURAL)
    ump = (GROUP, VERSION, POOL_PLURAL)
    isvc = (kserve.GROUP, kserve.VERSION, kserve.PLURAL)

    @kopf.on.login(registry=registry, id="login")
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Explicit, so the credentials do not depend on which client libraries happen to be installed.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry, id="configure")
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.persistence.finalizer = FINALIZER
        # Only warnings become Events: one "applied" Event per model instead of kopf's chatter per handler.
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 30
        settings.networking.request_timeout = 60
        settings.execution.max_workers = 8
        # Without it kopf retries its cluster-wide scans on 403 for about a minute before it settles
        # for the named namespaces, and reconciles nothing meanwhile.
        settings.scanning.disabled = namespaced
        if "state" not in memo:
            memo["state"] = OperatorState(config=config, api=KubeApi())

    @kopf.on.cleanup(registry=registry, id="close-client")
    async def close_client(memo: kopf.Memo, **_: Any) -> None:
        state: OperatorState | None = memo.get("state")
        if state is not None:
            await state.api.close()

    @kopf.on.probe(registry=registry, id="models-known")
    def models_known(memo: kopf.Memo, **_: Any) -> int:
        state: OperatorState | None = memo.get("state")
        return len(state.written_status) if state else 0

    # kopf passes handler arguments by keyword and types them as protocols, so the handlers take **kw.
    @kopf.index(*isvc, registry=registry, labels=MANAGED, id="children")
    def children(**kw: Any) -> dict[Key, dict[str, Any]]:
        return {_key(kw["body"]): _plain(kw["body"])}

    @kopf.index(*um, registry=registry, id="models")
    def models(**kw: Any) -> dict[Key, dict[str, Any]]:
        return {_key(kw["body"]): _plain(kw["body"])}

    @kopf.on.event(*ump, registry=registry, id="follow-pools")
    async def on_pool_event(**kw: Any) -> None:
        state: OperatorState = kw["memo"]["state"]
        if kw["event"]["type"] == "DELETED":
            await forget_pool(state, _key(kw["body"]))
        else:
            state.pools[_key(kw["body"])] = _plain(kw["body"])

    @kopf.on.resume(*ump, registry=registry, id="pool-on-resume")
    @kopf.on.create(*ump, registry=registry, id="pool-on-create")
    @kopf.on.update(*ump, registry=registry, id="pool-on-update")
    @kopf.timer(*ump, registry=registry, id="pool-repair", interval=config.repair_interval_seconds)
    async def on_pool(**kw: Any) -> None:
        _remember(kw)
        await reconcile_pool(kw["memo"]["state"], kw["body"], reason=str(kw.get("reason") or "reconcile"))

    @kopf.on.event(*isvc, registry=registry, labels={LABEL_POOL: kopf.PRESENT}, id="follow-pool-child")
    async def on_pool_child_event(**kw: Any) -> None:
        _remember(kw)
        await follow_pool_child_event(kw["memo"]["state"], kw["event"]["type"], kw["body"])

    @kopf.on.event(*um, registry=registry, id="follow-pool-members")
    async def on_member_event(**kw: Any) -> None:
        _remember(kw)
        await follow_member_event(kw["memo"]["state"], kw["event"]["type"], kw["body"])

    @kopf.on.resume(*um, registry=registry, id="apply-on-resume")
    async def on_resume(**kw: Any) -> None:
        await reconcile_model(
            kw["memo"]["state"],
            kw["body"],
            kw["children"],
            reason="operator start",
            retry=kw.get("retry", 0),
            models=_remember(kw),
        )

    @kopf.on.create(*um, registry=registry, id="apply-on-create")
    async def on_create(**kw: Any) -> None:
        await reconcile_model(
            kw["memo"]["state"],
            kw["body"],
            kw["children"],
            reason="created",
            retry=kw.get("retry", 0),
            models=_remember(kw),
        )

    @kopf.on.update(*um, registry=registry, id="apply-on-update")
    async def on_update(**kw: Any) -> None:
        await reconcile_model(
            kw["memo"]["state"],
            kw["body"],
            kw["children"],
            reason="spec changed",
            retry=kw.get("retry", 0),
            models=_remember(kw),
        )

    @kopf.timer(*um, registry=registry, id="repair-child", interval=config.repair_interval_seconds)
    async def repair(**kw: Any) -> None:
        await reconcile_model(
            kw["memo"]["state"],
            kw["body"],
            kw["children"],
            reason="drift repaired",
            retry=kw.get("retry", 0),
            models=_remember(kw),
        )

    @kopf.on.event(*isvc, registry=registry, labels=MANAGED, id="mirror-child-status")
    async def on_child_event(**kw: Any) -> None:
        await mirror_child_event(kw["memo"]["state"], kw["event"]["type"], kw["body"], kw["models"])

    # A model with warm windows is reconciled at each window's boundary, not up to a repair interval later.
    @kopf.daemon(*um, registry=registry, id="warm-boundaries", cancellation_timeout=5.0, when=_has_warm_schedule)
    async def warm_boundaries(**kw: Any) -> None:
        await follow_warm_boundaries(kw["memo"]["state"], kw["body"], kw["stopped"], kw["children"], kw["models"])

    # Predictor pods (KServe's label names their InferenceService): the step a starting one is at.
    @kopf.on.event("", "v1", "pods", registry=registry, labels={POD_LABEL: kopf.PRESENT}, id="follow-predictor-pods")
    async def on_pod_event(**kw: Any) -> None:
        await follow_pod_event(kw["memo"]["state"], kw["event"]["type"], kw["body"], kw["models"])

    @kopf.on.event(*um, registry=registry, id="follow-predictor-report")
    async def on_model_event(**kw: Any) -> None:
        if kw["event"]["type"] in ("ADDED", "MODIFIED"):
            await follow_predictor_report(kw["memo"]["state"], kw["body"], kw["children"], kw["models"])

    @kopf.on.event(*um, registry=registry, id="forget-deleted")
    async def forget(**kw: Any) -> None:
        if kw["event"]["type"] == "DELETED":
            state: OperatorState = kw["memo"]["state"]
            state.forget(_key(kw["body"]))
            try:
                uri = local_model.cached_uri(parse_model(_plain(kw["body"])))
            except SpecError:
                return
            if uri is not None:
                delete_cache_when_unused(state, local_model.cache_name(uri), kw["models"])

    if config.kserve.local_model_cache:
        # LocalModelCaches (cluster-scoped): their progress into the status of the models using them; and the
        # ones this operator made that no model uses any more are deleted (also those left from before a restart).
        @kopf.on.event(
            local_model.GROUP, local_model.VERSION, local_model.PLURAL, registry=registry, id="follow-caches"
        )
        async def on_cache_event(**kw: Any) -> None:
            await follow_cache_event(kw["memo"]["state"], kw["event"]["type"], kw["body"], kw["children"], kw["models"])

    @kopf.on.cleanup(registry=registry, id="stop-cache-deletions")
    async def stop_cache_deletions(memo: kopf.Memo, **_: Any) -> None:
        state: OperatorState | None = memo.get("state")
        for task in state.cache_deletions.values() if state else ():
            task.cancel()

    return registry


#: How often, and how many times, a cache no model uses is deleted again while KServe refuses (still in use: the
#: InferenceService that mounted it is being deleted, or KServe's controller has not noticed yet).
CACHE_DELETE_RETRY_S = 5.0
CACHE_DELETE_ATTEMPTS = 120


def _cache_users(models: Mapping[Key, Any] | None, uri: str, *, mounting: bool) -> list[dict[str, Any]]:
    """The models (bodies) whose cache is ``uri``'s; with ``mounting``, also those whose source KServe would match
    to it without asking (a file or folder inside the cached source)."""
    users = []
    for key in models or {}:
        body = _index_value(models, key)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            continue
        try:
            model = parse_model(body)
        except SpecError:
            continue
        if local_model.cached_uri(model) == uri or (
            mounting and model.spec.source.is_remote and local_model.covers(uri, model.spec.source.storage_uri)
        ):
            users.append(body)
    return users


async def follow_cache_event(
    state: OperatorState,
    event_type: str,
    cache: Mapping[str, Any],
    children: Mapping[Key, Any] | None,
    models: Mapping[Key, Any] | None,
) -> None:
    """A LocalModelCache changed: reconcile the models it concerns (their status, and the opt-out annotation that is
    lifted once every node holds the model); delete it if it is this operator's and no model uses it."""
    plain = _plain(cache)
    name = str(plain["metadata"]["name"])
    if event_type == "DELETED":
        state.caches.pop(name, None)
    else:
        state.caches[name] = plain
    uri = str((plain.get("spec") or {}).get("sourceModelUri") or "")
    if not uri:
        return
    for body in _cache_users(models, uri, mounting=True):
        await reconcile_model(state, body, children, reason="its LocalModelCache changed", models=models)
    for body in _pool_cache_users(state, uri):
        await reconcile_pool(state, body, reason="its LocalModelCache changed")
    if event_type != "DELETED" and local_model.managed(plain):
        delete_cache_when_unused(state, name, models)


def delete_cache_when_unused(state: OperatorState, name: str, models: Mapping[Key, Any] | None) -> None:
    """Start deleting the operator's cache ``name`` if no model asks for it (:func:`_delete_unused_cache`)."""
    cache = state.caches.get(name)
    if cache is None or not local_model.managed(cache):
        return
    uri = str((cache.get("spec") or {}).get("sourceModelUri") or "")
    if _cache_users(models, uri, mounting=False) or _pool_cache_users(state, uri):
        return
    running = state.cache_deletions.get(name)
    if running is None or running.done():
        state.cache_deletions[name] = asyncio.create_task(_delete_unused_cache(state, name, uri, models))


async def _delete_unused_cache(state: OperatorState, name: str, uri: str, models: Mapping[Key, Any] | None) -> None:
    """Delete the cache, again while KServe's webhook refuses it (an InferenceService still uses it: KServe v0.16.0
    pkg/webhook/admission/localmodelcache/local_model_cache_validation.go ValidateDelete), until a model asks for it
    again or it is gone."""
    for _ in range(CACHE_DELETE_ATTEMPTS):
        if name not in state.caches or _cache_users(models, uri, mounting=False) or _pool_cache_users(state, uri):
            return
        try:
            await state.api.delete_local_model_cache(name)
        except ApiError as exc:
            if api_error_code(exc) == 404:
                state.caches.pop(name, None)
                return
            logger.info("LocalModelCache %s is unused but not deleted yet (%s); retrying", name, exc)
            await asyncio.sleep(CACHE_DELETE_RETRY_S)
            continue
        logger.info("deleted LocalModelCache %s: no UniversalModel uses %s any more", name, uri)
        return
    logger.warning("LocalModelCache %s is unused but KServe kept refusing its deletion; delete it by hand", name)


async def mirror_child_event(
    state: OperatorState, event_type: str, child: Mapping[str, Any], models: Mapping[Key, Any] | None
) -> None:
    """A watched InferenceService changed: mirror its status into the parent, or recreate it if deleted."""
    key = _key(child)
    parent = _index_value(models, key)
    if parent is None or not _owned_by(child, parent) or parent.get("metadata", {}).get("deletionTimestamp"):
        return
    if event_type == "DELETED":
        state.latest_child.pop(key, None)
        logger.info("InferenceService %s/%s was deleted out of band; recreating it", *key)
        await reconcile_model(state, parent, None, reason="deleted out of band", models=models)
        return
    state.latest_child[key] = _plain(child)
    try:
        await sync_status(state, parent, _plain(child))
    except SpecError:
        return  # an invalid parent already says so in its status


def _has_warm_schedule(body: Mapping[str, Any], **_: Any) -> bool:
    return bool(((body.get("spec") or {}).get("scaling") or {}).get("warmSchedule"))


#: How far past a window's boundary the daemon reconciles (clock skew between a sleep and the clock it reads).
BOUNDARY_SLACK_S = 0.5
#: The longest the daemon sleeps before reading the schedule again (a spec change may bring a boundary closer).
BOUNDARY_RECHECK_S = 300.0


async def follow_warm_boundaries(
    state: OperatorState,
    body: Mapping[str, Any],
    stopped: Any,
    children: Mapping[Key, Any] | None,
    models: Mapping[Key, Any] | None = None,
) -> None:
    """Sleep until the model's next warm-window boundary (``status.warmSchedule.nextChange``), then reconcile: the
    InferenceService's minReplicas and the status change at the boundary. ``body`` is kopf's live view."""
    while not stopped:
        try:
            model = parse_model(_plain(body))
        except SpecError:
            return
        schedule = model.spec.scaling.warm_schedule
        if not schedule:
            return
        _, next_change = warm_at(schedule, state.clock())
        wait = BOUNDARY_RECHECK_S
        if next_change is not None:
            wait = min(wait, max(0.0, (next_change - state.clock()).total_seconds()) + BOUNDARY_SLACK_S)
        await stopped.wait(wait)
        if stopped or next_change is None or state.clock() < next_change:
            continue
        await reconcile_model(state, body, children, reason="a warm window began or ended", models=models)


async def follow_pod_event(
    state: OperatorState, event_type: str, pod: Mapping[str, Any], models: Mapping[Key, Any] | None
) -> None:
    """A predictor pod changed: keep what its step needs and restate its model (Waking, and the step)."""
    meta = pod.get("metadata") or {}
    key = (str(meta.get("namespace")), str((meta.get("labels") or {}).get(POD_LABEL)))
    known = state.pods.setdefault(key, {})
    if event_type == "DELETED":
        known.pop(str(meta.get("name")), None)
    else:
        known[str(meta.get("name"))] = compact(_plain(pod))
    if not known:
        state.pods.pop(key, None)
    parent = _index_value(models, key)
    if parent is None or key not in state.latest_child or parent.get("metadata", {}).get("deletionTimestamp"):
        return  # no model, or not its child's pods (not applied yet, or a foreign InferenceService's)
    try:
        await sync_status(state, parent, None)
    except SpecError:
        return  # an invalid parent already says so in its status


async def follow_predictor_report(
    state: OperatorState,
    body: Mapping[str, Any],
    children: Mapping[Key, Any] | None,
    models: Mapping[Key, Any] | None = None,
) -> None:
    """The gateway wrote which backend the predictor runs (``status.predictorReport``): reconcile when that changes
    the backend the status reports.

    kopf's update handlers never see it (a status change is not a spec change), so this event handler does; the
    reconcile rewrites the status and, the spec being the same, leaves the InferenceService alone. Only a report
    for the generation the status already describes counts (a newer spec is being reconciled anyway), and once the
    status says that backend the next event finds nothing to do: no loop.
    """
    plain = _plain(body)
    if plain.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        model = parse_model(plain)
    except SpecError:
        return
    report, generation = model.status.predictor_report, model.metadata.generation
    if report is None or model.status.observed_generation != generation:
        return
    shown = [a.model_dump(mode="json", by_alias=True, exclude_none=True) for a in model.status.adapters]
    if shown != adapter_statuses(model):
        await reconcile_model(state, body, children, reason="the predictor reported its adapters", models=models)
        return
    if report.generation != generation or model.status.backend == reported_backend(model).value:
        return
    await reconcile_model(state, body, children, reason="the predictor reported its backend", models=models)


async def _pool_of(state: OperatorState, namespace: str, name: str) -> UniversalModelPool | None:
    """The pool as last seen, else as the API server has it (the pools' watch may not have listed it yet)."""
    body = state.pools.get((namespace, name))
    if body is None:
        try:
            body = await state.api.get_pool(namespace, name)
        except ApiError as exc:
            raise kopf.TemporaryError(f"reading the UniversalModelPool failed: {exc}", delay=RETRY_DELAY) from exc
        if body is None:
            return None
        state.pools[(namespace, name)] = body
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    try:
        return parse_pool(body)
    except SpecError:
        return None


def _all_models(state: OperatorState) -> list[UniversalModel]:
    found = []
    for key in state.model_index or {}:
        body = _index_value(state.model_index, key)
        if body is None:
            continue
        try:
            found.append(parse_model(body))
        except SpecError:
            continue
    return found


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None and k != "lastTransitionTime"}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _pool_status_changed(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether a merge patch of ``new`` would change what ``current`` says (None removes; times aside)."""
    current = current or {}
    return any(_strip_none(current.get(key)) != _strip_none(value) for key, value in new.items())


async def reconcile_member(state: OperatorState, body: dict[str, Any], model: UniversalModel) -> None:
    """A model with spec.pool: no child of its own; its status says where its pool is (``Pooled``), and its pool's
    members ConfigMap lists it (the pool is reconciled)."""
    key = _key(body)
    pool = await _pool_of(state, key[0], str(model.spec.pool))
    status = member_status(model, pool, state.clock(), state.config)
    async with state.lock(key):
        known = state.written_status.get(key, _plain(body.get("status") or {}))
        if _pool_status_changed(known, status):
            try:
                await state.api.patch_model_status(key[0], key[1], status)
            except ApiError as exc:
                if api_error_code(exc) != 404:
                    raise kopf.TemporaryError(f"writing the status failed: {exc}", delay=RETRY_DELAY) from exc
                return
            state.written_status[key] = {**known, **status}
            if pool is None:
                kopf.warn(cast(kopf.Body, body), reason="PoolMissing", message=str(status["message"]))
    if pool is not None:
        pool_body = state.pools.get((key[0], pool.metadata.name))
        if pool_body is not None:
            await reconcile_pool(state, pool_body, reason=f"member {key[1]} changed")


async def reconcile_pool(state: OperatorState, body: Mapping[str, Any], *, reason: str = "reconcile") -> None:
    """Make the pool's members ConfigMap and InferenceService match its spec and members, then its status."""
    key = _key(body)
    async with state.reconciling.setdefault(("pool", f"{key[0]}/{key[1]}"), asyncio.Lock()):
        await _reconcile_pool(state, _plain(body), reason)


async def _reconcile_pool(state: OperatorState, body: dict[str, Any], reason: str) -> None:
    key = _key(body)
    try:
        pool = parse_pool(body)
        members = members_of(pool, _all_models(state))
        desired_map = desired_members_config_map(pool, members)
    except SpecError as error:
        await _report_invalid_pool(state, body, error)
        return
    # The pool's LocalModelCache (spec.cache) by the single model's code, its stand-in naming the cached folder.
    cache = await ensure_cache(state, body, stand_in(pool), state.model_index, 0) if pool.spec.cache else None
    try:
        desired = desired_pool_inference_service(pool, state.config, now=state.clock(),
                                                 live=state.pool_children.get(key), cache=cache)  # fmt: skip
    except SpecError as error:
        await _report_invalid_pool(state, body, error)
        return
    namespace = key[0]
    try:
        actual_map = await state.api.get_config_map(namespace, desired_map["metadata"]["name"])
        live = state.pool_children.get(key) or await state.api.get_inference_service(namespace, pool_service_name(pool))
        # Read afresh at every reconcile (the pool's repair timer too), so a rotated key follows.
        found, actual_credentials = await read_credentials(state, namespace, member_secrets(members),
                                                           credentials_secret_name(pool))  # fmt: skip
    except ApiError as exc:
        raise kopf.TemporaryError(f"reading the pool's children failed: {exc}", delay=RETRY_DELAY) from exc
    for child in (actual_map, actual_credentials, live):
        if child is not None and not _owned_by(child, body):
            kind = child.get("kind") or "object"
            await _report_invalid_pool(state, body, SpecError(
                "metadata.name",
                f"the {kind} {child['metadata']['name']!r} the pool needs already exists in {namespace!r} and is not "
                "owned by this UniversalModelPool; rename the pool or remove that object",
            ))  # fmt: skip
            return
    _warn_missing_member_secrets(state, namespace, pool, members, found)
    desired_credentials = desired_pool_credentials_secret(pool, found)
    try:
        # The credentials and the members first: a new pod must find both; an added member changes only these. The
        # credentials before the list, so that a running pod tends to see a new member's copy before the member.
        if data_drifted(desired_credentials, actual_credentials):
            await state.api.apply_secret(desired_credentials)
            logger.info("applied Secret %s/%s: copies of %d credentials Secrets", namespace,
                        desired_credentials["metadata"]["name"], len(desired_credentials["data"]))  # fmt: skip
        if data_drifted(desired_map, actual_map):
            await state.api.apply_config_map(desired_map)
            logger.info("applied ConfigMap %s/%s: %d members", namespace, desired_map["metadata"]["name"],
                        len(members))  # fmt: skip
        if child_drifted(desired, live):
            live = await state.api.apply_inference_service(desired)
            logger.info("applied InferenceService %s/%s for pool %s (%s)", namespace, desired["metadata"]["name"],
                        key[1], reason)  # fmt: skip
    except ApiError as exc:
        code = api_error_code(exc)
        if code in (400, 422) or denied_by_webhook(exc):
            refused = SpecError("spec", f"the pool's InferenceService was rejected: {exc}")
            await _report_invalid_pool(state, body, refused)
            return
        raise kopf.TemporaryError(f"applying the pool's children failed ({code}): {exc}", delay=RETRY_DELAY) from exc
    if live is not None:
        state.pool_children[key] = _newer(state.pool_children.get(key), live) or live
    await _write_pool_status(state, key, body, pool_status(pool, state.pool_children.get(key), members,
                                                            state.clock(), state.config, cache))  # fmt: skip


def _warn_missing_member_secrets(
    state: OperatorState,
    namespace: str,
    pool: UniversalModelPool,
    members: list[UniversalModel],
    found: Mapping[str, Any],
) -> None:
    """A Warning Event on each member whose credentialsSecret does not exist (once while it stays missing)."""
    for model in members:
        member_key = (namespace, model.metadata.name)
        member_body = _index_value(state.model_index, member_key)
        secret = model.spec.source.credentials_secret
        if member_body is None:
            continue
        missing = frozenset({secret}) if secret is not None and found.get(secret) is None else frozenset()
        warn_missing_secrets(
            state, member_key, member_body, missing, "CredentialsMissing",
            lambda name: f"Secret {name!r}, this model's spec.source.credentialsSecret, does not exist in "
            f"{namespace!r}: the pool {pool.metadata.name!r} cannot fetch its source until it does (the pool's other "
            "members serve on); create it, or fix the name",
        )  # fmt: skip


async def _write_pool_status(state: OperatorState, key: Key, body: dict[str, Any], status: dict[str, Any]) -> None:
    known = state.written_pool_status.get(key, body.get("status") or {})
    if not _pool_status_changed(known, status):
        return
    try:
        await state.api.patch_pool_status(key[0], key[1], status)
    except ApiError as exc:
        if api_error_code(exc) == 404:
            return
        raise kopf.TemporaryError(f"writing the pool's status failed: {exc}", delay=RETRY_DELAY) from exc
    state.written_pool_status[key] = status
    # Members read the pool's phase and address: restate them (a member's own events do the rest).
    pool = parse_pool({**body, "status": status})
    for model in members_of(pool, _all_models(state)):
        member_key = (model.metadata.namespace, model.metadata.name)
        member_body = _index_value(state.model_index, member_key)
        if member_body is None:
            continue
        new = member_status(model, pool, state.clock(), state.config)
        async with state.lock(member_key):
            current = state.written_status.get(member_key, member_body.get("status") or {})
            if _pool_status_changed(current, new):
                with contextlib.suppress(ApiError):
                    await state.api.patch_model_status(*member_key, new)
                    state.written_status[member_key] = {**current, **new}


async def _report_invalid_pool(state: OperatorState, body: dict[str, Any], error: SpecError) -> None:
    """SpecValid=False on the pool, one Warning Event naming the field; no retry (the spec must change)."""
    key = _key(body)
    status = status_for_invalid_spec(body, error, state.clock())
    status.pop("servedName", None)
    status.pop("step", None)
    known = state.written_pool_status.get(key, body.get("status") or {})
    if _pool_status_changed(known, status):
        with contextlib.suppress(ApiError):
            await state.api.patch_pool_status(key[0], key[1], status)
            state.written_pool_status[key] = status
            kopf.warn(cast(kopf.Body, body), reason="InvalidSpec", message=str(error))
    logger.warning("UniversalModelPool %s/%s has an invalid spec: %s", key[0], key[1], error)


async def forget_pool(state: OperatorState, key: Key) -> None:
    """The pool is gone (its InferenceService and ConfigMap with it, by garbage collection): its members say so, and
    its LocalModelCache goes too when no model or other pool names its source."""
    gone = state.pools.pop(key, None)
    state.pool_children.pop(key, None)
    state.written_pool_status.pop(key, None)
    for model in _all_models(state):
        if model.spec.pool == key[1] and model.metadata.namespace == key[0] and not model.metadata.deleting:
            body = _index_value(state.model_index, (key[0], model.metadata.name))
            if body is not None:
                await reconcile_member(state, body, model)
    try:
        cached = local_model.cached_uri(stand_in(parse_pool(gone))) if gone is not None else None
    except SpecError:
        cached = None
    if cached is not None:
        delete_cache_when_unused(state, local_model.cache_name(cached), state.model_index)


async def follow_pool_child_event(state: OperatorState, event_type: str, child: Mapping[str, Any]) -> None:
    """A pool's InferenceService changed: its status into the pool's (and the members'); recreated if deleted."""
    meta = child.get("metadata") or {}
    key = (str(meta.get("namespace")), str((meta.get("labels") or {}).get(LABEL_POOL)))
    body = state.pools.get(key)
    if body is None or not _owned_by(child, body) or (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    if event_type == "DELETED":
        state.pool_children.pop(key, None)
    else:
        state.pool_children[key] = _plain(child)
    await reconcile_pool(state, body, reason="its InferenceService changed")


async def follow_member_event(state: OperatorState, event_type: str, body: Mapping[str, Any]) -> None:
    """A UniversalModel that is, or was, a pool's member changed or went: the pools it concerns are reconciled (their
    members ConfigMap and status). kopf's update handlers miss status-only changes (the gateway's report)."""
    plain = _plain(body)
    namespace = str((plain.get("metadata") or {}).get("namespace") or "default")
    named = ((plain.get("spec") or {}).get("pool")) if isinstance(plain.get("spec"), dict) else None
    for key in list(state.pools):
        pool_body = state.pools.get(key)
        if pool_body is None or key[0] != namespace:
            continue
        listed = [m.get("name") for m in ((pool_body.get("status") or {}).get("members") or [])]
        if key[1] == named or plain["metadata"]["name"] in listed:
            if event_type != "DELETED" and key[1] == named:
                try:
                    model = parse_model(plain)
                except SpecError:
                    continue
                await reconcile_member(state, plain, model)  # reconciles the pool too
            else:
                await reconcile_pool(state, pool_body, reason="a member left")


def _owned_by(child: Mapping[str, Any], parent: Mapping[str, Any]) -> bool:
    uid = parent.get("metadata", {}).get("uid")
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)
