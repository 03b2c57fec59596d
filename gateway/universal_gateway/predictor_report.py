"""Which backend a running predictor chose, learnt from the predictor itself.

For text generation on a GPU with ``backend: auto`` only the predictor can tell which engine it runs (whether
vLLM imports there and supports the architecture), so the operator's status says ``auto``. The predictor's
model card (``GET /openai/v1/models``) names the engine it runs. In a cluster the gateway asks for it after it
has relayed an answer from the model (the predictor is up then: asking never wakes a model scaled to zero),
once per spec generation, and merge-patches ``status.predictorReport`` (``patch`` on
``universalmodels/status``, nothing on the spec); the operator, the one writer of ``status.backend``, reports
it from there. Locally the supervisor asks once a process is ready and shows it in ``ps``.

Why the status subresource is a safe grant: a write to ``/status`` ignores changes to anything but the
status stanza (Kubernetes v1.28 ``staging/src/k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1/types.go``,
``CustomResourceSubresourceStatus``; enforced by ``pkg/registry/customresource/status_strategy.go``), so the
gateway's ``patch`` on ``universalmodels/status`` cannot change a model's spec, metadata or finalizers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from universal_operator.kube import UniversalModelResource
from universal_operator.spec import Phase, UniversalModel
from universal_predictors.catalog import Backend
from universal_predictors.config import UPSTREAM_TOKEN_HEADER

logger = logging.getLogger(__name__)

#: How long the predictor's model card may take (it is a dictionary, not inference).
CARD_TIMEOUT_S = 5.0
#: After a failed ask or write, the next served request may try again this much later.
RETRY_AFTER_S = 30.0
#: A model with LoRA adapters: its predictor is asked for their states at most this often (under traffic).
ADAPTERS_EVERY_S = 10.0
#: After the API server refused the write (403: an older chart's RBAC), try again this much later.
REFUSED_RETRY_AFTER_S = 600.0

STATUS_RBAC_HINT = (
    "the gateway needs `patch` on universalmodels/status to record which backend a model's predictor runs "
    "(status.predictorReport): upgrade the Helm chart (the rules of universal_gateway.cluster.rbac_rules)"
)

Key = tuple[str, str]  # (namespace, name)


async def ask_cards(session: aiohttp.ClientSession, base_url: str, token: str | None) -> list[dict[str, Any]]:
    """The predictor's ``/openai/v1/models`` entries: its model's card first, then one per LoRA adapter."""
    headers = {UPSTREAM_TOKEN_HEADER: token} if token else {}
    timeout = aiohttp.ClientTimeout(total=CARD_TIMEOUT_S)
    async with session.get(f"{base_url}/openai/v1/models", headers=headers, timeout=timeout) as response:
        response.raise_for_status()
        payload: Any = await response.json()
    cards = payload.get("data") if isinstance(payload, dict) else None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []


def pool_card(cards: list[dict[str, Any]], served_name: str) -> dict[str, Any] | None:
    """A pooled model's card among its pool's (``universal-runtime serve`` lists every member: state, starts,
    memory_mb, evictions, why it stopped, its crashes and memory limit; gateway/universal_gateway/local.py
    ``LocalSupervisor._view``), as ``predictorReport.pool``; None when the pool does not list it (yet)."""
    card = next((c for c in cards if c.get("id") == served_name), None)
    if card is None:
        return None
    fields = {"state": "state", "starts": "starts", "memoryMb": "memory_mb", "evictions": "evictions",
              "message": "message", "reason": "reason", "crashes": "crashes", "lastExit": "last_exit",
              "memoryLimitMb": "memory_limit_mb"}  # fmt: skip
    report = {key: card[name] for key, name in fields.items() if card.get(name) not in (None, "")}
    if card.get("state") == "ready" and card.get("backend") not in (None, "", "auto"):
        report["backend"] = card["backend"]  # the engine it loaded with; kept (merge patch) once it is unloaded
    return report


def adapter_report(cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each adapter's state as the predictor's cards say (``predictorReport.adapters``), by name."""
    out = []
    for card in cards[1:]:
        adapter = card.get("adapter")
        if isinstance(adapter, dict) and isinstance(adapter.get("name"), str) and adapter.get("state"):
            out.append({k: adapter[k] for k in ("name", "state", "reason", "message") if adapter.get(k) is not None})
    return sorted(out, key=lambda a: str(a["name"]))


async def ask_backend(session: aiohttp.ClientSession, base_url: str, token: str | None) -> Backend | None:
    """The backend the predictor at ``base_url`` says it runs; None when its card names none (or only ``auto``)."""
    return backend_of(await ask_cards(session, base_url, token))


def backend_of(cards: list[dict[str, Any]]) -> Backend | None:
    if not cards:
        return None
    try:
        backend = Backend(str(cards[0].get("backend")))
    except ValueError:
        return None
    return None if backend is Backend.AUTO else backend


def generation_to_report(model: UniversalModel) -> int | None:
    """The spec generation whose backend the predictor should be asked for, or None when nothing is to learn.

    Something to learn: the operator's status, for the current generation, says the model is Ready and its
    backend ``auto``, and no report for that generation is there yet.
    """
    generation, status = model.metadata.generation, model.status
    if status.observed_generation != generation:
        return None
    if status.backend != Backend.AUTO.value or status.phase is not Phase.READY:
        return None
    if status.predictor_report is not None and status.predictor_report.generation == generation:
        return None
    return generation


class PredictorReporter:
    """Asks a model's predictor which backend it runs, once per generation, and records it in the model's status."""

    def __init__(self, client: Callable[[], AsyncClient]) -> None:
        self._client = client
        self._session: aiohttp.ClientSession | None = None
        self._asking: dict[Key, asyncio.Task[None]] = {}
        #: Per model: the generation last reported, or tried, and the monotonic time before which not to ask again.
        self._not_before: dict[Key, tuple[int, float]] = {}
        #: Per model with adapters: the monotonic time before which not to ask for their states again.
        self._adapters_not_before: dict[Key, float] = {}

    def served(self, key: Key, model: UniversalModel, address: str | None, token: str | None) -> None:
        """The gateway relayed an answer from this model: ask its predictor in the background if there is
        something to learn and no ask for it is under way or recently failed."""
        generation = generation_to_report(model)
        now = time.monotonic()
        # Adapters and a pooled model's place in its pool change under traffic: asked again at most every
        # ADAPTERS_EVERY_S.
        adapters_due = bool(model.spec.adapters or model.spec.pool) and now >= self._adapters_not_before.get(key, 0.0)
        if address is None:
            return
        asking = self._asking.get(key)
        if asking is not None and not asking.done():
            return
        seen, not_before = self._not_before.get(key, (None, 0.0))
        if generation is not None and seen == generation and now < not_before:
            generation = None
        if generation is None and not adapters_due:
            return
        if adapters_due:  # adapters load on their first request: their states change under traffic, so at most
            self._adapters_not_before[key] = now + ADAPTERS_EVERY_S  # every ADAPTERS_EVERY_S
        task = self._report(key, generation, model if adapters_due else None, address, token)
        self._asking[key] = asyncio.create_task(task, name=f"ask-{key[1]}")

    async def _report(
        self, key: Key, generation: int | None, adapters_of: UniversalModel | None, address: str, token: str | None
    ) -> None:
        namespace, name = key
        if generation is not None:
            self._not_before[key] = (generation, time.monotonic() + RETRY_AFTER_S)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            cards = await ask_cards(self._session, address, token)
        except Exception as exc:  # unreachable, an error answer, not JSON: the next served request asks again
            logger.info("could not ask %s/%s about itself (%s)", namespace, name, exc or type(exc).__name__)
            return
        report: dict[str, Any] = {}
        if adapters_of is not None and adapters_of.spec.pool is not None:
            card = pool_card(cards, adapters_of.served_name)
            previous_report = adapters_of.status.predictor_report
            in_pool = previous_report.pool if previous_report is not None else None
            shown = in_pool.model_dump(mode="json", by_alias=True, exclude_none=True) if in_pool is not None else None
            if card is not None and card != shown:
                report["pool"] = card
            adapters_of = None  # a pooled model has no adapters, and its pool's first card is another member's
            generation = None
        backend = backend_of(cards) if generation is not None else None
        if backend is not None:
            report |= {"backend": backend.value, "generation": generation}
        if adapters_of is not None:
            adapters = adapter_report(cards)
            previous = adapters_of.status.predictor_report
            known = [a.model_dump(mode="json", exclude_none=True, exclude={"served_name"}) for a in previous.adapters]\
                if previous is not None else []  # fmt: skip
            if adapters != sorted(known, key=lambda a: str(a["name"])):
                report["adapters"] = adapters
        if not report:
            return
        patch = {"status": {"predictorReport": report}}
        try:
            await self._client().patch(
                UniversalModelResource.Status, name, patch, namespace=namespace, patch_type=PatchType.MERGE
            )
        except ApiError as exc:
            code = exc.status.code
            if code == 404:
                return  # the model is gone
            refused = code == 403
            if refused:
                if generation is not None:
                    self._not_before[key] = (generation, time.monotonic() + REFUSED_RETRY_AFTER_S)
                self._adapters_not_before[key] = time.monotonic() + REFUSED_RETRY_AFTER_S
            logger.log(logging.WARNING if refused else logging.INFO,
                       "could not record %s/%s's predictor report %s: %s %s%s", namespace, name, report, code,
                       exc.status.message, f"; {STATUS_RBAC_HINT}" if refused else "")  # fmt: skip
            return
        except Exception as exc:  # the API server unreachable: the next served request tries again
            logger.info("could not record %s/%s's predictor report %s (%s)", namespace, name, report, exc)
            return
        if backend is not None and generation is not None:
            self._not_before[key] = (generation, float("inf"))
            logger.info("%s/%s runs %s (generation %d)", namespace, name, backend.value, generation)
        if "adapters" in report:
            logger.info("%s/%s adapters: %s", namespace, name, {a["name"]: a["state"] for a in report["adapters"]})

    async def close(self) -> None:
        for task in self._asking.values():
            task.cancel()
        for task in self._asking.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
