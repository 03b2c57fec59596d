"""The generated CRD: committed copy up to date, structural as the API server demands, CEL rules that agree
with the pydantic models they were written beside."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from hypothesis import given, settings
from pydantic import ValidationError

from tests.conftest import MODEL_KIND, POOL_KIND, cluster_examples, pooled
from tests.factories import load, servable_models
from universal_operator.crd import custom_resource_definition, render_crd_yaml
from universal_operator.spec import UniversalModel

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / "universalmodels.yaml"
#: Every UniversalModel in examples/cluster/: the one-model files, and the members in pool.yaml.
EXAMPLES = cluster_examples(MODEL_KIND)

CRD = custom_resource_definition()
VERSION = CRD["spec"]["versions"][0]
ROOT_SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = ROOT_SCHEMA["properties"]["spec"]
SCALING_SCHEMA = SPEC_SCHEMA["properties"]["scaling"]
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


# --------------------------------------------------------------------------------------------------
# (a) the committed CRD


def test_committed_crd_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == render_crd_yaml(), (
        "crds/universalmodels.yaml is out of date; regenerate it with "
        "`universal-runtime crd -o crds/universalmodels.yaml`"
    )


def test_committed_crd_parses_to_the_generated_object() -> None:
    assert yaml.safe_load(COMMITTED.read_text()) == CRD


# --------------------------------------------------------------------------------------------------
# (b) structural schema


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


NODES = list(schema_nodes(ROOT_SCHEMA))


def test_every_schema_node_has_a_type_unless_int_or_string_or_preserving_unknown_fields() -> None:
    untyped = [
        path
        for path, node in NODES
        if "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert untyped == []


@pytest.mark.parametrize("key", ["$ref", "$defs", "title", "const", "oneOf", "allOf", "discriminator"])
def test_no_schema_node_uses_keys_structural_schemas_forbid(key: str) -> None:
    assert [path for path, node in NODES if key in node] == []


def test_additional_properties_never_sits_beside_properties_and_is_never_false() -> None:
    assert [path for path, node in NODES if "additionalProperties" in node and "properties" in node] == []
    assert [path for path, node in NODES if node.get("additionalProperties") is False] == []


def test_any_of_appears_only_as_the_int_or_string_form() -> None:
    bad = [
        path
        for path, node in NODES
        if "anyOf" in node and not (node["anyOf"] == INT_OR_STRING and node.get("x-kubernetes-int-or-string"))
    ]
    assert bad == []
    assert {path for path, node in NODES if "anyOf" in node} == {".spec.resources.cpu", ".spec.resources.memory"}


def test_list_map_keys_are_required_in_their_items() -> None:
    for path, node in NODES:
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), path


def test_every_spec_property_has_a_description_for_kubectl_explain() -> None:
    properties = [(path, node) for path, node in schema_nodes(SPEC_SCHEMA, ".spec") if not path.endswith("{}")]
    assert [path for path, node in properties if not str(node.get("description", "")).strip()] == []


def test_cel_field_paths_name_fields_that_exist() -> None:
    for path, node in NODES:
        for rule in node.get("x-kubernetes-validations", []):
            if "fieldPath" in rule:
                target = node
                for part in rule["fieldPath"].lstrip(".").split("."):
                    target = target["properties"][part]
                assert target, (path, rule["fieldPath"])


def test_names_group_scope_subresource_and_printer_columns() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "universalmodels.serving.universal-runtime.dev"
    assert (spec["group"], spec["scope"]) == ("serving.universal-runtime.dev", "Namespaced")
    assert spec["names"] == {
        "kind": "UniversalModel",
        "listKind": "UniversalModelList",
        "plural": "universalmodels",
        "singular": "universalmodel",
        "shortNames": ["um", "umodel"],
        "categories": ["all", "universal-runtime"],
    }
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert (VERSION["served"], VERSION["storage"], VERSION["subresources"]) == (True, True, {"status": {}})
    columns = {c["name"]: (c["type"], c["jsonPath"]) for c in VERSION["additionalPrinterColumns"]}
    assert columns == {
        "Task": ("string", ".spec.task"),
        "Backend": ("string", ".status.backend"),
        "Served": ("string", ".status.servedName"),
        "Phase": ("string", ".status.phase"),
        "Step": ("string", ".status.step"),
        "Ready": ("string", '.status.conditions[?(@.type=="Ready")].status'),
        "URL": ("string", ".status.url"),
        "Age": ("date", ".metadata.creationTimestamp"),
    }
    assert ROOT_SCHEMA["required"] == ["spec"]
    assert "default" not in str(ROOT_SCHEMA["properties"]["status"])


# --------------------------------------------------------------------------------------------------
# (c) CEL rules, evaluated as the API server would after defaulting

ENV = celpy.Environment()


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill in schema ``default``s recursively, as the API server does before validating."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(value[name], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(item, schema["items"]) for item in value]
    return value


def _rules(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                yield from _rules(sub, value[name], f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


def cel_failures(body: dict[str, Any]) -> list[str]:
    """The messages of every CEL rule the object breaks (after defaulting), each prefixed by where it applies."""
    obj = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": body["metadata"]["name"]},  # root rules see metadata.name and generateName only
        "spec": body["spec"],
    }
    obj = apply_defaults(obj, ROOT_SCHEMA)
    failures = []
    for path, rule, value in _rules(ROOT_SCHEMA, obj, ""):
        program = ENV.program(ENV.compile(rule["rule"]))
        # On create the API server skips transition rules; binding oldSelf to self has the same effect.
        verdict = program.evaluate({"self": celpy.json_to_cel(value), "oldSelf": celpy.json_to_cel(value)})
        assert isinstance(verdict, celpy.celtypes.BoolType), (rule["rule"], verdict)
        if not verdict:
            failures.append(f"{path or '.'}: {rule['message']}")
    return failures


def test_scaling_mode_cannot_change_on_update() -> None:
    [rule] = [r for r in SCALING_SCHEMA["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    program = ENV.program(ENV.compile(rule["rule"]))
    knative = celpy.json_to_cel({"mode": "Knative", "minReplicas": 0, "maxReplicas": 1})
    standard = celpy.json_to_cel({"mode": "Standard", "minReplicas": 0, "maxReplicas": 1})
    assert not program.evaluate({"self": standard, "oldSelf": knative})
    assert program.evaluate({"self": knative, "oldSelf": knative})
    assert "cannot change" in rule["message"]


def test_spec_pool_cannot_change_on_update() -> None:
    [rule] = [r for r in SPEC_SCHEMA["x-kubernetes-validations"] if "oldSelf.pool" in r["rule"]]
    program = ENV.program(ENV.compile(rule["rule"]))
    pooled, other, alone = ({"task": "embed", "pool": "a"}, {"task": "embed", "pool": "b"}, {"task": "embed"})
    for old, new in ((alone, pooled), (pooled, alone), (pooled, other)):
        assert not program.evaluate({"self": celpy.json_to_cel(new), "oldSelf": celpy.json_to_cel(old)})
    assert program.evaluate({"self": celpy.json_to_cel(pooled), "oldSelf": celpy.json_to_cel(pooled)})
    assert "spec.pool cannot change" in rule["message"]


def pydantic_accepts(body: dict[str, Any]) -> bool:
    try:
        UniversalModel.model_validate(body)
    except ValidationError:
        return False
    return True


def test_every_cel_rule_compiles_with_celpy() -> None:
    rules = [rule["rule"] for _, node in NODES for rule in node.get("x-kubernetes-validations", [])]
    assert rules
    for rule in rules:
        ENV.program(ENV.compile(rule))


def test_defaults_fill_backend_and_scaling_as_the_api_server_would() -> None:
    body = apply_defaults({"metadata": {"name": "m"}, "spec": {"task": "embed", "source": {"uri": "/m"}}}, ROOT_SCHEMA)
    assert body["spec"]["backend"] == "auto"
    assert body["spec"]["scaling"] == {
        "mode": "Knative",
        "minReplicas": 0,
        "maxReplicas": 1,
        "idleTimeout": "5m",
        "startupTimeout": "20m",
    }
    assert body["spec"]["resources"] == {"gpus": 0}


@pytest.mark.parametrize("body", EXAMPLES.values(), ids=list(EXAMPLES))
def test_every_example_passes_every_cel_rule_and_pydantic(body: dict[str, Any]) -> None:
    assert cel_failures(body) == []
    assert pydantic_accepts(body)


def test_every_example_document_is_a_model_or_a_pool_and_every_member_names_an_example_pool() -> None:
    """A pool's own rules are tests/operator/test_pools.py's; its members are in EXAMPLES above."""
    documents = cluster_examples()
    assert {d["kind"] for d in documents.values()} == {MODEL_KIND, POOL_KIND}
    assert len(EXAMPLES) + len(cluster_examples(POOL_KIND)) == len(documents)
    pools = {d["metadata"]["name"] for d in cluster_examples(POOL_KIND).values()}
    members = {id: body["spec"]["pool"] for id, body in EXAMPLES.items() if pooled(body)}
    assert set(members.values()) == pools
    assert all(id.startswith("pool/") for id in members)


VALID = """
apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {name: qwen-chat}
spec:
  task: generate
  source: {uri: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF}
  scaling: {minReplicas: 1, maxReplicas: 1}
  env:
  - {name: A, value: "1"}
  - name: B
    valueFrom: {secretKeyRef: {name: s, key: k}}
"""

SECRET = {"name": "s", "key": "k"}
INVALID = {
    "a pooled vllm model (vLLM takes the GPU's memory; the pool shares one budget)": (
        {"spec": {"backend": "vllm", "pool": "small"}},
        ".spec: a pooled model cannot use backend vllm",
    ),
    "a pooled model asking for two GPUs": (
        {"spec": {"resources": {"gpus": 2}, "pool": "small"}},
        ".spec: a pooled model cannot ask for several GPUs",
    ),
    "a pooled model in Standard mode (the pool scales as a whole)": (
        {"spec": {"pool": "small", "scaling": {"mode": "Standard"}}},
        ".spec: a pooled model cannot use scaling.mode Standard",
    ),
    "a pooled model with adapters": (
        {"spec": {"pool": "small", "adapters": [{"name": "a", "source": {"uri": "s3://b/a"}}]}},
        ".spec: a pooled model cannot list adapters",
    ),
    "minReplicas above maxReplicas": (
        {"spec": {"scaling": {"minReplicas": 3, "maxReplicas": 2}}},
        ".spec.scaling: scaling.minReplicas must not exceed scaling.maxReplicas",
    ),
    "minReplicas above the defaulted maxReplicas": (
        {"spec": {"scaling": {"minReplicas": 2}}},
        ".spec.scaling: scaling.minReplicas must not exceed scaling.maxReplicas",
    ),
    "ocr with vllm": (
        {"spec": {"task": "ocr", "backend": "vllm", "source": {"uri": "/opt/ocr"}}},
        ".spec: backend does not serve this task",
    ),
    "embed with vllm (no vLLM encoder: it would crash-loop)": (
        {"spec": {"task": "embed", "backend": "vllm", "source": {"uri": "hf://BAAI/bge-m3"}}},
        ".spec: backend does not serve this task",
    ),
    "source.file on a rerank model": (
        {"spec": {"task": "rerank", "source": {"uri": "hf://BAAI/bge-reranker-base", "file": "*.gguf"}}},
        ".spec: source.file picks a GGUF file",
    ),
    "source.file with vllm": (
        {"spec": {"backend": "vllm", "source": {"file": "*.gguf"}}},
        ".spec: source.file picks a GGUF file",
    ),
    "source.projectorFile on an embed model": (
        {"spec": {"task": "embed", "source": {"uri": "/m", "projectorFile": "*mmproj*.gguf"}}},
        ".spec: source.projectorFile picks a multimodal projector GGUF",
    ),
    "source.projectorFile with transformers": (
        {"spec": {"backend": "transformers", "source": {"projectorFile": "*mmproj*.gguf"}}},
        ".spec: source.projectorFile picks a multimodal projector GGUF",
    ),
    "a GPU for OCR (its engines run on the CPU: the GPU would sit idle)": (
        {"spec": {"task": "ocr", "backend": "auto", "source": {"uri": "/opt/ocr"}, "resources": {"gpus": 1}}},
        ".spec: tasks ocr and anomaly run on the CPU",
    ),
    "a cache for an oci:// source": (
        {"spec": {"source": {"uri": "oci://registry/model:1"}, "cache": {"nodeGroups": ["g"], "modelSize": "1Gi"}}},
        ".spec: cache keeps a downloaded copy on the nodes",
    ),
    "a Knative idleTimeout above Knative's 1h retention bound": (
        {"spec": {"scaling": {"idleTimeout": "61m"}}},
        ".spec.scaling: scaling.idleTimeout must be at most 1h in Knative mode",
    ),
    "a startupTimeout with a fraction of a second (Knative's progress-deadline is whole seconds)": (
        {"spec": {"scaling": {"startupTimeout": "1500ms"}}},
        ".spec.scaling: scaling.startupTimeout must be whole seconds",
    ),
    "a zero startupTimeout (the Deployment's progressDeadlineSeconds must be above 0)": (
        {"spec": {"scaling": {"startupTimeout": "0s"}}},
        ".spec.scaling: scaling.startupTimeout must be longer than 0s",
    ),
    "a 40-character name": ({"metadata": {"name": "a" * 40}}, ".: metadata.name must be a DNS-1035 label"),
    "a name starting with a digit": ({"metadata": {"name": "1qwen"}}, ".: metadata.name must be a DNS-1035 label"),
    "a name with an upper-case letter": ({"metadata": {"name": "Qwen"}}, ".: metadata.name must be a DNS-1035 label"),
    "env with both value and valueFrom": (
        {"spec": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}},
        ".spec.env[0]: an env entry needs exactly one of value, valueFrom",
    ),
    "env with neither value nor valueFrom": (
        {"spec": {"env": [{"name": "A"}]}},
        ".spec.env[0]: an env entry needs exactly one of value, valueFrom",
    ),
    "adapters on an embed model (LoRA adapters are a generate feature)": (
        {"spec": {"task": "embed", "source": {"uri": "/m"}, "adapters": [{"name": "a", "source": {"uri": "/a"}}]}},
        ".spec: adapters (LoRA) apply only to task generate",
    ),
    "an adapter's revision on an s3:// source": (
        {"spec": {"adapters": [{"name": "a", "source": {"uri": "s3://b/a", "revision": "main"}}]}},
        ".spec.adapters[0].source: source.revision applies only to hf:// sources",
    ),
    "an adapter from a pvc:// claim (mounting it would roll the predictor)": (
        {"spec": {"adapters": [{"name": "a", "source": {"uri": "pvc://claim/a"}}]}},
        ".spec.adapters[0].source: an adapter cannot come from pvc://: mounting the claim would roll the "
        "predictor; copy the adapter to s3://, gs://, https:// or hf://",
    ),
    "valueFrom with two sources": (
        {"spec": {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}, "secretKeyRef": SECRET}}]}},
        ".spec.env[0].valueFrom: valueFrom needs exactly one of secretKeyRef, configMapKeyRef, fieldRef",
    ),
}


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_the_valid_base_object_passes_cel_and_pydantic() -> None:
    assert cel_failures(load(VALID)) == []
    assert pydantic_accepts(load(VALID))


@pytest.mark.parametrize(("patch", "failure"), INVALID.values(), ids=INVALID.keys())
def test_invalid_object_fails_exactly_the_matching_rule_and_pydantic_agrees(
    patch: dict[str, Any], failure: str
) -> None:
    body = merged(load(VALID), patch)
    failures = cel_failures(body)
    assert len(failures) == 1, failures
    assert failures[0].startswith(failure)
    assert not pydantic_accepts(body)


BOUNDARY_VALID = {
    "a 39-character name": {"metadata": {"name": "a" * 39}},
    "a one-letter name": {"metadata": {"name": "q"}},
    "min equal to max": {"spec": {"scaling": {"minReplicas": 4, "maxReplicas": 4}}},
    "a Knative idleTimeout of exactly 1h": {"spec": {"scaling": {"idleTimeout": "1h"}}},
    "a Standard idleTimeout above 1h": {"spec": {"scaling": {"mode": "Standard", "idleTimeout": "8h"}}},
    "a startupTimeout in milliseconds that are whole seconds": {"spec": {"scaling": {"startupTimeout": "90000ms"}}},
    "a fractional startupTimeout that is whole seconds": {"spec": {"scaling": {"startupTimeout": "1.5m"}}},
    "llamacpp with a file": {"spec": {"backend": "llamacpp", "source": {"file": "*q4_k_m.gguf"}}},
    "embed with a file": {"spec": {"task": "embed", "source": {"file": "*.gguf"}}},
    "every task with auto": {"spec": {"task": "anomaly", "source": {"uri": "/opt/a"}, "backend": "auto"}},
    "ocr with tesseract": {"spec": {"task": "ocr", "backend": "tesseract", "source": {"uri": "/opt/t"}}},
    "adapters on a generate model": {
        "spec": {
            "adapters": [
                {"name": "support-bot", "source": {"uri": "hf://acme/support-lora", "revision": "v2"}},
                {"name": "legal", "source": {"uri": "s3://adapters/legal", "credentialsSecret": "store"}},
            ]
        }
    },
    "an empty adapter list on an embed model": {"spec": {"task": "embed", "source": {"uri": "/m"}, "adapters": []}},
}


@pytest.mark.parametrize("patch", BOUNDARY_VALID.values(), ids=BOUNDARY_VALID.keys())
def test_boundary_cases_pass_cel_and_pydantic_alike(patch: dict[str, Any]) -> None:
    body = merged(load(VALID), patch)
    assert cel_failures(body) == []
    assert pydantic_accepts(body)


def test_a_name_with_a_trailing_newline_is_rejected_by_cel_and_pydantic_alike() -> None:
    body = merged(load(VALID), {"metadata": {"name": "qwen\n"}})
    assert cel_failures(body) != []
    assert not pydantic_accepts(body)


def test_duplicate_adapter_names_and_bad_names_are_rejected_by_pydantic_as_by_the_api_server() -> None:
    twice = [{"name": "a", "source": {"uri": "/a"}}, {"name": "a", "source": {"uri": "/b"}}]
    assert not pydantic_accepts(merged(load(VALID), {"spec": {"adapters": twice}}))
    for name in ("Support", "a:b", "a_b", "-a", "a" * 64):
        assert not pydantic_accepts(
            merged(load(VALID), {"spec": {"adapters": [{"name": name, "source": {"uri": "/a"}}]}})
        )


def test_duplicate_env_names_are_rejected_by_pydantic_as_by_the_api_server() -> None:
    body = merged(load(VALID), {"spec": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}})
    assert not pydantic_accepts(body)


@settings(max_examples=100, deadline=None)
@given(servable_models())
def test_every_generated_valid_model_passes_every_cel_rule(case: Any) -> None:
    body, _ = case
    assert pydantic_accepts(body)
    assert cel_failures(body) == []
