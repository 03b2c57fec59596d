"""RBAC for tests: whether rules grant a request, and an API emulator that enforces them.

A request is an :class:`~universal_simcluster.apiserver.Access` (verb, API group, plural, subresource,
namespace), as the emulator records it. Rules are Kubernetes ``PolicyRule`` dicts (``apiGroups``,
``resources`` with ``plural/subresource`` for subresources, ``verbs``; ``*`` matches anything).
``resourceNames`` and ``nonResourceURLs`` are not modelled: a rule carrying either is refused, so a
test cannot pass on a rule this module would misread.

:class:`RbacEmulator` answers 403 (as the API server does, with a ``Forbidden`` Status) to every
request its grants do not allow. It also checks what the emulator's access log cannot show: a
server-side apply that creates its object needs ``create`` besides ``patch`` (Kubernetes' documented
rule for apply), so such a request is checked, and recorded, as both.

It also admits writes as the OwnerReferencesPermissionEnforcement admission plugin does (on by default
in OpenShift and on hardened clusters; ``owner_references_enforced``), imitating kubernetes/kubernetes
plugin/pkg/admission/gc/gc_admission.go (``Validate``, ``ownerRefToDeleteAttributeRecords``,
``newBlockingOwnerDeletionRefs``; the same rules since v1.10, current in v1.28-v1.34): a create or update
that adds an ownerReference with ``blockOwnerDeletion: true`` (or turns it on) is refused 403 unless
the requester may ``update`` the owner's ``finalizers`` subresource; an update that changes
ownerReferences at all also needs ``delete`` on the object itself (a create does not: who may create
an object could have not created it). These checks are recorded as accesses too.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock

from universal_simcluster.apiserver.accounting import Access, rbac_verb
from universal_simcluster.apiserver.emulator import HARNESS_HEADER, KubeEmulator
from universal_simcluster.apiserver.errors import ApiError, status_body
from universal_simcluster.apiserver.resources import JSON, ResourceSpec

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
#: The request being served, while its write is admitted (None for harness requests and internal writes).
_REQUEST: contextvars.ContextVar[kmock.Request | None] = contextvars.ContextVar("rbac_request", default=None)


def _matches(values: Iterable[str], wanted: str) -> bool:
    return any(value in ("*", wanted) for value in values)


def rule_grants(rule: Mapping[str, Any], access: Access) -> bool:
    """Whether one PolicyRule grants the request (namespace scope is the binding's business)."""
    unsupported = {"resourceNames", "nonResourceURLs"} & set(rule)
    if unsupported:
        raise ValueError(
            f"rule {dict(rule)} uses {sorted(unsupported)}, which universal_simcluster.apiserver.rbac does not model"
        )
    resource = f"{access.plural}/{access.subresource}" if access.subresource else access.plural
    resources = rule.get("resources") or []
    resource_ok = _matches(resources, resource) or (
        access.subresource is not None and f"*/{access.subresource}" in resources
    )
    return (
        _matches(rule.get("verbs") or [], access.verb)
        and _matches(rule.get("apiGroups") or [], access.group)
        and (resource_ok)
    )


@dataclass(frozen=True)
class Grant:
    """Rules bound to a subject: everywhere (``namespace=None``, a ClusterRoleBinding) or in one namespace."""

    rules: tuple[Mapping[str, Any], ...]
    namespace: str | None = None

    def allows(self, access: Access) -> bool:
        # A RoleBinding grants nothing cluster-scoped and nothing across all namespaces.
        in_scope = self.namespace is None or self.namespace == access.namespace
        return in_scope and any(rule_grants(rule, access) for rule in self.rules)


def allows(grants: Iterable[Grant], access: Access) -> bool:
    return any(grant.allows(access) for grant in grants)


def grants_for(objects: Sequence[Mapping[str, Any]], service_account: str, namespace: str) -> list[Grant]:
    """The grants rendered manifests give one ServiceAccount, resolved through their (Cluster)RoleBindings.

    A binding naming a role that the manifests do not contain grants nothing (as on a cluster without it).
    """
    roles: dict[tuple[str, str | None, str], Mapping[str, Any]] = {}
    for obj in objects:
        if obj.get("kind") in ("Role", "ClusterRole"):
            meta = obj["metadata"]
            scope = meta.get("namespace") if obj["kind"] == "Role" else None
            roles[(obj["kind"], scope, meta["name"])] = obj
    grants = []
    for obj in objects:
        if obj.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = obj.get("subjects") or []
        if not any(
            s.get("kind") == "ServiceAccount" and s.get("name") == service_account and s.get("namespace") == namespace
            for s in subjects
        ):
            continue
        bound_in = obj["metadata"].get("namespace") if obj["kind"] == "RoleBinding" else None
        ref = obj["roleRef"]
        role = roles.get((ref["kind"], bound_in if ref["kind"] == "Role" else None, ref["name"]))
        if role is not None:
            grants.append(Grant(rules=tuple(role.get("rules") or ()), namespace=bound_in))
    return grants


def forbidden(access: Access, user: str) -> aiohttp.web.Response:
    """The 403 the API server answers, with its wording."""
    resource = f"{access.plural}/{access.subresource}" if access.subresource else access.plural
    scope = f'in the namespace "{access.namespace}"' if access.namespace else "at the cluster scope"
    message = (
        f"{resource} is forbidden: User {user!r} cannot {access.verb} resource {resource!r} "
        f'in API group "{access.group}" {scope}'
    )
    body = status_body(403, message, "Forbidden", {"kind": resource, "group": access.group})
    return aiohttp.web.Response(body=json.dumps(body).encode(), status=403, content_type="application/json")


@attrs.define(kw_only=True)
class RbacEmulator(KubeEmulator):
    """The API emulator with RBAC enforced for every non-harness request (harness writes are exempt)."""

    grants: list[Grant] = attrs.field(factory=list)
    user: str = "system:serviceaccount:test:subject"
    #: OwnerReferencesPermissionEnforcement (see the module docstring).
    owner_references_enforced: bool = True
    allowed: list[Access] = attrs.field(factory=list, init=False)
    denied: list[Access] = attrs.field(factory=list, init=False)

    def _accesses(self, request: kmock.Request, res: kmock.resource) -> list[Access]:
        method = str(request.method.value).upper()
        sub = None if request.subresource == "watch" else request.subresource
        access = Access(rbac_verb(method, request.name, request.params, request.subresource), res.group or "",
                        str(res.plural), sub, request.namespace)  # fmt: skip
        accesses = [access]
        is_apply = self._header(request, "Content-Type").startswith(APPLY_CONTENT_TYPE)
        if method == "PATCH" and is_apply and request.name and sub is None:
            try:
                exists = self.get_object(str(res.plural), request.namespace, request.name) is not None
            except KeyError:  # a resource the emulator does not serve: it answers 404 anyway
                exists = True
            if not exists:
                accesses.append(access._replace(verb="create"))
        return accesses

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None or self._header(request, HARNESS_HEADER):
            return await super()._handle(request)
        for access in self._accesses(request, res):
            if not allows(self.grants, access):
                self.denied.append(access)
                return forbidden(access, self.user)
            self.allowed.append(access)
        token = _REQUEST.set(request)  # each request is served in a task of its own: its own context
        try:
            return await super()._handle(request)
        finally:
            _REQUEST.reset(token)

    # -- OwnerReferencesPermissionEnforcement: the store's create and update paths, after RBAC --------

    def _create(self, spec: ResourceSpec, namespace: str | None, body: Any) -> JSON:
        if isinstance(body, dict):
            self._admit_owner_references(spec, namespace, None, body)
        return super()._create(spec, namespace, body)

    def _finish_update(self, spec: ResourceSpec, old: JSON, candidate: Any, sub: str | None) -> JSON:
        if isinstance(candidate, dict) and sub is None:  # status writes keep metadata (the pods/status exemption)
            self._admit_owner_references(spec, old["metadata"].get("namespace"), old, candidate)
        return super()._finish_update(spec, old, candidate, sub)

    def _admit_owner_references(self, spec: ResourceSpec, namespace: str | None, old: JSON | None, new: JSON) -> None:
        request = _REQUEST.get()
        if request is None or not self.owner_references_enforced:
            return
        new_refs = list((new.get("metadata") or {}).get("ownerReferences") or [])
        old_refs = list((old or {}).get("metadata", {}).get("ownerReferences") or [])
        if old is not None and new_refs == old_refs:
            return  # not changing owner references: always allowed
        if old is None and not new_refs:
            return
        name = (new.get("metadata") or {}).get("name") or (old or {}).get("metadata", {}).get("name")
        resource = f"{spec.plural}.{spec.group}" if spec.group else spec.plural
        if old is not None:  # an update changing them: only who may delete the object may set its owners
            self._authorize(Access("delete", spec.group, spec.plural, None, namespace), resource, name,
                            "cannot set an ownerRef on a resource you can't delete")  # fmt: skip
        was_blocking = {ref.get("uid") for ref in old_refs if ref.get("blockOwnerDeletion") is True}
        for ref in new_refs:
            if ref.get("blockOwnerDeletion") is not True or ref.get("uid") in was_blocking:
                continue
            owner = self._owner_spec(ref)
            if owner is None:
                raise ApiError(403, f'{resource} "{name}" is forbidden: cannot set blockOwnerDeletion in this case '
                               f"because cannot find RESTMapping for APIVersion {ref.get('apiVersion')} "
                               f"Kind {ref.get('kind')}", "Forbidden")  # fmt: skip
            access = Access("update", owner.group, owner.plural, "finalizers", namespace if owner.namespaced else None)
            self._authorize(access, resource, name, "cannot set blockOwnerDeletion if an ownerReference refers "
                            "to a resource you can't set finalizers on")  # fmt: skip

    def _owner_spec(self, ref: Mapping[str, Any]) -> ResourceSpec | None:
        """The served resource of an ownerReference's apiVersion and kind (the REST mapping)."""
        group = str(ref.get("apiVersion") or "").rpartition("/")[0]
        return next((s for s in self._specs.values() if s.group == group and s.kind == ref.get("kind")), None)

    def _authorize(self, access: Access, resource: str, name: str | None, why: str) -> None:
        if not allows(self.grants, access):
            self.denied.append(access)
            # The admission plugin's wording: "<resource> \"<name>\" is forbidden: <why>: <reason>, <err>"
            raise ApiError(403, f'{resource} "{name}" is forbidden: {why}: , <nil>', "Forbidden")
        self.allowed.append(access)
