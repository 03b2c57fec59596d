"""Status: the UniversalModel's status from its InferenceService as KServe last reported it, for a spec the
operator cannot serve, and while the API server refuses the operator a request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from universal_operator import kserve
from universal_operator.config import OperatorConfig
from universal_operator.predictor import reported_backend
from universal_operator.reconcile.cache import CacheState
from universal_operator.reconcile.render import request_timeout_seconds
from universal_operator.reconcile.waking import WakeStep, predictor_step
from universal_operator.spec import (
    ADAPTER_SEPARATOR,
    CONDITION_IDLE_STOP,
    READY_STOPPED_BY_HAND,
    AdapterState,
    Condition,
    Phase,
    ScalingMode,
    SpecError,
    UniversalModel,
)
from universal_operator.warm import warm_at

#: Ready=False reasons from KServe/Knative that a retry will not fix.
FAILURE_REASONS = frozenset(
    {
        "RevisionFailed",
        "ProgressDeadlineExceeded",
        "ContainerMissing",
        "ExitCode",
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "ModelLoadFailed",
        "InvalidSpec",
        "BlockedByFailedLoad",
        "RevisionMissing",
    }
)


def _now_text(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _find(conditions: list[dict[str, Any]] | None, kind: str) -> dict[str, Any] | None:
    for cond in conditions or []:
        if cond.get("type") == kind:
            return cond
    return None


def _conditions(
    previous: list[Condition], generation: int, now: datetime, *updates: tuple[str, str, str, str]
) -> list[dict[str, Any]]:
    """Conditions in a fixed order, keeping lastTransitionTime where the status did not change."""
    before = {c.type: c for c in previous}
    out = []
    for kind, status, reason, message in updates:
        old = before.get(kind)
        since = (
            old.last_transition_time if old is not None and old.status == status and old.last_transition_time else ""
        )
        out.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since or _now_text(now),
                "observedGeneration": generation,
            }
        )
    return out


def _child_failure(status: dict[str, Any], ready: dict[str, Any] | None) -> str | None:
    """A message when KServe's current state is a failure retrying will not fix, else None.

    Only the current state counts: ``lastFailureInfo`` is never cleared (SetModelFailureInfo is its only writer,
    KServe v0.14.1-v0.20.0 pkg/apis/serving/v1beta1/inference_service_status.go), so it explains a failure the
    transition status, the target state or Ready report, and is never one by itself. UpdateModelRevisionStates
    sets the *target* state to FailedToLoad (transition BlockedByFailedLoad); the active state keeps the last
    loaded one; InvalidSpec comes from UpdateModelTransitionStatus.
    """
    model_status = status.get("modelStatus") or {}
    info = model_status.get("lastFailureInfo") or {}
    target = (model_status.get("states") or {}).get("targetModelState")
    transition = model_status.get("transitionStatus")
    ready_failure = None
    if ready is not None and ready.get("status") == "False" and ready.get("reason") in FAILURE_REASONS:
        ready_failure = f"{ready.get('reason')}: {ready.get('message') or 'the predictor failed'}"
    if target == "FailedToLoad" or transition in ("BlockedByFailedLoad", "InvalidSpec"):
        parts = [info.get("reason"), info.get("message")]
        if info.get("exitCode") is not None:
            parts.append(f"exit code {info['exitCode']}")
        text = ": ".join(str(p) for p in parts if p)
        return text or ready_failure or f"the model failed to load ({transition or target})"
    return ready_failure


def _past_progress_deadline(status: dict[str, Any], ready: dict[str, Any] | None) -> bool:
    """Ready False for ProgressDeadlineExceeded alone: the model has not failed to load (no FailedToLoad target, no
    BlockedByFailedLoad); see the Standard-mode branch of :func:`status_from_inference_service`."""
    if ready is None or ready.get("status") != "False" or ready.get("reason") != "ProgressDeadlineExceeded":
        return False
    model_status = status.get("modelStatus") or {}
    target = (model_status.get("states") or {}).get("targetModelState")
    return target != "FailedToLoad" and model_status.get("transitionStatus") not in (
        "BlockedByFailedLoad",
        "InvalidSpec",
    )


def _is_true(condition: dict[str, Any] | None) -> bool:
    return condition is not None and condition.get("status") == "True"


def adapter_statuses(model: UniversalModel) -> list[dict[str, Any]]:
    """``status.adapters``: each listed adapter as the predictor last reported it (``predictorReport.adapters``,
    written by the gateway), Pending until then (an adapter loads with its first request)."""
    report = model.status.predictor_report
    known = {a.name: a for a in report.adapters} if report is not None else {}
    out = []
    for adapter in model.spec.adapters:
        seen = known.get(adapter.name)
        state = seen.state if seen is not None else AdapterState.PENDING
        served = f"{model.served_name}{ADAPTER_SEPARATOR}{adapter.name}"
        entry: dict[str, Any] = {"name": adapter.name, "servedName": served, "state": state.value}
        if seen is not None and seen.reason:
            entry |= {"reason": seen.reason, "message": seen.message}
        out.append(entry)
    return out


def status_from_inference_service(
    isvc: dict[str, Any] | None,
    model: UniversalModel,
    now: datetime | None = None,
    *,
    config: OperatorConfig | None = None,
    pods: Iterable[Mapping[str, Any]] | None = None,
    cache: CacheState | None = None,
) -> dict[str, Any]:
    """The UniversalModel's status given its InferenceService as KServe last reported it, and its predictor pods
    (``pods``: None when not known) for the step a starting predictor is at (:mod:`.waking`). ``cache``: the
    LocalModelCache its source matches, reported as ``status.cache`` and the Cached condition (:mod:`.cache`).

    What KServe reports, and so what this reads (KServe v0.14.1-v0.20.0 pkg/apis/serving/v1beta1/
    inference_service_status.go unless named):

    * ``status.observedGeneration`` is the Knative Service's or the Deployment's (PropagateStatus,
      PropagateRawStatus), never the InferenceService's: it is not compared with anything. A rollout shows as
      Ready not True, or in Knative mode as ``components.predictor.latestCreatedRevision`` differing from
      ``latestReadyRevision``.
    * A stop (``serving.kserve.io/stop``) empties the whole status but the deployment mode, PredictorReady=False
      and Stopped=True (KServe v0.15.1+ components/predictor.go for Serverless, v0.16.0+ for both modes;
      controller.go sets Stopped): stopped is judged first.
    * At zero pods (Knative scale to zero) PropagateModelStatus sets only targetModelState Pending and
      transitionStatus InProgress; activeModelState stays Loaded and Ready stays True. With the revisions
      equal that is Idle, not a rollout. ``copies.totalCopies`` keeps its last count up to 0.15 (written with
      Loaded only) and is the ready-pod count from 0.16 (PropagateModelStatus): it is not relied on.
    * Failure comes from the current state (:func:`_child_failure`); Ready=True wins over a stale failure.
    * Leaving zero is Waking: at zero in Knative mode (Ready stays True, no pod ready) with a predictor pod
      starting; resuming after a stop; or starting while the model was Idle or Waking. ``step`` says where the
      starting pod is, in Waking and in Loading.
    """
    now = now or datetime.now(UTC)
    config = config or OperatorConfig()
    release = config.kserve.release
    mode = model.spec.scaling.mode
    knative = mode is ScalingMode.KNATIVE
    generation = model.metadata.generation
    base: dict[str, Any] = {
        "observedGeneration": generation,
        "servedName": model.served_name,
        "backend": reported_backend(model).value,
        "inferenceService": model.metadata.name,
        "requestTimeoutSeconds": request_timeout_seconds(model, config),
    }
    if model.spec.adapters or model.status.adapters:  # (an emptied list clears the last states)
        base["adapters"] = adapter_statuses(model)
    if model.spec.scaling.warm_schedule:
        active, next_change = warm_at(model.spec.scaling.warm_schedule, now)
        base["warmSchedule"] = {"active": active, "nextChange": _now_text(next_change) if next_change else None}
    spec_valid = ("SpecValid", "True", "Valid", "The spec is valid.")
    extra: list[tuple[str, str, str, str]] = []
    base["cache"] = cache.status(isvc) if cache is not None else None
    if not knative:
        refusal = kserve.stop_unsupported(release, mode)
        extra.append(
            (CONDITION_IDLE_STOP, "False", "UnsupportedByKServe", refusal)
            if refusal is not None
            else (
                CONDITION_IDLE_STOP, "False", "GatewayNotPermitted",
                f"The gateway may not patch InferenceServices here (the chart's gateway.standardMode is false), so "
                f"it cannot stop this model after idleTimeout ({kserve.STOP_ANNOTATION}): the model keeps running. "
                "Set gateway.standardMode to true to let the gateway stop and wake it.",
            )
            if not config.gateway_stops_standard_models
            else (
                CONDITION_IDLE_STOP, "True", "GatewayStops",
                f"With minReplicas 0 the gateway stops the model after idleTimeout without requests "
                f"({kserve.STOP_ANNOTATION}) and the next request wakes it.",
            )
        )  # fmt: skip
    if cache is not None:
        extra.append(cache.condition(isvc))
    previous = model.status.conditions

    if isvc is None:
        message = "Creating the InferenceService."
        return {
            **base,
            "phase": Phase.PENDING.value,
            "step": None,
            "url": None,
            "address": None,
            "replicas": None,
            "message": message,
            "conditions": _conditions(
                previous, generation, now,
                ("Ready", "False", "InferenceServiceMissing", message),
                spec_valid,
                ("InferenceServiceReady", "Unknown", "NotCreated", message),
                *extra,
            ),
        }  # fmt: skip

    status = isvc.get("status") or {}
    conditions = status.get("conditions") or []
    ready = _find(conditions, "Ready")
    model_status = status.get("modelStatus") or {}
    copies = (model_status.get("copies") or {}).get("totalCopies")
    states = model_status.get("states") or {}
    predictor = (status.get("components") or {}).get("predictor") or {}
    created, serving = predictor.get("latestCreatedRevision"), predictor.get("latestReadyRevision")
    rolling_out = knative and bool(created) and created != serving
    url = status.get("url")
    address = (status.get("address") or {}).get("url") or (predictor.get("address") or {}).get("url")
    stop_asked = str((isvc.get("metadata", {}).get("annotations") or {}).get(kserve.STOP_ANNOTATION, "")).lower()
    stop_asked_and_honoured = stop_asked == "true" and kserve.can_stop(release, mode)
    stopped = _is_true(_find(conditions, "Stopped"))

    step = predictor_step(pods) if pods is not None else None
    was_idle = model.status.phase in (Phase.IDLE, Phase.WAKING)
    replicas: int | None = copies
    stopped_by_hand = False
    if stop_asked_and_honoured or (stopped and stop_asked == "true"):
        phase, replicas = Phase.IDLE, 0
        message = "Stopped while idle; the next request wakes it."
        if knative:
            # The gateway stops only Standard-mode models (Knative scales to zero itself), so this stop was set
            # by hand, and no request lifts it: say so, and the gateway answers 503 at once.
            stopped_by_hand = True
            message = (
                f'Stopped by hand: {kserve.STOP_ANNOTATION} is "true" on the InferenceService, which nothing here '
                "removes in Knative mode; requests get 503 until it is removed (kubectl annotate isvc "
                f"{model.metadata.name} {kserve.STOP_ANNOTATION}-)."
            )
        isvc_cond = ("True", "Stopped", message)
    elif not conditions:
        phase, isvc_cond = Phase.PENDING, ("Unknown", "AwaitingKServe", "KServe has not reported on it yet.")
        message = "Waiting for KServe to pick up the InferenceService."
    elif stopped:
        phase = Phase.WAKING
        step = step or WakeStep.SCHEDULING
        message = f"Waking: KServe is starting the predictor again; {step.says}."
        isvc_cond = ("Unknown", "Resuming", message)
    elif _is_true(ready):
        at_zero = states.get("targetModelState") == "Pending" and model_status.get("transitionStatus") == "InProgress"
        if rolling_out:
            phase = Phase.LOADING
            message = f"Rolling out revision {created}; {serving} serves meanwhile."
        elif knative and at_zero and states.get("activeModelState") == "Loaded" and step is not None:
            phase, replicas = Phase.WAKING, 0
            message = f"Waking from zero: {step.says}."
        elif knative and at_zero and states.get("activeModelState") == "Loaded":
            phase, replicas = Phase.IDLE, 0
            message = "Scaled to zero; the next request wakes it."
        else:
            phase, message = Phase.READY, "Serving."
        isvc_cond = ("True", str((ready or {}).get("reason") or "Ready"), str((ready or {}).get("message") or "Ready."))
    elif not knative and _past_progress_deadline(status, ready):
        # A Deployment's rollout past progressDeadlineSeconds: KServe fixes it at 600 (v0.14.1-v0.20.0
        # reconcilers/deployment/deployment_reconciler.go setDefaultDeploymentSpec; no InferenceService field sets
        # it) and PropagateRawStatus turns Progressing=False/ProgressDeadlineExceeded into PredictorReady False. The
        # Deployment still rolls on (only a condition), and the previous pods serve meanwhile: a slow load, not a
        # failure, unless the model itself failed (FailedToLoad, judged above through _child_failure's states).
        deadline = "the new replica has been starting for longer than the 600 s progress deadline KServe gives it"
        if copies:  # ready pods (0.16+: PropagateModelStatus counts the ready ones)
            phase, message = Phase.READY, f"Rolling out: {deadline}; the previous replica serves meanwhile."
            isvc_cond = ("False", "ProgressDeadlineExceeded", message)
        else:
            phase, message = Phase.LOADING, f"Starting: {deadline}; still loading (not a failure unless it exits)."
            isvc_cond = ("False", "ProgressDeadlineExceeded", message)
    elif (failure := _child_failure(status, ready)) is not None:
        phase, message = Phase.FAILED, failure
        isvc_cond = ("False", str((ready or {}).get("reason") or "Failed"), failure)
    else:
        phase = Phase.WAKING if was_idle and not rolling_out else Phase.LOADING
        message = str((ready or {}).get("message") or "The predictor is starting.")
        if rolling_out and not (ready or {}).get("message"):
            message = f"Rolling out revision {created}."
        if phase is Phase.WAKING:
            message = f"Waking: {step.says}." if step is not None else f"Waking: {message}"
        isvc_cond = (
            str((ready or {}).get("status") or "Unknown"),
            str((ready or {}).get("reason") or "Starting"),
            message,
        )

    if stopped_by_hand:
        ready_cond = ("Ready", "False", READY_STOPPED_BY_HAND, message)
    elif phase in (Phase.READY, Phase.IDLE):
        ready_cond = ("Ready", "True", "ScaledToZero" if phase is Phase.IDLE else "Serving", message)
    elif phase is Phase.WAKING:
        # A wake is what scale to zero promises, not a failure: the model answers (the request waits for it).
        ready_cond = ("Ready", "True", "Waking", message)
    elif phase is Phase.FAILED:
        ready_cond = ("Ready", "False", "InferenceServiceFailed", message)
    else:
        ready_cond = ("Ready", "False", phase.value, message)

    return {
        **base,
        "phase": phase.value,
        "step": step.label if step is not None and phase in (Phase.WAKING, Phase.LOADING) else None,
        "url": url,
        "address": address,
        "replicas": replicas,
        "message": message,
        "conditions": _conditions(
            previous, generation, now, ready_cond, spec_valid, ("InferenceServiceReady", *isvc_cond), *extra
        ),
    }


def status_for_invalid_spec(body: dict[str, Any], error: SpecError, now: datetime | None = None) -> dict[str, Any]:
    """The status of a UniversalModel whose spec cannot be served: SpecValid=False naming the field."""
    now = now or datetime.now(UTC)
    meta = body.get("metadata", {})
    generation = int(meta.get("generation") or 0)
    raw_previous = (body.get("status") or {}).get("conditions") or []
    previous = []
    for item in raw_previous:
        try:
            previous.append(Condition.model_validate(item))
        except ValidationError:
            continue
    message = f"Invalid spec: {error}"
    raw_spec = body.get("spec")
    served = raw_spec.get("servedName") if isinstance(raw_spec, dict) else None
    return {
        "phase": Phase.FAILED.value,
        "step": None,
        "observedGeneration": generation,
        "servedName": served if isinstance(served, str) else meta.get("name"),
        "message": message,
        "conditions": _conditions(
            previous, generation, now,
            ("Ready", "False", "InvalidSpec", message),
            ("SpecValid", "False", "InvalidSpec", message),
            ("InferenceServiceReady", "Unknown", "NotCreated", "No InferenceService for an invalid spec."),
        ),
    }  # fmt: skip


def status_for_forbidden(model: UniversalModel, refused: str, now: datetime | None = None) -> dict[str, Any]:
    """The status while the API server refuses the operator a request: RBAC, never a spec error.

    ``refused`` is the API server's 403 message, which names the user, verb, resource and namespace.
    SpecValid stays True (nothing in the spec can fix it); the handler retries with a growing delay.
    """
    now = now or datetime.now(UTC)
    generation = model.metadata.generation
    message = (
        f"The API server refused the operator: {refused}. This is RBAC, not the spec: grant the operator's "
        "service account that permission (the Helm chart's operator role lists what it needs); the operator "
        "retries meanwhile."
    )
    return {
        "observedGeneration": generation,
        "servedName": model.served_name,
        "backend": reported_backend(model).value,
        "inferenceService": model.metadata.name,
        "phase": Phase.PENDING.value,
        "step": None,
        "message": message,
        "conditions": _conditions(
            model.status.conditions, generation, now,
            ("Ready", "False", "Forbidden", message),
            ("SpecValid", "True", "Valid", "The spec is valid."),
            ("InferenceServiceReady", "Unknown", "Forbidden", message),
        ),
    }  # fmt: skip


def status_changed(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change what ``current`` says (None values mean absent)."""
    current = current or {}
    for key, value in new.items():
        if key == "conditions":
            continue
        if current.get(key) != value and not (value is None and key not in current):
            return True
    return _strip_times(current.get("conditions")) != _strip_times(new.get("conditions"))


def _strip_times(conditions: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
    return [
        (c.get("type"), c.get("status"), c.get("reason"), c.get("message"), c.get("observedGeneration"))
        for c in conditions or []
    ]
