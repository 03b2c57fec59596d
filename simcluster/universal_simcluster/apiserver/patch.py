"""Writes that change an object: PUT, JSON merge patch, strategic merge patch, JSON patch and server-side apply.

Server-side apply is a documented subset (see :mod:`universal_simcluster.apiserver`): maps merge recursively; lists
merge as their schema says (structured-merge-diff): ``x-kubernetes-list-type: map`` lists by their
``x-kubernetes-list-map-keys``, ``set`` lists by value, every other list is atomic. Ownership is a set of paths
(:mod:`.paths`) per field manager and subresource; conflicts are only detected between apply managers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch
import jsonpointer

from universal_simcluster.apiserver.errors import ApiError
from universal_simcluster.apiserver.paths import find_item, get_path, item_key, pattern, value_key
from universal_simcluster.apiserver.resources import JSON, ListType, Path_

#: Who owns fields under server-side apply: (field manager, subresource) -> the paths it applied.
Managers = dict[tuple[str, str | None], set[Path_]]

# Paths that server-side apply never treats as owned (identity & system fields).
SSA_IGNORED: frozenset[Path_] = frozenset(
    {
        ("apiVersion",),
        ("kind",),
        ("metadata", "name"),
        ("metadata", "namespace"),
        ("metadata", "uid"),
        ("metadata", "resourceVersion"),
        ("metadata", "generation"),
        ("metadata", "creationTimestamp"),
        ("metadata", "deletionTimestamp"),
        ("metadata", "deletionGracePeriodSeconds"),
        ("metadata", "managedFields"),
    }
)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge recursively, ``null`` deletes, lists are replaced."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strip_directives(value: Any) -> Any:
    """Drop strategic-merge-patch ``$`` directives (we treat SMP as a merge patch)."""
    if isinstance(value, Mapping):
        return {k: strip_directives(v) for k, v in value.items() if not str(k).startswith("$")}
    if isinstance(value, list):
        return [strip_directives(v) for v in value]
    return value


#: List types of every object's metadata (k8s.io/apimachinery pkg/apis/meta/v1 types.go: ownerReferences
#: ``+listType=map +listMapKey=uid``, finalizers ``+listType=set``).
META_LIST_TYPES: dict[Path_, ListType] = {
    ("metadata", "ownerReferences"): ("map", ("uid",)),
    ("metadata", "finalizers"): ("set", ()),
}


def schema_list_types(schema: Any, path: Path_ = ()) -> dict[Path_, ListType]:
    """The map and set lists an OpenAPI v3 schema declares (x-kubernetes-list-type), by path pattern."""
    out: dict[Path_, ListType] = {}
    if not isinstance(schema, Mapping):
        return out
    if schema.get("type") == "array":
        kind = schema.get("x-kubernetes-list-type")
        if kind == "map":
            out[path] = ("map", tuple(schema.get("x-kubernetes-list-map-keys") or ()))
        elif kind == "set":
            out[path] = ("set", ())
        out |= schema_list_types(schema.get("items"), (*path, "*"))
    for name, sub in (schema.get("properties") or {}).items():
        out |= schema_list_types(sub, (*path, name))
    return out


def _leaf_paths(
    value: Mapping[str, Any], prefix: Path_ = (), types: Mapping[Path_, ListType] | None = None
) -> set[Path_]:
    """The paths an applied object sets: map leaves, list-map items (by key) and their fields, set values."""
    paths: set[Path_] = set()
    for key, sub in value.items():
        paths |= _value_paths(sub, (*prefix, key), types or {})
    return paths


def _value_paths(value: Any, path: Path_, types: Mapping[Path_, ListType]) -> set[Path_]:
    kind = types.get(pattern(path))
    if isinstance(value, list) and kind is not None:
        paths: set[Path_] = set()
        for item in value:
            if kind[0] == "map" and isinstance(item, Mapping):
                identity = (*path, item_key(item, kind[1]))
                paths.add(identity)
                for key, sub in item.items():
                    if key not in kind[1]:
                        paths |= _value_paths(sub, (*identity, key), types)
            else:
                paths.add((*path, value_key(item)))
        return paths
    if isinstance(value, Mapping) and value:
        return _leaf_paths(value, path, types)
    return {path}


def _remove_path(value: JSON, path: Path_, depth: int = 0) -> None:
    """Remove what a path names (a leaf, a list-map item, a set value) and prune maps that became empty."""
    key, rest = path[0], path[1:]
    if isinstance(value, list):
        index = find_item(value, key)
        if index is None:
            return
        if rest:
            _remove_path(value[index], rest, depth + 1)
        else:
            value.pop(index)
        return
    if not isinstance(value, dict) or key not in value:
        return
    if not rest:
        value.pop(key, None)
        return
    _remove_path(value[key], rest, depth + 1)
    if depth >= 1 and value[key] in ({}, []):  # never prune top-level sections like spec/metadata
        value.pop(key)


def apply_merge(target: Any, patch: Any, types: Mapping[Path_, ListType], path: Path_ = ()) -> Any:
    """Merge an applied configuration into an object: maps recursively, list-maps by key, sets by value."""
    if isinstance(patch, Mapping):
        result = dict(target) if isinstance(target, Mapping) else {}
        for key, value in patch.items():
            if value is None:
                result.pop(key, None)
            else:
                result[key] = apply_merge(result.get(key), value, types, (*path, key))
        return result
    kind = types.get(pattern(path))
    if isinstance(patch, list) and isinstance(target, list) and kind is not None:
        merged = [copy.deepcopy(item) for item in target]
        for item in patch:
            if kind[0] == "map" and isinstance(item, Mapping):
                index = find_item(merged, item_key(item, kind[1]))
                if index is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[index] = apply_merge(merged[index], item, types, (*path, "*"))
            elif item not in merged:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def patched(old: JSON, body: Any, kind: str) -> Any:
    """What a write makes of ``old``: ``put`` (the body), ``merge`` (RFC 7386), ``strategic`` (treated as a merge
    patch, ``$`` directives dropped) or ``json`` (RFC 6902; a failed ``test`` answers 422)."""
    if kind == "json":
        if not isinstance(body, list):
            raise ApiError(400, "a JSON patch must be a list of operations")
        try:
            return jsonpatch.apply_patch(copy.deepcopy(old), body)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:  # JsonPatchTestFailed too
            raise ApiError(
                422, f"the server rejected our request due to an error in our request: {e}", "Invalid"
            ) from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be an object")
    if kind == "put":
        return copy.deepcopy(body)
    return merge_patch(old, strip_directives(body) if kind == "strategic" else body)


def applied_paths(scoped: Mapping[str, Any], types: Mapping[Path_, ListType]) -> set[Path_]:
    """The paths an apply configuration owns (identity and system fields excluded)."""
    return {p for p in _leaf_paths(scoped, types=types) if p not in SSA_IGNORED}


def apply_owned(
    old: JSON,
    scoped: JSON,
    managers: Managers,
    owner: tuple[str, str | None],
    *,
    force: bool,
    types: Mapping[Path_, ListType],
) -> JSON:
    """Server-side apply of ``scoped`` by ``owner`` onto ``old``: the merged object; ``managers`` updated.

    A field another apply manager owns with a different value is a conflict (409, each named), unless ``force``
    takes it over. What ``owner`` applied before and no longer applies is removed unless another manager owns it.
    """
    new_paths = applied_paths(scoped, types)
    sub = owner[1]
    conflicts: list[str] = []
    for other, paths in managers.items():
        if other == owner or other[1] != sub:
            continue
        for path in paths & new_paths:
            if path[-1].startswith(("k:", "v:")):
                continue  # an item's or a value's presence is shared, never a conflict
            if get_path(old, path) != get_path(scoped, path):
                conflicts.append(f".{'.'.join(path)} (owned by {other[0]!r})")
        if force:
            paths -= new_paths
    if conflicts and not force:
        raise ApiError(
            409,
            f"Apply failed with {len(conflicts)} conflict(s): {', '.join(sorted(conflicts))}",
            "Conflict",
            {"causes": [{"reason": "FieldManagerConflict", "field": c} for c in sorted(conflicts)]},
        )
    candidate = copy.deepcopy(old)
    still_owned = set().union(*(paths for other, paths in managers.items() if other != owner))
    for path in sorted(managers.get(owner, set()) - new_paths, key=len, reverse=True):
        if not any(other[: len(path)] == path for other in still_owned):
            _remove_path(candidate, path)
    merged: JSON = apply_merge(candidate, scoped, types)  # an object: ``scoped`` is one
    managers[owner] = new_paths
    return merged
