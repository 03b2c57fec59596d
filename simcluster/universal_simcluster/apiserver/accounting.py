"""Write accounting, RBAC's view of a request and fault injection: what tests and benchmarks count and break."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


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
