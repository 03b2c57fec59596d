"""A stand-in for KServe's controller: watches InferenceServices and reports them Ready.

It speaks to whatever API server the lightkube client points at (the emulator in tests, the demo and
the benchmark), writing statuses in KServe's shape: Ready/PredictorReady/IngressReady conditions,
``observedGeneration``, ``url``, ``address.url`` and ``modelStatus``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

from tests.support import admission
from universal_operator.kube import InferenceService

logger = logging.getLogger(__name__)


def ready_status(isvc: dict[str, Any], *, domain: str = "example.com", replicas: int = 1) -> dict[str, Any]:
    """The status KServe writes once an InferenceService's predictor is up (or scaled to zero)."""
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    mode = meta.get("annotations", {}).get("serving.kserve.io/deploymentMode", "Knative")
    conditions = [
        {"type": kind, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        for kind in ("IngressReady", "PredictorReady", "Ready")
    ]
    return {
        "observedGeneration": meta.get("generation", 1),
        "url": f"http://{name}-{namespace}.{domain}",
        "address": {"url": f"http://{name}-predictor.{namespace}.svc.cluster.local"},
        "components": {"predictor": {"latestReadyRevision": f"{name}-predictor-00001"}},
        "conditions": conditions,
        "deploymentMode": mode,
        "modelStatus": {
            "transitionStatus": "UpToDate",
            "states": {
                "activeModelState": "Loaded" if replicas else "Pending",
                "targetModelState": "Loaded" if replicas else "Pending",
            },
            "copies": {"failedCopies": 0, "totalCopies": replicas},
        },
    }


async def write_status(client: AsyncClient, isvc: dict[str, Any], status: dict[str, Any]) -> None:
    """Merge-patch an InferenceService's status subresource, as KServe's controller does."""
    meta = isvc["metadata"]
    await client.patch(
        InferenceService.Status,
        meta["name"],
        {"status": status},
        namespace=meta.get("namespace", "default"),
        patch_type=PatchType.MERGE,
    )


async def record_internal_error(client: AsyncClient, isvc: dict[str, Any], message: str) -> None:
    """The Warning event KServe's controller records when a reconcile fails (reason ``InternalError``)."""
    meta = isvc["metadata"]
    namespace = meta.get("namespace", "default")
    event = Event(
        metadata=ObjectMeta(generateName=f"{meta['name']}.", namespace=namespace),
        involvedObject=ObjectReference(
            apiVersion="serving.kserve.io/v1beta1",
            kind="InferenceService",
            name=meta["name"],
            namespace=namespace,
            uid=meta.get("uid"),
        ),
        reason="InternalError",
        message=message,
        type="Warning",
        source=EventSource(component="v1beta1Controllers"),
    )
    try:
        await client.create(event, namespace=namespace)
    except ApiError as exc:
        logger.debug("KServe stand-in could not record an event: %s", exc)


async def play_kserve(client: AsyncClient, *, delay: float = 0.0, namespace: str = "*") -> None:
    """Report every InferenceService whose generation KServe has not observed yet as Ready (runs forever)."""
    while True:
        try:
            async for kind, obj in client.watch(InferenceService, namespace=namespace):
                if kind == "DELETED":
                    continue
                isvc = obj.to_dict()
                meta = isvc.get("metadata", {})
                status = isvc.get("status") or {}
                if status.get("observedGeneration") == meta.get("generation"):
                    continue
                if delay:
                    await asyncio.sleep(delay)
                if problems := admission.reconcile_problems(isvc, admission.DEFAULT_CLUSTER):
                    # KServe's reconcile fails before any status: an InternalError event says why
                    # (KServe v0.16.0 pkg/controller/v1beta1/inferenceservice/controller.go Reconcile).
                    await record_internal_error(client, isvc, problems[0])
                    continue
                try:
                    await write_status(client, isvc, ready_status(isvc))
                except ApiError as exc:
                    logger.debug("KServe stand-in could not write a status: %s", exc)
        except (ApiError, OSError) as exc:  # a dropped watch: resume like a controller would
            logger.debug("KServe stand-in watch ended: %s", exc)
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def kserve_standin(client: AsyncClient, *, delay: float = 0.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run :func:`play_kserve` in the background for the duration of the block."""
    task = asyncio.create_task(play_kserve(client, delay=delay), name="kserve-standin")
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
