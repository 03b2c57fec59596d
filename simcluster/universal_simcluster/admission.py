"""What a real cluster's admission does to an InferenceService, as pure functions over the object.

The API emulator (:mod:`universal_simcluster.apiserver`) runs :func:`admit` on every create, update,
patch and apply of an InferenceService; the KServe stand-in (:mod:`universal_simcluster.kserve.standin`) asks
:func:`reconcile_problems` what KServe's controller would fail on. Each rule names the upstream file
(repository, path, tag) it imitates.

In order, as a cluster applies them:

1. KServe's mutating webhook (``inferenceservice.kserve-webhook-server.defaulter``): the predictor
   container is named ``kserve-container`` and missing resource requests/limits are filled.
2. KServe's validating webhook (``inferenceservice.kserve-webhook-server.validator``): name, autoscaler
   class and metric, replicas, deployment mode that cannot change.
3. What KServe then creates must be admitted too: in Knative mode Knative's webhook
   (``validation.webhook.serving.knative.dev``) validates the revision template (field masks by
   ``config-features`` flag, autoscaling annotations, progress deadline, timeout), and in every mode
   Kubernetes validates the pod template (requests within limits).

Deliberate simplification: step 3 happens, in a cluster, when KServe's controller creates the Knative
Service or Deployment (KServe records an ``InternalError`` event and the InferenceService never becomes
ready); the emulator refuses the InferenceService write itself, with the refusing component's own
message, so a test sees the refusal at once. The domain-name failure (KServe's reconcile, not
admission) is left to the stand-ins through :func:`reconcile_problems`.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

JSON = dict[str, Any]

KSERVE_DEFAULTER = "inferenceservice.kserve-webhook-server.defaulter"
KSERVE_VALIDATOR = "inferenceservice.kserve-webhook-server.validator"
KNATIVE_VALIDATOR = "validation.webhook.serving.knative.dev"
# KServe's names, spelled here as KServe spells them (KServe v0.20.0 pkg/constants/constants.go:
# InferenceServiceContainerName, DeploymentMode, AutoscalerClass, StopAnnotationKey; unchanged at the 0.21 wheel's
# source), never imported from the operator: a stand-in that shared the operator's constants would follow a rename.
CONTAINER_NAME = "kserve-container"
ANNOTATION_DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
ANNOTATION_AUTOSCALER_CLASS = "serving.kserve.io/autoscalerClass"
ANNOTATION_STOP = "serving.kserve.io/stop"


class Denied(Exception):
    """A refusal, answered as the API server answers it: ``code``, ``reason`` and the whole message."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ResourceDefaults:
    """KServe's ``inferenceservice`` ConfigMap ``resource`` block, as shipped.

    KServe v0.14.1 pkg/apis/serving/v1beta1/inference_service_defaults.go (``defaultResource``: cpu 1,
    memory 2Gi for requests and limits alike, hard-coded); v0.15.2 and v0.16.0 read them from
    config/configmap/inferenceservice.yaml (``cpuLimit: "1"``, ``memoryLimit: "2Gi"``, ``cpuRequest: "1"``,
    ``memoryRequest: "2Gi"``).
    """

    cpu_request: str = "1"
    memory_request: str = "2Gi"
    cpu_limit: str = "1"
    memory_limit: str = "2Gi"


@dataclass(frozen=True)
class Cluster:
    """The cluster whose admission is imitated: KServe release, Knative flags, limits."""

    kserve: tuple[int, int, int] = (0, 16, 0)
    #: Knative ``config-features`` flags set to Enabled; empty: a default install.
    knative_features: frozenset[str] = frozenset()
    #: Knative ``config-defaults`` ``max-revision-timeout-seconds`` (600 on a default install).
    max_revision_timeout_seconds: int = 600
    resource_defaults: ResourceDefaults = field(default_factory=ResourceDefaults)
    #: KServe's ``ingress.domainTemplate`` and ``ingressDomain`` (config/configmap/inferenceservice.yaml).
    domain_template: str = "{name}-{namespace}.{domain}"
    ingress_domain: str = "example.com"
    #: KServe's ``localModel.enabled`` in inferenceservice-config (false in config/configmap/inferenceservice.yaml):
    #: whether the defaulting webhook looks for a LocalModelCache matching each InferenceService.
    local_model_enabled: bool = False

    def enabled(self, flag: str) -> bool:
        return flag in self.knative_features


#: KServe 0.16 with a default Knative install: what the emulator admits unless told otherwise.
DEFAULT_CLUSTER = Cluster()


# --------------------------------------------------------------------------------------------------
# Values: quantities and Go durations


_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("0.001"), "k": Decimal(10**3),
    "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}  # fmt: skip


def quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity's value (k8s.io/apimachinery pkg/api/resource); ValueError if malformed."""
    match = _QUANTITY.fullmatch(str(value).strip())
    if not match:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY.pattern!r}")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
        return Decimal(number) * _SUFFIX[suffix]
    except InvalidOperation as exc:
        raise ValueError(str(exc)) from None


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|ms|s|m|h)")


def go_duration(text: str) -> float:
    """Seconds in a Go duration string, as Go's ``time.ParseDuration`` reads it; ValueError otherwise."""
    body = text[1:] if text[:1] in "+-" else text
    sign = -1.0 if text.startswith("-") else 1.0
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"time: invalid duration {text!r}")
    pos, total = 0, 0.0
    while pos < len(body):
        match = _GO_PART.match(body, pos)
        if not match or match.group(1) in ("", "."):
            raise ValueError(f"time: invalid duration {text!r}")
        total += float(match.group(1)) * _GO_UNITS[match.group(2)]
        pos = match.end()
    return sign * total


def go_format(seconds: float) -> str:
    """A whole-second duration as Go's ``time.Duration.String`` prints it (``1h0m0s``, ``6s``)."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


# --------------------------------------------------------------------------------------------------
# Deployment mode


def deployment_mode(isvc: JSON, cluster: Cluster) -> str:
    """``Knative``, ``Standard`` or ``ModelMesh``: what KServe's controller will run the object as.

    KServe v0.14.1/v0.15.2 pkg/controller/v1beta1/inferenceservice/utils/utils.go (GetDeploymentMode) know
    Serverless, RawDeployment and ModelMesh; anything else falls back to the ConfigMap's default
    (Serverless). v0.16.0 adds Knative and Standard and reads the legacy names as aliases.
    """
    recorded = ((isvc.get("status") or {}).get("deploymentMode")) or ""
    annotation = ((isvc.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_DEPLOYMENT_MODE, "")
    value = recorded or annotation
    known = {"Serverless": "Knative", "RawDeployment": "Standard", "ModelMesh": "ModelMesh"}
    if cluster.kserve >= (0, 16, 0):
        known |= {"Knative": "Knative", "Standard": "Standard"}
    return known.get(value, "Knative")


# --------------------------------------------------------------------------------------------------
# 1. KServe's defaulting webhook


def _predictor(isvc: JSON) -> JSON:
    return (isvc.get("spec") or {}).get("predictor") or {}


def kserve_default(isvc: JSON, cluster: Cluster) -> JSON:
    """The object after KServe's mutating webhook: a custom predictor's first container is named and its
    missing resource requests and limits are filled from the ConfigMap, key by key.

    KServe pkg/apis/serving/v1beta1/predictor_custom.go (CustomPredictor.Default) and
    inference_service_defaults.go (setResourceRequirementDefaults), v0.14.1, v0.15.2, v0.16.0.
    """
    out = copy.deepcopy(isvc)
    predictor = (out.get("spec") or {}).get("predictor")
    if not isinstance(predictor, dict) or not predictor.get("containers"):
        return out
    containers = predictor["containers"]
    first = containers[0]
    # v0.14.1 names the first container always; v0.15 on only when it is alone or unnamed.
    if cluster.kserve < (0, 15, 0) or len(containers) == 1 or not first.get("name"):
        first["name"] = CONTAINER_NAME
    defaults = cluster.resource_defaults
    resources = first.setdefault("resources", {})
    requests = resources.setdefault("requests", {})
    limits = resources.setdefault("limits", {})
    requests.setdefault("cpu", defaults.cpu_request)
    requests.setdefault("memory", defaults.memory_request)
    limits.setdefault("cpu", defaults.cpu_limit)
    limits.setdefault("memory", defaults.memory_limit)
    return out


# --------------------------------------------------------------------------------------------------
# 2. KServe's validating webhook

#: KServe pkg/apis/serving/v1beta1/inference_service_validation.go (IsvcNameFmt), v0.14.1-v0.16.0.
ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: KServe pkg/constants/constants.go (AutoscalerAllowedClassList, AutoscalerAllowedKPAMetricsList).
AUTOSCALER_CLASSES = ("hpa", "kpa", "external", "keda", "none")
KPA_METRICS = ("concurrency", "rps")
HPA_METRICS = ("cpu", "memory")


def kserve_validate(isvc: JSON, old: JSON | None, cluster: Cluster) -> str | None:
    """KServe's validating webhook: the first refusal's message, or None.

    KServe pkg/apis/serving/v1beta1/inference_service_validation.go (validateInferenceService,
    validateDeploymentMode from v0.15.1: the recorded mode and the annotation compared verbatim until v0.18.1,
    the recorded one normalised by ParseDeploymentMode from v0.19.0) and component.go
    (ComponentExtensionSpec.Validate), v0.16.0.
    """
    meta = isvc.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    name = str(meta.get("name", ""))
    if old is not None and cluster.kserve >= (0, 15, 1):
        recorded = (old.get("status") or {}).get("deploymentMode")
        if recorded and cluster.kserve >= (0, 19, 0):  # v0.19.0 compares constants.ParseDeploymentMode(recorded)
            recorded = {"Serverless": "Knative", "RawDeployment": "Standard"}.get(recorded, recorded)
        wanted = annotations.get(ANNOTATION_DEPLOYMENT_MODE)
        if recorded and wanted is not None and wanted != recorded:
            return f"update rejected: deploymentMode cannot be changed from '{recorded}' to '{wanted}'"
    if not ISVC_NAME.fullmatch(name):  # Go's "$" is the end of the text; Python's match passes "name\n"
        return (
            f'the InferenceService "{name}" is invalid: a InferenceService name must consist of lower case '
            "alphanumeric characters or '-', and must start with alphabetical character. "
            f'(e.g. "my-name" or "abc-123", regex used for validation is \'{ISVC_NAME.pattern[1:-1]}\')'
        )
    if (
        ANNOTATION_AUTOSCALER_CLASS in annotations
        and annotations[ANNOTATION_AUTOSCALER_CLASS] not in AUTOSCALER_CLASSES
    ):
        return f"[{annotations[ANNOTATION_AUTOSCALER_CLASS]}] is not a supported autoscaler class type"
    predictor = _predictor(isvc)
    concurrency = predictor.get("containerConcurrency")
    if concurrency is not None and concurrency < 0:
        return "the 'ContainerConcurrency' cannot be less than 0"
    min_replicas = predictor.get("minReplicas", 1)
    max_replicas = predictor.get("maxReplicas", 0)
    if min_replicas < 0:
        return "'MinReplicas' cannot be less than 0"
    if max_replicas < 0:
        return "'MaxReplicas' cannot be less than 0"
    if min_replicas > max_replicas and max_replicas != 0:
        return "'MinReplicas' cannot be greater than MaxReplicas"
    # validateAutoScalingCompExtension compares the annotation as written. v0.14.1: RawDeployment or the
    # Knative HPA class checks HPA metrics, else KPA's. v0.15.2/v0.16.0: the raw-deployment name (RawDeployment,
    # Standard in v0.16.0) checks HPA metrics only with autoscalerClass hpa (absent: nothing); any other mode
    # checks HPA metrics with the Knative HPA class, else KPA's.
    metric = predictor.get("scaleMetric")
    target = predictor.get("scaleTarget")
    written = annotations.get(ANNOTATION_DEPLOYMENT_MODE)
    raw_name = "Standard" if cluster.kserve >= (0, 16, 0) else "RawDeployment"
    hpa_class = annotations.get(CLASS) == "hpa.autoscaling.knative.dev"
    if cluster.kserve < (0, 15, 0):
        hpa = written == raw_name or hpa_class
        kpa = not hpa
    else:
        hpa = annotations.get(ANNOTATION_AUTOSCALER_CLASS) == "hpa" if written == raw_name else hpa_class
        kpa = written != raw_name and not hpa_class
    if hpa:
        metric = metric or "cpu"
        if metric not in HPA_METRICS:
            return f"[{metric}] is not a supported metric"
        # Go reads `metric == MetricCPU && target < 1 || target > 100` as (cpu and < 1) or > 100.
        if target is not None and ((metric == "cpu" and target < 1) or target > 100):
            return "the target utilization percentage should be a [1-100] integer"
        if target is not None and metric == "memory" and target < 1:
            return "the target memory should be greater than 1 MiB"
    elif kpa:
        if predictor.get("deploymentStrategy") is not None:
            return "customizing deploymentStrategy is only supported for raw deployment mode"
        metric = metric or "concurrency"
        if metric not in KPA_METRICS:
            return f"[{metric}] is not a supported metric"
        if metric == "rps" and target is not None and target < 1:
            return "the target for rps should be greater than 1"
    return None


# --------------------------------------------------------------------------------------------------
# 3a. Knative's webhook on the revision KServe builds (Knative mode)

#: Pod-level fields Knative drops unless a flag enables them: knative serving knative-v1.16.0
#: pkg/apis/serving/fieldmask.go (PodSpecMask) with pkg/apis/config/features.go (all Disabled by default).
POD_FIELD_FLAGS = {
    "affinity": "kubernetes.podspec-affinity",
    "topologySpreadConstraints": "kubernetes.podspec-topologyspreadconstraints",
    "hostAliases": "kubernetes.podspec-hostaliases",
    "nodeSelector": "kubernetes.podspec-nodeselector",
    "runtimeClassName": "kubernetes.podspec-runtimeclassname",
    "tolerations": "kubernetes.podspec-tolerations",
    "shareProcessNamespace": "kubernetes.podspec-shareprocessnamespace",
    "priorityClassName": "kubernetes.podspec-priorityclassname",
    "schedulerName": "kubernetes.podspec-schedulername",
    "initContainers": "kubernetes.podspec-init-containers",
    "dnsPolicy": "kubernetes.podspec-dnspolicy",
    "dnsConfig": "kubernetes.podspec-dnsconfig",
    "hostIPC": "kubernetes.podspec-hostipc",
    "hostPID": "kubernetes.podspec-hostpid",
    "hostNetwork": "kubernetes.podspec-hostnetwork",
}
#: Pod fields Knative always admits (PodSpecMask); the predictor's KServe-only fields are not pod fields.
POD_FIELDS_ALWAYS = {"serviceAccountName", "containers", "volumes", "imagePullSecrets", "enableServiceLinks"}
KSERVE_COMPONENT_FIELDS = {
    "minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "containerConcurrency", "timeout",
    "canaryTrafficPercent", "logger", "batcher", "labels", "annotations", "deploymentStrategy", "autoScaling",
    "storageUri", "storageUris",
    "model", "workerSpec", "sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface", "pmml",
    "lightgbm", "paddle",
}  # fmt: skip
#: PodSecurityContextMask (knative-v1.16.0): every field needs kubernetes.podspec-securitycontext, except a
#: RuntimeDefault/Unconfined seccompProfile under secure-pod-defaults; these are the ones it then admits.
POD_SECURITY_FIELDS = {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "supplementalGroups", "seccompProfile"}
#: SecurityContextMask (container level, knative-v1.16.0): always admitted; capabilities.add needs a flag.
CONTAINER_SECURITY_FIELDS = {
    "capabilities", "readOnlyRootFilesystem", "runAsUser", "runAsGroup", "runAsNonRoot", "allowPrivilegeEscalation",
    "seccompProfile",
}  # fmt: skip
#: ContainerMask (knative-v1.16.0).
CONTAINER_FIELDS = {
    "name", "args", "command", "env", "workingDir", "envFrom", "image", "imagePullPolicy", "livenessProbe", "ports",
    "readinessProbe", "resources", "securityContext", "startupProbe", "terminationMessagePath",
    "terminationMessagePolicy", "volumeMounts",
}  # fmt: skip
#: ProbeMask and HandlerMask (knative-v1.16.0 fieldmask.go): what a probe may hold.
PROBE_FIELDS = {"initialDelaySeconds", "timeoutSeconds", "periodSeconds", "successThreshold", "failureThreshold"}
PROBE_HANDLERS = ("httpGet", "tcpSocket", "exec", "grpc")
#: k8s_validation.go (reservedPaths, reservedEnvVars), knative-v1.16.0.
RESERVED_PATHS = {"/", "/dev", "/dev/log"}
RESERVED_ENV = {"PORT", "K_SERVICE", "K_CONFIGURATION", "K_REVISION"}
#: pkg/apis/autoscaling/register.go (WindowMin, WindowMax), knative-v1.16.0.
WINDOW_MIN, WINDOW_MAX = 6.0, 3600.0
WINDOW = "autoscaling.knative.dev/window"
RETENTION = "autoscaling.knative.dev/scale-to-zero-pod-retention-period"
SCALE_DOWN_DELAY = "autoscaling.knative.dev/scale-down-delay"
PROGRESS_DEADLINE = "serving.knative.dev/progress-deadline"
TARGET = "autoscaling.knative.dev/target"
CLASS = "autoscaling.knative.dev/class"
METRIC = "autoscaling.knative.dev/metric"


def _disallowed(paths: list[str]) -> list[str]:
    return [f"must not set the field(s): {', '.join(sorted(paths))}"] if paths else []


def _path(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def revision_annotations(isvc: JSON) -> dict[str, str]:
    """The annotations KServe puts on the Knative revision template: the object's and the component's.

    KServe v0.16.0 pkg/controller/v1beta1/inferenceservice/components/predictor.go (buildObjectMeta: the
    object's annotations, less the ConfigMap's disallowed list, under the predictor component's).
    """
    annotations = dict(((isvc.get("metadata") or {}).get("annotations")) or {})
    annotations.update(_predictor(isvc).get("annotations") or {})
    return {str(k): str(v) for k, v in annotations.items()}


def knative_annotation_problems(annotations: dict[str, str], prefix: str = "") -> list[str]:
    """Knative's autoscaling and progress-deadline annotation checks (knative-v1.16.0):
    pkg/apis/autoscaling/annotation_validation.go (validateWindow, validateLastPodRetention,
    validateScaleDownDelay, validateFloats, validateClass) and pkg/apis/serving/v1/revision_validation.go
    (validateProgressDeadlineAnnotation)."""
    problems: list[str] = []

    def where(key: str) -> str:
        return _path(prefix, key)

    def parsed(key: str) -> float | None:
        try:
            return go_duration(annotations[key])
        except ValueError:
            problems.append(f"invalid value: {annotations[key]}: {where(key)}")
            return None

    if WINDOW in annotations and (d := parsed(WINDOW)) is not None:
        if not WINDOW_MIN <= d <= WINDOW_MAX:
            problems.append(
                f"expected {go_format(WINDOW_MIN)} <= {annotations[WINDOW]} <= {go_format(WINDOW_MAX)}: {where(WINDOW)}"
            )
        elif d != int(d):
            problems.append(f"must be specified with at most second precision: {where(WINDOW)}")
    if RETENTION in annotations and (d := parsed(RETENTION)) is not None and not 0 <= d <= WINDOW_MAX:
        problems.append(f"expected 0s <= {annotations[RETENTION]} <= {go_format(WINDOW_MAX)}: {where(RETENTION)}")
    if SCALE_DOWN_DELAY in annotations and (d := parsed(SCALE_DOWN_DELAY)) is not None:
        if not 0 <= d <= WINDOW_MAX:
            problems.append(
                f"expected 0s <= {annotations[SCALE_DOWN_DELAY]} <= {go_format(WINDOW_MAX)}: {where(SCALE_DOWN_DELAY)}"
            )
        elif d != round(d):
            problems.append(f"must be specified with at most second precision: {where(SCALE_DOWN_DELAY)}")
    if TARGET in annotations:
        try:
            if float(annotations[TARGET]) < 0.01:
                problems.append(f"target {annotations[TARGET]} should be at least 0.01: {where(TARGET)}")
        except ValueError:
            problems.append(f"invalid value: {annotations[TARGET]}: {where(TARGET)}")
    if CLASS in annotations:
        value = annotations[CLASS]
        if value.endswith("autoscaling.knative.dev") and value not in (
            "kpa.autoscaling.knative.dev",
            "hpa.autoscaling.knative.dev",
        ):
            problems.append(f"invalid value: {value}: {where(CLASS)}")
    if annotations.get(PROGRESS_DEADLINE):
        text = annotations[PROGRESS_DEADLINE]
        try:
            d = go_duration(text)
        except ValueError:
            problems.append(f"invalid value: {text}: {where(PROGRESS_DEADLINE)}")
        else:
            if round(d) != d:
                problems.append(f"progress-deadline={text} is not at second precision: {where(PROGRESS_DEADLINE)}")
            elif d < 0:
                problems.append(f"progress-deadline={text} must be positive: {where(PROGRESS_DEADLINE)}")
    return problems


def knative_probe_problems(probe: JSON | None, port: JSON, where: str, readiness: bool) -> list[str]:
    """A serving container's liveness or readiness probe as Knative checks it (knative-v1.16.0
    k8s_validation.go ValidateUserContainer -> validateProbe, validateReadinessProbe after
    v1/revision_defaults.go applyReadinessProbeDefaults set successThreshold 1). The startup probe is only
    subject to the container mask there."""
    if probe is None:
        return []
    problems = _disallowed([f"{where}.{k}" for k in probe if k not in PROBE_FIELDS and k not in PROBE_HANDLERS])
    handlers = [k for k in PROBE_HANDLERS if probe.get(k) is not None]
    if not handlers:
        problems.append(f"expected exactly one, got neither: {where}.exec, {where}.grpc, {where}.httpGet, "
                        f"{where}.tcpSocket")  # fmt: skip
    elif len(handlers) > 1:
        problems.append(f"expected exactly one, got both: {', '.join(f'{where}.{h}' for h in handlers)}")
    for handler in ("httpGet", "tcpSocket"):
        probe_port = (probe.get(handler) or {}).get("port")
        if isinstance(probe_port, str) and probe_port != port.get("name"):
            problems.append(f"invalid value: {probe_port}: {where}.{handler}.port")
    if readiness:
        for key, least in (("periodSeconds", 0), ("initialDelaySeconds", 0), ("successThreshold", 1)):
            value = probe.get(key, 1 if key == "successThreshold" else 0)
            if value < least:
                problems.append(f"expected {least} <= {value} <= 2147483647: {where}.{key}")
        if probe.get("periodSeconds", 0) == 0:
            problems += [f"{key} is disallowed when periodSeconds is zero: {where}.{key}"
                         for key in ("failureThreshold", "timeoutSeconds") if probe.get(key)]  # fmt: skip
        else:
            for key in ("timeoutSeconds", "failureThreshold"):
                if probe.get(key, 1) < 1:  # Kubernetes' defaults (1, 3) are applied when the period is set
                    problems.append(f"expected 1 <= {probe[key]} <= 2147483647: {where}.{key}")
    return problems


def knative_revision_problems(isvc: JSON, cluster: Cluster) -> list[str]:
    """What Knative's webhook refuses in the revision template KServe builds from the predictor.

    knative serving knative-v1.16.0: pkg/apis/serving/k8s_validation.go (ValidatePodSpec, validateVolume,
    validatePersistentVolumeClaims, validateEnvValueFrom, validateSecurityContext, validateVolumeMounts),
    pkg/apis/serving/fieldmask.go (the masks), pkg/apis/serving/v1/revision_validation.go
    (validateTimeoutSeconds, validateProgressDeadlineAnnotation), pkg/apis/autoscaling/annotation_validation.go.
    Paths are those of the Knative Service KServe creates (``spec.template...``).
    """
    predictor = _predictor(isvc)
    spec_path = "spec.template.spec"
    problems: list[str] = []

    disallowed = [
        _path(spec_path, key)
        for key, flag in POD_FIELD_FLAGS.items()
        if predictor.get(key) not in (None, "", [], {}) and not cluster.enabled(flag)
    ]
    disallowed += [
        _path(spec_path, key)
        for key in predictor
        if key not in POD_FIELD_FLAGS
        and key not in POD_FIELDS_ALWAYS
        and key not in KSERVE_COMPONENT_FIELDS
        and key not in ("securityContext", "automountServiceAccountToken")
    ]
    problems += _disallowed(disallowed)

    pod_security = predictor.get("securityContext") or {}
    if pod_security:
        allowed: set[str] = set()
        if cluster.enabled("kubernetes.podspec-securitycontext"):
            allowed = set(POD_SECURITY_FIELDS)
        elif cluster.enabled("secure-pod-defaults") and (pod_security.get("seccompProfile") or {}).get("type") in (
            "RuntimeDefault",
            "Unconfined",
        ):
            allowed = {"seccompProfile"}
        problems += _disallowed([_path(spec_path, "securityContext", k) for k in pod_security if k not in allowed])

    volumes = {v.get("name"): v for v in predictor.get("volumes") or []}
    for i, volume in enumerate(predictor.get("volumes") or []):
        where = f"{spec_path}.volumes[{i}]"
        # emptyDir volumes: kubernetes.podspec-volumes-emptydir is Enabled on a default install (features.go).
        claim = volume.get("persistentVolumeClaim")
        if claim is not None:
            if not cluster.enabled("kubernetes.podspec-persistent-volume-claim"):
                problems.append(
                    "Persistent volume claim support is disabled, but found persistent volume claim "
                    f"{claim.get('claimName')}: {where}"
                )
            if not claim.get("readOnly") and not cluster.enabled("kubernetes.podspec-persistent-volume-write"):
                problems.append(
                    "Persistent volume write support is disabled, but found persistent volume claim "
                    f"{claim.get('claimName')} that is not read-only: {where}"
                )
        sources = {"secret", "configMap", "projected", "emptyDir", "persistentVolumeClaim"}
        problems += _disallowed([f"{where}.{k}" for k in volume if k != "name" and k not in sources])

    for c, container in enumerate(predictor.get("containers") or []):
        where = f"{spec_path}.containers[{c}]"
        problems += _disallowed([f"{where}.{k}" for k in container if k not in CONTAINER_FIELDS])
        if c == 0:  # the serving container (the one with the port); sidecars' probes are masked only
            port = (container.get("ports") or [{}])[0]
            problems += knative_probe_problems(container.get("livenessProbe"), port, f"{where}.livenessProbe", False)
            problems += knative_probe_problems(container.get("readinessProbe"), port, f"{where}.readinessProbe", True)
        for e, env in enumerate(container.get("env") or []):
            if env.get("name") in RESERVED_ENV:
                problems.append(f'"{env["name"]}" is a reserved environment variable: {where}.env[{e}].name')
            source = env.get("valueFrom") or {}
            if not cluster.enabled("kubernetes.podspec-fieldref"):
                problems += _disallowed(
                    [f"{where}.env[{e}].valueFrom.{k}" for k in ("fieldRef", "resourceFieldRef") if k in source]
                )
        security = container.get("securityContext") or {}
        problems += _disallowed(
            [f"{where}.securityContext.{k}" for k in security if k not in CONTAINER_SECURITY_FIELDS]
        )
        if (security.get("capabilities") or {}).get("add") and not cluster.enabled(
            "kubernetes.containerspec-addcapabilities"
        ):
            problems += _disallowed([f"{where}.securityContext.capabilities.add"])
        for m, mount in enumerate(container.get("volumeMounts") or []):
            mount_path = re.sub(r"/+$", "", str(mount.get("mountPath", ""))) or "/"
            if mount_path in RESERVED_PATHS:
                problems.append(f'mountPath "{mount_path}" is a reserved path: {where}.volumeMounts[{m}].mountPath')
            if mount.get("name") not in volumes:
                problems.append(f"volumeMount has no matching volume: {where}.volumeMounts[{m}].name")

    timeout = predictor.get("timeout")
    if timeout is not None and not 0 <= timeout <= cluster.max_revision_timeout_seconds:
        problems.append(
            f"expected 0 <= {timeout} <= {cluster.max_revision_timeout_seconds}: {spec_path}.timeoutSeconds"
        )
    problems += knative_annotation_problems(revision_annotations(isvc), "spec.template.metadata.annotations")
    return problems


# --------------------------------------------------------------------------------------------------
# 3b. Kubernetes' pod validation (the Deployment's pod template, in every mode)

#: Resources whose requests may differ from limits (k8s pkg/apis/core/v1/helper IsOvercommitAllowed):
#: the native ones; extended resources such as nvidia.com/gpu must have requests equal to limits.
_OVERCOMMIT = ("cpu", "memory", "ephemeral-storage", "hugepages-")


def pod_problems(isvc: JSON) -> list[str]:
    """Kubernetes' resource checks on each predictor container.

    kubernetes pkg/apis/core/validation/validation.go (ValidateResourceRequirements): a request above its
    limit is refused ("must be less than or equal to cpu limit of 1"); an extended resource's request must
    equal its limit.
    """
    problems: list[str] = []
    for c, container in enumerate(_predictor(isvc).get("containers") or []):
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        where = f"spec.template.spec.containers[{c}].resources.requests"
        for name, value in requests.items():
            try:
                asked = quantity(value)
            except ValueError as exc:
                problems.append(f"{where}[{name}]: Invalid value: {value!r}: {exc}")
                continue
            if name not in limits:
                if not name.startswith(_OVERCOMMIT) and "/" in name:
                    problems.append(
                        f"{where}[{name}]: Required value: Limit must be set for non overcommitable resources"
                    )
                continue
            try:
                limit = quantity(limits[name])
            except ValueError as exc:
                problems.append(f"spec.template.spec.containers[{c}].resources.limits[{name}]: Invalid value: {exc}")
                continue
            if "/" in name and not name.startswith(_OVERCOMMIT) and asked != limit:
                problems.append(f"{where}: Invalid value: {value!r}: must be equal to {name} limit of {limits[name]}")
            elif asked > limit:
                problems.append(
                    f"{where}: Invalid value: {value!r}: must be less than or equal to {name} limit of {limits[name]}"
                )
    return problems


# --------------------------------------------------------------------------------------------------
# The whole chain, and what KServe's reconcile fails on


# --------------------------------------------------------------------------------------------------
# KServe's LocalModelCache: the defaulting webhook's label, the cache's own validating webhook

#: KServe v0.16.0 pkg/constants/constants.go: LocalModelLabel, LocalModelSourceUriAnnotationKey,
#: LocalModelPVCNameAnnotationKey, NodeGroupAnnotationKey (from v0.15.0), DisableLocalModelKey. Spelled here, not
#: imported from the operator: the stand-in checks the operator against upstream's names.
LOCAL_MODEL_LABEL = "internal.serving.kserve.io/localmodel"
LOCAL_MODEL_SOURCE_ANNOTATION = "internal.serving.kserve.io/localmodel-sourceuri"
LOCAL_MODEL_PVC_ANNOTATION = "internal.serving.kserve.io/localmodel-pvc-name"
NODE_GROUP_ANNOTATION = "serving.kserve.io/nodegroup"
DISABLE_LOCAL_MODEL_ANNOTATION = "serving.kserve.io/disable-localmodel"
LOCAL_MODEL_CACHE_VALIDATOR = "localmodelcache.kserve-webhook-server.validator"
#: The release from which the node-group annotation picks the claim (v0.15.0 adds NodeGroupAnnotationKey).
NODE_GROUP_SINCE = (0, 15, 0)
#: The release from which a node's copy lives under models/<storage key> (v0.18.0 GetStorageKey), not models/<cache>.
STORAGE_KEY_SINCE = (0, 18, 0)


def match_storage_uri(source: str, storage_uri: str) -> bool:
    """KServe v0.16.0 pkg/apis/serving/v1alpha1/local_model_cache_types.go MatchStorageURI: the URI is the cache's
    source or a path below it."""
    cached, wanted = source.rstrip("/"), storage_uri.rstrip("/")
    return wanted == cached or wanted.startswith(cached + "/")


def storage_key(source: str) -> str:
    """KServe v0.18.0 pkg/apis/serving/v1alpha1/local_model_cache_types.go GetStorageKey: sha256, 16 hex digits."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def cached_folder(cache: JSON, release: tuple[int, int, int]) -> str:
    """The folder under the node group's volume holding a cache's model: ``models/<name>`` (v0.14.1-v0.17.1
    localmodelnode/controller.go launchJob's subPath), ``models/<storage key>`` from v0.18.0."""
    if release >= STORAGE_KEY_SINCE:
        return f"models/{storage_key(str(cache['spec']['sourceModelUri']))}"
    return f"models/{cache['metadata']['name']}"


def custom_storage_uri(isvc: JSON) -> str | None:
    """A custom predictor's storage URI: its kserve-container's STORAGE_URI env value (KServe v0.16.0
    pkg/apis/serving/v1beta1/predictor_custom.go GetStorageUri)."""
    for container in _predictor(isvc).get("containers") or []:
        if container.get("name") == CONTAINER_NAME:
            return next((e.get("value") for e in container.get("env") or [] if e.get("name") == "STORAGE_URI"), None)
    return None


def _drop_local_model(meta: JSON) -> None:
    (meta.get("labels") or {}).pop(LOCAL_MODEL_LABEL, None)
    for key in (LOCAL_MODEL_SOURCE_ANNOTATION, LOCAL_MODEL_PVC_ANNOTATION):
        (meta.get("annotations") or {}).pop(key, None)


def set_local_model_label(isvc: JSON, caches: list[JSON], cluster: Cluster) -> None:
    """The defaulting webhook's LocalModelCache step, in place (KServe v0.16.0 pkg/apis/serving/v1beta1/
    inference_service_defaults.go: Default lists the caches only with localModel.enabled and no
    disable-localmodel annotation; setLocalModelLabel).

    With no list (disabled, or opted out) v0.14.1-v0.17.1 leave the labels as they are; v0.18.0 on removes them. The
    first cache (in list order) whose source matches the storage URI wins; with a node-group annotation (v0.15.0+)
    only a cache listing that group matches, and the claim is ``<cache>-<group>``; else ``<cache>-<first group>``.
    """
    meta = isvc.setdefault("metadata", {})
    annotations = meta.get("annotations") or {}
    listed = cluster.local_model_enabled and DISABLE_LOCAL_MODEL_ANNOTATION not in annotations
    if not listed:
        if cluster.kserve >= STORAGE_KEY_SINCE:
            _drop_local_model(meta)
        return
    uri = custom_storage_uri(isvc)
    if uri is None:
        return
    group = annotations.get(NODE_GROUP_ANNOTATION) if cluster.kserve >= NODE_GROUP_SINCE else None
    for cache in caches:
        spec = cache.get("spec") or {}
        groups = list(spec.get("nodeGroups") or [])
        if not groups or not match_storage_uri(str(spec.get("sourceModelUri") or ""), uri):
            continue
        if group is not None and group not in groups:
            continue
        name = cache["metadata"]["name"]
        meta.setdefault("labels", {})[LOCAL_MODEL_LABEL] = name
        meta.setdefault("annotations", {})[LOCAL_MODEL_SOURCE_ANNOTATION] = spec["sourceModelUri"]
        meta["annotations"][LOCAL_MODEL_PVC_ANNOTATION] = f"{name}-{group if group is not None else groups[0]}"
        return
    _drop_local_model(meta)


def local_model_cache_refusal(cache: JSON, old: JSON | None, others: list[JSON]) -> str | None:
    """Why a LocalModelCache create or update is refused, or None.

    The CRD's CEL rule on sourceModelUri (``self == oldSelf``, "StorageUri is immutable": KServe v0.16.0
    config/crd/full/serving.kserve.io_localmodelcaches.yaml) and the validating webhook's unique-URI check
    (pkg/webhook/admission/localmodelcache/local_model_cache_validation.go validateUniqueStorageURI).
    """
    spec = cache.get("spec") or {}
    uri = spec.get("sourceModelUri")
    if old is not None and (old.get("spec") or {}).get("sourceModelUri") != uri:
        return (
            "LocalModelCache.serving.kserve.io is invalid: spec.sourceModelUri: Invalid value: StorageUri is immutable"
        )
    name = cache["metadata"]["name"]
    for other in others:
        if other["metadata"]["name"] != name and (other.get("spec") or {}).get("sourceModelUri") == uri:
            return (
                f'admission webhook "{LOCAL_MODEL_CACHE_VALIDATOR}" denied the request: LocalModelCache '
                f"{other['metadata']['name']} has the same StorageURI {uri}"
            )
    return None


def local_model_cache_delete_refusal(cache: JSON, isvcs: dict[tuple[str, str], JSON]) -> str | None:
    """Why deleting a LocalModelCache is refused: an InferenceService its status lists still carries its label, or
    cannot be read (the webhook returns the Get error). KServe v0.16.0 local_model_cache_validation.go ValidateDelete.
    """
    name = cache["metadata"]["name"]
    for ref in (cache.get("status") or {}).get("inferenceServices") or []:
        key = (str(ref.get("namespace")), str(ref.get("name")))
        isvc = isvcs.get(key)
        if isvc is None:
            return (
                f'admission webhook "{LOCAL_MODEL_CACHE_VALIDATOR}" denied the request: '
                f'inferenceservices.serving.kserve.io "{key[1]}" not found'
            )
        if ((isvc.get("metadata") or {}).get("labels") or {}).get(LOCAL_MODEL_LABEL) == name:
            return (
                f'admission webhook "{LOCAL_MODEL_CACHE_VALIDATOR}" denied the request: LocalModelCache {name} is '
                f"being used by InferenceService {key[1]}"
            )
    return None


def admit(isvc: JSON, old: JSON | None, cluster: Cluster, caches: list[JSON] | None = None) -> JSON:
    """The object as stored after admission, or :class:`Denied` with the API server's answer.

    A validating webhook's refusal reaches the client as Kubernetes' apiserver
    staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/errors/statuserror.go (ToStatusErr) makes it:
    ``admission webhook "<name>" denied the request: <message>``, with the webhook's code. KServe's
    webhooks are controller-runtime CustomValidators, whose errors become ``Denied`` (403 Forbidden,
    controller-runtime pkg/webhook/admission/response.go ValidationResponse); Knative's webhook
    (knative.dev/pkg webhook/resourcesemantics/validation) answers a Status without a code, which the API
    server turns into 400 BadRequest, with ``validation failed: `` before the field errors.

    ``caches``: the cluster's LocalModelCaches (the defaulting webhook lists them: :func:`set_local_model_label`).
    """
    defaulted = kserve_default(isvc, cluster)
    set_local_model_label(defaulted, caches or [], cluster)
    refusal = kserve_validate(defaulted, old, cluster)
    if refusal is not None:
        raise Denied(403, "Forbidden", f'admission webhook "{KSERVE_VALIDATOR}" denied the request: {refusal}')
    if deployment_mode(defaulted, cluster) == "Knative":
        problems = knative_revision_problems(defaulted, cluster)
        if problems:
            raise Denied(
                400,
                "BadRequest",
                f'admission webhook "{KNATIVE_VALIDATOR}" denied the request: validation failed: '
                + "\n".join(problems),
            )
    problems = pod_problems(defaulted)
    if problems:
        name = (defaulted.get("metadata") or {}).get("name", "")
        kind = "Deployment" if deployment_mode(defaulted, cluster) == "Standard" else "Revision's Deployment"
        raise Denied(422, "Invalid", f'{kind} "{name}-predictor" is invalid: ' + "; ".join(problems))
    return defaulted


def domain_labels(isvc: JSON, cluster: Cluster) -> list[str]:
    """The hosts KServe builds from its domain template (Standard mode: the predictor's and the top level).

    KServe pkg/controller/v1beta1/inferenceservice/reconcilers/raw/raw_kube_reconciler.go (createRawURL on
    the component ``{name}-predictor``) and reconcilers/ingress/kube_ingress_reconciler.go (top level), both
    through reconcilers/ingress/domain.go (GenerateDomainName); v0.14.1, v0.15.2, v0.16.0. In Knative mode
    the hosts come from Knative's own template (``{service}.{namespace}.{domain}``), not this one.
    """
    meta = isvc.get("metadata") or {}
    name, namespace = str(meta.get("name", "")), str(meta.get("namespace", "default"))
    if deployment_mode(isvc, cluster) != "Standard":
        return []
    return [
        cluster.domain_template.format(name=component, namespace=namespace, domain=cluster.ingress_domain)
        for component in (f"{name}-predictor", name)
    ]


def reconcile_problems(isvc: JSON, cluster: Cluster) -> list[str]:
    """What KServe's controller fails on while reconciling (recorded as an ``InternalError`` event).

    GenerateDomainName (KServe reconcilers/ingress/domain.go) checks the host with
    IsFullyQualifiedDomainName: every label at most 63 characters.
    """
    problems = []
    for host in domain_labels(isvc, cluster):
        for label in host.split("."):
            if len(label) > 63:
                problems.append(
                    f'failed creating host name: invalid domain name "{host}": url: Invalid value: "{host}": '
                    f"a DNS-1123 label must be no more than 63 characters"
                )
                break
    return problems
