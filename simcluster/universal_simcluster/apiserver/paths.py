"""Addressing into objects: field paths (``metadata.name``) and server-side apply's list elements.

A path is a tuple of map keys; inside a list, an element names a list-map item by its keys (``k:{"uid":"..."}``)
or a set value (``v:"x"``), the way structured-merge-diff names them in managed fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from universal_simcluster.apiserver.resources import Path_


def pattern(path: Path_) -> Path_:
    """A concrete path as a list-type pattern: list items (``k:``/``v:`` elements) become ``*``."""
    return tuple("*" if part.startswith(("k:", "v:")) else part for part in path)


def item_key(item: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The element naming a list-map item by its key fields."""
    return "k:" + json.dumps({k: item.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))


def value_key(value: Any) -> str:
    """The element naming a set value."""
    return "v:" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def find_item(items: list[Any], element: str) -> int | None:
    """The index of the list-map item (``k:``) or set value (``v:``) an owned path names."""
    if element.startswith("k:"):
        wanted = json.loads(element[2:])
        for index, item in enumerate(items):
            if isinstance(item, Mapping) and all(item.get(k) == v for k, v in wanted.items()):
                return index
    elif element.startswith("v:"):
        value = json.loads(element[2:])
        return items.index(value) if value in items else None
    return None


def get_path(value: Any, path: Path_) -> Any:
    """What a path names in ``value`` (None where any step is missing)."""
    for key in path:
        if isinstance(value, list):
            index = find_item(value, key)
            if index is None:
                return None
            value = value[index]
            continue
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value
