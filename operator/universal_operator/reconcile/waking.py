"""Which step a starting predictor is at, read from its pods: what ``kubectl get um`` shows while a model wakes.

KServe labels every predictor pod with its InferenceService's name (``serving.kserve.io/inferenceservice``,
``constants.InferenceServicePodLabelKey``, set in ``pkg/controller/v1beta1/inferenceservice/components/
predictor.go`` at v0.14.1, v0.16.0 and v0.20.0, with ``component: predictor``), downloads the model in the init
container ``storage-initializer`` (``constants.StorageInitializerContainerName``), and runs the model server in
``kserve-container`` (``constants.InferenceServiceContainerName``); an ``oci://`` model comes in the ``modelcar``
sidecar's image (``constants.ModelcarContainerName``, v0.16.0+). Kubernetes says the rest in the pod's status
(core/v1 ``PodStatus``): ``PodScheduled`` until a node is chosen, an init container ``running`` while it works,
a container ``waiting`` with reason ``ContainerCreating`` while its image is pulled and it is created
(``PodInitializing`` while init containers run first; ``ErrImagePull``/``ImagePullBackOff`` when the pull fails:
pkg/kubelet/kubelet_pods.go), then ``running`` with ``ready`` false until its readiness probe passes.

The steps, in the order a pod goes through them: Scheduling, Pulling image, Downloading, Loading. A pod being
deleted or finished is not starting; a ready ``kserve-container`` means the model serves (no step). Of several
pods (a rollout, a second replica) the one furthest along is reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import IntEnum
from typing import Any

#: The label KServe puts on a predictor pod: its InferenceService's name.
POD_LABEL = "serving.kserve.io/inferenceservice"
MODEL_CONTAINER = "kserve-container"
DOWNLOADERS = frozenset({"storage-initializer"})


class WakeStep(IntEnum):
    """A starting predictor's step, ordered as a pod goes through them."""

    SCHEDULING = 1
    PULLING = 2
    DOWNLOADING = 3
    LOADING = 4

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def says(self) -> str:
        """The step in a sentence, for the status message."""
        return _SAYS[self]


_LABELS = {
    WakeStep.SCHEDULING: "Scheduling",
    WakeStep.PULLING: "Pulling image",
    WakeStep.DOWNLOADING: "Downloading",
    WakeStep.LOADING: "Loading",
}
_SAYS = {
    WakeStep.SCHEDULING: "the predictor pod waits for a node",
    WakeStep.PULLING: "pulling the predictor's images",
    WakeStep.DOWNLOADING: "the storage initializer is downloading the model",
    WakeStep.LOADING: "the model server is loading the model",
}


def _state(status: Mapping[str, Any]) -> str:
    state = status.get("state") or {}
    return next((name for name in ("running", "terminated", "waiting") if name in state), "waiting")


def pod_step(pod: Mapping[str, Any]) -> WakeStep | None:
    """The step ``pod`` is at; None when it serves (or is not starting: deleted, finished)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conditions.get("PodScheduled") != "True":
        return WakeStep.SCHEDULING
    for init in status.get("initContainerStatuses") or []:
        state = _state(init)
        if state == "terminated" and (init["state"]["terminated"].get("exitCode") == 0):
            continue
        if state == "running":
            return WakeStep.DOWNLOADING if init.get("name") in DOWNLOADERS else WakeStep.PULLING
        return WakeStep.PULLING  # waiting to be created (its image), or restarting after a failure
    containers = status.get("containerStatuses") or []
    model = next((c for c in containers if c.get("name") == MODEL_CONTAINER), None)
    if model is not None and model.get("ready"):
        return None
    if model is None or any(_state(c) == "waiting" for c in containers):
        return WakeStep.PULLING
    return WakeStep.LOADING


def predictor_step(pods: Iterable[Mapping[str, Any]]) -> WakeStep | None:
    """The step of a model's predictor pods: None when one serves or none is starting, else the furthest."""
    steps = []
    for pod in pods:
        step = pod_step(pod)
        if step is None and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            phase = (pod.get("status") or {}).get("phase")
            if phase not in ("Succeeded", "Failed"):
                return None  # a pod serves
            continue
        if step is not None:
            steps.append(step)
    return max(steps) if steps else None


_STATUS_KEYS = ("phase", "conditions", "initContainerStatuses", "containerStatuses")


def compact(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`pod_step` reads of a pod (the operator keeps these, not whole pods)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "deletionTimestamp") if k in meta},
        "status": {k: status[k] for k in _STATUS_KEYS if k in status},
    }
