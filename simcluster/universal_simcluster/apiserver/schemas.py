"""A custom resource's structural schema on writes: defaulting, pruning, validation and CEL rules.

What it imitates (Kubernetes v1.31, ``staging/src/k8s.io/apiextensions-apiserver``): a create or an update of a
custom resource is defaulted (``pkg/apiserver/schema/defaulting/algorithm.go``: a property's ``default`` fills it
where it is absent, recursively, into ``properties``, ``items`` and ``additionalProperties``), pruned
(``pkg/apiserver/schema/pruning/algorithm.go``: a field the schema does not specify is dropped unless the node says
``x-kubernetes-preserve-unknown-fields``; the root's ``apiVersion``, ``kind`` and ``metadata`` are kept), then
validated against the OpenAPI schema (``pkg/apiserver/validation``: types, ``enum``, ``required``, bounds, lengths,
``pattern``) and its ``x-kubernetes-validations`` CEL rules (``pkg/apiserver/schema/cel``: ``self``, and
``oldSelf`` on updates for transition rules, which are skipped on create; a property a rule cannot spell as it is,
such as ``namespace``, escaped as ``apiserver/pkg/cel/escaping.go`` does: ``__namespace__``). A failure is 422
Invalid naming the field, as the API server answers; pruned fields are dropped silently (the real server also warns,
``unknown field``).

A documented subset: ``anyOf``/``oneOf``/``allOf``/``not`` value validation, ``format``, ``multipleOf``,
``x-kubernetes-int-or-string`` coercion and CEL cost limits are not checked here.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

JSON = dict[str, Any]
Schema = Mapping[str, Any]

_ROOT_KEPT = ("apiVersion", "kind", "metadata")


def apply_defaults(value: Any, schema: Schema) -> Any:
    """``value`` with every absent property that has a ``default`` filled in (a copy)."""
    if isinstance(value, dict):
        out = dict(value)
        properties = schema.get("properties") or {}
        for name, sub in properties.items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(out[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name in out:
                if name not in properties:
                    out[name] = apply_defaults(out[name], extra)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def prune(value: Any, schema: Schema, *, root: bool = False) -> Any:
    """``value`` without the fields ``schema`` does not specify (a copy)."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        out: JSON = {}
        for name, item in value.items():
            if root and name in _ROOT_KEPT:
                out[name] = item
            elif name in properties:
                out[name] = prune(item, properties[name])
            elif isinstance(extra, Mapping):
                out[name] = prune(item, extra)
            elif extra is True or keep_unknown:
                out[name] = item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [prune(item, schema["items"]) for item in value]
    return value


def unknown_fields(value: Any, schema: Schema, path: str = "", *, root: bool = False) -> list[str]:
    """The paths :func:`prune` drops from ``value`` (``spec.predictor.minReplica``), as the API server's
    ``unknown field`` warnings name them."""
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for name, item in value.items():
            if root and name in _ROOT_KEPT:
                continue
            if name in properties:
                found += unknown_fields(item, properties[name], _join(path, name))
            elif isinstance(extra, Mapping):
                found += unknown_fields(item, extra, _join(path, name))
            elif not (extra is True or keep_unknown):
                found.append(_join(path, name))
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return found


_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def _type_ok(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(kind, object))


def validate(value: Any, schema: Schema, path: str = "") -> list[str]:
    """Field errors of ``value`` under ``schema``, in the API server's words (``spec.x: Invalid value: ...``)."""
    errors: list[str] = []
    where = path or "<root>"
    if value is None and schema.get("nullable"):
        return errors
    kind = schema.get("type")
    int_or_string = schema.get("x-kubernetes-int-or-string")
    if kind and not int_or_string and not _type_ok(value, str(kind)):
        found = type(value).__name__ if value is not None else "null"
        return [f'{where}: Invalid value: "{found}": {where} in body must be of type {kind}: "{found}"']
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        errors.append(f"{where}: Unsupported value: {value!r}: supported values: {allowed}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: Too long: may not be longer than {schema['maxLength']}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: Invalid value: {value!r}: {where} in body should be at least "
                          f"{schema['minLength']} chars long")  # fmt: skip
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: Invalid value: {value!r}: {where} in body should match '{schema['pattern']}'")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: Invalid value: {value}: {where} in body should be greater than or equal to "
                          f"{schema['minimum']}")  # fmt: skip
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: Invalid value: {value}: {where} in body should be less than or equal to "
                          f"{schema['maximum']}")  # fmt: skip
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{where}: Invalid value: {len(value)}: {where} in body should have at least "
                          f"{schema['minItems']} items")  # fmt: skip
        errors += _list_type_errors(value, schema, where)
        items = schema.get("items")
        if isinstance(items, Mapping):
            for index, item in enumerate(value):
                errors += validate(item, items, f"{path}[{index}]")
    if isinstance(value, dict):
        for name in schema.get("required") or []:
            if name not in value:
                errors.append(f"{_join(path, name)}: Required value")
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            if name in properties:
                errors += validate(item, properties[name], _join(path, name))
            elif isinstance(extra, Mapping):
                errors += validate(item, extra, _join(path, name))
    return errors


def _list_type_errors(value: list[Any], schema: Schema, where: str) -> list[str]:
    """``x-kubernetes-list-type`` ``map`` (unique map keys) and ``set`` (unique items): a repeat is a Duplicate
    value (apiextensions-apiserver v1.31 ``pkg/apiserver/schema/listtype/validation.go``, validateListSetsAndMaps)."""
    kind = schema.get("x-kubernetes-list-type")
    seen: set[str] = set()
    errors: list[str] = []
    for index, item in enumerate(value):
        if kind == "map" and isinstance(item, dict):
            key = json.dumps({k: item.get(k) for k in schema.get("x-kubernetes-list-map-keys") or []}, sort_keys=True)
        elif kind == "set":
            key = json.dumps(item, sort_keys=True)
        else:
            continue
        if key in seen:
            errors.append(f"{where}[{index}]: Duplicate value: {key}")
        seen.add(key)
    return errors


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def cel_errors(value: Any, old: Any, schema: Schema, path: str = "") -> list[str]:
    """The ``x-kubernetes-validations`` rules ``value`` breaks, each ``path: Invalid value: ...: message``. A rule
    naming ``oldSelf`` is a transition rule: checked only where an old value exists (an update)."""
    import celpy
    from celpy.adapter import json_to_cel

    errors: list[str] = []
    where = path or "<root>"
    for rule in schema.get("x-kubernetes-validations") or []:
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        environment = celpy.Environment()
        program = environment.program(environment.compile(rule["rule"]))
        activation = {"self": json_to_cel(cel_value(value, schema))}
        if transition:
            activation["oldSelf"] = json_to_cel(cel_value(old, schema))
        try:
            verdict = program.evaluate(activation)
        except Exception as exc:  # celpy's evaluation errors: the rule cannot hold
            errors.append(f"{where}: Invalid value: the rule {rule['rule']!r} failed to evaluate: {exc}")
            continue
        if not bool(verdict):
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            errors.append(f"{_join(where, rule['fieldPath'].lstrip('.')) if rule.get('fieldPath') else where}: "
                          f"Invalid value: \"object\": {message}")  # fmt: skip
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for name, item in value.items():
            if name in properties:
                previous = old.get(name) if isinstance(old, dict) else None
                errors += cel_errors(item, previous, properties[name], _join(path, name))
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            errors += cel_errors(item, None, schema["items"], f"{path}[{index}]")
    return errors


#: CEL's reserved words; a property so named is ``__{word}__`` in a rule (Kubernetes v1.31
#: ``staging/src/k8s.io/apiserver/pkg/cel/escaping.go``, ``celReservedSymbols``: ``namespace`` among them).
_CEL_RESERVED = frozenset({"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
                           "function", "if", "import", "let", "loop", "package", "namespace", "return", "var",
                           "void", "while"})  # fmt: skip
_CEL_ESCAPES = {"__": "__underscores__", ".": "__dot__", "-": "__dash__", "/": "__slash__"}


def cel_property_name(name: str) -> str | None:
    """``name`` as a CEL rule spells the property (``Escape`` in the same file); ``None``: a rule cannot name it."""
    if not name or name[0].isdigit():
        return None
    if name in _CEL_RESERVED:
        return f"__{name}__"
    if not re.fullmatch(r"[A-Za-z0-9_./-]+", name):
        return None
    return re.sub(r"__|[./-]", lambda m: _CEL_ESCAPES[m.group()], name)


def cel_value(value: Any, schema: Schema) -> Any:
    """``value`` as a rule sees it: the properties ``schema`` declares under their escaped names; the keys of a map
    (``additionalProperties``) as they are, reached with ``self['key']``."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out: JSON = {}
        for name, item in value.items():
            if name in properties:
                escaped = cel_property_name(name)
                if escaped is not None:
                    out[escaped] = cel_value(item, properties[name])
            else:
                out[name] = cel_value(item, extra) if isinstance(extra, Mapping) else item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [cel_value(item, schema["items"]) for item in value]
    return value


def admit(obj: JSON, old: JSON | None, schema: Schema) -> tuple[JSON, list[str]]:
    """``obj`` defaulted and pruned, and the errors that refuse it (empty: admitted)."""
    shaped = prune(apply_defaults(obj, schema), schema, root=True)
    body = {k: v for k, v in shaped.items() if k not in _ROOT_KEPT}
    errors = validate(body, {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items()
                                                      if k not in _ROOT_KEPT}})  # fmt: skip
    if not errors:
        errors = cel_errors(_cel_view(shaped), _cel_view(old) if old is not None else None, schema)
    return shaped, errors


def _cel_view(obj: JSON) -> JSON:
    """The root object as a CEL rule sees it: of metadata, only ``name`` and ``generateName`` (the apiextensions
    validation docs: the only metadata fields accessible to rules)."""
    meta = obj.get("metadata") or {}
    return {**obj, "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta}}
