"""The whole objects the operator renders for each example in ``examples/cluster/``, against golden files.

The fragment tables (``test_render_inference_service.py``) pin one behaviour each; these pin everything, so a
field nobody meant to add (or lose) shows up as a diff. ``tests/operator/golden/<example>.yaml`` holds, in apply order,
every object ``desired_service_account`` and ``desired_inference_service`` render for the example.

After a deliberate change to rendering, regenerate them and review the diff like code::

    UPDATE_GOLDEN=1 python -m pytest tests/operator/test_golden.py
    git diff tests/operator/golden/
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from universal_operator.config import OperatorConfig, parse_config
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.service_account import desired_service_account
from universal_operator.spec import parse_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "cluster"
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
REGENERATE = "UPDATE_GOLDEN=1 python -m pytest tests/operator/test_golden.py"

#: Where ``kubectl apply -f examples/cluster/`` puts a manifest that names no namespace, and a fixed uid (the
#: API server's, in a real cluster) so the ownerReferences are stable.
NAMESPACE = "default"
UID = "5f0c3a1e-0000-4000-8000-000000000001"

#: The default OperatorConfig, except where an example needs more: llama-vllm names the GPU profile gpu-l4
#: (as operator/README.md's Configuration section writes it), and its nodeSelector, tolerations and
#: runtimeClassName need those Knative features enabled (operator/README.md, "Knative features").
CONFIGS: dict[str, OperatorConfig] = {
    "llama-vllm": parse_config(
        {
            "profiles": {
                "gpu-l4": {
                    "gpuResource": "nvidia.com/gpu",
                    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "runtimeClassName": "nvidia",
                    "shmSize": "8Gi",
                }
            },
            "knative": {
                "features": [
                    "kubernetes.podspec-nodeselector",
                    "kubernetes.podspec-tolerations",
                    "kubernetes.podspec-runtimeclassname",
                ]
            },
        }
    ),
}

EXAMPLE_NAMES = sorted(path.stem for path in EXAMPLES.glob("*.yaml"))


def rendered(example: str) -> list[dict[str, Any]]:
    """Every object the operator applies for ``examples/cluster/<example>.yaml``, in the order it applies them."""
    body = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    body["metadata"].setdefault("namespace", NAMESPACE)
    body["metadata"].setdefault("uid", UID)
    model = parse_model(body)
    config = CONFIGS.get(example, OperatorConfig())
    account = desired_service_account(model)
    return [*([account] if account is not None else []), desired_inference_service(model, config)]


class _PlainDumper(yaml.SafeDumper):
    """Writes a sub-tree the render shares (the probes' httpGet) in full at each place, never as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(objects: list[dict[str, Any]]) -> str:
    """The objects as multi-document YAML, keys in the order the operator renders them."""
    return yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False, width=120)


def header(example: str) -> str:
    config = "the default OperatorConfig" if example not in CONFIGS else "tests/operator/test_golden.py's CONFIGS entry"
    return (
        f"# What the operator renders for examples/cluster/{example}.yaml (namespace {NAMESPACE}) with {config}.\n"
        f"# Generated: {REGENERATE} (see tests/operator/golden/README.md).\n"
    )


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_the_operator_renders_the_golden_objects_for_each_example(example: str) -> None:
    objects = rendered(example)
    golden = GOLDEN / f"{example}.yaml"
    if UPDATE:
        golden.write_text(header(example) + dump(objects))
        return
    if not golden.exists():
        pytest.fail(f"{golden.relative_to(ROOT)} is missing; create it with {REGENERATE}")
    expected = list(yaml.safe_load_all(golden.read_text()))
    if expected != objects:
        diff = difflib.unified_diff(
            dump(expected).splitlines(keepends=True),
            dump(objects).splitlines(keepends=True),
            fromfile=f"{golden.relative_to(ROOT)} (golden)",
            tofile=f"rendered from examples/cluster/{example}.yaml",
        )
        pytest.fail(
            f"the rendered objects differ from the golden file; if the change is meant, regenerate with {REGENERATE} "
            "and review `git diff tests/operator/golden/`:\n" + "".join(diff),
            pytrace=False,
        )


def test_every_golden_file_belongs_to_an_example() -> None:
    stale = sorted(path.name for path in GOLDEN.glob("*.yaml") if path.stem not in EXAMPLE_NAMES)
    assert not stale, f"golden files without an example in examples/cluster/ (delete them): {stale}"


def test_golden_files_hold_an_inference_service_and_a_service_account_only_with_credentials() -> None:
    """The set of child kinds: a model naming source.credentialsSecret gets its own ServiceAccount first."""
    for example in EXAMPLE_NAMES:
        body = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
        kinds = [obj["kind"] for obj in rendered(example)]
        with_credentials = bool(body["spec"]["source"].get("credentialsSecret"))
        assert kinds == (["ServiceAccount", "InferenceService"] if with_credentials else ["InferenceService"]), example
