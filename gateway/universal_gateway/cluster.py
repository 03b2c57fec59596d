"""KubernetesBackends: route to the UniversalModels the operator serves, from their status.

The gateway watches UniversalModels (one namespace, several, or all) and routes each ``servedName``
to ``status.address``. Knative-mode models need nothing more: Knative's activator holds a request
while a replica starts, so the gateway only waits long enough (the model's ``startupTimeout``).

Standard-mode models have no activator, so their TTL is ours: the gateway owns the
``serving.kserve.io/stop`` annotation on the InferenceService. It alone sees the traffic, and
server-side apply keeps the operator's field manager off an annotation it never sets, so the two never
fight. Idle past ``idleTimeout`` -> ``stop: "true"``; a request for a stopped model removes it and is held
until the model reports Ready (bounded by ``startupTimeout``, then 503); concurrent requests share one
wake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from universal_gateway.backends import Backends, ModelState, ModelView, UsageStats, counted
from universal_operator.kube import InferenceService, UniversalModelResource
from universal_operator.spec import parse_duration
from universal_predictors.config import Task
from universal_predictors.errors import Unavailable

logger = logging.getLogger(__name__)

STOP_ANNOTATION = "serving.kserve.io/stop"
FIELD_MANAGER = "universal-runtime-gateway"


def rbac_rules(*, standard_mode: bool) -> list[dict[str, list[str]]]:
    """The RBAC rules the gateway's ServiceAccount needs, and nothing more.

    Watching UniversalModels is all a Knative-only gateway does; ``patch`` on InferenceServices is for the
    Standard-mode TTL (the stop annotation). A Role per watched namespace or one ClusterRole grants these;
    the tests hold the gateway to exactly this list.
    """
    rules = [
        {
            "apiGroups": [UniversalModelResource._api_info.resource.group],
            "resources": [UniversalModelResource._api_info.plural],
            "verbs": ["get", "list", "watch"],
        }
    ]
    if standard_mode:
        rules.append(
            {
                "apiGroups": [InferenceService._api_info.resource.group],
                "resources": [InferenceService._api_info.plural],
                "verbs": ["patch"],
            }
        )
    return rules


_PHASES = {
    "Ready": ModelState.READY,
    "Idle": ModelState.IDLE,
    "Pending": ModelState.LOADING,
    "Loading": ModelState.LOADING,
    "Failed": ModelState.FAILED,
}


@dataclass
class ClusterModel:
    """What the gateway knows of one UniversalModel."""

    namespace: str
    name: str
    body: dict[str, Any]
    stats: UsageStats = field(default_factory=UsageStats)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    waking: asyncio.Task[None] | None = None
    stop_requested: bool = False

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.body.get("spec") or {})

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.body.get("status") or {})

    @property
    def served_name(self) -> str:
        return str(self.status.get("servedName") or self.spec.get("servedName") or self.name)

    @property
    def task(self) -> Task:
        return Task(self.spec.get("task", "generate"))

    @property
    def state(self) -> ModelState:
        return _PHASES.get(str(self.status.get("phase")), ModelState.LOADING)

    @property
    def address(self) -> str | None:
        address = self.status.get("address")
        return str(address).rstrip("/") if address else None

    @property
    def standard_mode(self) -> bool:
        return (self.spec.get("scaling") or {}).get("mode") == "Standard"

    def _duration(self, key: str, default: str) -> float:
        text = (self.spec.get("scaling") or {}).get(key) or default
        return parse_duration(str(text)).total_seconds()

    @property
    def idle_timeout(self) -> float:
        return self._duration("idleTimeout", "5m")

    @property
    def startup_timeout(self) -> float:
        return self._duration("startupTimeout", "20m")


class KubernetesBackends(Backends):
    """UniversalModels in the cluster as the gateway's backends."""

    def __init__(
        self,
        namespaces: Sequence[str] = (),
        *,
        client: AsyncClient | None = None,
        reap_interval: float = 1.0,
    ) -> None:
        self._namespaces = list(namespaces) or ["*"]
        self._client = client
        self._models: dict[str, ClusterModel] = {}  # served name -> model
        self._tasks: list[asyncio.Task[None]] = []
        self._reap_interval = reap_interval
        self._synced = asyncio.Event()

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(field_manager=FIELD_MANAGER)
        return self._client

    async def start(self) -> None:
        for namespace in self._namespaces:
            self._tasks.append(asyncio.create_task(self._watch(namespace), name=f"watch-{namespace}"))
        self._tasks.append(asyncio.create_task(self._reap_idle(), name="standard-mode-ttl"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.close()

    async def wait_synced(self, within: float = 30.0) -> None:
        await asyncio.wait_for(self._synced.wait(), within)

    # -- watching ----------------------------------------------------------------------------------

    async def _watch(self, namespace: str) -> None:
        while True:
            try:
                async for kind, obj in self.client.watch(UniversalModelResource, namespace=namespace):
                    raw: Any = obj
                    self._observe(kind, raw.to_dict())
                    self._synced.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped watch: resume, as any controller does
                logger.warning("watching UniversalModels in %s failed (%s); retrying", namespace, exc)
                await asyncio.sleep(1.0)

    def _observe(self, kind: str, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or "default"), str(meta.get("name")))
        current = next((m for m in self._models.values() if (m.namespace, m.name) == key), None)
        if kind == "DELETED":
            if current is not None:
                self._models.pop(current.served_name, None)
            return
        if current is None:
            current = ClusterModel(namespace=key[0], name=key[1], body=body)
        else:
            self._models.pop(current.served_name, None)
            current.body = body
        self._models[current.served_name] = current
        if current.state is ModelState.READY:
            current.ready.set()
            current.stop_requested = False
        else:
            current.ready.clear()

    # -- Backends ----------------------------------------------------------------------------------

    def models(self) -> list[ModelView]:
        return [
            ModelView(
                name=m.served_name,
                task=m.task,
                backend=str(m.status.get("backend") or m.spec.get("backend") or "auto"),
                state=m.state,
                message=str(m.status.get("message") or ""),
                endpoint=m.address,
                stats=m.stats,
                extra={
                    "namespace": m.namespace,
                    "mode": "Standard" if m.standard_mode else "Knative",
                    "url": m.status.get("url"),
                },
            )
            for m in self._models.values()
        ]

    def find(self, name: str) -> ModelView | None:
        return next((v for v in self.models() if v.name == name), None) if name in self._models else None

    def upstream_timeout(self, name: str) -> float | None:
        model = self._models.get(name)
        return model.startup_timeout if model is not None else None

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[str]:
        model = self._models[name]
        async with counted(model.stats):
            if model.standard_mode and model.state is not ModelState.READY:
                await self._wake(model)
            if model.state is ModelState.FAILED:
                raise Unavailable(f"The model {name!r} has failed: {model.status.get('message', '')}",
                                  code="model_failed", retry_after=30)  # fmt: skip
            if model.address is None:
                if not model.standard_mode:
                    await self._wait_ready(model, model.startup_timeout)
                if model.address is None:
                    raise Unavailable(f"The model {name!r} has no address yet; it is being created.",
                                      code="model_loading", retry_after=5)  # fmt: skip
            yield model.address

    async def _wake(self, model: ClusterModel) -> None:
        """Remove the stop annotation once for all waiting requests and wait until Ready (bounded)."""
        if model.waking is None or model.waking.done():
            model.waking = asyncio.create_task(self._unstop(model))
        await asyncio.shield(model.waking)
        await self._wait_ready(model, model.startup_timeout)

    async def _unstop(self, model: ClusterModel) -> None:
        logger.info("waking %s/%s (removing %s)", model.namespace, model.name, STOP_ANNOTATION)
        await self._patch_stop(model, None)

    async def _wait_ready(self, model: ClusterModel, within: float) -> None:
        try:
            await asyncio.wait_for(model.ready.wait(), within)
        except TimeoutError:
            raise Unavailable(
                f"The model {model.served_name!r} did not become ready within its startupTimeout.",
                code="model_loading",
                retry_after=10,
            ) from None

    async def _patch_stop(self, model: ClusterModel, value: str | None) -> None:
        patch = {"metadata": {"annotations": {STOP_ANNOTATION: value}}}
        try:
            await self.client.patch(
                InferenceService, model.name, patch, namespace=model.namespace, patch_type=PatchType.MERGE
            )
        except ApiError as exc:
            raise Unavailable(f"Could not change {model.name}'s stop annotation: {exc}", retry_after=5) from None

    async def _reap_idle(self) -> None:
        """Standard mode's TTL: stop models idle past their idleTimeout."""
        while True:
            await asyncio.sleep(self._reap_interval)
            now = time.monotonic()
            for model in list(self._models.values()):
                if (
                    model.standard_mode
                    and model.state is ModelState.READY
                    and not model.stop_requested
                    and model.stats.in_flight == 0
                    and (model.spec.get("scaling") or {}).get("minReplicas", 0) == 0
                    and now - model.stats.last_used_monotonic >= model.idle_timeout
                ):
                    model.stop_requested = True
                    logger.info("stopping idle %s/%s", model.namespace, model.name)
                    try:
                        await self._patch_stop(model, "true")
                    except Unavailable as exc:
                        model.stop_requested = False
                        logger.warning("%s", exc)
