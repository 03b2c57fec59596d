"""Shared builders for the reconcile tests: manifests as YAML text in, parsed objects out."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import yaml
from hypothesis import strategies as st

from universal_operator.config import OperatorConfig, parse_config
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.spec import (
    CPU_TASKS,
    MAX_NAME_LENGTH,
    REMOTE_SCHEMES,
    UniversalModel,
    parse_duration,
    parse_model,
)
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import FILE_PATTERN_BACKENDS, FILE_PATTERN_TASKS, TASK_BACKENDS

#: An operator configuration with two hardware profiles, as a deployer would write it, for a cluster whose
#: Knative admits what the profiles set (and downward-API env).
CONFIG_YAML = """
knative:
  features:
  - kubernetes.podspec-nodeselector
  - kubernetes.podspec-tolerations
  - kubernetes.podspec-runtimeclassname
  - kubernetes.podspec-fieldref
images:
  cpu: registry.example/predictor-cpu:1
  cuda: registry.example/predictor-cuda:1
profiles:
  gpu-l4:
    nodeSelector:
      cloud.google.com/gke-accelerator: nvidia-l4
    tolerations:
    - key: nvidia.com/gpu
      operator: Exists
      effect: NoSchedule
    runtimeClassName: nvidia
    shmSize: 2Gi
  amd:
    gpuResource: amd.com/gpu
    image: registry.example/predictor-rocm:1
    nodeSelector:
      accelerator: mi300
"""

CONFIG: OperatorConfig = parse_config(yaml.safe_load(CONFIG_YAML))

#: Kubernetes' rule for label values (63 characters at most, alphanumeric at both ends).
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def is_label_value(text: str) -> bool:
    return len(text) <= 63 and LABEL_VALUE.fullmatch(text) is not None


def is_dns_1035_label(text: str) -> bool:
    return len(text) <= 63 and DNS_1035.fullmatch(text) is not None


def load(text: str) -> Any:
    """YAML text (indented freely in the test source) as Python data."""
    return yaml.safe_load(textwrap.dedent(text))


def manifest(text: str, *, uid: str = "uid-1", generation: int = 1) -> dict[str, Any]:
    """A UniversalModel body from YAML; apiVersion, kind, namespace, uid and generation filled in if absent."""
    body: dict[str, Any] = load(text)
    body.setdefault("apiVersion", "serving.universal-runtime.dev/v1alpha1")
    body.setdefault("kind", "UniversalModel")
    meta = body.setdefault("metadata", {})
    meta.setdefault("namespace", "models")
    meta.setdefault("uid", uid)
    meta.setdefault("generation", generation)
    return body


def model(text: str, **meta: Any) -> UniversalModel:
    return parse_model(manifest(text, **meta))


def render(text: str, config: OperatorConfig = CONFIG) -> dict[str, Any]:
    """The InferenceService the operator renders for a UniversalModel manifest."""
    return desired_inference_service(model(text), config)


def at(obj: Any, path: str) -> Any:
    """The sub-tree at a dotted path; ``[n]`` indexes lists: ``spec.predictor.containers[0].env``."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        obj = obj[int(part[1:-1])] if part.startswith("[") else obj[part]
    return obj


def pick(mapping: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``like`` taken from ``mapping`` (None where absent), to compare with ``==`` against ``like``."""
    return {key: mapping.get(key) for key in like}


# --------------------------------------------------------------------------------------------------
# Hypothesis strategies: valid UniversalModel manifests and the operator configs that can serve them

#: Configs the generated specs are rendered with: two profiles, a default profile, and none at all.
CONFIGS: tuple[OperatorConfig, ...] = (
    CONFIG,
    parse_config({**load(CONFIG_YAML), "defaultProfile": "amd", "serviceAccountName": "predictors"}),
    OperatorConfig(),
)

_PATH_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789._-")
_segment = st.text(_PATH_CHARS, min_size=1, max_size=12)
_path = st.lists(_segment, min_size=1, max_size=4).map("/".join)
names = st.from_regex(rf"[a-z]([-a-z0-9]{{0,{MAX_NAME_LENGTH - 2}}}[a-z0-9])?", fullmatch=True)
dns_1123 = st.from_regex(
    r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?){0,2}", fullmatch=True
)
served_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,90}", fullmatch=True)
env_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
engine_arg_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
engine_arg_values = st.one_of(
    st.text(max_size=20),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
)
#: Memory as Mi or Gi, cpu as cores or millicores: spellings whose equal re-spellings the drift check must accept.
memory_quantities = st.builds(lambda n, unit: f"{n}{unit}", st.integers(1, 4096), st.sampled_from(["Mi", "Gi"]))
cpu_quantities = st.one_of(st.integers(1, 64).map(str), st.integers(1, 64000).map(lambda n: f"{n}m"))
durations = st.one_of(
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(0, 5000), st.sampled_from(["s", "m", "h"])),
    st.builds(lambda n: f"{n * 1000}ms", st.integers(0, 5000)),
    st.builds(lambda h, m: f"{h}h{m}m", st.integers(0, 3), st.integers(0, 59)),
    st.builds(lambda n: f"{n}.5m", st.integers(0, 30)),
)
#: Knative-mode idle times: at most 1h (Knative's bound on the scale-to-zero retention).
knative_idle_durations = st.one_of(
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(0, 3600), st.just("s")),
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(0, 60), st.just("m")),
    st.builds(lambda m, s: f"{m}m{s}.5s", st.integers(0, 58), st.integers(0, 59)),
)


def _env_entry(name: str) -> st.SearchStrategy[dict[str, Any]]:
    key_ref = st.fixed_dictionaries(
        {"name": dns_1123, "key": st.text(_PATH_CHARS, min_size=1, max_size=10)},
        optional={"optional": st.booleans()},
    )
    field_ref = st.fixed_dictionaries({"fieldPath": st.sampled_from(["status.podIP", "metadata.name"])})
    return st.one_of(
        st.fixed_dictionaries({"name": st.just(name), "value": st.text(max_size=20)}),
        st.fixed_dictionaries({"name": st.just(name), "valueFrom": st.fixed_dictionaries({"secretKeyRef": key_ref})}),
        st.fixed_dictionaries(
            {"name": st.just(name), "valueFrom": st.fixed_dictionaries({"configMapKeyRef": key_ref})}
        ),
        st.fixed_dictionaries(
            {
                "name": st.just(name),
                "valueFrom": st.fixed_dictionaries({"fieldRef": field_ref}),
            }
        ),
    )


@st.composite
def servable_models(draw: st.DrawFn) -> tuple[dict[str, Any], OperatorConfig]:
    """A valid UniversalModel body (any task, an allowed backend, ...) and an operator config that can serve it."""
    config = draw(st.sampled_from(CONFIGS))
    task = draw(st.sampled_from(list(Task)))
    backend = draw(st.sampled_from([Backend.AUTO, *TASK_BACKENDS[task]]))
    remote = draw(st.booleans())
    scheme = draw(st.sampled_from(REMOTE_SCHEMES)) if remote else None
    if scheme == "hf":
        uri = f"hf://{draw(_segment)}/{draw(_segment)}"  # hf://OWNER/REPO
    elif scheme is not None:
        uri = f"{scheme}://{draw(_path)}"
    else:
        uri = f"/{draw(_path)}"
    source: dict[str, Any] = {"uri": uri}
    if task in FILE_PATTERN_TASKS and backend in FILE_PATTERN_BACKENDS and draw(st.booleans()):
        source["file"] = draw(st.sampled_from(["*q4_k_m.gguf", "*.gguf", "model-Q8_0.gguf"]))
    if scheme == "hf" and draw(st.booleans()):
        source["revision"] = draw(_segment)  # reaches KServe as hf://OWNER/REPO:REV
    if draw(st.booleans()):
        source["credentialsSecret"] = draw(dns_1123)
    spec: dict[str, Any] = {"task": task.value, "source": source}
    if draw(st.booleans()) or backend is not Backend.AUTO:
        spec["backend"] = backend.value
    if draw(st.booleans()):
        spec["servedName"] = draw(served_names)
    if draw(st.booleans()):
        spec["engineArgs"] = draw(st.dictionaries(engine_arg_keys, engine_arg_values, max_size=4))
    resources: dict[str, Any] = {}
    profile = draw(st.sampled_from([None, *sorted(config.profiles)]))
    if profile is not None:
        resources["profile"] = profile
    resources["gpus"] = 0 if task.value in CPU_TASKS else draw(st.integers(0, 8))  # CPU tasks refuse GPUs
    if draw(st.booleans()):
        resources["cpu"] = draw(cpu_quantities)
    if draw(st.booleans()):
        resources["memory"] = draw(memory_quantities)
    spec["resources"] = resources
    max_replicas = draw(st.integers(1, 1000))
    mode = draw(st.sampled_from(["Knative", "Standard"]))
    scaling: dict[str, Any] = {
        "mode": mode,
        "minReplicas": draw(st.integers(0, max_replicas)),
        "maxReplicas": max_replicas,
        "idleTimeout": draw(knative_idle_durations if mode == "Knative" else durations),
        "startupTimeout": draw(durations.filter(lambda d: parse_duration(d).total_seconds() > 0)),
    }
    if draw(st.booleans()):
        scaling["targetConcurrency"] = draw(st.integers(1, 10000))
    spec["scaling"] = scaling
    env_keys = draw(st.lists(env_names, max_size=4, unique=True))
    spec["env"] = [draw(_env_entry(name)) for name in env_keys]
    if mode == "Knative" and "kubernetes.podspec-fieldref" not in config.knative.features:
        spec["env"] = [e for e in spec["env"] if "fieldRef" not in e.get("valueFrom", {})]
    if draw(st.booleans()):
        spec["image"] = f"registry.example/{draw(_segment).lower()}:1"
    body = {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {
            "name": draw(names),
            "namespace": draw(st.sampled_from(["default", "models"])),
            "uid": "uid-1",
            "generation": draw(st.integers(1, 50)),
        },
        "spec": spec,
    }
    return body, config
