"""Generate the UniversalModel CustomResourceDefinition from the pydantic spec and status models.

Pydantic's JSON Schema is close to what the API server wants, but not the same: a structural schema
has no ``$ref``, no ``title``, no ``anyOf`` with ``null``, and spells its extensions
``x-kubernetes-*``. :func:`structural_schema` translates; :func:`custom_resource_definition` wraps it.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from universal_operator import spec
from universal_predictors.catalog import CATALOG, Catalog

# Keys of JSON Schema the API server's structural schema accepts (plus x-kubernetes-* extensions).
_KEPT_KEYS = {
    "type", "format", "description", "default", "enum", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems",
    "uniqueItems", "properties", "additionalProperties", "items", "required", "nullable",
}  # fmt: skip

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Task", "type": "string", "jsonPath": ".spec.task", "description": "What the model does."},
    {"name": "Backend", "type": "string", "jsonPath": ".status.backend", "description": "The resolved engine."},
    {"name": "Served", "type": "string", "jsonPath": ".status.servedName", "description": "The OpenAI model name."},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Where the model is."},
    {"name": "Step", "type": "string", "jsonPath": ".status.step", "description": "A starting predictor's step."},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Whether the model answers requests.",
    },
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "description": "The external URL."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline ``$ref``s and translate one JSON Schema node into a structural-schema node."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        # Field-level keys (description, default) win over the referenced model's own.
        node = {**target, **node}
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v != {"type": "null"}]
        if len(variants) != 1:
            raise ValueError(f"cannot express a union of {len(variants)} schemas structurally: {variants}")
        variant = variants[0]
        if "$ref" in variant:
            variant = {**copy.deepcopy(defs[variant["$ref"].rsplit("/", 1)[-1]])}
        node = {**variant, **node}
        if node.get("default") is None:
            node.pop("default", None)
        return _resolve(node, defs)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "default" in node and node["default"] is None:
        del node["default"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _resolve(value, defs)
        elif key in _KEPT_KEYS or key.startswith("x-kubernetes-"):
            out[key] = value
    if out.get("additionalProperties") is False:
        # Structural schemas forbid it beside properties; the API server prunes unknown fields anyway.
        del out["additionalProperties"]
    if out.get("additionalProperties") is True or out.get("additionalProperties") == {}:
        del out["additionalProperties"]
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _strip_defaults(node: Any) -> Any:
    """Remove defaults (the status is written by the operator, never defaulted by the API server)."""
    if isinstance(node, dict):
        return {k: _strip_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_strip_defaults(v) for v in node]
    return node


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI v3 structural schema of ``model`` (camelCase names, descriptions, defaults, CEL)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _resolve(raw, defs)
    return schema


def _with_catalog(spec_schema: dict[str, Any], catalog: Catalog) -> dict[str, Any]:
    """The spec schema with its task enum and task rules written from ``catalog`` (the spec models carry
    the same from the project's catalog; a catalog with one more task gives the CRD that task)."""
    spec_schema = copy.deepcopy(spec_schema)
    task = spec_schema["properties"]["task"]
    task["enum"] = catalog.names
    task["description"] = spec.task_description(catalog)
    rules = {
        ".backend": (spec.task_backend_rule(catalog), spec.task_backend_message(catalog)),
        ".source.file": (spec.file_pattern_rule(catalog), spec.file_pattern_message(catalog)),
    }
    for validation in spec_schema["x-kubernetes-validations"]:
        if validation.get("fieldPath") in rules:
            validation["rule"], validation["message"] = rules[validation["fieldPath"]]
    return spec_schema


def custom_resource_definition(catalog: Catalog = CATALOG) -> dict[str, Any]:
    """The ``apiextensions.k8s.io/v1`` CustomResourceDefinition for UniversalModel, for ``catalog``'s tasks."""
    spec_schema = _with_catalog(structural_schema(spec.UniversalModelSpec), catalog)
    status_schema = _strip_defaults(structural_schema(spec.UniversalModelStatus))
    status_schema["description"] = "What the operator observed (predictorReport alone is written by the gateway)."
    root = {
        "type": "object",
        "description": (
            "A model served behind the OpenAI-compatible gateway: the operator renders it into a KServe "
            "InferenceService running the universal predictor and mirrors that service's status here."
        ),
        "required": ["spec"],
        "x-kubernetes-validations": [spec.NAME_RULE],
        "properties": {
            "apiVersion": {"type": "string", "description": "serving.universal-runtime.dev/v1alpha1"},
            "kind": {"type": "string", "description": "UniversalModel"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{spec.PLURAL}.{spec.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "universal-runtime"},
        },
        "spec": {
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": list(spec.SHORT_NAMES),
                "categories": ["all", "universal-runtime"],
            },
            "versions": [
                {
                    "name": spec.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as the YAML committed in ``crds/universalmodels.yaml``."""
    header = "# Generated by `universal-runtime crd` from universal_operator.spec. Do not edit by hand.\n"
    return header + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=120)


POOL_PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Where the pool is."},
    {"name": "Members", "type": "integer", "jsonPath": ".status.memberCount", "description": "UniversalModels in it."},
    {"name": "Used-MB", "type": "integer", "jsonPath": ".status.memoryUsedMb", "description": "Loaded memory."},
    {"name": "Budget", "type": "string", "jsonPath": ".spec.memoryBudget", "description": "The loaded members' bound."},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Whether the pool answers requests.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def pool_custom_resource_definition() -> dict[str, Any]:
    """The ``apiextensions.k8s.io/v1`` CustomResourceDefinition for UniversalModelPool."""
    status_schema = _strip_defaults(structural_schema(spec.UniversalModelPoolStatus))
    status_schema["description"] = "What the operator observed of the pool and, from its members' reports, inside it."
    root = {
        "type": "object",
        "description": (
            "One pod serving many small UniversalModels (those naming it in spec.pool): the operator renders one "
            "KServe InferenceService, '<name>-pool', running the universal runtime's supervisor, which loads each "
            "member on its first request and unloads idle ones within memoryBudget. Members come and go without "
            "a rollout."
        ),
        "x-kubernetes-validations": [spec.POOL_NAME_RULE],
        "properties": {
            "apiVersion": {"type": "string", "description": "serving.universal-runtime.dev/v1alpha1"},
            "kind": {"type": "string", "description": "UniversalModelPool"},
            "metadata": {"type": "object"},
            "spec": {**structural_schema(spec.UniversalModelPoolSpec), "default": {}},
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{spec.POOL_PLURAL}.{spec.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "universal-runtime"},
        },
        "spec": {
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.POOL_KIND,
                "listKind": f"{spec.POOL_KIND}List",
                "plural": spec.POOL_PLURAL,
                "singular": spec.POOL_SINGULAR,
                "shortNames": list(spec.POOL_SHORT_NAMES),
                "categories": ["all", "universal-runtime"],
            },
            "versions": [
                {
                    "name": spec.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": POOL_PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render_pool_crd_yaml() -> str:
    """The pool CRD as the YAML committed in ``crds/universalmodelpools.yaml``."""
    header = "# Generated by `universal-runtime crd --pool` from universal_operator.spec. Do not edit by hand.\n"
    return header + yaml.safe_dump(pool_custom_resource_definition(), sort_keys=False, width=120)
