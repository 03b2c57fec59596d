"""The HTTP side of the API: request paths as Kubernetes lays them out, and JSON answers."""

from __future__ import annotations

import json
from typing import Any

import aiohttp.web
from kmock._internal import parsing as _parsing


def parse_api_path(path: str) -> _parsing.ParsedPath:
    """Split a Kubernetes API path into group/version/plural/namespace/name/subresource."""
    parts = [p for p in path.strip("/").split("/") if p]
    version: str | None  # a group's path may stop before its version (``/apis/serving.kserve.io``)
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 2 and parts[0] == "apis":
        group, version, rest = parts[1], (parts[2] if len(parts) >= 3 else None), parts[3:]
    else:
        return _parsing.ParsedPath()
    namespace = None
    namespace_subresource = len(rest) == 3 and group == "" and rest[2] in ("status", "finalize")
    if len(rest) >= 3 and rest[0] == "namespaces" and not namespace_subresource:
        namespace, rest = rest[1], rest[2:]
    return _parsing.ParsedPath(
        group=group,
        version=version,
        plural=rest[0] if rest else None,
        namespace=namespace,
        name=rest[1] if len(rest) > 1 else None,
        subresource="/".join(rest[2:]) or None,
    )


def json_response(payload: Any, status: int = 200) -> aiohttp.web.Response:
    """JSON with exactly ``Content-Type: application/json`` (lightkube compares it verbatim)."""
    return aiohttp.web.Response(body=json.dumps(payload).encode(), status=status, content_type="application/json")
