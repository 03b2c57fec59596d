"""The InferenceService that serves a UniversalModel: everything the operator owns in it, nothing else.

Its parts come from the modules beside this one (the checks a spec must pass first, the labels, the storage
ServiceAccount's name) and from the predictor's command line in :mod:`universal_operator.predictor`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from universal_operator import kserve
from universal_operator.config import OperatorConfig, Profile
from universal_operator.predictor import (
    CONTAINER_NAME,
    compile_cache_claim,
    engine_arg_defaults,
    predictor_config,
)
from universal_operator.reconcile.adapter_credentials import (
    ADAPTER_CREDENTIALS_MOUNT_PATH,
    ADAPTER_CREDENTIALS_VOLUME,
    adapter_credentials_dir,
    adapter_credentials_secret_name,
)
from universal_operator.reconcile.adapters import (
    ADAPTERS_MOUNT_PATH,
    ADAPTERS_VOLUME,
    adapters_config_map_name,
    adapters_file,
)
from universal_operator.reconcile.cache import DISABLE_ANNOTATION, NODE_GROUP_ANNOTATION, CacheState
from universal_operator.reconcile.checks import FEATURE_SECURITY_CONTEXT, check_servable
from universal_operator.reconcile.labels import (
    ANNOTATION_SERVED_NAME,
    labels_for,
    owner_reference,
    visibility_labels,
)
from universal_operator.reconcile.service_account import predictor_service_account
from universal_operator.spec import ScalingMode, UniversalModel
from universal_operator.warm import WarmWindow, warm_at
from universal_predictors.config import (
    DEFAULT_HTTP_PORT,
    GPUS_ENV,
    PREDICTOR_MODULE,
    STATE_MOUNT_PATH,
)

ANNOTATION_RETENTION = "autoscaling.knative.dev/scale-to-zero-pod-retention-period"
ANNOTATION_WINDOW = "autoscaling.knative.dev/window"
ANNOTATION_PROGRESS_DEADLINE = "serving.knative.dev/progress-deadline"
CACHE_DIR = "/cache"
#: Where a profile's compile-cache claim is mounted, and the caches pointed into it: vLLM keeps its
#: torch.compile artifacts under VLLM_CACHE_ROOT (vllm 0.32 envs.py, default ~/.cache/vllm: the emptyDir,
#: gone at scale to zero; compilation/backends.py writes torch_compile_cache there), Triton its kernels
#: under TRITON_CACHE_DIR (default ~/.triton/cache), FlashInfer its JIT-compiled kernels under
#: FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (flashinfer-python 0.7.0.post1 jit/env.py, default $HOME).
COMPILE_CACHE_DIR = "/var/cache/universal-runtime/compile"
COMPILE_CACHE_ENV = {
    "VLLM_CACHE_ROOT": f"{COMPILE_CACHE_DIR}/vllm",
    "TRITON_CACHE_DIR": f"{COMPILE_CACHE_DIR}/triton",
    "FLASHINFER_WORKSPACE_BASE": f"{COMPILE_CACHE_DIR}/flashinfer",
}
#: The predictor's probes. Liveness asks KServe's /v2/health/live, which answers as soon as the HTTP server
#: runs and stays up while a model loads (loading is off the event loop), so a slow load is never killed;
#: a dead engine ends the process itself (readiness fails first). The startup probe holds liveness off until
#: the server listens (imports, a modelcar's model appearing), for at most spec.scaling.startupTimeout.
LIVE_PATH = "/v2/health/live"
PROBE_PERIOD_S = 10
PROBE_TIMEOUT_S = 5
#: Six unanswered liveness probes in a row (a minute): the server is hung, not busy.
LIVENESS_FAILURES = 6
#: How long a request may take to its first byte once a replica is up: Knative's own default revision timeout
#: (knative-v1.16.0 pkg/apis/config/defaults.go, DefaultRevisionTimeoutSeconds = 5 * 60).
LONGEST_REQUEST = timedelta(minutes=5)
#: Knative's stable window: its default and its bounds (knative serving knative-v1.16.0
#: pkg/autoscaler/config/config.go StableWindow; pkg/apis/autoscaling/register.go WindowMin, WindowMax).
KNATIVE_STABLE_WINDOW = timedelta(seconds=60)
KNATIVE_MIN_WINDOW = timedelta(seconds=6)
#: config-autoscaler scale-to-zero-grace-period on a default install (knative-v1.16.0
#: pkg/autoscaler/config/config.go): the least time a revision stays up once it is inactive.
KNATIVE_SCALE_TO_ZERO_GRACE = timedelta(seconds=30)


def predictor_probes(model: UniversalModel) -> dict[str, Any]:
    """Readiness, liveness and startup probes of the predictor container (see LIVE_PATH)."""
    startup_s = model.spec.scaling.startup_duration.total_seconds()
    live = {"httpGet": {"path": LIVE_PATH, "port": DEFAULT_HTTP_PORT}, "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": PROBE_TIMEOUT_S}  # fmt: skip
    return {
        # Ready only once the model is loaded and its engine alive: the predictor's v2 readiness says exactly that.
        "readinessProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": DEFAULT_HTTP_PORT},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {**live, "failureThreshold": LIVENESS_FAILURES},
        "startupProbe": {**live, "failureThreshold": max(1, -(-int(startup_s) // PROBE_PERIOD_S))},
    }


def _env(model: UniversalModel, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The predictor container's environment.

    Credentials are not here: the predictor reads the files the storage initializer fetched, offline
    (HF_HUB_OFFLINE), and env on ``kserve-container`` never reaches the initializer (see
    :func:`desired_service_account`). Nor are download patterns: no KServe release passes any to the
    initializer of an InferenceService, so ``source.file`` is applied by the predictor (``--source-file``)
    to the whole source the initializer fetched (operator/README.md, "Credentials and downloads").
    """
    spec = model.spec
    env: list[dict[str, Any]] = []
    if spec.source.is_remote:
        # KServe v0.16.0 pkg/apis/serving/v1beta1/predictor_custom.go (GetStorageUri): a custom container's
        # STORAGE_URI is its storage URI; the pod webhook fetches it and rewrites the value to /mnt/models.
        env.append({"name": "STORAGE_URI", "value": spec.source.storage_uri})
    env += [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        # The storage initializer fetched the model; the predictor must not reach for the hub itself.
        {"name": "HF_HUB_OFFLINE", "value": "1" if spec.source.is_remote else "0"},
    ]
    if spec.resources.gpus > 0:
        # The predictor cannot see its own extended-resource limits (the downward API has none for them):
        # told how many GPUs it got, it refuses to start on an engine that would leave them unused.
        env.append({"name": GPUS_ENV, "value": str(spec.resources.gpus)})
    env += [{"name": name, "value": value} for name, value in (extra or {}).items()]
    taken = {item["name"] for item in env}
    for var in spec.env:
        if var.name in taken:
            env = [item for item in env if item["name"] != var.name]
        env.append(var.model_dump(by_alias=True, exclude_none=True))
    return env


def _resources(model: UniversalModel, profile: Profile | None) -> dict[str, Any]:
    """Requests and limits, always both for what the spec sets; what it leaves out KServe fills.

    KServe's defaulting webhook fills each missing request and limit separately from its ConfigMap (cpu 1,
    memory 2Gi for both; KServe v0.14.1-v0.16.0 pkg/apis/serving/v1beta1/inference_service_defaults.go
    setResourceRequirementDefaults), so a request without its limit can end above the filled-in limit and
    Kubernetes refuses the pod. Setting both keeps request <= limit whatever the ConfigMap says.
    """
    res = model.spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if res.cpu:
        # CPU limit = request: a limit must be set (else KServe's 1 applies), any other value would be a guess,
        # and an equal one gives a replica the speed it asked for on a busy node and an idle one alike (with
        # memory set too, the pod is Guaranteed QoS).
        requests["cpu"] = res.cpu
        limits["cpu"] = res.cpu
    if res.memory:
        # Memory is requested and limited alike: engines size their caches from the cgroup limit.
        requests["memory"] = res.memory
        limits["memory"] = res.memory
    if res.gpus:
        gpu_resource = profile.gpu_resource if profile else "nvidia.com/gpu"
        requests[gpu_resource] = str(res.gpus)
        limits[gpu_resource] = str(res.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _image(model: UniversalModel, profile: Profile | None, config: OperatorConfig) -> str:
    if model.spec.image:
        return model.spec.image
    if profile is not None and profile.image:
        return profile.image
    return config.images.cuda if model.spec.resources.gpus > 0 else config.images.cpu


def container_security_context(config: OperatorConfig) -> dict[str, Any]:
    """The restricted profile on the container, which Knative always admits: every field here is in
    knative serving knative-v1.16.0 pkg/apis/serving/fieldmask.go SecurityContextMask (capabilities.add,
    which needs a flag, is never set). The user and group IDs come from the operator's podSecurity."""
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }
    if config.pod_security.run_as_user is not None:
        context["runAsUser"] = config.pod_security.run_as_user
    if config.pod_security.run_as_group is not None:
        context["runAsGroup"] = config.pod_security.run_as_group
    context["capabilities"] = {"drop": ["ALL"]}
    context["seccompProfile"] = {"type": "RuntimeDefault"}
    return context


def pod_security_context(model: UniversalModel, config: OperatorConfig) -> dict[str, Any] | None:
    """The pod-level securityContext, or None where it would be refused.

    Knative drops every pod-level field unless kubernetes.podspec-securitycontext is enabled (knative-v1.16.0
    pkg/apis/serving/fieldmask.go PodSecurityContextMask); fsGroup has no container-level equivalent, so
    without that flag it is not set (emptyDir volumes are writable by any user). IDs left empty in the
    operator's podSecurity are the platform's to assign (OpenShift's restricted SCC).
    """
    if model.spec.scaling.mode is ScalingMode.KNATIVE and FEATURE_SECURITY_CONTEXT not in config.knative.features:
        return None
    ids = config.pod_security
    context: dict[str, Any] = {"runAsNonRoot": True}
    if ids.run_as_user is not None:
        context["runAsUser"] = ids.run_as_user
    if ids.run_as_group is not None:
        context["runAsGroup"] = ids.run_as_group
    if ids.fs_group is not None:
        context["fsGroup"] = ids.fs_group
    context["seccompProfile"] = {"type": "RuntimeDefault"}
    return context


def knative_idle_annotations(idle: timedelta) -> dict[str, str]:
    """The stable window and scale-to-zero retention whose sum is ``idle`` (``spec.scaling.idleTimeout``).

    Knative scales a revision to zero once (a) its stable-window average concurrency is zero, so a full
    ``autoscaling.knative.dev/window`` after the last request ends (pkg/autoscaler/scaling/autoscaler.go:
    desired pods = ceil(stable average / target)), and (b) it has been inactive for the longer of the
    cluster's scale-to-zero-grace-period (30s by default) and the revision's
    ``scale-to-zero-pod-retention-period`` (pkg/reconciler/autoscaling/kpa/scaler.go handleScaleToZero,
    lastPodRetention); knative serving knative-v1.16.0. Idle time is therefore window + max(grace, retention):
    the window keeps Knative's default 60s where the idle time allows, shrinks (down to 6s) to leave the
    grace period room, and the retention takes the rest. Idle times under 6s + grace get 6s + grace.
    """
    room = idle - KNATIVE_SCALE_TO_ZERO_GRACE
    window = min(max(room, KNATIVE_MIN_WINDOW), KNATIVE_STABLE_WINDOW)
    window = timedelta(seconds=int(window.total_seconds()))  # Knative wants the window in whole seconds
    retention = max(idle - window, timedelta(0))
    return {ANNOTATION_WINDOW: _go_seconds(window), ANNOTATION_RETENTION: _go_seconds(retention)}


def _go_seconds(value: timedelta) -> str:
    """A duration Go's time.ParseDuration reads: whole seconds as ``90s``, fractions as ``2.5s``."""
    seconds = value.total_seconds()
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{seconds:g}s"


def request_timeout_seconds(model: UniversalModel, config: OperatorConfig) -> int:
    """The predictor's KServe ``timeout``: how long a request may wait for its first byte, a cold start included.

    Knative mode: the activator holds a request while a replica starts and answers 504 once the revision's
    timeoutSeconds pass without a byte of the response (knative-v1.16.0 cmd/activator/main.go, NewTimeoutHandler
    fed rev.Spec.TimeoutSeconds; pkg/http/handler/timeout.go). KServe copies ``timeout`` into timeoutSeconds and
    responseStartTimeoutSeconds (KServe v0.16.0 pkg/controller/v1beta1/inferenceservice/reconcilers/knative/
    ksvc_reconciler.go; the field is ComponentExtensionSpec.TimeoutSeconds, json ``timeout``, in
    pkg/apis/serving/v1beta1/component.go). So: startupTimeout plus the longest request, at most the cluster's
    max-revision-timeout-seconds, above which Knative refuses the revision (pkg/apis/serving/v1/
    revision_validation.go, validateTimeoutSeconds). The gateway waits exactly as long (status.requestTimeoutSeconds).

    Standard mode: the gateway holds a request until the model is Ready, so only the request itself counts
    (KServe uses it as the HTTPRoute's timeout: v0.16.0 reconcilers/ingress/httproute_reconciler.go).
    """
    scaling = model.spec.scaling
    if scaling.mode is ScalingMode.STANDARD:
        return int(LONGEST_REQUEST.total_seconds())
    wanted = scaling.startup_duration + LONGEST_REQUEST
    return min(int(wanted.total_seconds()), config.knative.max_revision_timeout_seconds)


def _min_replicas(min_replicas: int, schedule: list[WarmWindow], now: datetime | None) -> int:
    """``minReplicas``, raised to 1 while a warm window is open (no schedule: unchanged, so no clock is read)."""
    if not schedule or min_replicas >= 1:
        return min_replicas
    active, _ = warm_at(schedule, now or datetime.now(UTC))
    return 1 if active else min_replicas


def cache_annotations(model: UniversalModel, cache: CacheState | None, live: dict[str, Any] | None) -> dict[str, str]:
    """What steers KServe's LocalModelCache for this model (:mod:`.cache`): the node group it runs on, and the opt-out
    while the cache its source matches does not hold the model on every node yet (KServe would mount it anyway).

    Once the ``live`` InferenceService mounts the cache the opt-out is not rendered again (a node joining the group
    downloads soon): before v0.18.0 KServe would keep the label anyway (setLocalModelLabel returns early without a
    cache list), so only the annotation would change, and a rollout with it.
    """
    if cache is None or cache.name is None:
        return {}
    out: dict[str, str] = {}
    if model.spec.cache is not None:
        out[NODE_GROUP_ANNOTATION] = model.spec.cache.node_groups[0]
    if not cache.ready and not cache.status(live)["mounted"]:
        out[DISABLE_ANNOTATION] = "true"
    return out


def desired_inference_service(
    model: UniversalModel,
    config: OperatorConfig,
    *,
    now: datetime | None = None,
    cache: CacheState | None = None,
    live: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The InferenceService that serves ``model``: everything the operator owns in it, nothing else.

    ``now`` (aware; default the current time) decides whether a ``scaling.warmSchedule`` window holds a replica:
    inside one, the predictor's ``minReplicas`` is at least 1 (KServe turns it into Knative's min-scale
    annotation; /work/shared/REFERENCE.md, "Raw deployment vs Serverless"). Standard mode already keeps 1.

    Applied by server-side apply, so fields KServe or the gateway set (defaults, the stop annotation)
    are theirs and stay untouched. Raises SpecError for a spec only the operator can reject.

    ``cache``: the LocalModelCache the model's source matches, if any (:func:`cache_annotations`).
    ``live``: the InferenceService as stored, if any: its ``status.deploymentMode`` is what KServe holds the
    annotation to (:func:`universal_operator.kserve.deployment_mode`), its labels say whether a cache is mounted.
    """
    profile = check_servable(model, config)
    spec = model.spec
    scaling = spec.scaling
    knative = scaling.mode is ScalingMode.KNATIVE
    compile_claim = compile_cache_claim(model, profile)

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": _image(model, profile, config),
        "imagePullPolicy": config.images.pull_policy,
        "command": ["python", "-m", PREDICTOR_MODULE],
        "args": predictor_config(
            model,
            engine_arg_defaults=engine_arg_defaults(model, config, profile),
            adapters_file=adapters_file(model),
            adapter_credentials_dir=adapter_credentials_dir(model),
        ).to_args(),
        "env": _env(model, {**(COMPILE_CACHE_ENV if compile_claim else {}), **config.tracing.env}),
        "ports": [{"name": "http1", "containerPort": DEFAULT_HTTP_PORT, "protocol": "TCP"}],
        **predictor_probes(model),
        "securityContext": container_security_context(config),
        "volumeMounts": [
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    resources = _resources(model, profile)
    if resources:
        container["resources"] = resources

    volumes: list[dict[str, Any]] = [
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.state is not None:
        volumes.append({"name": "state", "persistentVolumeClaim": {"claimName": spec.state.claim_name}})
        mount: dict[str, Any] = {"name": "state", "mountPath": STATE_MOUNT_PATH}
        if spec.state.sub_path:
            mount["subPath"] = spec.state.sub_path
        container["volumeMounts"].append(mount)
    if compile_claim is not None:
        volumes.append({"name": "compile-cache", "persistentVolumeClaim": {"claimName": compile_claim}})
        container["volumeMounts"].append({"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR})
    adapters_map = adapters_config_map_name(model)
    if adapters_map is not None:  # a ConfigMap volume: the kubelet updates it in place (reconcile/adapters.py)
        volumes.append({"name": ADAPTERS_VOLUME, "configMap": {"name": adapters_map}})
        container["volumeMounts"].append({"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT_PATH, "readOnly": True})
    credentials = adapter_credentials_secret_name(model)
    if credentials is not None:  # whole, like the list: the kubelet rewrites it in place (adapter_credentials.py)
        volumes.append({"name": ADAPTER_CREDENTIALS_VOLUME, "secret": {"secretName": credentials}})
        container["volumeMounts"].append(
            {"name": ADAPTER_CREDENTIALS_VOLUME, "mountPath": ADAPTER_CREDENTIALS_MOUNT_PATH, "readOnly": True}
        )
    if spec.resources.gpus > 0:
        shm: dict[str, Any] = {"medium": "Memory"}
        if profile is not None and profile.shm_size:
            shm["sizeLimit"] = profile.shm_size
        volumes.append({"name": "dshm", "emptyDir": shm})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})

    predictor: dict[str, Any] = {
        "minReplicas": _min_replicas(scaling.min_replicas, scaling.warm_schedule, now)
        if knative
        else max(scaling.min_replicas, 1),
        "maxReplicas": scaling.max_replicas,
        "timeout": request_timeout_seconds(model, config),
        "containers": [container],
        "volumes": volumes,
        "labels": labels_for(model),
    }
    security = pod_security_context(model, config)
    if security is not None:
        predictor["securityContext"] = security
    if knative:
        if scaling.target_concurrency is not None:
            predictor["scaleMetric"] = "concurrency"
            predictor["scaleTarget"] = scaling.target_concurrency
        predictor["annotations"] = {
            **knative_idle_annotations(scaling.idle_duration),
            ANNOTATION_PROGRESS_DEADLINE: scaling.startup_timeout,
        }
    if not knative and spec.state is not None and scaling.max_replicas == 1:
        # One replica with a state claim: most likely ReadWriteOnce (several replicas need ReadWriteMany, as
        # spec.state says), which a rolling update would deadlock on, the new pod waiting for the claim the old one
        # holds on another node. Recreate stops the old pod first (ComponentExtensionSpec.DeploymentStrategy, raw
        # deployment only: KServe v0.14.1-v0.20.0 pkg/apis/serving/v1beta1/component.go, applied by
        # reconcilers/deployment/deployment_reconciler.go).
        predictor["deploymentStrategy"] = {"type": "Recreate"}
    account = predictor_service_account(model, config)
    if account:
        predictor["serviceAccountName"] = account
    if profile is not None:
        if profile.node_selector:
            predictor["nodeSelector"] = dict(profile.node_selector)
        if profile.tolerations:
            predictor["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in profile.tolerations]
        if profile.runtime_class_name:
            predictor["runtimeClassName"] = profile.runtime_class_name

    return {
        "apiVersion": kserve.API_VERSION,
        "kind": kserve.KIND,
        "metadata": {
            "name": model.metadata.name,
            "namespace": model.metadata.namespace,
            "labels": {**labels_for(model), **visibility_labels(model, config)},
            "annotations": {
                kserve.DEPLOYMENT_MODE_ANNOTATION: kserve.deployment_mode(
                    config.kserve.release, scaling.mode, ((live or {}).get("status") or {}).get("deploymentMode")
                ),
                ANNOTATION_SERVED_NAME: model.served_name,
                **cache_annotations(model, cache, live),
            },
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {"predictor": predictor},
    }
