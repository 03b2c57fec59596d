"""Running a rendered InferenceService's predictor container with podman, as a kubelet would run the pod.

:func:`run_args` translates the ``kserve-container`` the operator rendered, field by field, into ``podman run``
flags: command and args, env, the pod's and the container's securityContext, memory and CPU limits, emptyDir
volumes as tmpfs, and KServe's storage-initializer output read-only at /mnt/models, or an ``oci://`` model image
as KServe's modelcar sidecar shows it (:func:`modelcar_args`). A field it does not know fails the translation (a
new rendered field must be given its podman meaning here, not silently dropped).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from universal_simcluster.admission import CONTAINER_NAME

#: KServe v0.16.0 pkg/constants/constants.go: DefaultModelLocalMountPath, CustomSpecStorageUriEnvVarKey, OciURIPrefix,
#: ModelInitModeEnvVarKey.
MODEL_MOUNT_PATH = "/mnt/models"
STORAGE_URI_ENV = "STORAGE_URI"
OCI_PREFIX = "oci://"
MODEL_INIT_MODE_ENV = "MODEL_INIT_MODE"
#: KServe v0.16.0 pkg/utils/storage.go: what the modelcar sidecar (CreateModelcarContainer) and its init container
#: (CreateModelcarInitContainer) run; the sidecar's limits are the configmap's cpuModelcar/memoryModelcar defaults
#: (config/configmap/inferenceservice.yaml). $$ is the sidecar shell's pid, in the pod's shared process namespace.
MODELCAR_COMMAND = f"ln -sf /proc/$$/root/models {MODEL_MOUNT_PATH} && sleep infinity"
MODELCAR_INIT_CHECK = '[ -d /models ] && [ "$(ls -A /models)" ]'
MODELCAR_LIMITS = {"cpu": "10m", "memory": "15Mi"}

#: Container fields the translation honours (the rest of the rendered container must be absent).
_CONTAINER_FIELDS = {
    "name", "image", "imagePullPolicy", "command", "args", "env", "ports", "readinessProbe", "livenessProbe",
    "startupProbe", "securityContext", "volumeMounts", "resources",
}  # fmt: skip
_CONTAINER_SECURITY = {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "runAsNonRoot", "capabilities",
                       "seccompProfile", "runAsUser", "runAsGroup"}  # fmt: skip
_POD_SECURITY = {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile", "fsGroupChangePolicy"}
PODMAN_TIMEOUT_S = 120.0
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


class Untranslatable(Exception):
    """The rendered pod has a field this translation does not know how to give podman."""


@dataclass(frozen=True)
class Modelcar:
    """A running modelcar sidecar: its container (whose processes the pod shares) and the pod's /mnt emptyDir."""

    container: str
    volume: Path


def modelcar_image(storage_uri: str) -> str:
    """The model image of an ``oci://`` storage URI (ConfigureModelcarToContainer trims the prefix)."""
    return storage_uri.removeprefix(OCI_PREFIX)


def modelcar_init_args(image: str) -> list[str]:
    """``podman run`` arguments for the modelcar init container: the image has a non-empty /models."""
    return ["run", "--rm", "--pull=never", "--no-healthcheck", "--entrypoint", "sh", image, "-c", MODELCAR_INIT_CHECK]


def modelcar_args(image: str, *, name: str, volume: Path) -> list[str]:
    """``podman run`` arguments for the modelcar sidecar: links its /models into the shared /mnt, then sleeps.

    KServe gives it no securityContext (unless uidModelcar is configured): the image's own user runs it.
    """
    volume.mkdir(parents=True, exist_ok=True)
    volume.chmod(0o777)  # an emptyDir is world-writable
    return [
        "run", "--detach", "--rm", "--pull=never", "--no-healthcheck", "--name", name,
        "--memory", str(_bytes(MODELCAR_LIMITS["memory"])), "--cpus", _cpus(MODELCAR_LIMITS["cpu"]),
        "--volume", f"{volume}:{Path(MODEL_MOUNT_PATH).parent}", "--entrypoint", "sh", image, "-c", MODELCAR_COMMAND,
    ]  # fmt: skip


def predictor_container(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The rendered ``kserve-container`` of an InferenceService."""
    containers = isvc["spec"]["predictor"]["containers"]
    [container] = [c for c in containers if c["name"] == CONTAINER_NAME]
    return dict(container)


def _bytes(quantity: str | int) -> int:
    text = str(quantity)
    for suffix, factor in {**_BINARY, **_DECIMAL}.items():
        if text.endswith(suffix):
            return int(Decimal(text[: -len(suffix)]) * factor)
    return int(Decimal(text))


def _cpus(quantity: str | int) -> str:
    text = str(quantity)
    return str(Decimal(text[:-1]) / 1000) if text.endswith("m") else text


def run_args(
    isvc: Mapping[str, Any],
    *,
    name: str,
    image: str | None = None,
    model_dir: Path | None = None,
    publish: Mapping[int, int] | None = None,
    volumes_dir: Path | None = None,
    links: Path | None = None,
    modelcar: Modelcar | None = None,
    secrets: Mapping[tuple[str, str], str] | None = None,
    projections: Mapping[str, Path] | None = None,
    detach: bool = True,
) -> list[str]:
    """``podman run`` arguments (without ``podman``) for the predictor pod of ``isvc``.

    ``model_dir`` is what KServe's storage initializer wrote (or the modelcar's /models): mounted read-only at
    /mnt/models, as KServe v0.16.0 pkg/webhook/admission/pod/storage_initializer_injector.go mounts the
    provision location (read-only unless the storage.kserve.io/readonly annotation says "false"), and a
    non-empty STORAGE_URI env var is rewritten to that path there. ``links``: a host folder the files in
    ``model_dir`` link into (KServe's storage code links a local source instead of copying it), bound read-only
    at its own path. ``modelcar``: an ``oci://`` source as KServe runs it instead (v0.16.0 pkg/utils/storage.go
    ConfigureModelcarToContainer): the pod shares the sidecar's process namespace, mounts the shared emptyDir at
    /mnt (writable) where the sidecar linked /models, and gets MODEL_INIT_MODE=async; STORAGE_URI is left as
    written (CommonStorageInitialization returns before its rewrite when the source is a modelcar).
    ``publish`` maps host ports to container ports; ``volumes_dir`` is an empty folder where the pod's emptyDir
    volumes are made; ``secrets`` resolves ``secretKeyRef`` env, (Secret, key) -> value, as the kubelet does;
    ``projections``: by volume name, the host folder where a configMap or secret volume's keys are projected (the
    kubelet's layout: each key a link through ``..data``), bound read-only: "A ConfigMap is always mounted as
    readOnly" (kubernetes/website ``content/en/docs/concepts/storage/volumes.md``, configMap; secrets likewise).
    ``detach=False`` runs the pod attached (its output on podman's) and removes it when it ends.
    """
    predictor = isvc["spec"]["predictor"]
    container = predictor_container(isvc)
    unknown = set(container) - _CONTAINER_FIELDS
    if unknown:
        raise Untranslatable(f"container fields {sorted(unknown)}")
    pod_security = predictor.get("securityContext") or {}
    security = container.get("securityContext") or {}
    if set(pod_security) - _POD_SECURITY or set(security) - _CONTAINER_SECURITY:
        raise Untranslatable(f"securityContext fields {sorted(set(pod_security) - _POD_SECURITY)}, "
                             f"{sorted(set(security) - _CONTAINER_SECURITY)}")  # fmt: skip

    # Kubernetes ignores an image's HEALTHCHECK (the probes are the pod's), and so does this pod.
    args = ["run", "--detach" if detach else "--rm", "--name", name, "--no-healthcheck"]
    user = security.get("runAsUser", pod_security.get("runAsUser"))
    group = security.get("runAsGroup", pod_security.get("runAsGroup"))
    if user is not None:
        args += ["--user", f"{user}:{group if group is not None else 0}"]
    if pod_security.get("fsGroup") is not None:
        args += ["--group-add", str(pod_security["fsGroup"])]
    if security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) and user == 0:
        raise Untranslatable("runAsNonRoot with runAsUser 0: the kubelet would refuse to start this container")
    if security.get("readOnlyRootFilesystem"):
        # No extra tmpfs on /run, /tmp, /var/tmp: a pod's read-only root has none.
        args += ["--read-only", "--read-only-tmpfs=false"]
    capabilities = security.get("capabilities") or {}
    for cap in capabilities.get("drop", []):
        args += ["--cap-drop", cap]
    for cap in capabilities.get("add", []):
        args += ["--cap-add", cap]
    if security.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    seccomp = (security.get("seccompProfile") or pod_security.get("seccompProfile") or {}).get("type")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp not in (None, "RuntimeDefault"):
        raise Untranslatable(f"seccompProfile {seccomp}")

    limits = (container.get("resources") or {}).get("limits") or {}
    if "memory" in limits:
        args += ["--memory", str(_bytes(limits["memory"]))]
    if "cpu" in limits:
        args += ["--cpus", _cpus(limits["cpu"])]

    for var in container.get("env", []):
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if "value" in var:
            value = var["value"]
        elif ref is not None and secrets is not None:
            if (ref["name"], ref["key"]) not in secrets:
                if ref.get("optional"):
                    continue
                raise Untranslatable(
                    f"CreateContainerConfigError: secret {ref['name']!r} has no key {ref['key']!r} (env {var['name']})"
                )
            value = secrets[(ref["name"], ref["key"])]
        else:
            raise Untranslatable(f"env {var['name']} from {sorted(set(var) - {'name'})}")
        if var["name"] == STORAGE_URI_ENV and value and modelcar is None:
            value = MODEL_MOUNT_PATH
        args += ["--env", f"{var['name']}={value}"]
    if modelcar is not None:
        args += ["--env", f"{MODEL_INIT_MODE_ENV}=async"]

    volumes = {volume["name"]: volume for volume in predictor.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            empty_dir = volume["emptyDir"] or {}
            if empty_dir.get("medium") == "Memory":
                size = empty_dir.get("sizeLimit")
                args += ["--tmpfs", f"{mount['mountPath']}:rw" + (f",size={_bytes(size)}" if size else "")]
            else:
                # A fresh world-writable directory on the node, as the kubelet makes it (podman 4.3's --tmpfs takes
                # its mode from the image's directory, not from mode=, and copies the image's files up).
                if volumes_dir is None:
                    raise Untranslatable(f"emptyDir {mount['name']}: give volumes_dir")
                host = volumes_dir / mount["name"]
                host.mkdir(parents=True)
                host.chmod(0o777)
                args += ["--volume", f"{host}:{mount['mountPath']}"]
        elif ("configMap" in volume or "secret" in volume) and projections and mount["name"] in projections:
            args += ["--volume", f"{projections[mount['name']]}:{mount['mountPath']}:ro"]
        else:
            raise Untranslatable(f"volume {mount['name']}: {sorted(set(volume) - {'name'})}")
    storage = any(var["name"] == STORAGE_URI_ENV and var.get("value") for var in container.get("env", []))
    if storage and modelcar is not None:
        args += ["--pid", f"container:{modelcar.container}"]
        args += ["--volume", f"{modelcar.volume}:{Path(MODEL_MOUNT_PATH).parent}"]
    elif storage:
        if model_dir is None:
            raise Untranslatable("STORAGE_URI is set: give the storage initializer's output as model_dir")
        args += ["--volume", f"{model_dir}:{MODEL_MOUNT_PATH}:ro"]
        if links is not None:
            args += ["--volume", f"{links}:{links}:ro"]
    for host_port, container_port in (publish or {}).items():
        args += ["--publish", f"127.0.0.1:{host_port}:{container_port}"]

    if container.get("command"):  # Kubernetes' command replaces the image's ENTRYPOINT, args its CMD
        args += ["--entrypoint", json.dumps(container["command"])]
    args.append(image or container["image"])
    args += container.get("args", [])
    return args


async def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run podman without blocking the event loop (bounded: a hung podman fails the test, not the tier)."""
    proc = await asyncio.create_subprocess_exec(
        "podman", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=PODMAN_TIMEOUT_S)
    result = subprocess.CompletedProcess(["podman", *args], proc.returncode or 0, stdout.decode(), stderr.decode())
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def podman_sync(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run podman (outside an event loop: fixtures, skip checks)."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check)
