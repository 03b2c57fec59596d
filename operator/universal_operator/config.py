"""The operator's own configuration: images, hardware profiles, watched namespaces.

One YAML file, named by ``UNIVERSAL_RUNTIME_OPERATOR_CONFIG`` (the Helm chart mounts it from a
ConfigMap). It is validated at start-up; a bad file stops the operator with one line naming the key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from universal_predictors.catalog import Backend
from universal_predictors.config import EngineArgValue

CONFIG_ENV = "UNIVERSAL_RUNTIME_OPERATOR_CONFIG"
DEFAULT_CPU_IMAGE = "ghcr.io/universal-runtime/predictor-cpu:0.1.0"
DEFAULT_CUDA_IMAGE = "ghcr.io/universal-runtime/predictor-cuda:0.1.0"


class ConfigError(Exception):
    """The operator's configuration cannot be used; the message is one line naming the key."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Images(_Model):
    """Predictor images: the CPU build and the CUDA build."""

    cpu: str = Field(default=DEFAULT_CPU_IMAGE, min_length=1)
    cuda: str = Field(default=DEFAULT_CUDA_IMAGE, min_length=1)
    pull_policy: str = Field(default="IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")


class Toleration(_Model):
    """A pod toleration, as Kubernetes spells it."""

    key: str | None = None
    operator: str | None = Field(default=None, pattern="^(Exists|Equal)$")
    value: str | None = None
    effect: str | None = Field(default=None, pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")
    toleration_seconds: int | None = None


class Profile(_Model):
    """A hardware profile: where GPU (or special CPU) models run and with what."""

    gpu_resource: str = Field(default="nvidia.com/gpu", min_length=1, description="The extended resource name.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    runtime_class_name: str | None = None
    image: str | None = Field(default=None, description="An image for this profile instead of the default ones.")
    shm_size: str | None = Field(default=None, description="Size of a memory-backed /dev/shm (vLLM, NCCL).")
    engine_args: dict[Backend, dict[str, EngineArgValue]] = Field(
        default_factory=dict,
        description="Default engine args per backend (e.g. vllm: {gpu_memory_utilization: 0.85}); a model's own "
        "spec.engineArgs win, and only the backend the predictor runs takes them (with auto, they do not steer it).",
    )
    compile_cache_claim: str | None = Field(
        default=None,
        description="A PersistentVolumeClaim (of this name, in each model's namespace; ReadWriteMany for more "
        "than one replica) where vLLM and Triton keep compiled graphs and kernels, so a replica woken from zero "
        "reuses them. Without one, vLLM models that scale to zero run eager (enforce_eager) by default.",
    )


#: KServe releases the operator renders for (major.minor[.patch]); see the README's support matrix.
KSERVE_VERSION = r"^0\.(1[4-9]|[2-9][0-9])(\.[0-9]+)?$"
DEFAULT_KSERVE_VERSION = "0.16.0"


class KServeSettings(_Model):
    """What the cluster's KServe is: what it accepts and reports differs between releases."""

    version: str = Field(
        default=DEFAULT_KSERVE_VERSION,
        pattern=KSERVE_VERSION,
        description="The KServe release installed in the cluster, e.g. 0.15.2 (0.14 or later).",
    )
    local_model_cache: bool = Field(
        default=False,
        description=(
            "Whether KServe's LocalModelCache is enabled (localModel.enabled in inferenceservice-config, its "
            "controller and node agent installed): models with spec.cache then get a node-local copy. Off, such "
            "models download on each wake and their Cached condition says why."
        ),
    )

    @property
    def release(self) -> tuple[int, int, int]:
        """The version as a comparable tuple (a missing patch counts as 0)."""
        parts = [int(part) for part in self.version.split(".")]
        return (parts[0], parts[1], parts[2] if len(parts) > 2 else 0)


class KnativeSettings(_Model):
    """What the cluster's Knative Serving admits beyond its defaults."""

    features: list[str] = Field(
        default_factory=list,
        description=(
            "Knative config-features flags this cluster has set to Enabled, e.g. kubernetes.podspec-securitycontext; "
            "empty: a default install."
        ),
    )
    max_revision_timeout_seconds: int = Field(
        default=600,
        ge=1,
        description="Knative's config-defaults max-revision-timeout-seconds (600 on a default install).",
    )


class PodSecurity(_Model):
    """The predictor pods' identity; leave the IDs empty where the platform assigns them (OpenShift)."""

    run_as_user: int | None = Field(default=1000, ge=0)
    run_as_group: int | None = Field(default=1000, ge=0)
    fs_group: int | None = Field(default=1000, ge=0)


class Tracing(_Model):
    """OpenTelemetry traces from every predictor (universal_predictors.tracing; off unless OTEL_TRACES_EXPORTER is
    set): the OTEL_* variables put on each predictor container, beneath the model's own spec.env."""

    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _otel_only(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _OTEL_NAME.match(name):
                raise ValueError(f"{name!r} is not an OTEL_* variable (only those are passed to the predictors)")
        return env


_OTEL_NAME = re.compile(r"^OTEL_[A-Z0-9_]+$")


class OperatorConfig(_Model):
    """Everything the operator is told by its deployer."""

    images: Images = Field(default_factory=Images)
    kserve: KServeSettings = Field(default_factory=KServeSettings)
    knative: KnativeSettings = Field(default_factory=KnativeSettings)
    pod_security: PodSecurity = Field(default_factory=PodSecurity)
    profiles: dict[str, Profile] = Field(default_factory=dict)
    default_profile: str | None = None
    namespaces: list[str] = Field(default_factory=list, description="Watched namespaces; empty: cluster-wide.")
    service_account_name: str | None = Field(default=None, description="The predictor pods' service account.")
    repair_interval_seconds: float = Field(default=60.0, gt=0, description="How often drift is checked.")
    gateway_stops_standard_models: bool = Field(
        default=True,
        description=(
            "Whether the gateway may stop idle Standard-mode models (it patches their InferenceService's "
            "serving.kserve.io/stop annotation: the chart grants that with gateway.standardMode, and sets this "
            "from it). false: such models keep running, and their IdleStop condition says why."
        ),
    )
    tracing: Tracing = Field(default_factory=Tracing)
    expose_models: bool = Field(
        default=False,
        description=(
            "false: each InferenceService is cluster-local, so clients reach models through the gateway (and its "
            "API keys) only; true: KServe also publishes each model's own external URL."
        ),
    )

    @model_validator(mode="after")
    def _default_profile_exists(self) -> OperatorConfig:
        if self.default_profile is not None and self.default_profile not in self.profiles:
            raise ValueError(f"defaultProfile {self.default_profile!r} is not one of profiles {sorted(self.profiles)}")
        return self

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def profile(self, name: str | None) -> Profile | None:
        """The named profile, the default one when ``name`` is empty, or None when neither exists.

        Raises KeyError for a name that no profile has.
        """
        chosen = name or self.default_profile
        if chosen is None:
            return None
        return self.profiles[chosen]


def _error_location(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    return f"{where}: {first['msg']}"


def parse_config(data: Any, origin: str = "operator config") -> OperatorConfig:
    """Validate a parsed YAML document; ConfigError names the first bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return OperatorConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{origin}: {_error_location(exc)}") from None


def load_config(path: str | os.PathLike[str] | None = None) -> OperatorConfig:
    """Read the configuration from ``path`` or the file ``$UNIVERSAL_RUNTIME_OPERATOR_CONFIG`` names.

    With neither, the defaults apply (the public images, no profiles, cluster-wide).
    """
    location = path if path is not None else os.environ.get(CONFIG_ENV)
    if not location:
        return OperatorConfig()
    file = Path(location)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the operator config ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_config(data, origin=str(file))
