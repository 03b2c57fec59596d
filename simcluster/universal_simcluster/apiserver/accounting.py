"""Write accounting, RBAC's view of a request and fault injection: what tests and benchmarks count and break.

Only :func:`rbac_verb` imitates Kubernetes (cited there); the accounting and the injected failures are the harness's
own instruments, with no counterpart in a real API server.
"""

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
    """The RBAC verb the API server checks for a request, as Kubernetes v1.31
    ``staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go`` (NewRequestInfo) derives it: the method's
    verb; a GET without a name is ``list``, or ``watch`` when ``watch`` is any value but ``false``/``0``; the
    deprecated ``/watch/`` path prefix is ``watch``; a DELETE without a name is ``deletecollection``."""
    if method == "GET":
        if subresource == "watch":
            return "watch"
        if name:
            return "get"
        watch = params.get("watch")
        return "watch" if watch is not None and watch.lower() not in ("false", "0") else "list"
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
