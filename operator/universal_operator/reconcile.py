"""Pure reconcile logic: UniversalModel -> InferenceService, InferenceService status -> UniversalModel status.

Nothing here talks to Kubernetes. The handlers feed these functions plain dicts and write the results.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import ValidationError

from universal_operator import kserve
from universal_operator.config import OperatorConfig, Profile
from universal_operator.spec import (
    GROUP,
    KIND,
    Condition,
    Phase,
    ScalingMode,
    UniversalModel,
    parse_duration,
)
from universal_predictors.config import (
    DEFAULT_HTTP_PORT,
    GPUS_ENV,
    MODEL_MOUNT_PATH,
    PREDICTOR_MODULE,
    STATE_MOUNT_PATH,
    TASK_BACKENDS,
    Backend,
    PredictorConfig,
    render_engine_arg,
    resolve_backend,
)

MANAGED_BY = "universal-runtime"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MODEL = f"{GROUP}/model"
LABEL_TASK = f"{GROUP}/task"
LABEL_SERVED_NAME = f"{GROUP}/served-name"
ANNOTATION_SERVED_NAME = f"{GROUP}/served-name"
#: Labels that make KServe keep a model's route inside the cluster, one per mode: Knative mode reads Knative's
#: (KServe v0.14.1-v0.16.0 reconcilers/ingress/ingress_reconciler.go), Standard mode KServe's own
#: (reconcilers/ingress/kube_ingress_reconciler.go, httproute_reconciler.go at v0.16.0).
LABEL_KNATIVE_VISIBILITY = "networking.knative.dev/visibility"
LABEL_KSERVE_VISIBILITY = "networking.kserve.io/visibility"
CLUSTER_LOCAL = "cluster-local"
ANNOTATION_RETENTION = "autoscaling.knative.dev/scale-to-zero-pod-retention-period"
ANNOTATION_WINDOW = "autoscaling.knative.dev/window"
ANNOTATION_PROGRESS_DEADLINE = "serving.knative.dev/progress-deadline"
CONTAINER_NAME = "kserve-container"
#: vLLM's engine argument that shards one model over several GPUs.
TENSOR_PARALLEL_ARG = "tensor_parallel_size"
CACHE_DIR = "/cache"
#: vLLM's engine argument that skips torch.compile and CUDA graphs (nothing to recompile on a wake).
EAGER_ARG = "enforce_eager"
#: Where a profile's compile-cache claim is mounted, and the caches pointed into it: vLLM keeps its
#: torch.compile artifacts under VLLM_CACHE_ROOT (vllm 0.32 envs.py, default ~/.cache/vllm: the emptyDir,
#: gone at scale to zero; compilation/backends.py writes torch_compile_cache there), Triton its kernels
#: under TRITON_CACHE_DIR (default ~/.triton/cache).
COMPILE_CACHE_DIR = "/var/cache/universal-runtime/compile"
COMPILE_CACHE_ENV = {"VLLM_CACHE_ROOT": f"{COMPILE_CACHE_DIR}/vllm", "TRITON_CACHE_DIR": f"{COMPILE_CACHE_DIR}/triton"}
#: The predictor's probes. Liveness asks KServe's /v2/health/live, which answers as soon as the HTTP server
#: runs and stays up while a model loads (loading is off the event loop), so a slow load is never killed;
#: a dead engine ends the process itself (readiness fails first). The startup probe holds liveness off until
#: the server listens (imports, a modelcar's model appearing), for at most spec.scaling.startupTimeout.
LIVE_PATH = "/v2/health/live"
PROBE_PERIOD_S = 10
PROBE_TIMEOUT_S = 5
#: Six unanswered liveness probes in a row (a minute): the server is hung, not busy.
LIVENESS_FAILURES = 6
#: The per-model ServiceAccount that hands spec.source.credentialsSecret to KServe's storage initializer.
STORAGE_ACCOUNT_SUFFIX = "-storage"
SERVICE_ACCOUNT_API_VERSION = "v1"
#: How long a request may take to its first byte once a replica is up: Knative's own default revision timeout
#: (knative-v1.16.0 pkg/apis/config/defaults.go, DefaultRevisionTimeoutSeconds = 5 * 60).
LONGEST_REQUEST = timedelta(minutes=5)
#: The condition saying whether the gateway can stop an idle Standard-mode model (the gateway reads it).
CONDITION_IDLE_STOP = "IdleStop"
#: Knative's stable window: its default and its bounds (knative serving knative-v1.16.0
#: pkg/autoscaler/config/config.go StableWindow; pkg/apis/autoscaling/register.go WindowMin, WindowMax).
KNATIVE_STABLE_WINDOW = timedelta(seconds=60)
KNATIVE_MIN_WINDOW = timedelta(seconds=6)
#: config-autoscaler scale-to-zero-grace-period on a default install (knative-v1.16.0
#: pkg/autoscaler/config/config.go): the least time a revision stays up once it is inactive.
KNATIVE_SCALE_TO_ZERO_GRACE = timedelta(seconds=30)
#: Knative config-features flags (knative serving knative-v1.16.0 pkg/apis/config/features.go), all
#: Disabled on a default install; pkg/apis/serving/fieldmask.go drops the fields they guard.
FEATURE_SECURITY_CONTEXT = "kubernetes.podspec-securitycontext"
FEATURE_NODE_SELECTOR = "kubernetes.podspec-nodeselector"
FEATURE_TOLERATIONS = "kubernetes.podspec-tolerations"
FEATURE_RUNTIME_CLASS = "kubernetes.podspec-runtimeclassname"
FEATURE_PVC = "kubernetes.podspec-persistent-volume-claim"
FEATURE_PVC_WRITE = "kubernetes.podspec-persistent-volume-write"
FEATURE_FIELD_REF = "kubernetes.podspec-fieldref"
#: The longest DNS label (RFC 1123); KServe builds host names from the object's name and namespace.
DNS_LABEL_MAX = 63
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
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class SpecError(Exception):
    """A spec the operator cannot serve; ``field`` names where, the message says what to do."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


# --------------------------------------------------------------------------------------------------
# Parsing and judging a spec


def parse_model(body: dict[str, Any]) -> UniversalModel:
    """Validate a UniversalModel object; SpecError names the first offending field."""
    try:
        return UniversalModel.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise SpecError(loc, message) from None


def check_servable(model: UniversalModel, config: OperatorConfig) -> None:
    """What only the operator can judge: the profile exists, the source can be fetched in a cluster."""
    spec = model.spec
    if spec.resources.profile is not None and spec.resources.profile not in config.profiles:
        known = ", ".join(sorted(config.profiles)) or "none are configured"
        raise SpecError(
            "spec.resources.profile",
            f"profile {spec.resources.profile!r} is not in the operator's configuration ({known})",
        )
    source = spec.source
    if source.scheme == "file" or (source.scheme is None and not source.uri.startswith("/")):
        raise SpecError(
            "spec.source.uri",
            f"{source.uri!r} is a path on a workstation; in a cluster use hf://, s3://, gs://, pvc:// or https://, "
            "or an absolute path baked into spec.image",
        )
    for key, value in spec.engine_args.items():
        if isinstance(value, dict | list):
            raise SpecError(f"spec.engineArgs.{key}", "must be a string, number or boolean")
    check_host_names(model)
    check_knative_features(model, config)


def check_host_names(model: UniversalModel) -> None:
    """Standard mode: the host labels KServe builds from name and namespace must fit one DNS label.

    KServe's raw-deployment reconciler names the predictor's host ``{name}-predictor-{namespace}`` (and the
    top-level one ``{name}-{namespace}``) with its default domainTemplate, and fails the reconcile when a
    label exceeds 63 characters (KServe v0.14.1-v0.16.0 pkg/controller/v1beta1/inferenceservice/reconcilers/
    raw/raw_kube_reconciler.go createRawURL, reconcilers/ingress/domain.go GenerateDomainName). In Knative
    mode hosts come from Knative's template ``{service}.{namespace}.{domain}``: separate labels.
    """
    if model.spec.scaling.mode is not ScalingMode.STANDARD:
        return
    name, namespace = model.metadata.name, model.metadata.namespace
    label = f"{name}-predictor-{namespace}"
    if len(label) > DNS_LABEL_MAX:
        room = DNS_LABEL_MAX - len("-predictor-")
        raise SpecError(
            "metadata.name",
            f"name {name!r} ({len(name)} characters) and namespace {namespace!r} ({len(namespace)} characters) "
            f"make KServe's host label {label!r} {len(label)} characters long, over the {DNS_LABEL_MAX} a DNS "
            f"label allows: in Standard mode name and namespace together may have at most {room} characters; "
            "use a shorter name",
        )


def knative_features_needed(model: UniversalModel, config: OperatorConfig) -> dict[str, list[str]]:
    """Knative mode: the config-features flags each part of the spec needs, by the spec field that needs them.

    knative serving knative-v1.16.0 pkg/apis/serving/fieldmask.go (PodSpecMask, VolumeSourceMask,
    EnvVarSourceMask) and k8s_validation.go (validatePersistentVolumeClaims: a writable claim also needs
    persistent-volume-write). Pod-level securityContext is not listed: it is rendered only when enabled.
    """
    spec = model.spec
    if spec.scaling.mode is not ScalingMode.KNATIVE:
        return {}
    needed: dict[str, list[str]] = {}
    try:
        profile = config.profile(spec.resources.profile)
    except KeyError:
        profile = None
    if profile is not None:
        where = f"spec.resources.profile {spec.resources.profile or config.default_profile!r}"
        if profile.node_selector:
            needed.setdefault(where, []).append(FEATURE_NODE_SELECTOR)
        if profile.tolerations:
            needed.setdefault(where, []).append(FEATURE_TOLERATIONS)
        if profile.runtime_class_name:
            needed.setdefault(where, []).append(FEATURE_RUNTIME_CLASS)
    if compile_cache_claim(model, config) is not None:
        where = f"spec.resources.profile {spec.resources.profile or config.default_profile!r} (compileCacheClaim)"
        needed.setdefault(where, []).extend([FEATURE_PVC, FEATURE_PVC_WRITE])
    if spec.state is not None:
        needed["spec.state"] = [FEATURE_PVC, FEATURE_PVC_WRITE]
        if config.pod_security.fs_group is not None:
            # The claim is writable by the predictor's user only through the pod's fsGroup.
            needed["spec.state"].append(FEATURE_SECURITY_CONTEXT)
    for var in spec.env:
        if var.value_from is not None and var.value_from.field_ref is not None:
            needed.setdefault(f"spec.env[{var.name}]", []).append(FEATURE_FIELD_REF)
    return needed


def check_knative_features(model: UniversalModel, config: OperatorConfig) -> None:
    """Refuse, naming the flags, a Knative-mode spec the cluster's Knative would not admit."""
    enabled = set(config.knative.features)
    missing = {
        where: [flag for flag in flags if flag not in enabled]
        for where, flags in knative_features_needed(model, config).items()
    }
    missing = {where: flags for where, flags in missing.items() if flags}
    if not missing:
        return
    flags = sorted({flag for needed in missing.values() for flag in needed})
    parts = "; ".join(f"{where} needs {', '.join(needed)}" for where, needed in missing.items())
    raise SpecError(
        next(iter(missing)).split(" ")[0].split("[")[0],
        f"Knative admits this only with config-features flags it has disabled ({parts}): set "
        f"{', '.join(f'{flag}: enabled' for flag in flags)} in the knative-serving/config-features ConfigMap and "
        "list them under the operator's knative.features, or use scaling.mode Standard",
    )


# --------------------------------------------------------------------------------------------------
# Rendering the InferenceService


def labels_for(model: UniversalModel) -> dict[str, str]:
    """Labels on the child (and its pods): who manages it, which model, which task, which served name."""
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: MANAGED_BY,
        LABEL_NAME: model.metadata.name,
        LABEL_COMPONENT: "predictor",
        LABEL_MODEL: model.metadata.name,
        LABEL_TASK: model.spec.task.value,
    }
    served = model.served_name
    labels[LABEL_SERVED_NAME] = served if len(served) <= 63 and _LABEL_VALUE.fullmatch(served) else _label_safe(served)
    return labels


def visibility_labels(model: UniversalModel, config: OperatorConfig) -> dict[str, str]:
    """Keep the model's own route inside the cluster unless the operator is told to expose models.

    The gateway is the front door (API keys, one address); a model KServe publishes on its own ingress host
    would be reachable around it.
    """
    if config.expose_models:
        return {}
    knative = model.spec.scaling.mode is ScalingMode.KNATIVE
    return {LABEL_KNATIVE_VISIBILITY if knative else LABEL_KSERVE_VISIBILITY: CLUSTER_LOCAL}


def _label_safe(text: str) -> str:
    """A label value standing for ``text`` (which has characters or length labels forbid)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:54].strip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


def predictor_config(
    model: UniversalModel,
    http_port: int = DEFAULT_HTTP_PORT,
    *,
    source: str | None = None,
    state_dir: str | None = None,
    engine_arg_defaults: dict[Backend, dict[str, str]] | None = None,
) -> PredictorConfig:
    """The predictor's command line as a config: the one contract cluster and local runs share.

    In a cluster remote sources arrive at /mnt/models (KServe's storage initializer) and state lives on
    ``spec.state``'s volume; the local supervisor passes the paths it fetched and chose instead.
    """
    spec = model.spec
    if source is None:
        source = MODEL_MOUNT_PATH if spec.source.is_remote else spec.source.uri.removeprefix("file://")
    if state_dir is None and spec.state is not None:
        state_dir = STATE_MOUNT_PATH
    backend = resolved_backend(model)
    engine_args = {k: render_engine_arg(v) for k, v in spec.engine_args.items()}
    if backend is Backend.VLLM and spec.resources.gpus > 1:
        # vLLM runs a model on one GPU unless told otherwise: spread it over every GPU the replica gets,
        # unless the user chose a split (tensor_parallel_size x pipeline_parallel_size) themselves.
        engine_args.setdefault(TENSOR_PARALLEL_ARG, str(spec.resources.gpus))
    return PredictorConfig(
        model_name=model.served_name,
        task=spec.task,
        backend=backend,
        source=source,
        source_file=spec.source.file,
        source_projector_file=spec.source.projector_file,
        engine_args=engine_args,
        engine_arg_defaults=engine_arg_defaults or {},
        http_port=http_port,
        state_dir=state_dir,
    )


def resolved_backend(model: UniversalModel) -> Backend:
    """The backend as far as the spec can decide it (see :func:`resolve_backend`)."""
    spec = model.spec
    # A projector is a llama.cpp file: with one, auto means llama.cpp as a GGUF weights pattern does.
    pattern = spec.source.file or spec.source.projector_file
    return resolve_backend(spec.task, spec.backend, spec.source.uri, pattern, spec.resources.gpus)


def reported_backend(model: UniversalModel) -> Backend:
    """The backend the status reports: the spec's resolution, or, where that is ``auto``, the one the running
    predictor reported for this very generation (``status.predictorReport``, which the gateway writes) if it is
    one of the task's. A report for an earlier generation says nothing about the current spec: ``auto`` again."""
    backend = resolved_backend(model)
    report = model.status.predictor_report
    if backend is not Backend.AUTO or report is None or report.generation != model.metadata.generation:
        return backend
    try:
        running = Backend(report.backend)
    except ValueError:
        return backend
    return running if running in TASK_BACKENDS[model.spec.task] else backend


def possible_backends(model: UniversalModel) -> tuple[Backend, ...]:
    """The backends the predictor may run: the resolved one, or every one of the task's when that is ``auto``."""
    backend = resolved_backend(model)
    return TASK_BACKENDS[model.spec.task] if backend is Backend.AUTO else (backend,)


def scales_to_zero(model: UniversalModel, config: OperatorConfig) -> bool:
    """Whether the model's replicas go away when idle: Knative with minReplicas 0, or Standard mode where the
    gateway stops idle models (KServe releases that have the stop annotation)."""
    scaling = model.spec.scaling
    if scaling.mode is ScalingMode.KNATIVE:
        return scaling.min_replicas == 0
    return kserve.can_stop(config.kserve.release, scaling.mode)


def compile_cache_claim(model: UniversalModel, config: OperatorConfig) -> str | None:
    """The profile's compile-cache claim, for a model that may run vLLM (the only engine that compiles)."""
    try:
        profile = config.profile(model.spec.resources.profile)
    except KeyError:  # an unknown profile: check_servable names it
        return None
    if profile is None or Backend.VLLM not in possible_backends(model):
        return None
    return profile.compile_cache_claim


def engine_arg_defaults(model: UniversalModel, config: OperatorConfig) -> dict[Backend, dict[str, str]]:
    """Engine-arg defaults by backend, for the backends the predictor may run (it applies only its own's).

    The profile's ``engineArgs``; and for vLLM on a model that scales to zero without a compile cache,
    ``enforce_eager=true``: every wake would otherwise torch.compile the model and capture its CUDA graphs
    again, into an emptyDir that is gone at the next scale to zero (a minute or more of a cold start on
    large models, paid by the request that woke it), where eager mode costs decode speed instead. A
    profile's or the model's own ``enforce_eager`` wins; a compile-cache claim keeps compilation.
    """
    profile = config.profile(model.spec.resources.profile)
    defaults: dict[Backend, dict[str, str]] = {}
    for backend in possible_backends(model):
        given = profile.engine_args.get(backend, {}) if profile is not None else {}
        defaults[backend] = {key: render_engine_arg(value) for key, value in given.items()}
    if Backend.VLLM in defaults and scales_to_zero(model, config) and compile_cache_claim(model, config) is None:
        defaults[Backend.VLLM].setdefault(EAGER_ARG, "true")
    return {backend: args for backend, args in defaults.items() if args}


def predictor_probes(model: UniversalModel) -> dict[str, Any]:
    """Readiness, liveness and startup probes of the predictor container (see LIVE_PATH)."""
    startup_s = parse_duration(model.spec.scaling.startup_timeout).total_seconds()
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


# --------------------------------------------------------------------------------------------------
# Credentials for KServe's storage initializer: a ServiceAccount per model


def storage_account_name(model: UniversalModel) -> str | None:
    """The name of the model's own ServiceAccount, or None when it names no credentials secret."""
    if not model.spec.source.credentials_secret:
        return None
    return f"{model.metadata.name}{STORAGE_ACCOUNT_SUFFIX}"


def desired_service_account(model: UniversalModel) -> dict[str, Any] | None:
    """The ServiceAccount whose ``secrets`` hand spec.source.credentialsSecret to KServe's storage initializer.

    Why a ServiceAccount: the initializer's env is built by KServe's pod webhook, never copied from
    ``kserve-container``. For a custom container (ours) its credentials come from the secrets listed on the
    pod's ServiceAccount (KServe v0.14.1 to v0.20.0 pkg/credentials/service_account_credentials.go,
    CreateSecretVolumeAndEnv -> mountSecretCredential; storage_initializer_injector.go). The other
    mechanisms do not fit: ``storage.key``/``storage.parameters`` exist only for ``predictor.model``
    (CustomPredictor.GetStorageSpec returns nil) and read one shared ``storage-config`` Secret; the
    secret-name annotation's key is a per-install setting (``storageSecretNameAnnotation``: the kustomize
    install says ``serving.kserve.io/storageSecretName``, the Helm chart ``serving.kserve.io/secretName``).

    Owned by the model (garbage-collected with it), applied before the InferenceService. The token is not
    mounted: the predictor never calls the API. It replaces OperatorConfig.serviceAccountName for this
    model only (reading that account to copy its imagePullSecrets or IRSA annotation would need RBAC on
    every ServiceAccount); a model that needs the configured account instead lists the secret in that
    account's ``secrets`` and leaves credentialsSecret empty.
    """
    name = storage_account_name(model)
    if name is None:
        return None
    return {
        "apiVersion": SERVICE_ACCOUNT_API_VERSION,
        "kind": "ServiceAccount",
        "metadata": {
            "name": name,
            "namespace": model.metadata.namespace,
            "labels": {
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_PART_OF: MANAGED_BY,
                LABEL_NAME: model.metadata.name,
                LABEL_MODEL: model.metadata.name,
            },
            "ownerReferences": [owner_reference(model)],
        },
        "secrets": [{"name": model.spec.source.credentials_secret}],
        "automountServiceAccountToken": False,
    }


def predictor_service_account(model: UniversalModel, config: OperatorConfig) -> str | None:
    """The predictor pods' ServiceAccount: the model's own when it has credentials, else the configured one."""
    return storage_account_name(model) or config.service_account_name


def service_account_drifted(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """Whether the live ServiceAccount lost something the operator set (or is gone)."""
    if actual is None or actual.get("metadata", {}).get("deletionTimestamp"):
        return True
    want_meta, have_meta = desired["metadata"], actual.get("metadata", {})
    return not (
        is_subset(want_meta["labels"], have_meta.get("labels") or {})
        and is_subset(want_meta["ownerReferences"], have_meta.get("ownerReferences") or [], field="ownerReferences")
        and is_subset(desired["secrets"], actual.get("secrets") or [], field="secrets")
        and actual.get("automountServiceAccountToken") == desired["automountServiceAccountToken"]
    )


def owned_by(child: dict[str, Any], model: UniversalModel) -> bool:
    """Whether ``child`` names ``model`` as its controller."""
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == model.metadata.uid and ref.get("controller") for ref in refs)


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


def knative_idle_annotations(idle_timeout: str) -> dict[str, str]:
    """The stable window and scale-to-zero retention whose sum is ``idle_timeout``.

    Knative scales a revision to zero once (a) its stable-window average concurrency is zero, so a full
    ``autoscaling.knative.dev/window`` after the last request ends (pkg/autoscaler/scaling/autoscaler.go:
    desired pods = ceil(stable average / target)), and (b) it has been inactive for the longer of the
    cluster's scale-to-zero-grace-period (30s by default) and the revision's
    ``scale-to-zero-pod-retention-period`` (pkg/reconciler/autoscaling/kpa/scaler.go handleScaleToZero,
    lastPodRetention); knative serving knative-v1.16.0. Idle time is therefore window + max(grace, retention):
    the window keeps Knative's default 60s where the idle time allows, shrinks (down to 6s) to leave the
    grace period room, and the retention takes the rest. Idle times under 6s + grace get 6s + grace.
    """
    idle = parse_duration(idle_timeout)
    room = idle - KNATIVE_SCALE_TO_ZERO_GRACE
    window = min(max(room, KNATIVE_MIN_WINDOW), KNATIVE_STABLE_WINDOW)
    window = timedelta(seconds=int(window.total_seconds()))  # Knative wants the window in whole seconds
    retention = max(idle - window, timedelta(0))
    return {ANNOTATION_WINDOW: _go_seconds(window), ANNOTATION_RETENTION: _go_seconds(retention)}


def _go_seconds(value: timedelta) -> str:
    """A duration Go's time.ParseDuration reads: whole seconds as ``90s``, fractions as ``2.5s``."""
    seconds = value.total_seconds()
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{seconds:g}s"


def owner_reference(model: UniversalModel) -> dict[str, Any]:
    """The controller reference that lets garbage collection delete the child with its parent."""
    return {
        "apiVersion": model.api_version,
        "kind": KIND,
        "name": model.metadata.name,
        "uid": model.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


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
    wanted = parse_duration(scaling.startup_timeout) + LONGEST_REQUEST
    return min(int(wanted.total_seconds()), config.knative.max_revision_timeout_seconds)


def desired_inference_service(model: UniversalModel, config: OperatorConfig) -> dict[str, Any]:
    """The InferenceService that serves ``model``: everything the operator owns in it, nothing else.

    Applied by server-side apply, so fields KServe or the gateway set (defaults, the stop annotation)
    are theirs and stay untouched. Raises SpecError for a spec only the operator can reject.
    """
    check_servable(model, config)
    spec = model.spec
    profile = config.profile(spec.resources.profile)
    scaling = spec.scaling
    knative = scaling.mode is ScalingMode.KNATIVE
    compile_claim = compile_cache_claim(model, config)

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": _image(model, profile, config),
        "imagePullPolicy": config.images.pull_policy,
        "command": ["python", "-m", PREDICTOR_MODULE],
        "args": predictor_config(model, engine_arg_defaults=engine_arg_defaults(model, config)).to_args(),
        "env": _env(model, COMPILE_CACHE_ENV if compile_claim else {}),
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
    if spec.resources.gpus > 0:
        shm: dict[str, Any] = {"medium": "Memory"}
        if profile is not None and profile.shm_size:
            shm["sizeLimit"] = profile.shm_size
        volumes.append({"name": "dshm", "emptyDir": shm})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})

    predictor: dict[str, Any] = {
        "minReplicas": scaling.min_replicas if knative else max(scaling.min_replicas, 1),
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
            **knative_idle_annotations(scaling.idle_timeout),
            ANNOTATION_PROGRESS_DEADLINE: scaling.startup_timeout,
        }
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
                kserve.DEPLOYMENT_MODE_ANNOTATION: kserve.deployment_mode(config.kserve.release, scaling.mode),
                ANNOTATION_SERVED_NAME: model.served_name,
            },
            "ownerReferences": [owner_reference(model)],
        },
        "spec": {"predictor": predictor},
    }


# --------------------------------------------------------------------------------------------------
# Drift: does the live child still carry everything we want in it?

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("0.001"), "k": Decimal(10**3),
    "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}  # fmt: skip


def _quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity's value, or None if ``value`` is not one."""
    match = _QUANTITY.fullmatch(str(value))
    if not match:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
        return Decimal(number) * _SUFFIX[suffix]
    except (InvalidOperation, KeyError):
        return None


def _same_scalar(want: Any, have: Any, quantities: bool) -> bool:
    if want == have:
        return True
    # The API server canonicalises quantities ("1024Mi" comes back as "1Gi"); compare those by value.
    if quantities and isinstance(want, str | int) and isinstance(have, str | int):
        a, b = _quantity(want), _quantity(have)
        return a is not None and a == b
    return False


#: The lists the operator writes that Kubernetes merges by key (x-kubernetes-list-map-keys, patchMergeKey in
#: k8s.io/api core/v1 and meta/v1 types.go; KServe v0.16.0 config/crd/full/serving.kserve.io_inferenceservices.yaml
#: marks a container's env, ports and volumeMounts the same way). An item is found by its key, and items
#: another writer added (a webhook's env entry, a second owner reference) are theirs, not drift. Other lists
#: (args, command, tolerations) are atomic: they compare whole, item by item.
LIST_MAP_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "protocol"),
    "ownerReferences": ("uid",),
    "secrets": ("name",),
    "imagePullSecrets": ("name",),
}


def is_subset(want: Any, have: Any, *, quantities: bool = False, field: str | None = None) -> bool:
    """Whether ``have`` contains everything in ``want``.

    Maps compare by key; lists named in :data:`LIST_MAP_KEYS` by their items' keys (extra items in
    ``have`` are fine); other lists item by item with equal lengths. Scalars compare exactly, except
    under ``resources`` maps, where quantities compare by value. ``field`` is the name the value sits under.
    """
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and is_subset(v, have[k], quantities=quantities or k in ("requests", "limits"), field=k)
            for k, v in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        keys = LIST_MAP_KEYS.get(field or "")
        if keys and all(isinstance(w, dict) for w in want):
            by_key = {tuple(h.get(k) for k in keys): h for h in have if isinstance(h, dict)}
            return all(
                (match := by_key.get(tuple(w.get(k) for k in keys))) is not None
                and is_subset(w, match, quantities=quantities)
                for w in want
            )
        return len(want) == len(have) and all(
            is_subset(w, h, quantities=quantities) for w, h in zip(want, have, strict=True)
        )
    return _same_scalar(want, have, quantities)


def child_drifted(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """Whether the live InferenceService lost something the operator set (or is gone)."""
    if actual is None or actual.get("metadata", {}).get("deletionTimestamp"):
        return True
    want_meta = desired["metadata"]
    have_meta = actual.get("metadata", {})
    return not (
        is_subset(want_meta.get("labels", {}), have_meta.get("labels", {}))
        and is_subset(want_meta.get("annotations", {}), have_meta.get("annotations", {}))
        and is_subset(
            want_meta.get("ownerReferences", []), have_meta.get("ownerReferences", []), field="ownerReferences"
        )
        and is_subset(desired["spec"], actual.get("spec", {}))
    )


# --------------------------------------------------------------------------------------------------
# Status


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


def _is_true(condition: dict[str, Any] | None) -> bool:
    return condition is not None and condition.get("status") == "True"


def status_from_inference_service(
    isvc: dict[str, Any] | None,
    model: UniversalModel,
    now: datetime | None = None,
    *,
    config: OperatorConfig | None = None,
) -> dict[str, Any]:
    """The UniversalModel's status given its InferenceService as KServe last reported it.

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
    spec_valid = ("SpecValid", "True", "Valid", "The spec is valid.")
    extra: list[tuple[str, str, str, str]] = []
    if not knative:
        refusal = kserve.stop_unsupported(release, mode)
        extra.append(
            (CONDITION_IDLE_STOP, "False", "UnsupportedByKServe", refusal)
            if refusal is not None
            else (
                CONDITION_IDLE_STOP, "True", "GatewayStops",
                f"With minReplicas 0 the gateway stops the model after idleTimeout without requests "
                f"({kserve.STOP_ANNOTATION}) and the next request wakes it.",
            )
        )  # fmt: skip
    previous = model.status.conditions

    if isvc is None:
        message = "Creating the InferenceService."
        return {
            **base,
            "phase": Phase.PENDING.value,
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

    replicas: int | None = copies
    if stop_asked_and_honoured or (stopped and stop_asked == "true"):
        phase, replicas = Phase.IDLE, 0
        message = "Stopped while idle; the next request wakes it."
        isvc_cond = ("True", "Stopped", message)
    elif not conditions:
        phase, isvc_cond = Phase.PENDING, ("Unknown", "AwaitingKServe", "KServe has not reported on it yet.")
        message = "Waiting for KServe to pick up the InferenceService."
    elif stopped:
        phase = Phase.LOADING
        message = "Waking: KServe is starting the predictor again."
        isvc_cond = ("Unknown", "Resuming", message)
    elif _is_true(ready):
        at_zero = states.get("targetModelState") == "Pending" and model_status.get("transitionStatus") == "InProgress"
        if rolling_out:
            phase = Phase.LOADING
            message = f"Rolling out revision {created}; {serving} serves meanwhile."
        elif knative and at_zero and states.get("activeModelState") == "Loaded":
            phase, replicas = Phase.IDLE, 0
            message = "Scaled to zero; the next request wakes it."
        else:
            phase, message = Phase.READY, "Serving."
        isvc_cond = ("True", str((ready or {}).get("reason") or "Ready"), str((ready or {}).get("message") or "Ready."))
    elif (failure := _child_failure(status, ready)) is not None:
        phase, message = Phase.FAILED, failure
        isvc_cond = ("False", str((ready or {}).get("reason") or "Failed"), failure)
    else:
        phase = Phase.LOADING
        message = str((ready or {}).get("message") or "The predictor is starting.")
        if rolling_out and not (ready or {}).get("message"):
            message = f"Rolling out revision {created}."
        isvc_cond = (
            str((ready or {}).get("status") or "Unknown"),
            str((ready or {}).get("reason") or "Starting"),
            message,
        )

    if phase in (Phase.READY, Phase.IDLE):
        ready_cond = ("Ready", "True", "ScaledToZero" if phase is Phase.IDLE else "Serving", message)
    elif phase is Phase.FAILED:
        ready_cond = ("Ready", "False", "InferenceServiceFailed", message)
    else:
        ready_cond = ("Ready", "False", phase.value, message)

    return {
        **base,
        "phase": phase.value,
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
