"""What the emulator knows about a served resource beyond kmock's discovery data: its kind, scope, status
subresource, printer columns and the list merge semantics server-side apply uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kmock

JSON = dict[str, Any]
Path_ = tuple[str, ...]

ALL_VERBS = frozenset({"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"})


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
    #: A custom resource's structural schema (its CRD version's ``openAPIV3Schema``): writes are defaulted, pruned and
    #: validated against it (:mod:`.schemas`). None: a built-in kind or a CRD without one, stored as written.
    schema: Mapping[str, Any] | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)


def present(obj: JSON, spec: ResourceSpec) -> JSON:
    """A stored object as served for the requested version (only apiVersion differs)."""
    if obj.get("apiVersion") == spec.api_version:
        return obj
    return dict(obj, apiVersion=spec.api_version)
