"""Shared builders for the reconcile tests: manifests as YAML text in, parsed objects out."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import yaml

from universal_operator.config import OperatorConfig, parse_config
from universal_operator.reconcile import desired_inference_service, parse_model
from universal_operator.spec import UniversalModel

#: An operator configuration with two hardware profiles, as a deployer would write it.
CONFIG_YAML = """
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
    body = load(text)
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
