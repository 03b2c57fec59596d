"""Rendered objects checked against their kinds' published schemas, vendored in ``schemas/`` (README.md there
names each file's upstream repository, tag and path), the way the API server and ``kubectl --validate=strict``
would check them.

Built-in kinds (Ingress, NetworkPolicy): Kubernetes' OpenAPI v3 components, with ``jsonschema`` for types,
``required``, ``enum``, ``oneOf`` and the integer formats, plus a walk of our own for strict field validation: the
components are open objects (no ``additionalProperties: false``), so an unknown field would pass ``jsonschema``
where ``kubectl apply --validate=strict`` (the default since kubectl 1.27) refuses it.

Custom resources (HTTPRoute, ServiceMonitor): the CRD's ``openAPIV3Schema`` through the simulated API server's own
structural-schema code (``universal_simcluster.apiserver.schemas``: defaulting, validation, CEL rules), and pruning
must leave the object unchanged: the API server drops a field its structural schema lacks without an error, so a
misspelt field would vanish from the cluster silently. ``jsonschema`` adds what that code leaves out (``anyOf``,
formats) and ``metadata`` is checked as ObjectMeta, as for built-in kinds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from universal_simcluster.apiserver import schemas as structural

SCHEMAS_DIR = Path(__file__).parent / "schemas"
#: The Kubernetes minors whose networking.k8s.io/v1 components are vendored: the chart's minimum (Chart.yaml
#: kubeVersion) and the newest published.
KUBE_VERSIONS = ("1.28", "1.35")
_COMPONENTS = "#/components/schemas/"
_BUILTIN = {("networking.k8s.io/v1", "Ingress"): "io.k8s.api.networking.v1.Ingress",
            ("networking.k8s.io/v1", "NetworkPolicy"): "io.k8s.api.networking.v1.NetworkPolicy"}  # fmt: skip
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_CUSTOM = {("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
           ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json"}  # fmt: skip
#: The kinds checked here, each an (apiVersion, kind).
KINDS = frozenset(_BUILTIN) | frozenset(_CUSTOM)

_FORMATS = jsonschema.FormatChecker()


def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


_FORMATS.checks("int32")(_int32)
_FORMATS.checks("int64")(_int64)


def errors(obj: Mapping[str, Any], kube_version: str = KUBE_VERSIONS[-1]) -> list[str]:
    """Every way ``obj`` breaks its kind's published schema (empty: valid), each ``field: what``."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in _BUILTIN:
        return _builtin_errors(obj, _BUILTIN[key], kube_version)
    if key in _CUSTOM:
        return _custom_resource_errors(obj, _CUSTOM[key], kube_version)
    raise LookupError(f"no vendored schema for {key}")


@cache
def _networking(kube_version: str) -> tuple[dict[str, Any], Registry[Any]]:
    document = json.loads((SCHEMAS_DIR / f"networking-v1-{kube_version}.json").read_text())
    uri = f"urn:kubernetes:{kube_version}:networking.k8s.io/v1"
    resource: Resource[Any] = Resource.from_contents(document, default_specification=DRAFT202012)
    return {"uri": uri, "schemas": document["components"]["schemas"]}, Registry().with_resource(uri, resource)


def _builtin_errors(obj: Mapping[str, Any], component: str, kube_version: str) -> list[str]:
    spec, registry = _networking(kube_version)
    found = _jsonschema_errors(obj, {"$ref": f"{spec['uri']}{_COMPONENTS}{component}"}, registry)
    return found + list(_unknown_fields(obj, spec["schemas"][component], spec["schemas"]))


@cache
def _crd_schema(file: str) -> dict[str, Any]:
    return dict(json.loads((SCHEMAS_DIR / file).read_text()))


def _custom_resource_errors(obj: Mapping[str, Any], file: str, kube_version: str) -> list[str]:
    schema = _crd_schema(file)
    body = dict(obj)
    _, found = structural.admit(body, None, schema)
    found += _jsonschema_errors(body, schema, Registry())
    if structural.prune(body, schema, root=True) != body:
        pruned = _unknown_fields({k: v for k, v in body.items() if k != "metadata"}, schema, {}, structural=True)
        found += [f"{field}: the API server would prune it" for field in pruned]
    # metadata as the API server reads it, whatever the kind: ObjectMeta.
    spec, registry = _networking(kube_version)
    meta = {"$ref": f"{spec['uri']}{_COMPONENTS}{_OBJECT_META}"}
    found += [f"metadata.{e}" for e in _jsonschema_errors(body.get("metadata"), meta, registry)]
    found += list(_unknown_fields(body.get("metadata"), spec["schemas"][_OBJECT_META], spec["schemas"], "metadata"))
    return found


def _jsonschema_errors(value: Any, schema: Mapping[str, Any], registry: Registry[Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema, registry=registry, format_checker=_FORMATS)
    return [f"{e.json_path.removeprefix('$.')}: {e.message}" for e in validator.iter_errors(value)]


def _resolved(schema: Mapping[str, Any], components: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` with its ``$ref`` and single-entry ``allOf`` (OpenAPI v3's wrapping of a ``$ref``) followed."""
    while True:
        if isinstance(schema.get("$ref"), str):
            schema = components[schema["$ref"].removeprefix(_COMPONENTS)]
        elif len(schema.get("allOf") or []) == 1 and "properties" not in schema:
            schema = schema["allOf"][0]
        else:
            return schema


def _unknown_fields(value: Any, schema: Mapping[str, Any], components: Mapping[str, Any], path: str = "", *,
                   structural: bool = False) -> Iterator[str]:  # fmt: skip
    """The fields of ``value`` that ``schema`` does not declare, each ``unknown field "<path>"`` as kubectl words it.
    An object schema with neither ``properties`` nor ``additionalProperties`` is free-form in Kubernetes' OpenAPI
    (FieldsV1) but empty in a structural schema (``structural``), where pruning drops all it holds."""
    schema = _resolved(schema, components)
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return
        if not structural and "properties" not in schema and "additionalProperties" not in schema:
            return
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            where = f"{path}.{name}" if path else name
            if name in properties:
                yield from _unknown_fields(item, properties[name], components, where, structural=structural)
            elif isinstance(extra, Mapping):
                yield from _unknown_fields(item, extra, components, where, structural=structural)
            elif extra is not True:
                yield f'unknown field "{where}"'
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            yield from _unknown_fields(item, schema["items"], components, f"{path}[{index}]", structural=structural)
