"""The whole objects the operator renders for each example in ``examples/cluster/``, against golden files.

The fragment tables (``test_render_inference_service.py``) pin one behaviour each; these pin everything, so a
field nobody meant to add (or lose) shows up as a diff. ``tests/operator/golden/<example>.yaml`` holds, in apply order,
every object ``desired_service_account`` and ``desired_inference_service`` render for the example's model; for a pool
(``pool.yaml``: a UniversalModelPool and its members), what ``desired_members_config_map`` and
``desired_pool_inference_service`` render for the pool, and nothing for its members (pooled, they get no child).

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
from universal_operator.reconcile.pools import desired_members_config_map, desired_pool_inference_service, members_of
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.service_account import desired_service_account
from universal_operator.spec import parse_model, parse_pool

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


def documents(example: str) -> list[dict[str, Any]]:
    """The example's documents as ``kubectl apply`` stores them: in namespace default, each with a uid."""
    bodies = [d for d in yaml.safe_load_all((EXAMPLES / f"{example}.yaml").read_text()) if d is not None]
    for body in bodies:
        body["metadata"].setdefault("namespace", NAMESPACE)
        body["metadata"].setdefault("uid", UID)
    return bodies


def rendered(example: str) -> list[dict[str, Any]]:
    """Every object the operator applies for ``examples/cluster/<example>.yaml``, in the order it applies them: for
    each model of its own, its ServiceAccount (with credentials) then its InferenceService; for each pool, its members
    ConfigMap then its InferenceService (reconcile_pool's order: a new pod must find its list); for a pooled
    member, nothing."""
    bodies = documents(example)
    models = [parse_model(b) for b in bodies if b["kind"] == "UniversalModel"]
    config = CONFIGS.get(example, OperatorConfig())
    objects: list[dict[str, Any]] = []
    for body in bodies:
        if body["kind"] == "UniversalModelPool":
            pool = parse_pool(body)
            objects += [desired_members_config_map(pool, members_of(pool, models)),
                        desired_pool_inference_service(pool, config)]  # fmt: skip
            continue
        model = parse_model(body)
        if model.spec.pool is not None:
            continue
        account = desired_service_account(model)
        objects += [*([account] if account is not None else []), desired_inference_service(model, config)]
    return objects


class _PlainDumper(yaml.SafeDumper):
    """Writes a sub-tree the render shares (the probes' httpGet) in full at each place, never as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(objects: list[dict[str, Any]]) -> str:
    """The objects as multi-document YAML, keys in the order the operator renders them."""
    return yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False, width=120)


def header(example: str) -> str:
    config = "the default OperatorConfig" if example not in CONFIGS else "tests/operator/test_golden.py's CONFIGS entry"
    pooled = any(b["kind"] == "UniversalModelPool" for b in documents(example))
    return (
        f"# What the operator renders for examples/cluster/{example}.yaml (namespace {NAMESPACE}) with {config}.\n"
        + ("# The pool's members ConfigMap and InferenceService; its members get no child of their own.\n" if pooled
           else "")
        + f"# Generated: {REGENERATE} (see tests/operator/golden/README.md).\n"
    )  # fmt: skip


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
    """The set of child kinds: a model naming source.credentialsSecret gets its own ServiceAccount first; a pool gets
    its members ConfigMap (listing every member in its file) and its InferenceService, its members nothing."""
    for example in EXAMPLE_NAMES:
        bodies = documents(example)
        objects = rendered(example)
        kinds = [obj["kind"] for obj in objects]
        if [b["kind"] for b in bodies] == ["UniversalModel"]:
            with_credentials = bool(bodies[0]["spec"]["source"].get("credentialsSecret"))
            assert kinds == (["ServiceAccount", "InferenceService"] if with_credentials else ["InferenceService"]), (
                example
            )
            continue
        pools = [b["metadata"]["name"] for b in bodies if b["kind"] == "UniversalModelPool"]
        members = [b for b in bodies if b["kind"] == "UniversalModel"]
        assert pools, f"{example}: a multi-document example is a pool and its members"
        assert all(m["spec"].get("pool") in pools for m in members), example
        assert kinds == ["ConfigMap", "InferenceService"] * len(pools), example
        listed = {key for obj in objects if obj["kind"] == "ConfigMap" for key in obj["data"]}
        assert listed == {f"{m['metadata']['name']}.yaml" for m in members}, example
        names = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "InferenceService"}
        assert names == {f"{pool}-pool" for pool in pools}, example
