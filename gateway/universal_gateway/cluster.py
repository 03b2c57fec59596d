"""KubernetesBackends: route to the UniversalModels the operator serves, from their status.

The gateway watches UniversalModels (one namespace, several, or all) and routes each ``servedName``
to ``status.address``. Knative-mode models need nothing more: Knative's activator holds a request
while a replica starts, up to the revision's timeout, so the gateway waits exactly as long (the
model's ``status.requestTimeoutSeconds``, the operator's rendering of that timeout).

Standard-mode models have no activator, so their TTL is ours: the gateway owns the
``serving.kserve.io/stop`` annotation on the InferenceService. Server-side apply keeps the operator's
field manager off an annotation it never sets, so the two never fight. Idle past ``idleTimeout`` ->
``stop: "true"``; a request for a stopped model removes it and is held until the model reports Ready
(bounded by ``startupTimeout``, then 503); concurrent requests share one wake. Where the cluster's
KServe cannot stop a Standard-mode model (before 0.16), the operator says so in the model's ``IdleStop``
condition and the gateway never tries: the model stays running.

A gateway replica sees only its own traffic, so before stopping a model it asks the model itself:
every ready replica of its predictor (their ``/metrics``: requests in flight and the time of the latest
one), found through the EndpointSlices of the predictor Service; asking through the Service would reach
one replica only. That costs ``list`` on EndpointSlices and no writes; recording use on the
InferenceService would write (and KServe copies its annotations onto the pods, so every write would roll
them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.discovery_v1 import EndpointSlice
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families

from universal_gateway.backends import SYSTEM_CLOCK, Backends, Clock, ModelState, ModelView, UsageStats, counted
from universal_gateway.key_secrets import KeySecrets
from universal_gateway.kube_watch import describe as _describe
from universal_gateway.kube_watch import expired, retry_delay
from universal_gateway.policy import ServingPolicy, is_idle
from universal_gateway.predictor_report import PredictorReporter
from universal_operator import kserve
from universal_operator.kube import InferenceService, UniversalModelResource
from universal_operator.spec import (
    CONDITION_IDLE_STOP,
    READY_STOPPED_BY_HAND,
    Phase,
    ScalingMode,
    SpecError,
    UniversalModel,
    UniversalModelStatus,
    parse_model,
)
from universal_predictors import metric_names
from universal_predictors.catalog import Task
from universal_predictors.errors import Unavailable

logger = logging.getLogger(__name__)

FIELD_MANAGER = "universal-runtime-gateway"

#: How long the reaper waits for a replica's /metrics (one that does not answer counts as busy).
METRICS_TIMEOUT_S = 2.0
#: The label the EndpointSlice controller puts on a Service's slices (discovery.k8s.io/v1).
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
#: A failed stop is retried after 5 s, 10 s, 20 s... at most every 5 minutes.
STOP_RETRY_FIRST_S = 5.0
STOP_RETRY_MAX_S = 300.0


ENDPOINT_SLICES_HINT = (
    "the gateway needs `list` on endpointslices.discovery.k8s.io to ask every replica of a Standard-mode "
    "model before stopping it: upgrade the Helm chart (gateway.standardMode=true grants it)"
)


def predictor_service(isvc_name: str) -> str:
    """The Service KServe gives a RawDeployment (Standard-mode) predictor: ``{name}-predictor``.

    KServe v0.16.0 pkg/constants/constants.go PredictorServiceName, used by
    pkg/controller/v1beta1/inferenceservice/components/predictor.go; v0.14.1 and v0.15.2 name it so too,
    unless a ``{name}-predictor-default`` Service from before KServe 0.9 already exists (then no slices
    match, and the reaper asks through the model's address instead).
    """
    return f"{isvc_name}-predictor"


STANDARD_MODE_HINT = (
    f"the gateway needs `patch` on {kserve.PLURAL}.{kserve.GROUP} to stop idle Standard-mode models: "
    "install the Helm chart with gateway.standardMode=true (the rules of "
    "universal_gateway.cluster.rbac_rules(standard_mode=True))"
)


def rbac_rules(*, standard_mode: bool) -> list[dict[str, list[str]]]:
    """The RBAC rules the gateway's ServiceAccount needs, and nothing more.

    Watching UniversalModels is all a Knative-only gateway reads; its one write is ``patch`` on their ``status``
    subresource, which cannot change a spec: ``status.predictorReport``, the backend a predictor says it runs
    (:mod:`universal_gateway.predictor_report`). ``patch`` on InferenceServices is for the
    Standard-mode TTL (the stop annotation), and ``list`` on EndpointSlices for its idle check (every ready
    replica of the predictor Service is asked). A Role per watched namespace or one ClusterRole grants
    these; the tests hold the gateway to exactly this list.
    """
    rules = [
        {
            "apiGroups": [UniversalModelResource._api_info.resource.group],
            "resources": [UniversalModelResource._api_info.plural],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": [UniversalModelResource._api_info.resource.group],
            "resources": [f"{UniversalModelResource._api_info.plural}/status"],
            "verbs": ["patch"],
        },
    ]
    if standard_mode:
        rules.append(
            {
                "apiGroups": [InferenceService._api_info.resource.group],
                "resources": [InferenceService._api_info.plural],
                "verbs": ["patch"],
            }
        )
        rules.append(
            {
                "apiGroups": [EndpointSlice._api_info.resource.group],
                "resources": [EndpointSlice._api_info.plural],
                "verbs": ["list"],
            }
        )
    return rules


_PHASES = {
    Phase.READY: ModelState.READY,
    Phase.IDLE: ModelState.IDLE,
    Phase.PENDING: ModelState.LOADING,
    Phase.LOADING: ModelState.LOADING,
    Phase.WAKING: ModelState.LOADING,  # leaving zero: held (Standard) or passed to Knative's activator, as Loading
    Phase.FAILED: ModelState.FAILED,
}

Key = tuple[str, str]  # (namespace, name)


@dataclass
class ClusterModel:
    """What the gateway knows of one UniversalModel: the object, parsed once per change, and its bookkeeping."""

    model: UniversalModel
    policy: ServingPolicy = field(init=False)
    stats: UsageStats = field(default_factory=UsageStats)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set while the model is Ready or Failed: what a request held for it waits on.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    waking: asyncio.Task[None] | None = None
    stop_requested: bool = False
    #: Latest use another gateway replica served, as the model reported it (monotonic seconds).
    used_elsewhere: float = 0.0
    #: Consecutive failed stop patches, and when the next may be tried (monotonic seconds).
    stop_failures: int = 0
    stop_retry_at: float = 0.0

    def __post_init__(self) -> None:
        self.policy = ServingPolicy.from_model(self.model)

    def update(self, model: UniversalModel) -> None:
        """The object as the API server now has it."""
        self.model = model
        self.policy = ServingPolicy.from_model(model)

    @property
    def namespace(self) -> str:
        return self.model.metadata.namespace

    @property
    def name(self) -> str:
        return self.model.metadata.name

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)

    @property
    def precedence(self) -> tuple[str, str, str]:
        """Who serves a name several models claim: the oldest, then by namespace/name (RFC 3339 sorts)."""
        return (self.model.metadata.creation_timestamp, self.namespace, self.name)

    @property
    def status(self) -> UniversalModelStatus:
        return self.model.status

    @property
    def served_name(self) -> str:
        return self.status.served_name or self.model.served_name

    @property
    def task(self) -> Task:
        return self.model.spec.task

    @property
    def state(self) -> ModelState:
        phase = self.status.phase
        return _PHASES[phase] if phase is not None else ModelState.LOADING

    @property
    def address(self) -> str | None:
        address = self.status.address
        return address.rstrip("/") if address else None

    @property
    def standard_mode(self) -> bool:
        return self.policy.mode is ScalingMode.STANDARD

    @property
    def request_timeout(self) -> float:
        """How long a request may wait for its first byte: the operator's rendering of the predictor's KServe
        ``timeout`` (in Knative mode the activator answers 504 after it), else the startupTimeout."""
        rendered = self.status.request_timeout_seconds
        return float(rendered) if rendered is not None and rendered > 0 else self.policy.startup_timeout

    @property
    def stop_supported(self) -> bool:
        """False when the operator reports the cluster's KServe cannot stop this model (condition IdleStop)."""
        for condition in self.status.conditions:
            if condition.type == CONDITION_IDLE_STOP:
                return condition.status != "False"
        return True

    @property
    def last_used(self) -> float:
        """The latest use any gateway replica is known to have served (monotonic seconds)."""
        return max(self.stats.last_used_monotonic, self.used_elsewhere)


@dataclass
class _WatchHealth:
    """One namespace's watch, for readiness: listed once yet, and the error since the last good list."""

    listed: bool = False
    error: str | None = None


class KubernetesBackends(Backends):
    """UniversalModels in the cluster as the gateway's backends."""

    def __init__(
        self,
        namespaces: Sequence[str] = (),
        *,
        client: AsyncClient | None = None,
        reap_interval: float = 1.0,
        watch_timeout: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
        key_secrets: KeySecrets | None = None,
    ) -> None:
        self._namespaces = list(namespaces) or ["*"]
        #: API keys from labelled Secrets (``--api-key-secrets``): watched while the backends run; part of readiness.
        self.key_secrets = key_secrets
        self._client = client
        self._all: dict[Key, ClusterModel] = {}
        self._models: dict[str, ClusterModel] = {}  # served name -> the model serving it
        self._shadowed: dict[Key, Key] = {}  # a model not routed -> the one serving its name
        self._invalid: dict[Key, str] = {}  # a model whose object does not parse -> why (logged once)
        self._tasks: list[asyncio.Task[None]] = []
        self._reap_interval = reap_interval
        self._watch_timeout = watch_timeout  # the API server ends each watch after this (None: its default)
        self._clock = clock  # what Standard mode's TTL is judged by: each use, each stop and its retries
        self._health = {namespace: _WatchHealth() for namespace in self._namespaces}
        self._synced = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self._reporter = PredictorReporter(lambda: self.client)

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(field_manager=FIELD_MANAGER)
        return self._client

    async def start(self) -> None:
        for namespace in self._namespaces:
            self._tasks.append(asyncio.create_task(self._watch(namespace), name=f"watch-{namespace}"))
        self._tasks.append(asyncio.create_task(self._reap_idle(), name="standard-mode-ttl"))
        if self.key_secrets is not None:
            await self.key_secrets.start()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._reporter.close()
        if self.key_secrets is not None:
            await self.key_secrets.close()
        if self._http is not None:
            await self._http.close()
        if self._client is not None:
            await self._client.close()

    async def wait_synced(self, within: float = 30.0) -> None:
        """Return once every watched namespace has been listed."""
        await asyncio.wait_for(self._synced.wait(), within)

    def readiness(self) -> str | None:
        if self.key_secrets is not None and (reason := self.key_secrets.readiness()) is not None:
            return reason
        for namespace, health in self._health.items():
            where = "all namespaces" if namespace == "*" else f"namespace {namespace!r}"
            if not health.listed:
                detail = f" (last error: {health.error})" if health.error else ""
                return f"UniversalModels in {where} are not listed yet{detail}; routes are incomplete."
            if health.error is not None:
                return f"Watching UniversalModels in {where} fails ({health.error}); routes may be stale."
        return None

    # -- watching ----------------------------------------------------------------------------------

    async def _watch(self, namespace: str) -> None:
        """List, then watch from the list's resourceVersion; on any failure, list again.

        The list is how the gateway knows it has seen every model (a watch on an empty namespace says
        nothing), and listing again after a failure drops models deleted while the watch was down."""
        health = self._health[namespace]
        failures = 0
        while True:
            try:
                listing = self.client.list(UniversalModelResource, namespace=namespace)
                items: list[Any] = [item async for item in listing]
                bodies = [item.to_dict() for item in items]
                self._replace(namespace, bodies)
                health.listed, health.error, failures = True, None, 0
                if all(h.listed for h in self._health.values()):
                    self._synced.set()
                async for kind, obj in self.client.watch(
                    UniversalModelResource,
                    namespace=namespace,
                    resource_version=listing.resourceVersion,
                    server_timeout=self._watch_timeout,
                ):
                    raw: Any = obj
                    self._observe(kind, raw.to_dict())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped watch: list and resume, as any controller does
                health.error = _describe(exc)
                gone = expired(exc)
                delay = 0.0 if gone else retry_delay(failures)
                failures = 0 if gone else failures + 1
                logger.log(logging.INFO if gone else logging.WARNING,
                           "watching UniversalModels in %s failed (%s); retrying", namespace, health.error)  # fmt: skip
                await asyncio.sleep(delay)

    def _replace(self, namespace: str, bodies: Iterable[dict[str, Any]]) -> None:
        """Make a namespace's models (all of them for ``*``) those of a fresh list."""
        listed = {self._upsert(body) for body in bodies}
        for key in [k for k in self._all if namespace in ("*", k[0]) and k not in listed]:
            del self._all[key]
        self._route()

    def _observe(self, kind: str, body: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._all.pop(self._key(body), None)
            self._invalid.pop(self._key(body), None)
        elif kind in ("ADDED", "MODIFIED"):
            self._upsert(body)
        self._route()

    @staticmethod
    def _key(body: dict[str, Any]) -> Key:
        """Which object a body is, read before (and whether or not) it parses."""
        meta = body.get("metadata") or {}
        return (str(meta.get("namespace") or "default"), str(meta.get("name")))

    def _upsert(self, body: dict[str, Any]) -> Key:
        key = self._key(body)
        try:
            parsed = parse_model(body)
        except SpecError as error:
            # Not one the operator serves either (it reports why in the model's status): not routed.
            self._all.pop(key, None)
            if self._invalid.get(key) != str(error):
                logger.warning("UniversalModel %s/%s is not routed: %s", key[0], key[1], error)
            self._invalid[key] = str(error)
            return key
        self._invalid.pop(key, None)
        model = self._all.get(key)
        if model is None:
            model = self._all[key] = ClusterModel(parsed, stats=UsageStats(clock=self._clock))
        else:
            was = model.status.phase
            model.update(parsed)
            if was is Phase.IDLE and model.status.phase is Phase.WAKING:
                self.wake_steps.wake(model.served_name)
        self.wake_steps.moved(model.served_name, model.status.step, self._clock.monotonic())
        if model.state is ModelState.READY:
            if not model.ready.is_set():
                # Just up: whichever replica woke it holds a request that has not reached it yet, so
                # the model's own metrics cannot show that use; count it as used now.
                model.used_elsewhere = max(model.used_elsewhere, self._clock.monotonic())
            model.ready.set()
            model.stop_requested = False
        else:
            model.ready.clear()
        if model.state in (ModelState.READY, ModelState.FAILED):
            model.settled.set()
        else:
            model.settled.clear()
        return key

    def _route(self) -> None:
        """Served name -> model. Two models claiming one name: the oldest serves it, deterministically
        (whichever event came last must not decide), and the other is reported once."""
        claims: dict[str, list[ClusterModel]] = {}
        for model in self._all.values():
            claims.setdefault(model.served_name, []).append(model)
        routes: dict[str, ClusterModel] = {}
        shadowed: dict[Key, Key] = {}
        for name, models in claims.items():
            winner, *others = sorted(models, key=lambda m: m.precedence)
            routes[name] = winner
            if winner.key in self._shadowed:
                logger.info("%s/%s now serves %r", winner.namespace, winner.name, name)
            for other in others:
                shadowed[other.key] = winner.key
                if self._shadowed.get(other.key) != winner.key:
                    logger.warning(
                        "UniversalModels %s/%s and %s/%s both serve %r: %s/%s is older and serves it; "
                        "%s/%s is not routed until the other is gone or renamed",
                        winner.namespace, winner.name, other.namespace, other.name, name,
                        winner.namespace, winner.name, other.namespace, other.name,
                    )  # fmt: skip
        self._models = routes
        self._shadowed = shadowed

    # -- Backends ----------------------------------------------------------------------------------

    def models(self) -> list[ModelView]:
        return [
            ModelView(
                name=m.served_name,
                task=m.task,
                backend=m.status.backend or m.model.spec.backend.value,
                state=m.state,
                message=m.status.message or "",
                endpoint=m.address,
                stats=m.stats,
                adapters=tuple(a.name for a in m.model.spec.adapters),
                extra={
                    "namespace": m.namespace,
                    "mode": m.policy.mode.value,
                    "url": m.status.url,
                    **({"step": m.status.step} if m.status.step else {}),
                    **({"max_held_requests": m.policy.max_held} if m.policy.max_held else {}),
                },
            )
            for m in self._models.values()
        ]

    def find(self, name: str) -> ModelView | None:
        return next((v for v in self.models() if v.name == name), None) if name in self._models else None

    def upstream_timeout(self, name: str) -> float | None:
        model = self._models.get(name)
        return model.request_timeout if model is not None else None

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[str]:
        model = self._models.get(name)
        if model is None:  # deleted between the gateway's lookup and now
            raise Unavailable(f"The model {name!r} is being removed.", code="model_not_found", retry_after=5)
        async with counted(model.stats):
            self._raise_if_failed(model)  # a failed model is not woken: it answers 503 at once
            if model.standard_mode and model.state is not ModelState.READY:
                if model.stop_supported:
                    await self._wake(model)
                else:  # never stopped (KServe cannot): it is starting or rolling out
                    await self._wait_ready(model, model.policy.startup_timeout)
            self._raise_if_failed(model)
            if model.address is None:
                if not model.standard_mode:
                    await self._wait_ready(model, model.policy.startup_timeout)
                if model.address is None:
                    raise Unavailable(f"The model {name!r} has no address yet; it is being created.",
                                      code="model_loading", retry_after=5)  # fmt: skip
            yield model.address
        # Relayed: the predictor is up, so it can say which backend ``auto`` chose without being woken.
        self._reporter.served(model.key, model.model, model.address, self.upstream_token)
        pool = model.model.spec.pool
        if pool is not None:  # the pool's one card list says every member's state: a crash, an eviction, an unload
            for other in list(self._models.values()):
                if other is not model and other.key[0] == model.key[0] and other.model.spec.pool == pool \
                        and other.address is not None:  # fmt: skip
                    self._reporter.served(other.key, other.model, other.address, self.upstream_token)

    async def _wake(self, model: ClusterModel) -> None:
        """Remove the stop annotation once for all waiting requests and wait until Ready (bounded)."""
        if model.waking is None or model.waking.done():
            model.waking = asyncio.create_task(self._unstop(model))
        await asyncio.shield(model.waking)
        await self._wait_ready(model, model.policy.startup_timeout)

    async def _warm_wake(self, model: ClusterModel) -> None:
        """Wake a stopped model because a warm window opened (no request waits on it: a refusal is logged)."""
        try:
            await self._unstop(model)
        except Unavailable as exc:
            logger.warning("%s/%s: a warm window opened but the model could not be woken: %s", model.namespace,
                           model.name, exc.message)  # fmt: skip

    async def _unstop(self, model: ClusterModel) -> None:
        logger.info("waking %s/%s (removing %s)", model.namespace, model.name, kserve.STOP_ANNOTATION)
        try:
            await self._patch_stop(model, None)
        except ApiError as exc:
            hint = f"; {STANDARD_MODE_HINT}" if exc.status.code == 403 else ""
            message = f"Could not change {model.name}'s stop annotation: {_describe(exc)}{hint}"
            raise Unavailable(message, retry_after=5) from None

    @staticmethod
    def _raise_if_failed(model: ClusterModel) -> None:
        ready = next((c for c in model.status.conditions if c.type == "Ready"), None)
        if ready is not None and ready.reason == READY_STOPPED_BY_HAND:  # no request lifts it: do not wait
            raise Unavailable(ready.message or f"The model {model.served_name!r} is stopped.", code="model_stopped",
                              retry_after=60)  # fmt: skip
        if model.state is ModelState.FAILED:
            raise Unavailable(f"The model {model.served_name!r} has failed: {model.status.message or ''}",
                              code="model_failed", retry_after=30)  # fmt: skip

    async def _wait_ready(self, model: ClusterModel, within: float) -> None:
        """Until the model is Ready; 503 as soon as it fails instead (not at the end of ``within``)."""
        try:
            await asyncio.wait_for(model.settled.wait(), within)
            self._raise_if_failed(model)
        except TimeoutError:
            raise Unavailable(
                f"The model {model.served_name!r} did not become ready within its startupTimeout.",
                code="model_loading",
                retry_after=10,
            ) from None

    async def _patch_stop(self, model: ClusterModel, value: str | None) -> None:
        patch = {"metadata": {"annotations": {kserve.STOP_ANNOTATION: value}}}
        await self.client.patch(
            InferenceService, model.name, patch, namespace=model.namespace, patch_type=PatchType.MERGE
        )

    # -- Standard mode's TTL -----------------------------------------------------------------------

    def _stoppable(self, model: ClusterModel, now: float) -> bool:
        """Idle past its idleTimeout as far as this replica knows, and not backing off a failed stop."""
        policy = model.policy
        return (
            policy.gateway_stops_when_idle(in_cluster=True)
            and model.stop_supported
            and model.state is ModelState.READY
            and not model.stop_requested
            and is_idle(model.last_used, model.stats.in_flight, policy.idle_timeout, now)
            and now >= model.stop_retry_at
        )

    async def _reap_idle(self) -> None:
        """Stop models idle past their idleTimeout, unless the model says another replica used it; inside a
        warm window keep them, and wake a stopped one."""
        while True:
            await asyncio.sleep(self._reap_interval)
            wall = self._clock.now()
            for model in list(self._models.values()):
                if model.standard_mode and model.policy.warm(wall):
                    # A warm window (scaling.warmSchedule): never stopped in it, and woken when it opens.
                    if (
                        model.stop_supported
                        and model.state is ModelState.IDLE
                        and (model.waking is None or model.waking.done())
                    ):
                        model.waking = asyncio.create_task(self._warm_wake(model))
                    continue
                if not self._stoppable(model, self._clock.monotonic()):
                    continue
                used = await self._used_upstream(model)
                if used is not None and not is_idle(used, 0, model.policy.idle_timeout, self._clock.monotonic()):
                    model.used_elsewhere = max(model.used_elsewhere, used)  # check again once that use is old
                    continue
                if self._models.get(model.served_name) is model and self._stoppable(model, self._clock.monotonic()):
                    await self._stop(model)

    async def _used_upstream(self, model: ClusterModel) -> float | None:
        """When the model last served a request through any gateway (monotonic; now if one is in flight).

        Every ready replica is asked; the model is idle only if each one is (nothing in flight, its latest
        request older than idleTimeout), so the latest use of any replica is the model's. A ready replica
        that cannot be read counts as busy (now): Kubernetes routes requests to it, and a predictor whose
        event loop is deep in a long generation answers late; stopping the model would cut what it serves.
        One really gone leaves the ready endpoints within a readiness period and stops counting.

        None when nothing can be asked: no ready replica (none serves anyone), or, without EndpointSlices to
        read, a model address that does not answer in METRICS_TIMEOUT_S. Stopping is then fine: a stopped
        model wakes on the next request anyway."""
        replicas = await self._ready_replicas(model)
        if replicas is None:  # no slices to read: ask through the Service (one replica), as before
            if model.address is None:
                return None
            try:
                in_flight, last = await self._usage(model.address)
            except Exception as exc:  # unreachable, timed out, not Prometheus text
                logger.info("no metrics from %s/%s (%s); stopping it", model.namespace, model.name, _describe(exc))
                return None
            return self._used_at(in_flight, last)
        if not replicas:
            return None
        results = await asyncio.gather(*(self._usage(url) for url in replicas), return_exceptions=True)
        in_flight = last = 0.0
        for url, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                logger.info("no metrics from %s/%s at %s (%s); counting it as busy",
                            model.namespace, model.name, url, _describe(result))  # fmt: skip
                return self._clock.monotonic()
            in_flight, last = max(in_flight, result[0]), max(last, result[1])
        return self._used_at(in_flight, last)

    async def _ready_replicas(self, model: ClusterModel) -> list[str] | None:
        """The base URLs of the predictor Service's ready endpoints; None when it has no EndpointSlices
        (or they cannot be listed)."""
        service = predictor_service(model.name)
        try:
            listing = self.client.list(EndpointSlice, namespace=model.namespace, labels={SERVICE_NAME_LABEL: service})
            slices = [item async for item in listing]
        except Exception as exc:  # refused (an older chart's RBAC) or the API server unreachable
            refused = isinstance(exc, ApiError) and exc.status.code == 403
            hint = f"; {ENDPOINT_SLICES_HINT}" if refused else ""
            logger.log(logging.WARNING if refused else logging.INFO,
                       "cannot list the EndpointSlices of %s/%s (%s)%s; asking one replica through its address",
                       model.namespace, service, _describe(exc), hint)  # fmt: skip
            return None
        if not slices:
            return None
        urls: set[str] = set()
        for endpoint_slice in slices:
            # KServe's predictor Service has the predictor container's port first
            # (v0.16.0 reconcilers/service/service_reconciler.go createDefaultSvc).
            port = next((p.port for p in endpoint_slice.ports or [] if p.port and p.protocol in (None, "TCP")), None)
            if port is None:
                continue
            for endpoint in endpoint_slice.endpoints or []:
                # discovery.k8s.io/v1 EndpointConditions: a nil ready means ready.
                if endpoint.conditions is not None and endpoint.conditions.ready is False:
                    continue
                host = endpoint.addresses[0]
                urls.add(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        return sorted(urls)

    async def _usage(self, base_url: str) -> tuple[float, float]:
        """A predictor replica's requests in flight and the Unix time of its latest one (0: none yet)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S))
        async with self._http.get(f"{base_url}/metrics") as response:
            response.raise_for_status()
            text = await response.text()
        in_flight = last = 0.0
        for family in text_string_to_metric_families(text):
            # One model per predictor process: its series are this model's, whatever their label.
            for sample in family.samples:
                if sample.name == metric_names.IN_FLIGHT:
                    in_flight = max(in_flight, sample.value)
                elif sample.name == metric_names.LAST_REQUEST:
                    last = max(last, sample.value)
        return in_flight, last

    def _used_at(self, in_flight: float, last: float) -> float | None:
        """Usage as a monotonic time: now while a request is in flight, None when there never was one."""
        now = self._clock.monotonic()
        if in_flight > 0:
            return now
        if last <= 0:
            return None
        return min(now, self._clock.monotonic_at(last))  # the model's clock ahead of ours: used just now

    async def _stop(self, model: ClusterModel) -> None:
        model.stop_requested = True
        logger.info("stopping idle %s/%s", model.namespace, model.name)
        try:
            await self._patch_stop(model, "true")
        except Exception as exc:  # refused, or the API server unreachable: the reaper must live on
            model.stop_requested = False
            # Back off: a refusal (403 without the Standard-mode RBAC) does not go away by itself.
            model.stop_failures += 1
            delay = min(STOP_RETRY_MAX_S, STOP_RETRY_FIRST_S * 2 ** (model.stop_failures - 1))
            model.stop_retry_at = self._clock.monotonic() + delay
            refused = isinstance(exc, ApiError) and exc.status.code == 403
            hint = f"; {STANDARD_MODE_HINT}" if refused and model.stop_failures == 1 else ""
            logger.warning("could not stop idle %s/%s: %s%s; retrying in %.0fs",
                           model.namespace, model.name, _describe(exc), hint, delay)  # fmt: skip
        else:
            model.stop_failures = 0
            model.stop_retry_at = 0.0
