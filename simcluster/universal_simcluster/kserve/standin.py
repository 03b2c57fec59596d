"""A stand-in for KServe's controller: watches InferenceServices and writes the status a KServe release would.

It speaks to whatever API server the lightkube client points at (the emulator in tests, the demo and
the benchmark). The release is a parameter (:class:`KServeVersion`, default the operator's default
``kserve.version``); what differs between releases is imitated from KServe's source at the tag named beside
each behaviour (``pkg/apis/serving/v1beta1`` shortened to ``v1beta1/``, the controller's
``pkg/controller/v1beta1/inferenceservice`` to ``controller/``):

* the deployment mode is resolved as GetDeploymentMode does (``controller/utils/utils.go``): the mode recorded
  in ``status.deploymentMode`` first (0.15+), then the annotation if the release knows the name, else the
  configured default (``deploy.defaultDeploymentMode``, "Serverless" in ``config/configmap/inferenceservice.yaml``
  at v0.14.1, v0.15.2 and v0.16.0);
* ``status.observedGeneration`` is the child's (the Knative Service's or the Deployment's: PropagateStatus,
  PropagateRawStatus in ``v1beta1/inference_service_status.go``), which a stop deletes and a wake creates anew
  at generation 1;
* a stop (0.15.1+ Knative, 0.16.0+ Standard: ``controller/components/predictor.go``) replaces the whole status
  with deploymentMode, PredictorReady False, IngressReady False and Stopped True;
* ``lastFailureInfo`` is never cleared (SetModelFailureInfo is its only writer), only replaced or wiped by a stop;
* at zero pods (Knative) only ``targetModelState: Pending`` and ``transitionStatus: InProgress`` change; the
  active state stays Loaded; ``totalCopies`` keeps its count up to 0.15 and is the ready-pod count (0, omitted)
  from 0.16 (UpdateModelRevisionStates, PropagateModelStatus).

Statuses are written whole, as KServe's ``Status().Update`` does (controller.go, updateStatus).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

from universal_simcluster import admission
from universal_simcluster.kserve import InferenceService

logger = logging.getLogger(__name__)

TIME = "2026-01-01T00:00:00Z"
#: The conditions of a Knative-mode InferenceService: PropagateStatus (PredictorReady, PredictorRouteReady,
#: PredictorConfigurationReady), controller.go (RoutesReady, LatestDeploymentReady), the ingress (IngressReady).
KNATIVE_CONDITIONS = ("IngressReady", "LatestDeploymentReady", "PredictorConfigurationReady", "PredictorReady",
                      "PredictorRouteReady", "Ready", "RoutesReady")  # fmt: skip


#: The KServe release the stand-in imitates unless told another: the operator's default target (tests/operator checks
#: the two agree, so that the default simulated cluster is the cluster the operator expects).
DEFAULT_KSERVE_VERSION = "0.16.0"


@dataclass(frozen=True)
class KServeVersion:
    """A KServe release as the stand-ins imitate it."""

    version: str = DEFAULT_KSERVE_VERSION
    #: inferenceservice-config's deploy.defaultDeploymentMode (config/configmap/inferenceservice.yaml).
    default_mode: str = "Serverless"

    @property
    def release(self) -> tuple[int, int, int]:
        parts = [int(part) for part in self.version.split(".")]
        return (parts[0], parts[1], parts[2] if len(parts) > 2 else 0)

    @property
    def renamed_modes(self) -> bool:
        """0.16 renamed Serverless/RawDeployment to Knative/Standard (KServe v0.16.0 pkg/constants/constants.go)."""
        return self.release >= (0, 16, 0)

    def mode_name(self, knative: bool) -> str:
        if self.renamed_modes:
            return "Knative" if knative else "Standard"
        return "Serverless" if knative else "RawDeployment"

    def recorded_mode(self, isvc: dict[str, Any], knative: bool) -> str:
        """What the controller writes to status.deploymentMode: GetDeploymentMode's answer, which is the recorded
        value first. v0.15.x-v0.18.1 return that string as it is, so an InferenceService made before 0.16 keeps
        ``Serverless``/``RawDeployment`` after an upgrade; v0.19.0 normalises it (constants.ParseDeploymentMode)
        (pkg/controller/v1beta1/inferenceservice/utils/utils.go GetDeploymentMode at each tag)."""
        recorded = str((isvc.get("status") or {}).get("deploymentMode") or "")
        if not recorded or self.release < (0, 15, 0):
            return self.mode_name(knative)
        if self.release >= (0, 19, 0):
            return {"Serverless": "Knative", "RawDeployment": "Standard"}.get(recorded, recorded)
        return recorded

    def resolve_mode(self, isvc: dict[str, Any]) -> bool:
        """Whether KServe runs ``isvc`` on Knative, as GetDeploymentMode decides it.

        KServe v0.14.1/v0.15.2/v0.16.0 pkg/controller/v1beta1/inferenceservice/utils/utils.go: the recorded
        status.deploymentMode wins (0.15+); an annotation counts only if the release knows its value (0.16 also
        maps the legacy names); anything else is the configured default, which is taken verbatim.
        """
        recorded = str((isvc.get("status") or {}).get("deploymentMode") or "")
        if recorded and self.release >= (0, 15, 0):
            return recorded in ("Serverless", "Knative")
        annotation = str(
            (isvc.get("metadata", {}).get("annotations") or {}).get(admission.ANNOTATION_DEPLOYMENT_MODE, "")
        )
        known = ("Serverless", "RawDeployment", "Knative", "Standard") if self.renamed_modes else (
            "Serverless", "RawDeployment")  # fmt: skip
        chosen = annotation if annotation in known else self.default_mode
        return chosen in ("Serverless", "Knative")

    def can_stop(self, knative: bool) -> bool:
        """serving.kserve.io/stop: Serverless from 0.15.1 (controller/components/predictor.go, the Knative branch),
        RawDeployment from 0.16.0 (controller/reconcilers/deployment/deployment_reconciler.go)."""
        return self.release >= ((0, 15, 1) if knative else (0, 16, 0))

    def stop_requested(self, isvc: dict[str, Any], knative: bool) -> bool:
        """The annotation set and honoured (GetForceStopRuntime: "true" in any case)."""
        value = str((isvc.get("metadata", {}).get("annotations") or {}).get(admission.ANNOTATION_STOP, ""))
        return value.lower() == "true" and self.can_stop(knative)

    def has_stopped_condition(self, knative: bool) -> bool:
        """Whether a running InferenceService carries Stopped=False: 0.15.x sets it in the Knative branch of
        predictor.go only, 0.16 in controller.go for every mode."""
        return self.renamed_modes or (knative and self.can_stop(True))


DEFAULT_VERSION = KServeVersion()


@dataclass(frozen=True)
class Child:
    """The workload KServe made for an InferenceService: its generation and (Knative) revision number."""

    generation: int = 1
    revision: int = 1


def _meta(isvc: dict[str, Any]) -> tuple[str, str]:
    meta = isvc["metadata"]
    return meta["name"], meta.get("namespace", "default")


def _conditions(pairs: list[tuple[str, str, str, str]], version: KServeVersion, knative: bool) -> list[dict[str, Any]]:
    out = []
    for kind, status, reason, message in pairs:
        condition: dict[str, Any] = {"type": kind, "status": status, "lastTransitionTime": TIME}
        if reason:
            condition["reason"] = reason
        if message:
            condition["message"] = message
        out.append(condition)
    if version.has_stopped_condition(knative):
        out.append({"type": "Stopped", "status": "False", "severity": "Info", "lastTransitionTime": TIME})
    return out


def _revision(name: str, number: int) -> str:
    return f"{name}-predictor-{number:05d}"


def _base(version: KServeVersion, knative: bool, child: Child, isvc: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = {"observedGeneration": child.generation}
    if version.release >= (0, 15, 0):  # status.deploymentMode is new in 0.15 (v1beta1/inference_service_status.go)
        status["deploymentMode"] = version.recorded_mode(isvc, knative)
    return status


def ready_status(
    isvc: dict[str, Any],
    *,
    domain: str = "example.com",
    replicas: int = 1,
    version: KServeVersion = DEFAULT_VERSION,
    child: Child | None = None,
    address: str | None = None,
    failure_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The status once the predictor is up; ``replicas=0``: Knative scaled it to zero (Ready stays True)."""
    name, namespace = _meta(isvc)
    knative = version.resolve_mode(isvc)
    child = child or Child()
    address = address or f"http://{name}-predictor.{namespace}.svc.cluster.local"
    status = _base(version, knative, child, isvc)
    if knative:
        pairs = [(kind, "True", "", "") for kind in KNATIVE_CONDITIONS]
        revision = _revision(name, child.revision)
        predictor: dict[str, Any] = {
            "latestCreatedRevision": revision,
            "latestReadyRevision": revision,
            "latestRolledoutRevision": revision,
            "traffic": [{"revisionName": revision, "percent": 100, "latestRevision": True}],
            "url": f"http://{name}-predictor-{namespace}.{domain}",
            "address": {"url": address},
        }
    else:
        pairs = [("IngressReady", "True", "", ""), ("PredictorReady", "True", "NewReplicaSetAvailable", ""),
                 ("Ready", "True", "", "")]  # fmt: skip
        predictor = {"url": f"http://{name}-predictor-{namespace}.{domain}"}
        if version.release < (0, 15, 0):  # v0.14.1 PropagateRawStatus: the Deployment's revision annotation
            predictor["latestCreatedRevision"] = str(child.generation)
    model_status: dict[str, Any] = {
        "transitionStatus": "UpToDate",
        "states": {"activeModelState": "Loaded", "targetModelState": "Loaded"},
        "copies": {"failedCopies": 0, "totalCopies": replicas},
    }
    if replicas == 0:
        # Zero pods (UpdateModelRevisionStates(Pending)): only the target state and the transition change.
        model_status["transitionStatus"] = "InProgress"
        model_status["states"]["targetModelState"] = "Pending"
        if version.renamed_modes:  # 0.16: TotalCopies = ready pods, omitempty; before: the last Loaded count
            model_status["copies"] = {"failedCopies": 0}
        else:
            model_status["copies"] = {"failedCopies": 0, "totalCopies": 1}
    if failure_info:
        model_status["lastFailureInfo"] = failure_info
    status.update(
        url=f"http://{name}-{namespace}.{domain}",
        address={"url": address},
        conditions=_conditions(pairs, version, knative),
        components={"predictor": predictor},
        modelStatus=model_status,
    )
    return status


def loading_status(
    isvc: dict[str, Any],
    *,
    version: KServeVersion = DEFAULT_VERSION,
    child: Child | None = None,
    address: str | None = None,
    loaded_before: bool = False,
    failure_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A new child or a rollout: the pods run, the model loads (PropagateModelStatus: Loading, InProgress).

    Knative: the Configuration is Unknown while the latest created revision is not ready (knative-v1.16.0
    pkg/apis/serving/v1/configuration_lifecycle.go), so PredictorReady and Ready are. Standard: the Deployment
    is not Available yet, which 0.15+ PropagateRawStatus reports as PredictorReady False/MinimumReplicasUnavailable.
    """
    name, _ = _meta(isvc)
    knative = version.resolve_mode(isvc)
    child = child or Child()
    status = _base(version, knative, child, isvc)
    if knative:
        routed = "True" if loaded_before else "Unknown"  # the route still reaches the last ready revision
        pairs = [("IngressReady", routed, "", ""),
                 ("LatestDeploymentReady", "Unknown", "PredictorConfigurationReady not ready", ""),
                 ("PredictorConfigurationReady", "Unknown", "", ""), ("PredictorReady", "Unknown", "", ""),
                 ("PredictorRouteReady", routed, "", ""), ("Ready", "Unknown", "", ""),
                 ("RoutesReady", routed, "", "")]  # fmt: skip
        predictor: dict[str, Any] = {"latestCreatedRevision": _revision(name, child.revision)}
        if loaded_before and child.revision > 1:
            predictor["latestReadyRevision"] = _revision(name, child.revision - 1)
    else:
        unavailable = "Deployment does not have minimum availability."
        pairs = [("IngressReady", "True", "", ""),
                 ("PredictorReady", "False", "MinimumReplicasUnavailable", unavailable),
                 ("Ready", "False", "MinimumReplicasUnavailable", unavailable)]  # fmt: skip
        predictor = {}
    model_status: dict[str, Any] = {
        "transitionStatus": "InProgress",
        "states": {"activeModelState": "Loaded" if loaded_before else "", "targetModelState": "Loading"},
        "copies": {"failedCopies": 0},
    }
    if failure_info:
        model_status["lastFailureInfo"] = failure_info
    if address:
        status["address"] = {"url": address}
        predictor["address"] = {"url": address}
    status.update(
        conditions=_conditions(pairs, version, knative), components={"predictor": predictor}, modelStatus=model_status
    )
    return status


def failed_status(
    isvc: dict[str, Any],
    message: str,
    *,
    exit_code: int | None = None,
    version: KServeVersion = DEFAULT_VERSION,
    child: Child | None = None,
    address: str | None = None,
    loaded_before: bool = False,
) -> dict[str, Any]:
    """A predictor container that exited: UpdateModelRevisionStates(FailedToLoad, info) sets the target state,
    BlockedByFailedLoad and lastFailureInfo; Knative reports the revision failed, a Deployment its pods
    unavailable."""
    knative = version.resolve_mode(isvc)
    status = loading_status(isvc, version=version, child=child, address=address, loaded_before=loaded_before)
    if knative:
        revision = status["components"]["predictor"]["latestCreatedRevision"]
        text = f'Revision "{revision}" failed with message: Container failed with: {message}'
        for condition in status["conditions"]:
            if condition["type"] in ("PredictorConfigurationReady", "PredictorReady", "Ready"):
                condition.update(status="False", reason="RevisionFailed", message=text)
    info: dict[str, Any] = {"reason": "ModelLoadFailed", "message": message}
    if exit_code is not None:
        info["exitCode"] = exit_code
    status["modelStatus"].update(
        transitionStatus="BlockedByFailedLoad",
        states={"activeModelState": "Loaded" if loaded_before else "", "targetModelState": "FailedToLoad"},
        lastFailureInfo=info,
    )
    return status


def stopped_status(isvc: dict[str, Any], *, version: KServeVersion = DEFAULT_VERSION) -> dict[str, Any]:
    """serving.kserve.io/stop: everything wiped but deploymentMode; PredictorReady and IngressReady False (reason
    Stopped from 0.16), Stopped True (controller/components/predictor.go, controller.go, the ingress
    reconcilers). ModelStatus is a struct: it stays, with its empty transitionStatus."""
    knative = version.resolve_mode(isvc)
    reason = "Stopped" if version.renamed_modes else ""
    conditions = [
        {"type": kind, "status": "False", "lastTransitionTime": TIME, **({"reason": reason} if reason else {})}
        for kind in ("IngressReady", "PredictorReady", "Ready")
    ]
    conditions.append({"type": "Stopped", "status": "True", "lastTransitionTime": TIME})
    return {
        "deploymentMode": version.recorded_mode(isvc, knative),
        "conditions": conditions,
        "modelStatus": {"transitionStatus": ""},
    }


async def write_status(client: AsyncClient, isvc: dict[str, Any], status: dict[str, Any]) -> None:
    """Replace an InferenceService's whole status, as KServe's Status().Update does."""
    name, namespace = _meta(isvc)
    await client.patch(
        InferenceService.Status,
        name,
        [{"op": "add", "path": "/status", "value": status}],
        namespace=namespace,
        patch_type=PatchType.JSON,
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
        await client.create(event)  # into the metadata's namespace
    except ApiError as exc:
        logger.debug("KServe stand-in could not record an event: %s", exc)


@dataclass
class _Seen:
    """What the stand-in did for one InferenceService (by uid)."""

    generation: int = 0
    stopped: bool = False
    child: Child | None = None  # None: no child exists (not made yet, or deleted by a stop)


def next_child(current: Child | None, knative: bool) -> Child:
    """The child after a spec change: the same object one generation on (a new revision in Knative mode)."""
    if current is None:
        return Child()
    return Child(generation=current.generation + 1, revision=current.revision + (1 if knative else 0))


async def play_kserve(
    client: AsyncClient,
    *,
    delay: float = 0.0,
    namespace: str = "*",
    version: KServeVersion = DEFAULT_VERSION,
) -> None:
    """Report every InferenceService as KServe ``version`` would once its predictor is up (runs forever).

    A new spec makes the child one generation older (Knative: a new revision); with ``delay`` the loading
    status is written first. A stop the release honours wipes the status and deletes the child; removing it
    makes a new child (generation 1)."""
    seen: dict[str, _Seen] = {}
    while True:
        try:
            async for kind, obj in client.watch(InferenceService, namespace=namespace):
                raw: Any = obj  # a lightkube generic resource: to_dict is untyped
                isvc = raw.to_dict()
                uid = str(isvc.get("metadata", {}).get("uid"))
                if kind == "DELETED":
                    seen.pop(uid, None)
                    continue
                if problems := admission.reconcile_problems(isvc, admission.DEFAULT_CLUSTER):
                    # KServe's reconcile fails before any status: an InternalError event says why
                    # (KServe v0.16.0 pkg/controller/v1beta1/inferenceservice/controller.go Reconcile).
                    await record_internal_error(client, isvc, problems[0])
                    continue
                try:
                    await _react(client, isvc, seen.setdefault(uid, _Seen()), delay, version)
                except ApiError as exc:
                    logger.debug("KServe stand-in could not write a status: %s", exc)
        except (ApiError, OSError) as exc:  # a dropped watch: resume like a controller would
            logger.debug("KServe stand-in watch ended: %s", exc)
            await asyncio.sleep(0.2)


async def _react(client: AsyncClient, isvc: dict[str, Any], seen: _Seen, delay: float, version: KServeVersion) -> None:
    knative = version.resolve_mode(isvc)
    generation = int(isvc.get("metadata", {}).get("generation") or 1)
    if version.stop_requested(isvc, knative):
        if not seen.stopped:
            seen.stopped, seen.child = True, None
            await write_status(client, isvc, stopped_status(isvc, version=version))
        return
    if not seen.stopped and seen.generation == generation and seen.child is not None:
        return  # nothing new (our own status writes come back as events too)
    loaded_before = seen.child is not None
    seen.stopped, seen.generation = False, generation
    seen.child = next_child(seen.child, knative)
    if delay:
        await write_status(client, isvc, loading_status(isvc, version=version, child=seen.child,
                                                        loaded_before=loaded_before))  # fmt: skip
        await asyncio.sleep(delay)
    await write_status(client, isvc, ready_status(isvc, version=version, child=seen.child))


@contextlib.asynccontextmanager
async def kserve_standin(
    client: AsyncClient, *, delay: float = 0.0, version: KServeVersion = DEFAULT_VERSION
) -> AsyncIterator[asyncio.Task[None]]:
    """Run :func:`play_kserve` in the background for the duration of the block."""
    task = asyncio.create_task(play_kserve(client, delay=delay, version=version), name="kserve-standin")
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
