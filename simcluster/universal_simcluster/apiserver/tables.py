"""Table printing: ``kubectl get`` asks for ``as=Table`` and renders the columns the server computes.

The columns are a CRD's ``additionalPrinterColumns`` (a JSONPath subset), with Name first and Age last unless a
column already shows the creation timestamp, as apiextensions-apiserver's table convertor does.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from typing import Any

from universal_simcluster.apiserver.clock import now
from universal_simcluster.apiserver.paths import get_path
from universal_simcluster.apiserver.resources import JSON, PrinterColumn, ResourceSpec


def human_duration(seconds: float) -> str:
    """Port of ``k8s.io/apimachinery/pkg/util/duration.HumanDuration`` (kubectl's AGE column)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    try:
        moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    return human_duration((now() - moment).total_seconds())


_JSONPATH_TOKEN = re.compile(
    r"""\.(?P<key>[A-Za-z0-9_\-]+)
      | \[(?P<index>-?\d+|\*)\]
      | \[\?\(@\.(?P<fpath>[A-Za-z0-9_.\-]+)\s*==\s*(?P<q>["'])(?P<fvalue>.*?)(?P=q)\)\]
      | \[(?P<qk>["'])(?P<qkey>.*?)(?P=qk)\]""",
    re.VERBOSE,
)


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """Evaluate the simple JSONPath subset used by printer columns; returns all matches."""
    expr = expression.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = expr.removeprefix("$")
    values: list[Any] = [obj]
    pos = 0
    while pos < len(expr):
        m = _JSONPATH_TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"Unsupported JSONPath: {expression!r}")
        pos = m.end()
        nxt: list[Any] = []
        for value in values:
            if m.group("key") is not None or m.group("qkey") is not None:
                key = m.group("key") if m.group("key") is not None else m.group("qkey")
                if isinstance(value, Mapping) and key in value:
                    nxt.append(value[key])
            elif m.group("index") is not None and isinstance(value, list):
                if m.group("index") == "*":
                    nxt.extend(value)
                elif -len(value) <= int(m.group("index")) < len(value):
                    nxt.append(value[int(m.group("index"))])
            elif m.group("fpath") is not None and isinstance(value, list):
                fpath = tuple(m.group("fpath").split("."))
                nxt.extend(item for item in value if str(get_path(item, fpath)) == m.group("fvalue"))
        values = nxt
    return values


def _cell(column: PrinterColumn, obj: JSON) -> Any:
    """Render one printer-column cell the way apiextensions' table convertor does."""
    try:
        results = jsonpath(obj, column.json_path)
    except ValueError:
        return None
    if not results or results[0] is None:
        return None
    value = results[0]
    if column.type == "date":
        return age(str(value))
    if column.type == "integer":
        return int(value) if isinstance(value, int | float) else value
    if column.type == "number":
        return float(value) if isinstance(value, int | float) else value
    if column.type == "boolean":
        return value
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else str(value)


def table(spec: ResourceSpec, payload: JSON, include: str, resource_version: int) -> JSON:
    """Server-side printing as the apiextensions table convertor does it (``kubectl get``).

    ``payload`` is an object or a list; ``include`` is the ``includeObject`` parameter (Metadata, Object, None).
    """
    columns = list(spec.printer_columns)
    definitions = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "priority": 0,
            "description": "Name must be unique within a namespace.",
        }
    ]
    definitions += [
        {"name": c.name, "type": c.type, "format": c.format, "priority": c.priority, "description": c.description}
        for c in columns
    ]
    has_age = any(
        c.json_path.strip() in (".metadata.creationTimestamp", "{.metadata.creationTimestamp}") for c in columns
    )
    if not has_age:
        definitions.append(
            {
                "name": "Age",
                "type": "date",
                "format": "",
                "priority": 0,
                "description": "CreationTimestamp is a timestamp of when the object was created.",
            }
        )
    items = payload.get("items", [payload])
    rows = []
    for obj in items:
        meta = obj.get("metadata", {})
        cells: list[Any] = [meta.get("name")] + [_cell(c, obj) for c in columns]
        if not has_age:
            cells.append(age(meta.get("creationTimestamp")))
        row_obj: JSON | None = obj
        if include == "Metadata":
            row_obj = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": {
                    k: meta[k]
                    for k in (
                        "name",
                        "namespace",
                        "uid",
                        "resourceVersion",
                        "creationTimestamp",
                        "labels",
                        "annotations",
                        "generation",
                    )
                    if k in meta
                },
            }
        elif include == "None":
            row_obj = None
        rows.append({"cells": cells, "object": row_obj})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": payload.get("metadata", {}).get("resourceVersion", str(resource_version))},
        "columnDefinitions": definitions,
        "rows": rows,
    }
