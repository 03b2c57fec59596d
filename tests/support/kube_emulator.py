"""An in-process Kubernetes API emulator for operator tests.

It subclasses :class:`kmock.KubernetesEmulator` and replaces its object store
semantics with a much closer imitation of a real API server, so that the real
kopf operator, the lightkube client and the real ``kubectl`` can run against it:

* every write stamps ``metadata.resourceVersion`` (one global counter), and
  creates stamp ``uid``, ``creationTimestamp`` and ``generation``; the
  generation grows whenever anything outside ``metadata``/``status`` changes
  (and when a graceful deletion starts, as in Kubernetes);
* an append-only event log per resource makes ``watch?resourceVersion=N``
  resume exactly after ``N``; lists report the current global version;
  ``sendInitialEvents=true`` ends the initial batch with a bookmark;
* JSON-patch ``test`` failures answer 422, stale ``resourceVersion`` in a
  merge patch / PUT / apply body answers 409;
* the ``status`` subresource is isolated from the main resource both ways;
* server-side apply (a documented subset), label & field selectors,
  background garbage collection via ``ownerReferences``,
  server-side ``Table`` rendering for ``kubectl get``;
* fault injection and write accounting for tests and benchmarks.

Deliberate simplifications (documented once, here):

* Server-side apply merges maps recursively; lists merge as their schema
  says (structured-merge-diff): ``x-kubernetes-list-type: map`` lists by
  their ``x-kubernetes-list-map-keys`` and ``set`` lists by value (read from
  a CRD's ``openAPIV3Schema``; for every object ``metadata.ownerReferences``
  by uid and ``metadata.finalizers`` as a set, k8s.io/apimachinery
  meta/v1 types.go; a ServiceAccount's ``secrets`` by name, core/v1
  types.go patchMergeKey), every other list is atomic and replaced (the
  apiextensions default for CRDs: "Defaults to atomic for arrays"; KServe's
  InferenceService CRD leaves ``predictor.containers`` unannotated, so it
  is atomic). Ownership is tracked per object, per field manager and per
  subresource as a set of paths (map leaves, list-map items by key, set
  values); ``metadata.managedFields`` is not rendered. Conflicts are only
  detected between apply managers, and only writes by apply own fields: an
  item another writer added by a patch is nobody's, so an applier never
  removes it (unless it sits inside an item the applier stops applying).
* Strategic merge patches are treated as JSON merge patches (``$``-directives
  are dropped).
* ``propagationPolicy: Foreground`` behaves as ``Background``; ``Orphan``
  skips the garbage collection. GC runs synchronously within the request that
  finally deleted the owner.
* Namespaces are not required to exist for namespaced objects; no schema
  validation, no defaulting, no admission except for InferenceServices, which
  pass through :mod:`tests.support.admission` (KServe's webhooks, Knative's
  revision validation, pod validation) when ``admission`` is set;
  ``limit``/``continue`` are ignored
  (every list is a single page); PUT without ``metadata.resourceVersion`` is
  accepted as an unconditional update.
* A watched object that stops matching a label selector does not produce a
  synthetic ``DELETED`` event.
* Requests to registered resources are served by this class directly; kmock's
  ``<<`` reactions still work for all other URLs (discovery, custom endpoints).
  Seeding via ``emulator.objects[...] = ...`` bypasses stamping and watches.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import datetime
import json
import os
import re
import secrets
import subprocess
import uuid
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import parsing as _parsing
from kmock._internal import rendering as _rendering

from tests.support import admission as _admission

JSON = dict[str, Any]
Path_ = tuple[str, ...]

ALL_VERBS = frozenset({"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
HARNESS_HEADER = "X-Kube-Emulator-Harness"

# Paths that server-side apply never treats as owned (identity & system fields).
_SSA_IGNORED: frozenset[Path_] = frozenset(
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
_SYSTEM_META = ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds")
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Gone",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


# --------------------------------------------------------------------------------------------------
# Small value types
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrinterColumn:
    """One ``additionalPrinterColumns`` entry, remembered for Table rendering."""

    name: str
    type: str
    json_path: str
    format: str = ""
    description: str = ""
    priority: int = 0


#: How server-side apply merges a list: ("map", its keys) or ("set", ()); lists not named are atomic.
ListType = tuple[str, tuple[str, ...]]


@dataclass
class ResourceSpec:
    """What the emulator must know about a served resource (beyond kmock's discovery info)."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = False
    printer_columns: tuple[PrinterColumn, ...] = ()
    list_kind: str = ""
    #: Merge semantics of lists by path pattern ("*" for a list's items), besides metadata's.
    list_types: Mapping[Path_, ListType] = field(default_factory=dict)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)


class WriteKey(NamedTuple):
    """The address of a write for accounting: which object (and subresource) was written."""

    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None


class Access(NamedTuple):
    """One client request in RBAC's terms: what a Role would have to grant for it."""

    verb: str
    group: str
    plural: str
    subresource: str | None
    namespace: str | None


def rbac_verb(method: str, name: str | None, params: Mapping[str, str], subresource: str | None) -> str:
    """The RBAC verb the API server checks for a request (``watch`` for ``?watch=true`` and ``/watch/``)."""
    if method == "GET":
        if subresource == "watch" or params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if name else "list"
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
    if method in verbs:
        return verbs[method]
    return "delete" if name else "deletecollection"


@dataclass(frozen=True)
class WriteRecord:
    """One write request as the emulator saw it (``status`` is the HTTP status answered)."""

    method: str
    key: WriteKey
    content_type: str
    status: int


@dataclass
class FaultRule:
    """A pending injected failure; see :meth:`KubeEmulator.inject_failures`."""

    status: int
    remaining: int
    methods: frozenset[str]
    plural: str | None
    subresource: str | None
    namespace: str | None
    name: str | None

    def matches(self, method: str, key: WriteKey) -> bool:
        return (
            self.remaining > 0
            and method in self.methods
            and (self.plural is None or self.plural == key.plural)
            and (self.subresource is None or (self.subresource or None) == key.subresource)
            and (self.namespace is None or self.namespace == key.namespace)
            and (self.name is None or self.name == key.name)
        )


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str
    obj: JSON


class ApiError(Exception):
    """An API failure to be answered as a Kubernetes ``Status`` (never escapes to kmock)."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: JSON | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details or {}


def status_body(code: int, message: str, reason: str | None = None, details: JSON | None = None) -> JSON:
    """A ``v1 Status`` failure body as Kubernetes sends it."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "details": details or {},
        "code": code,
    }


# --------------------------------------------------------------------------------------------------
# Pure helpers: time, dicts, selectors, JSONPath
# --------------------------------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


def rfc3339(moment: datetime.datetime | None = None) -> str:
    """Second-precision RFC3339 with ``Z``, as Kubernetes renders ``metav1.Time``."""
    return (moment or _now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    try:
        moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    return human_duration((_now() - moment).total_seconds())


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


def _strip_directives(value: Any) -> Any:
    """Drop strategic-merge-patch ``$`` directives (we treat SMP as a merge patch)."""
    if isinstance(value, Mapping):
        return {k: _strip_directives(v) for k, v in value.items() if not str(k).startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
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


def _pattern(path: Path_) -> Path_:
    """A concrete path as a list-type pattern: list items (``k:``/``v:`` elements) become ``*``."""
    return tuple("*" if part.startswith(("k:", "v:")) else part for part in path)


def _item_key(item: Mapping[str, Any], keys: Sequence[str]) -> str:
    return "k:" + json.dumps({k: item.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))


def _value_key(value: Any) -> str:
    return "v:" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def _find_item(items: list[Any], element: str) -> int | None:
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


def _leaf_paths(
    value: Mapping[str, Any], prefix: Path_ = (), types: Mapping[Path_, ListType] | None = None
) -> set[Path_]:
    """The paths an applied object sets: map leaves, list-map items (by key) and their fields, set values."""
    paths: set[Path_] = set()
    for key, sub in value.items():
        paths |= _value_paths(sub, (*prefix, key), types or {})
    return paths


def _value_paths(value: Any, path: Path_, types: Mapping[Path_, ListType]) -> set[Path_]:
    kind = types.get(_pattern(path))
    if isinstance(value, list) and kind is not None:
        paths: set[Path_] = set()
        for item in value:
            if kind[0] == "map" and isinstance(item, Mapping):
                identity = (*path, _item_key(item, kind[1]))
                paths.add(identity)
                for key, sub in item.items():
                    if key not in kind[1]:
                        paths |= _value_paths(sub, (*identity, key), types)
            else:
                paths.add((*path, _value_key(item)))
        return paths
    if isinstance(value, Mapping) and value:
        return _leaf_paths(value, path, types)
    return {path}


def _get_path(value: Any, path: Path_) -> Any:
    for key in path:
        if isinstance(value, list):
            index = _find_item(value, key)
            if index is None:
                return None
            value = value[index]
            continue
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _remove_path(value: JSON, path: Path_, depth: int = 0) -> None:
    """Remove what a path names (a leaf, a list-map item, a set value) and prune maps that became empty."""
    key, rest = path[0], path[1:]
    if isinstance(value, list):
        index = _find_item(value, key)
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
    kind = types.get(_pattern(path))
    if isinstance(patch, list) and isinstance(target, list) and kind is not None:
        merged = [copy.deepcopy(item) for item in target]
        for item in patch:
            if kind[0] == "map" and isinstance(item, Mapping):
                index = _find_item(merged, _item_key(item, kind[1]))
                if index is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[index] = apply_merge(merged[index], item, types, (*path, "*"))
            elif item not in merged:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


_SET_TERM = re.compile(r"^\s*([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_label_selector(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """Compile ``k=v,k!=v,k,!k,k in (a,b),k notin (a,b)`` into a predicate over labels."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(selector):
        if m := _SET_TERM.match(term):
            key, op, raw = m.group(1), m.group(2), m.group(3)
            values = frozenset(v.strip() for v in raw.split(",") if v.strip())
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            checks.append(lambda labels, k=absent: k not in labels)
        else:
            checks.append(lambda labels, k=term: k in labels)
    return lambda labels: all(check(labels) for check in checks)


def parse_field_selector(selector: str) -> Callable[[Mapping[str, Any]], bool]:
    """Compile ``path=v,path==v,path!=v`` (dotted paths, e.g. ``metadata.name``) into a predicate."""
    checks: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in _split_terms(selector):
        negate = "!=" in term
        key, value = (s.strip() for s in term.replace("!=", "=").replace("==", "=").split("=", 1))
        path = tuple(key.split("."))

        def check(obj: Mapping[str, Any], p: Path_ = path, v: str = value, neg: bool = negate) -> bool:
            actual = _get_path(obj, p)
            text = "" if actual is None else str(actual).lower() if isinstance(actual, bool) else str(actual)
            return (text != v) if neg else (text == v)

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


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
                nxt.extend(item for item in value if str(_get_path(item, fpath)) == m.group("fvalue"))
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
        return _age(str(value))
    if column.type == "integer":
        return int(value) if isinstance(value, int | float) else value
    if column.type == "number":
        return float(value) if isinstance(value, int | float) else value
    if column.type == "boolean":
        return value
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else str(value)


def parse_api_path(path: str) -> _parsing.ParsedPath:
    """Split a Kubernetes API path into group/version/plural/namespace/name/subresource."""
    parts = [p for p in path.strip("/").split("/") if p]
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


def _json_response(payload: Any, status: int = 200) -> aiohttp.web.Response:
    """JSON with exactly ``Content-Type: application/json`` (lightkube compares it verbatim)."""
    return aiohttp.web.Response(body=json.dumps(payload).encode(), status=status, content_type="application/json")


def _generated_suffix() -> str:
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # same alphabet as k8s' utilrand.String
    return "".join(secrets.choice(alphabet) for _ in range(5))


# --------------------------------------------------------------------------------------------------
# The emulator
# --------------------------------------------------------------------------------------------------


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the API-server semantics operators rely on (see module doc)."""

    watch_poll_interval: float = 0.5  # how often idle watches check for a gone client
    # Close connections after each (non-streaming) response. Keep-alive connections keep server-side
    # tasks alive in the shared event loop, and kopf waits 5 s for "hung" tasks when it stops.
    keep_alive: bool = False

    _specs: dict[kmock.resource, ResourceSpec] = attrs.field(factory=dict, init=False)
    _canonical: dict[kmock.resource, kmock.resource] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _log: dict[kmock.resource, list[_Event]] = attrs.field(factory=dict, init=False)
    _log_rvs: dict[kmock.resource, list[int]] = attrs.field(factory=dict, init=False)
    _wakeup: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _managers: dict[tuple[kmock.resource, str | None, str], dict[tuple[str, str | None], set[Path_]]] = attrs.field(
        factory=dict, init=False
    )
    _faults: list[FaultRule] = attrs.field(factory=list, init=False)
    writes: Counter[WriteKey] = attrs.field(factory=Counter, init=False)
    writes_by_method: Counter[str] = attrs.field(factory=Counter, init=False)
    write_log: list[WriteRecord] = attrs.field(factory=list, init=False)
    access_log: list[Access] = attrs.field(factory=list, init=False)  # every non-harness resource request
    #: The cluster whose admission InferenceService writes go through; None: none (a bare API server).
    admission: _admission.Cluster | None = attrs.field(default=None, init=False)

    # ---------------------------------------------------------------- registration & public helpers

    def register_resource(
        self, spec: ResourceSpec, info: kmock.ResourceInfo | None = None, *, canonical: kmock.resource | None = None
    ) -> None:
        """Serve a resource: discovery info for kmock, semantics for us.

        ``canonical`` lets several versions of one CRD share a single object store.
        """
        res = spec.resource
        self._specs[res] = spec
        self._canonical[res] = canonical or res
        self.resources[res] = info or kmock.ResourceInfo(
            namespaced=spec.namespaced,
            kind=spec.kind,
            singular=spec.kind.lower(),
            verbs=set(ALL_VERBS),
            subresources={"status"} if spec.status_subresource else set(),
        )

    def resolve(self, plural: str) -> ResourceSpec:
        """Find a served resource by ``plural``, ``plural.group``, ``group/version/plural`` or kind."""
        if "/" in plural:
            parsed = kmock.resource(plural)
            for spec in self._specs.values():
                if parsed.check(spec.resource):
                    return spec
        candidates = [
            spec
            for spec in self._specs.values()
            if plural in (spec.plural, f"{spec.plural}.{spec.group}", spec.kind, f"{spec.plural}.{spec.version}")
        ]
        candidates.sort(key=lambda s: (s.group != "", self._canonical[s.resource] != s.resource))
        if not candidates:
            raise KeyError(f"Resource {plural!r} is not served by the emulator.")
        return candidates[0]

    def url_for(
        self, plural: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The API path of a collection, an object or its subresource."""
        spec = self.resolve(plural)
        base = f"/apis/{spec.group}/{spec.version}" if spec.group else f"/api/{spec.version}"
        ns = f"/namespaces/{namespace}" if spec.namespaced and namespace else ""
        tail = "".join(f"/{part}" for part in (name, subresource) if part)
        return f"{base}{ns}/{spec.plural}{tail}"

    def get_object(self, plural: str, namespace: str | None, name: str) -> JSON | None:
        """The current state of an object (a deep copy), or None if absent."""
        spec = self.resolve(plural)
        obj = self._current(self._canonical[spec.resource], namespace if spec.namespaced else None, name)
        return None if obj is None else copy.deepcopy(self._present(obj, spec))

    def list_objects(self, plural: str, namespace: str | None = None) -> list[JSON]:
        """Current objects of a resource (all namespaces unless given), sorted by namespace/name."""
        spec = self.resolve(plural)
        return [
            copy.deepcopy(self._present(obj, spec))
            for obj in self._select(self._canonical[spec.resource], namespace, {})
        ]

    @property
    def resource_version(self) -> int:
        """The current global resourceVersion counter."""
        return self._rv

    async def put_status(
        self, plural: str, namespace: str | None, name: str, status: JSON, *, replace: bool = False
    ) -> JSON:
        """Write ``.status`` as a controller would: a real HTTP PATCH to ``/status``.

        It goes through stamping and the watch log, so watchers see MODIFIED. By default it is a
        merge patch (``None`` values delete keys); ``replace=True`` replaces the whole status.
        Harness writes are excluded from the write accounting.
        """
        url = self.url_for(plural, namespace, name, "status")
        if replace:
            body: Any = [{"op": "add", "path": "/status", "value": status}]
            content_type = "application/json-patch+json"
        else:
            body, content_type = {"status": status}, "application/merge-patch+json"
        headers = {"Content-Type": content_type, HARNESS_HEADER: "true"}
        async with self.patch(url, data=json.dumps(body), headers=headers) as response:
            payload: JSON = await response.json()
            if response.status >= 400:
                raise ApiError(response.status, payload.get("message", ""), payload.get("reason"))
            return payload

    def inject_failures(
        self,
        status: int = 500,
        times: int = 1,
        methods: Iterable[str] | None = None,
        resource: str | None = None,
        subresource: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
    ) -> FaultRule:
        """Make the next ``times`` matching requests fail with ``status`` without applying them.

        ``methods`` defaults to the write methods. ``resource`` is a plural (None: any).
        ``subresource=None`` matches any; ``''`` only the main resource; ``'status'`` only status.
        """
        rule = FaultRule(
            status=status,
            remaining=times,
            methods=frozenset(m.upper() for m in (methods or WRITE_METHODS)),
            plural=resource,
            subresource=subresource,
            namespace=namespace,
            name=name,
        )
        self._faults.append(rule)
        return rule

    def reset_writes(self) -> None:
        """Forget the write accounting (e.g. after the setup phase of a test)."""
        self.writes.clear()
        self.writes_by_method.clear()
        self.write_log.clear()

    def write_count(
        self,
        plural: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
        *,
        method: str | None = None,
    ) -> int:
        """How many write requests matched the given filters (None means any)."""
        return sum(
            1
            for rec in self.write_log
            if (plural is None or rec.key.plural == plural)
            and (namespace is None or rec.key.namespace == namespace)
            and (name is None or rec.key.name == name)
            and (method is None or rec.method == method.upper())
        )

    def close_watches(self) -> None:
        """End all watch streams now (before the server shuts down, so it need not wait)."""
        self._closed = True
        self._wake()

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close_watches()
        await super().__aexit__(*exc_info)

    # ---------------------------------------------------------------- discovery fixes

    async def _serve_version(self, request: kmock.Request) -> Any:
        # kmock renders the core group as "/v1" (Kubernetes: "v1") and copies short names onto
        # subresources, which makes kubectl warn that "um" may also mean "universalmodels/status".
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and str(payload.get("groupVersion", "")).startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]
        for entry in payload.get("resources", []) if isinstance(payload, dict) else []:
            if "/" in entry.get("name", ""):
                entry.update(shortNames=[], categories=[], singularName="", verbs=["get", "patch", "update"])
            else:
                entry["verbs"] = sorted(entry.get("verbs", []))
        return payload

    async def _serve_apis(self, request: kmock.Request) -> Any:
        # Prefer the storage version of multi-version CRDs (kmock picks an arbitrary one).
        payload = await super()._serve_apis(request)
        for group in payload.get("groups", []):
            self._prefer_storage(group)
        return payload

    async def _serve_group(self, request: kmock.Request) -> Any:
        payload = await super()._serve_group(request)
        self._prefer_storage(payload)
        return payload

    def _prefer_storage(self, group: JSON) -> None:
        storage = {canon.version for res, canon in self._canonical.items() if res.group == group.get("name")}
        versions = sorted(group.get("versions", []), key=lambda v: v["version"] not in storage)
        if versions:
            group["versions"] = versions
            group["preferredVersion"] = versions[0]

    # ---------------------------------------------------------------- request parsing

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Same as kmock's entry point, but with a URL parser that knows core ``namespaces``.

        kmock's parser fails on ``/api/v1/namespaces`` and reads ``/api/v1/namespaces/x`` as
        "namespace x, no resource"; real clients (kubectl, kopf) use both.
        """
        await raw_request.read()
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            request = await self._parse_request(raw_request, id=len(self._requests))
            self._requests.append(request)
            try:
                response = await self._handle(request)
                if not self.keep_alive and not response.prepared:
                    response.force_close()
                return response
            except _rendering.StreamingError as e:
                raw_response = e.args[0]
                raise e.__cause__ or e from None
        except Exception as e:
            if not self._errors:
                raise
            self._errors[-1].append(e)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    @staticmethod
    async def _parse_request(raw_request: aiohttp.web.BaseRequest, *, id: int) -> kmock.Request:
        body = await raw_request.read()
        text = await raw_request.text()
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            data = None
        parsed = parse_api_path(raw_request.path)
        resource = (
            None
            if parsed.group is None
            else kmock.resource(group=parsed.group, version=parsed.version, plural=parsed.plural)
        )
        action = _parsing.guess_k8s(parsed, kmock.method(raw_request.method), dict(raw_request.query))
        return kmock.Request(
            id=id,
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            data=data,
            body=body,
            text=text,
            action=action,
            resource=resource,
            namespace=parsed.namespace,
            name=parsed.name,
            subresource=parsed.subresource,
        )

    # ---------------------------------------------------------------- request dispatch

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or request.subresource == "watch":
            return await super()._handle(request)
        spec = self._specs.get(res)
        method = str(request.method.value).upper()
        key = WriteKey(res.plural, request.namespace, request.name or self._body_name(request), request.subresource)
        harness = bool(self._header(request, HARNESS_HEADER))
        if not harness:
            verb = rbac_verb(method, request.name, request.params, request.subresource)
            sub = None if request.subresource == "watch" else request.subresource
            self.access_log.append(Access(verb, res.group or "", res.plural, sub, request.namespace))
        try:
            if spec is None:
                if res not in self.resources:
                    raise ApiError(404, "the server could not find the requested resource")
                return await super()._handle(request)  # declared via kmock directly: kmock's semantics
            for rule in self._faults:
                if rule.matches(method, key):
                    rule.remaining -= 1
                    raise ApiError(rule.status, f"Injected failure ({rule.status}) for {method} {request.url.path}")
            response = await self._dispatch(request, spec, method)
        except ApiError as e:
            response = _json_response(status_body(e.code, e.message, e.reason, e.details), status=e.code)
        if method in WRITE_METHODS and not harness:
            self.writes[key] += 1
            self.writes_by_method[method] += 1
            self.write_log.append(WriteRecord(method, key, self._header(request, "Content-Type"), response.status))
        return response

    async def _dispatch(self, request: kmock.Request, spec: ResourceSpec, method: str) -> aiohttp.web.StreamResponse:
        params = request.params
        name, sub = request.name, request.subresource
        if sub not in (None, "status") or (sub == "status" and not spec.status_subresource):
            raise ApiError(404, "the server could not find the requested resource")
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(request, spec)
        if method == "GET":
            payload = self._fetch(spec, request) if name else self._list(spec, request)
            if "as=Table" in self._header(request, "Accept"):
                payload = self._table(spec, payload, request)
            return _json_response(payload)
        if method == "POST" and name is None:
            return _json_response(self._create(spec, request.namespace, self._body(request)), status=201)
        if method == "DELETE" and name is None:
            return _json_response(self._delete_collection(spec, request))
        if name is None:
            raise ApiError(405, f"{method} is not supported on a collection", "MethodNotAllowed")
        if method == "DELETE":
            return _json_response(self._delete(spec, request.namespace, name, self._body(request)))
        if method == "PUT":
            return _json_response(self._update(spec, request, "put"))
        if method == "PATCH":
            content_type = self._header(request, "Content-Type").split(";")[0].strip()
            if content_type == "application/apply-patch+yaml":
                status, obj = self._apply(spec, request)
                return _json_response(obj, status=status)
            kinds = {
                "application/merge-patch+json": "merge",
                "application/strategic-merge-patch+json": "strategic",
                "application/json-patch+json": "json",
            }
            if content_type not in kinds:
                raise ApiError(
                    415, f"the body of the request was in an unknown format: {content_type}", "UnsupportedMediaType"
                )
            return _json_response(self._update(spec, request, kinds[content_type]))
        raise ApiError(405, f"{method} is not supported", "MethodNotAllowed")

    # ---------------------------------------------------------------- request parsing helpers

    @staticmethod
    def _header(request: kmock.Request, name: str) -> str:
        raw = request._raw_request
        if raw is not None:
            return str(raw.headers.get(name, ""))
        return next((str(v) for k, v in request.headers.items() if k.lower() == name.lower()), "")

    @staticmethod
    def _body(request: kmock.Request) -> Any:
        if isinstance(request.data, dict | list):
            return request.data
        if not request.text.strip():
            return None
        try:
            return yaml.safe_load(request.text)
        except yaml.YAMLError as e:
            raise ApiError(400, f"cannot parse the request body: {e}") from e

    def _body_name(self, request: kmock.Request) -> str | None:
        if request.method.value.upper() != "POST" or not isinstance(request.data, dict):
            return None
        meta = request.data.get("metadata") or {}
        return meta.get("name") or meta.get("generateName")

    # ---------------------------------------------------------------- store primitives

    def _key_ns(self, spec: ResourceSpec, namespace: str | None) -> str | None:
        return namespace if spec.namespaced else None

    def _current(self, canon: kmock.resource, namespace: str | None, name: str) -> JSON | None:
        key = (canon, namespace, name)
        if key not in self._objects:
            return None
        obj = self._objects[key]
        return None if obj.deleted else obj.raw

    def _select(
        self, canon: kmock.resource, namespace: str | None, params: Mapping[str, str], name: str | None = None
    ) -> list[JSON]:
        predicate = self._predicate(params, name)
        found = [
            obj.raw
            for (res, ns, _), obj in self._objects.items()
            if res == canon and not obj.deleted and (namespace is None or ns == namespace)
        ]
        found = [obj for obj in found if predicate(obj)]
        found.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return found

    @staticmethod
    def _predicate(params: Mapping[str, str], name: str | None = None) -> Callable[[Mapping[str, Any]], bool]:
        labels = parse_label_selector(params.get("labelSelector", ""))
        fields = parse_field_selector(params.get("fieldSelector", ""))
        return lambda obj: (
            (name is None or obj.get("metadata", {}).get("name") == name)
            and labels(obj.get("metadata", {}).get("labels") or {})
            and fields(obj)
        )

    def _present(self, obj: JSON, spec: ResourceSpec) -> JSON:
        """Render a stored object for the requested version (only apiVersion differs)."""
        if obj.get("apiVersion") == spec.api_version:
            return obj
        return dict(obj, apiVersion=spec.api_version)

    def _wake(self) -> None:
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    def _commit(self, spec: ResourceSpec, new: JSON, event: str) -> JSON:
        """Stamp a new resourceVersion, store the object (or its deletion) and log the watch event."""
        canon = self._canonical[spec.resource]
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        key = (canon, new["metadata"].get("namespace"), new["metadata"]["name"])
        if event == "DELETED":
            self._objects[key].delete()
            self._managers.pop(key, None)
        elif key in self._objects:
            self._objects[key].history.append(new)
        else:
            self._objects[key] = new
        self._log.setdefault(canon, []).append(_Event(self._rv, event, new))
        self._log_rvs.setdefault(canon, []).append(self._rv)
        self._wake()
        if (
            event != "DELETED"
            and canon.group == "apiextensions.k8s.io"
            and canon.plural == ("customresourcedefinitions")
        ):
            self._register_crd_object(new)
        return new

    # ---------------------------------------------------------------- reads

    def _fetch(self, spec: ResourceSpec, request: kmock.Request) -> JSON:
        assert request.name is not None
        obj = self._current(self._canonical[spec.resource], self._key_ns(spec, request.namespace), request.name)
        if obj is None:
            raise self._not_found(spec, request.name)
        return self._present(obj, spec)

    def _list(self, spec: ResourceSpec, request: kmock.Request) -> JSON:
        items = self._select(self._canonical[spec.resource], request.namespace, request.params)
        return {
            "apiVersion": spec.api_version,
            "kind": spec.list_kind or f"{spec.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": [self._present(obj, spec) for obj in items],
        }

    def _table(self, spec: ResourceSpec, payload: JSON, request: kmock.Request) -> JSON:
        """Server-side printing as the apiextensions table convertor does it."""
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
        include = request.params.get("includeObject", "Metadata")
        rows = []
        for obj in items:
            meta = obj.get("metadata", {})
            cells: list[Any] = [meta.get("name")] + [_cell(c, obj) for c in columns]
            if not has_age:
                cells.append(_age(meta.get("creationTimestamp")))
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
            "metadata": {"resourceVersion": payload.get("metadata", {}).get("resourceVersion", str(self._rv))},
            "columnDefinitions": definitions,
            "rows": rows,
        }

    async def _watch(self, request: kmock.Request, spec: ResourceSpec) -> aiohttp.web.StreamResponse:
        """Stream watch events: initial ADDED (or a replay after ``resourceVersion``), then live ones."""
        assert request._raw_request is not None
        params = request.params
        canon = self._canonical[spec.resource]
        predicate = self._predicate(params, request.name)
        since = params.get("resourceVersion", "")
        initial = params.get("sendInitialEvents") == "true"
        if since and not since.isdigit():
            raise ApiError(400, f"invalid resourceVersion: {since!r}")

        # Snapshot synchronously (no awaits) so that nothing slips between the snapshot & the log.
        queue: list[JSON] = []
        log = self._log.setdefault(canon, [])
        rvs = self._log_rvs.setdefault(canon, [])
        if initial or not since or since == "0":
            ns = request.namespace if spec.namespaced else None
            queue = [
                {"type": "ADDED", "object": self._present(obj, spec)}
                for obj in self._select(canon, ns, params, request.name)
            ]
            cursor = len(log)
            if initial:
                queue.append(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": spec.kind,
                            "apiVersion": spec.api_version,
                            "metadata": {
                                "resourceVersion": str(self._rv),
                                "annotations": {"k8s.io/initial-events-end": "true"},
                            },
                        },
                    }
                )
        else:
            cursor = bisect.bisect_right(rvs, int(since))

        timeout = params.get("timeoutSeconds")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout) if timeout else None
        response = aiohttp.web.StreamResponse(status=200)
        response.content_type = "application/json"
        await response.prepare(request._raw_request)
        transport = request._raw_request.transport
        try:
            while True:
                while cursor < len(log):
                    event = log[cursor]
                    cursor += 1
                    obj = event.obj
                    if (
                        request.namespace is None
                        or not spec.namespaced
                        or obj["metadata"].get("namespace") == request.namespace
                    ) and predicate(obj):
                        queue.append({"type": event.type, "object": self._present(obj, spec)})
                if queue:
                    await response.write(b"".join(json.dumps(item).encode() + b"\n" for item in queue))
                    queue = []
                    continue  # more may have arrived while writing
                if self._closed or transport is None or transport.is_closing():
                    break
                wait = self.watch_poll_interval
                if deadline is not None:
                    wait = min(wait, deadline - loop.time())
                    if wait <= 0:
                        break
                wakeup = self._wakeup
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), timeout=wait)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away; nothing to tell it
        return response

    # ---------------------------------------------------------------- writes

    def _not_found(self, spec: ResourceSpec, name: str) -> ApiError:
        res = f"{spec.plural}.{spec.group}" if spec.group else spec.plural
        return ApiError(
            404, f'{res} "{name}" not found', "NotFound", {"name": name, "group": spec.group, "kind": spec.plural}
        )

    def _conflict(self, spec: ResourceSpec, name: str, why: str) -> ApiError:
        res = f"{spec.plural}.{spec.group}" if spec.group else spec.plural
        return ApiError(
            409,
            f'Operation cannot be fulfilled on {res} "{name}": {why}',
            "Conflict",
            {"name": name, "group": spec.group, "kind": spec.plural},
        )

    def _create(self, spec: ResourceSpec, namespace: str | None, body: Any) -> JSON:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "metadata.name: Required value: name or generateName is required")
            meta["name"] = f"{meta['generateName']}{_generated_suffix()}"
        if spec.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        canon = self._canonical[spec.resource]
        if self._current(canon, meta.get("namespace"), meta["name"]) is not None:
            res = f"{spec.plural}.{spec.group}" if spec.group else spec.plural
            raise ApiError(
                409,
                f'{res} "{meta["name"]}" already exists',
                "AlreadyExists",
                {"name": meta["name"], "group": spec.group, "kind": spec.plural},
            )
        obj["apiVersion"] = self._specs[canon].api_version
        obj["kind"] = spec.kind
        if spec.status_subresource:
            obj.pop("status", None)
            if spec.plural == "namespaces" and not spec.group:
                obj["status"] = {"phase": "Active"}
        for system_key in (*_SYSTEM_META, "resourceVersion", "managedFields"):
            meta.pop(system_key, None)
        obj = self._admit(spec, obj, None)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        meta["generation"] = 1
        return self._present(self._commit(spec, obj, "ADDED"), spec)

    def _admit(self, spec: ResourceSpec, obj: JSON, old: JSON | None) -> JSON:
        """Admission of an InferenceService write (see :func:`tests.support.admission.admit`)."""
        if self.admission is None or (spec.group, spec.plural) != ("serving.kserve.io", "inferenceservices"):
            return obj
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            return obj  # finalizer bookkeeping on the way out
        try:
            return _admission.admit(obj, old, self.admission)
        except _admission.Denied as denied:
            # A webhook's Status carries no details (apiserver webhook/errors/statuserror.go ToStatusErr).
            raise ApiError(denied.code, denied.message, denied.reason) from None

    def _update(self, spec: ResourceSpec, request: kmock.Request, kind: str) -> JSON:
        assert request.name is not None
        namespace = self._key_ns(spec, request.namespace)
        old = self._current(self._canonical[spec.resource], namespace, request.name)
        if old is None:
            raise self._not_found(spec, request.name)
        body = self._body(request)
        if kind == "json":
            if not isinstance(body, list):
                raise ApiError(400, "a JSON patch must be a list of operations")
            try:
                candidate = jsonpatch.apply_patch(copy.deepcopy(old), body)
            except jsonpatch.JsonPatchTestFailed as e:
                raise ApiError(
                    422, f"the server rejected our request due to an error in our request: {e}", "Invalid"
                ) from e
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                raise ApiError(
                    422, f"the server rejected our request due to an error in our request: {e}", "Invalid"
                ) from e
        else:
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be an object")
            self._check_rv(spec, old, body)
            if kind == "put":
                candidate = copy.deepcopy(body)
            else:
                candidate = merge_patch(old, _strip_directives(body) if kind == "strategic" else body)
        return self._finish_update(spec, old, candidate, request.subresource)

    def _check_rv(self, spec: ResourceSpec, old: JSON, body: JSON) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and str(wanted) != old["metadata"]["resourceVersion"]:
            raise self._conflict(
                spec,
                old["metadata"]["name"],
                "the object has been modified; please apply your changes to the latest version and try again",
            )

    def _finish_update(self, spec: ResourceSpec, old: JSON, candidate: Any, sub: str | None) -> JSON:
        """Apply the subresource rules & system fields, skip no-ops, commit, finalize if released."""
        if not isinstance(candidate, dict):
            raise ApiError(422, "the patched object is not an object")
        if sub == "status":
            new = copy.deepcopy(old)
            if candidate.get("status") is None:
                new.pop("status", None)
            else:
                new["status"] = candidate["status"]
        else:
            new = candidate
            if spec.status_subresource:
                new.pop("status", None)
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
        meta = new.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(422, "metadata must be an object")
        old_meta = old["metadata"]
        meta["name"] = old_meta["name"]
        if "namespace" in old_meta:
            meta["namespace"] = old_meta["namespace"]
        for system_key in _SYSTEM_META:
            if system_key in old_meta:
                meta[system_key] = old_meta[system_key]
            else:
                meta.pop(system_key, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        meta.pop("managedFields", None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if sub is None:
            new = self._admit(spec, new, old)
            meta = new["metadata"]
        if new == old:
            return self._present(old, spec)  # a no-op write: no new version, no watch event (as in k8s)
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }:
            meta["generation"] = int(old_meta.get("generation", 0)) + 1
        committed = self._commit(spec, new, "MODIFIED")
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._hard_delete(spec, committed)
        return self._present(committed, spec)

    def _apply(self, spec: ResourceSpec, request: kmock.Request) -> tuple[int, JSON]:
        """Server-side apply (subset): create if absent; else merge with per-manager field removal."""
        assert request.name is not None
        manager = request.params.get("fieldManager")
        if not manager:
            raise ApiError(
                422, 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch'
            )
        force = request.params.get("force") == "true"
        applied = self._body(request)
        if not isinstance(applied, dict):
            raise ApiError(400, "the apply body must be an object")
        sub = request.subresource
        namespace = self._key_ns(spec, request.namespace)
        canon = self._canonical[spec.resource]
        obj_key = (canon, namespace, request.name)
        old = self._current(canon, namespace, request.name)
        if sub == "status":
            scoped: JSON = {"status": applied["status"]} if "status" in applied else {}
        else:
            scoped = {k: v for k, v in applied.items() if not (k == "status" and spec.status_subresource)}
        types = {**META_LIST_TYPES, **spec.list_types}
        new_paths = {p for p in _leaf_paths(scoped, types=types) if p not in _SSA_IGNORED}
        if old is None:
            if sub == "status":
                raise self._not_found(spec, request.name)
            body = copy.deepcopy(applied)
            body.setdefault("metadata", {})["name"] = request.name
            created = self._create(spec, namespace, body)
            self._managers[obj_key] = {(manager, None): new_paths}
            return 201, created

        self._check_rv(spec, old, applied)
        managers = self._managers.setdefault(obj_key, {})
        owner = (manager, sub)
        conflicts: list[str] = []
        for other, paths in managers.items():
            if other == owner or other[1] != sub:
                continue
            for path in paths & new_paths:
                if path[-1].startswith(("k:", "v:")):
                    continue  # an item's or a value's presence is shared, never a conflict
                if _get_path(old, path) != _get_path(scoped, path):
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
        candidate = apply_merge(candidate, scoped, types)
        managers[owner] = new_paths
        return 200, self._finish_update(spec, old, candidate, sub)

    def _delete(self, spec: ResourceSpec, namespace: str | None, name: str, options: Any) -> JSON:
        options = options if isinstance(options, dict) else {}
        canon = self._canonical[spec.resource]
        old = self._current(canon, self._key_ns(spec, namespace), name)
        if old is None:
            raise self._not_found(spec, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != old["metadata"].get("uid"):
            raise self._conflict(spec, name, "Precondition failed: UID in precondition does not match")
        if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise self._conflict(spec, name, "Precondition failed: ResourceVersion does not match")
        return self._present(self._begin_delete(spec, old, cascade=options.get("propagationPolicy") != "Orphan"), spec)

    def _begin_delete(self, spec: ResourceSpec, old: JSON, *, cascade: bool = True) -> JSON:
        meta = old["metadata"]
        if meta.get("deletionTimestamp"):
            return old
        if meta.get("finalizers"):
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = rfc3339()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            new["metadata"]["generation"] = int(meta.get("generation", 0)) + 1
            return self._commit(spec, new, "MODIFIED")
        return self._hard_delete(spec, old, cascade=cascade)

    def _hard_delete(self, spec: ResourceSpec, obj: JSON, *, cascade: bool = True) -> JSON:
        gone = copy.deepcopy(obj)
        self._commit(spec, gone, "DELETED")
        if cascade:
            self._collect_garbage(gone["metadata"].get("uid"))
        return gone

    def _collect_garbage(self, owner_uid: str | None) -> None:
        """Background-cascade: delete dependents whose owners are all gone (recursively)."""
        if not owner_uid:
            return
        live_uids = {obj.raw["metadata"].get("uid") for obj in self._objects.values() if not obj.deleted}
        dependents: list[tuple[ResourceSpec, JSON]] = []
        for (canon, _, _), stored in list(self._objects.items()):
            if stored.deleted:
                continue
            obj = stored.raw
            owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
            if owner_uid in owners and not owners & live_uids and canon in self._specs:
                dependents.append((self._specs[canon], obj))
        for spec, obj in dependents:
            current = self._current(
                self._canonical[spec.resource], obj["metadata"].get("namespace"), obj["metadata"]["name"]
            )
            if current is not None:
                self._begin_delete(spec, current)

    def _delete_collection(self, spec: ResourceSpec, request: kmock.Request) -> JSON:
        canon = self._canonical[spec.resource]
        items = [self._begin_delete(spec, obj) for obj in self._select(canon, request.namespace, request.params)]
        return {
            "apiVersion": spec.api_version,
            "kind": spec.list_kind or f"{spec.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": [self._present(obj, spec) for obj in items],
        }

    # ---------------------------------------------------------------- CRDs

    def _register_crd_object(self, crd: Mapping[str, Any]) -> None:
        """Serve the custom resource described by a CRD (called for stored CRD objects too)."""
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
        if not (group and plural and kind):
            return
        versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
        storage = next((v["name"] for v in versions if v.get("storage")), versions[0]["name"] if versions else None)
        if storage is None:
            return
        canonical = kmock.resource(group, storage, plural)
        for version in sorted(versions, key=lambda v: v["name"] != storage):
            status = "status" in (version.get("subresources") or spec.get("subresources") or {})
            columns = tuple(
                PrinterColumn(
                    name=c["name"],
                    type=c.get("type", "string"),
                    json_path=c["jsonPath"],
                    format=c.get("format", ""),
                    description=c.get("description", ""),
                    priority=int(c.get("priority", 0)),
                )
                for c in version.get("additionalPrinterColumns") or spec.get("additionalPrinterColumns") or []
            )
            res_spec = ResourceSpec(
                group=group,
                version=version["name"],
                plural=plural,
                kind=kind,
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                status_subresource=status,
                printer_columns=columns,
                list_kind=names.get("listKind", f"{kind}List"),
                list_types=schema_list_types((version.get("schema") or {}).get("openAPIV3Schema")),
            )
            info = kmock.ResourceInfo(
                namespaced=res_spec.namespaced,
                kind=kind,
                singular=names.get("singular") or kind.lower(),
                verbs=set(ALL_VERBS),
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources={"status"} if status else set(),
            )
            self.register_resource(res_spec, info, canonical=canonical)


# --------------------------------------------------------------------------------------------------
# Registration helpers
# --------------------------------------------------------------------------------------------------


def register_crd(emulator: KubeEmulator, crd: Mapping[str, Any]) -> None:
    """Serve a custom resource from an ``apiextensions.k8s.io/v1`` CRD dict.

    The CRD object itself is also stored (with a watch event) when ``customresourcedefinitions``
    is served (see :func:`register_builtins`), as kopf and kubectl may look at it.
    """
    emulator._register_crd_object(crd)
    crd_res = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    crd_spec = emulator._specs.get(crd_res)
    name = (crd.get("metadata") or {}).get("name")
    if crd_spec is not None and name and emulator._current(crd_res, None, name) is None:
        emulator._create(crd_spec, None, copy.deepcopy(dict(crd)))


_BUILTINS: dict[str, tuple[str, bool, bool]] = {
    # resource: (kind, namespaced, status subresource)
    "v1/namespaces": ("Namespace", False, True),
    "v1/events": ("Event", True, False),
    "events.k8s.io/v1/events": ("Event", True, False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, True),
    "v1/configmaps": ("ConfigMap", True, False),
    "v1/secrets": ("Secret", True, False),
    "v1/serviceaccounts": ("ServiceAccount", True, False),
    "v1/services": ("Service", True, True),
    "v1/pods": ("Pod", True, True),
    "discovery.k8s.io/v1/endpointslices": ("EndpointSlice", True, False),
}


#: Lists of the built-in kinds that merge by key under server-side apply (k8s.io/api core/v1 types.go:
#: ServiceAccount.secrets ``patchMergeKey=name``; imagePullSecrets is atomic).
_BUILTIN_LIST_TYPES: dict[str, dict[Path_, ListType]] = {
    "v1/serviceaccounts": {("secrets",): ("map", ("name",))},
}


def register_builtins(emulator: KubeEmulator, *, default_namespace: bool = True) -> None:
    """Serve what kopf and kubectl need: namespaces, both events APIs, CRDs (+ a few common kinds).

    Discovery details (short names, verbs) come from kmock's bundled K3s discovery data.
    """
    bundled = kmock.ResourcesArray()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # kmock uses importlib.resources.read_binary
        bundled.load_bundled()
    for name, (kind, namespaced, status) in _BUILTINS.items():
        res = kmock.resource(name)
        info: kmock.ResourceInfo | None = None
        if res in bundled:  # keep only the subresources we emulate
            known = bundled[res]
            info = kmock.ResourceInfo(
                namespaced=namespaced,
                kind=kind,
                singular=known.singular,
                verbs=set(known.verbs) or set(ALL_VERBS),
                shortnames=set(known.shortnames),
                categories=set(known.categories),
                subresources={"status"} if status else set(),
            )
        group, version, plural = name.rsplit("/", 2) if name.count("/") == 2 else ("", *name.split("/"))
        emulator.register_resource(
            ResourceSpec(
                group=group,
                version=version,
                plural=plural,
                kind=kind,
                namespaced=namespaced,
                status_subresource=status,
                list_types=_BUILTIN_LIST_TYPES.get(name, {}),
            ),
            info,
        )
    if default_namespace:
        emulator._create(emulator.resolve("namespaces"), None, {"metadata": {"name": "default"}})


def register_inference_services(emulator: KubeEmulator) -> None:
    """Serve KServe's ``serving.kserve.io/v1beta1`` InferenceService (shortname ``isvc``)."""
    register_crd(
        emulator,
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "inferenceservices.serving.kserve.io"},
            "spec": {
                "group": "serving.kserve.io",
                "scope": "Namespaced",
                "names": {
                    "plural": "inferenceservices",
                    "singular": "inferenceservice",
                    "kind": "InferenceService",
                    "listKind": "InferenceServiceList",
                    "shortNames": ["isvc"],
                },
                "versions": [
                    {
                        "name": "v1beta1",
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "additionalPrinterColumns": [
                            {"name": "URL", "type": "string", "jsonPath": ".status.url"},
                            {
                                "name": "Ready",
                                "type": "string",
                                "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
                            },
                            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                        ],
                    }
                ],
            },
        },
    )


# --------------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------------


@dataclass
class ServedEmulator:
    """A running emulator with its URL, a kubeconfig file, and a non-blocking ``kubectl`` runner."""

    emulator: KubeEmulator
    url: str
    kubeconfig: Path
    cache_dir: Path
    kubectl_timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)

    async def kubectl(
        self, *args: str, input: str | None = None, check: bool = False, limit_s: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against the emulator without blocking the serving event loop."""
        argv = ["kubectl", f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.cache_dir}", *args]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.env},
        )
        try:
            stdout, stderr = await asyncio.wait_for(
                proc.communicate(input.encode() if input is not None else None), timeout=limit_s or self.kubectl_timeout
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        result = subprocess.CompletedProcess(argv, proc.returncode or 0, stdout.decode(), stderr.decode())
        if check:
            result.check_returncode()
        return result


def write_kubeconfig(path: Path, url: str, *, namespace: str = "default", token: str = "emulator-token") -> Path:
    """A kubeconfig pointing at ``url`` with a bearer token (plain http: no TLS settings needed)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emulator",
        "preferences": {},
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "emulator", "user": {"token": token}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.asynccontextmanager
async def serve_emulator(
    tmp_path: Path,
    *,
    crds: Sequence[Mapping[str, Any]] = (),
    inference_services: bool = True,
    emulator: KubeEmulator | None = None,
    admission: _admission.Cluster | None = _admission.DEFAULT_CLUSTER,
) -> AsyncIterator[ServedEmulator]:
    """Start an emulator (builtins, optional CRDs, KServe) on a random loopback port; write a kubeconfig.

    InferenceService writes pass ``admission`` (default: KServe 0.16 with a default Knative install);
    None serves them unchecked. An emulator passed in keeps an admission it already has.
    """
    emulator = emulator if emulator is not None else KubeEmulator()
    if emulator.admission is None:
        emulator.admission = admission
    if not emulator._specs:
        register_builtins(emulator)
        if inference_services:
            register_inference_services(emulator)
        for crd in crds:
            register_crd(emulator, crd)
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = await asyncio.to_thread(write_kubeconfig, tmp_path / "kubeconfig", url)
        served = ServedEmulator(emulator=emulator, url=url, kubeconfig=kubeconfig, cache_dir=tmp_path / "kube-cache")
        try:
            yield served
        finally:
            emulator.close_watches()
