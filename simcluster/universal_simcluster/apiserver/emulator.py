"""The API emulator: kmock's Kubernetes emulator with the API-server semantics of :mod:`universal_simcluster.apiserver`.

This module holds the request handling (dispatch by verb and content type), the object lifecycle (create,
update, graceful deletion with finalizers, background garbage collection) and CRD registration; selectors,
patching and apply, table printing, watch and storage are their own modules beside it.
"""

from __future__ import annotations

import base64
import copy
import json
import secrets
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import parsing as _parsing
from kmock._internal import rendering as _rendering

from universal_simcluster import admission as _admission
from universal_simcluster.apiserver import schemas as _schemas
from universal_simcluster.apiserver.accounting import WRITE_METHODS, Access, FaultRule, WriteKey, WriteRecord, rbac_verb
from universal_simcluster.apiserver.clock import rfc3339
from universal_simcluster.apiserver.errors import ApiError, status_body
from universal_simcluster.apiserver.patch import META_LIST_TYPES, applied_paths, apply_owned, patched, schema_list_types
from universal_simcluster.apiserver.resources import ALL_VERBS, JSON, PrinterColumn, ResourceSpec, present
from universal_simcluster.apiserver.selectors import matcher
from universal_simcluster.apiserver.storage import Key, Store, current, select
from universal_simcluster.apiserver.tables import table
from universal_simcluster.apiserver.watch import serve_watch
from universal_simcluster.apiserver.wire import json_response, parse_api_path

HARNESS_HEADER = "X-Kube-Emulator-Harness"
_SYSTEM_META = ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds")


def _generated_suffix() -> str:
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # same alphabet as k8s' utilrand.String
    return "".join(secrets.choice(alphabet) for _ in range(5))


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the API-server semantics operators rely on (see the package doc)."""

    watch_poll_interval: float = 0.5  # how often idle watches check for a gone client
    # Close connections after each (non-streaming) response. Keep-alive connections keep server-side
    # tasks alive in the shared event loop, and kopf waits 5 s for "hung" tasks when it stops.
    keep_alive: bool = False

    _specs: dict[kmock.resource, ResourceSpec] = attrs.field(factory=dict, init=False)
    _canonical: dict[kmock.resource, kmock.resource] = attrs.field(factory=dict, init=False)
    _store: Store = attrs.field(factory=Store, init=False)
    _faults: list[FaultRule] = attrs.field(factory=list, init=False)
    writes: Counter[WriteKey] = attrs.field(factory=Counter, init=False)
    writes_by_method: Counter[str] = attrs.field(factory=Counter, init=False)
    write_log: list[WriteRecord] = attrs.field(factory=list, init=False)
    access_log: list[Access] = attrs.field(factory=list, init=False)  # every non-harness resource request
    #: Every field a write carried that its CRD's schema lacks and the server dropped: (kind, name, path), what a
    #: real API server answers as ``Warning: unknown field "spec.x"`` (apiextensions-apiserver v1.31
    #: ``pkg/apiserver/customresource_handler.go``: ``PruneWithOptions(..., ReturnPruned)`` gives the unknown field
    #: paths, warned under the default ``fieldValidation=Warn``). Tests assert it stays empty where they should.
    pruned: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
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
        return None if obj is None else copy.deepcopy(present(obj, spec))

    def list_objects(self, plural: str, namespace: str | None = None) -> list[JSON]:
        """Current objects of a resource (all namespaces unless given), sorted by namespace/name."""
        spec = self.resolve(plural)
        return [
            copy.deepcopy(present(obj, spec)) for obj in self._select(self._canonical[spec.resource], namespace, {})
        ]

    @property
    def resource_version(self) -> int:
        """The current global resourceVersion counter."""
        return self._store.rv

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
        self._store.close()

    def compact(self, upto: int | None = None) -> None:
        """Compact the history up to resourceVersion ``upto`` (default: now): resuming a watch or continuing a list
        from before it is then 410 Expired, as on a real cluster after etcd's compaction (every 5 minutes by
        default) or once the watch cache's window has moved on."""
        self._store.compact(upto)

    def expire_watches(self) -> None:
        """End every open watch with an ERROR event, 410 Expired (a watcher the API server dropped)."""
        self._store.expire_watches()

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
        for group in payload.get("groups", []) if isinstance(payload, dict) else []:
            self._prefer_storage(group)
        return payload

    async def _serve_group(self, request: kmock.Request) -> Any:
        payload = await super()._serve_group(request)
        if isinstance(payload, dict):  # kmock's discovery documents are; its type admits any payload
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
            response = json_response(status_body(e.code, e.message, e.reason, e.details), status=e.code)
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
            canon = self._canonical[spec.resource]
            return await serve_watch(
                request, spec, canon, self._store, self._objects, poll_interval=self.watch_poll_interval
            )
        if method == "GET":
            payload = self._fetch(spec, request) if name else self._list(spec, request)
            if "as=Table" in self._header(request, "Accept"):
                payload = table(spec, payload, request.params.get("includeObject", "Metadata"), self._store.rv)
            return json_response(payload)
        if method == "POST" and name is None:
            return json_response(self._create(spec, request.namespace, self._body(request)), status=201)
        if method == "DELETE" and name is None:
            return json_response(self._delete_collection(spec, request))
        if name is None:
            raise ApiError(405, f"{method} is not supported on a collection", "MethodNotAllowed")
        if method == "DELETE":
            return json_response(self._delete(spec, request.namespace, name, self._body(request)))
        if method == "PUT":
            return json_response(self._update(spec, request, "put"))
        if method == "PATCH":
            content_type = self._header(request, "Content-Type").split(";")[0].strip()
            if content_type == "application/apply-patch+yaml":
                status, obj = self._apply(spec, request)
                return json_response(obj, status=status)
            kinds = {
                "application/merge-patch+json": "merge",
                "application/strategic-merge-patch+json": "strategic",
                "application/json-patch+json": "json",
            }
            if content_type not in kinds:
                raise ApiError(
                    415, f"the body of the request was in an unknown format: {content_type}", "UnsupportedMediaType"
                )
            return json_response(self._update(spec, request, kinds[content_type]))
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
        return current(self._objects, (canon, namespace, name))

    def _select(
        self, canon: kmock.resource, namespace: str | None, params: Mapping[str, str], name: str | None = None
    ) -> list[JSON]:
        return select(self._objects, canon, namespace, matcher(params, name))

    def _commit(self, spec: ResourceSpec, new: JSON, event: str) -> JSON:
        """Stamp a new resourceVersion, store the object (or its deletion) and log the watch event."""
        canon = self._canonical[spec.resource]
        key: Key = (canon, new["metadata"].get("namespace"), new["metadata"]["name"])
        self._store.commit(self._objects, key, new, event)
        if event != "DELETED" and (canon.group, canon.plural) == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd_object(new)
        return new

    # ---------------------------------------------------------------- reads

    def _fetch(self, spec: ResourceSpec, request: kmock.Request) -> JSON:
        assert request.name is not None
        obj = self._current(self._canonical[spec.resource], self._key_ns(spec, request.namespace), request.name)
        if obj is None:
            raise self._not_found(spec, request.name)
        return present(obj, spec)

    def _list(self, spec: ResourceSpec, request: kmock.Request) -> JSON:
        """A list, in pages of ``limit`` items when asked (Kubernetes v1.31 storage/etcd3/store.go GetList): sorted by
        namespace and name, ``metadata.continue`` carrying where the next page starts and the first page's
        resourceVersion, ``remainingItemCount`` when no selector filters the list. A continued page lists the objects
        as they are now after that point (etcd lists at the first page's revision; this store keeps no snapshots), and
        a token from before a compaction is 410 Expired, as etcd3's ``compactedContinue`` answers."""
        params = request.params
        items = self._select(self._canonical[spec.resource], request.namespace, params)
        rv = self._store.rv
        token = params.get("continue")
        if token:
            start, rv = _decode_continue(token)
            if self._store.too_old(rv):
                raise ApiError(410, CONTINUE_EXPIRED, "Expired")
            items = [o for o in items if _list_key(o) >= start]
        metadata: JSON = {"resourceVersion": str(rv)}
        limit = params.get("limit", "")
        if limit.isdigit() and 0 < int(limit) < len(items):
            page, rest = items[: int(limit)], items[int(limit) :]
            metadata["continue"] = _encode_continue(_list_key(page[-1]) + "\x00", rv)
            if not params.get("labelSelector") and not params.get("fieldSelector"):
                metadata["remainingItemCount"] = len(rest)
            items = page
        return {
            "apiVersion": spec.api_version,
            "kind": spec.list_kind or f"{spec.kind}List",
            "metadata": metadata,
            "items": [present(obj, spec) for obj in items],
        }

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
        obj = self._structural(spec, obj, None)
        obj = self._admit(spec, obj, None)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        meta["generation"] = 1
        return present(self._commit(spec, obj, "ADDED"), spec)

    def _kserve_objects(self, plural: str) -> list[JSON]:
        """Stored KServe objects of ``plural`` (none when KServe's CRD is not served), in the API's list order."""
        version = "v1alpha1" if plural.startswith("localmodel") else "v1beta1"
        canon = kmock.resource("serving.kserve.io", version, plural)
        if canon not in self._specs:
            return []
        return self._select(canon, None, {})

    def _structural(self, spec: ResourceSpec, obj: JSON, old: JSON | None) -> JSON:
        """A custom resource's write defaulted, pruned and validated against its CRD's schema (:mod:`.schemas`);
        422 Invalid naming every field that fails, as the API server answers."""
        if spec.schema is None:
            return obj
        shaped, errors = _schemas.admit(obj, old, spec.schema)
        name = obj["metadata"].get("name", "")
        self.pruned += [(spec.kind, name, path) for path in _schemas.unknown_fields(obj, spec.schema, root=True)]
        if errors:
            res = f"{spec.kind}.{spec.group}" if spec.group else spec.kind
            causes = [
                {"reason": "FieldValueInvalid", "message": e.split(": ", 1)[-1], "field": e.split(": ", 1)[0]}
                for e in errors
            ]
            raise ApiError(422, f'{res} "{name}" is invalid: {", ".join(errors)}', "Invalid",
                           {"name": name, "group": spec.group, "kind": spec.kind, "causes": causes})  # fmt: skip
        return shaped

    def _admit(self, spec: ResourceSpec, obj: JSON, old: JSON | None) -> JSON:
        """Admission of an InferenceService or LocalModelCache write (see :func:`universal_simcluster.admission.admit`,
        :func:`universal_simcluster.admission.local_model_cache_refusal`)."""
        if self.admission is None or spec.group != "serving.kserve.io":
            return obj
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            return obj  # finalizer bookkeeping on the way out
        if spec.plural == "localmodelcaches":
            refusal = _admission.local_model_cache_refusal(obj, old, self._kserve_objects("localmodelcaches"))
            if refusal is not None:
                raise ApiError(422 if "immutable" in refusal else 403, refusal, "Invalid" if "immutable" in refusal
                               else "Forbidden")  # fmt: skip
            return obj
        if spec.plural != "inferenceservices":
            return obj
        caches = self._kserve_objects("localmodelcaches") if self.admission.local_model_enabled else None
        try:
            return _admission.admit(obj, old, self.admission, caches)
        except _admission.Denied as denied:
            # A webhook's Status carries no details (apiserver webhook/errors/statuserror.go ToStatusErr).
            raise ApiError(denied.code, denied.message, denied.reason) from None

    def _admit_delete(self, spec: ResourceSpec, old: JSON) -> None:
        """KServe's LocalModelCache webhook also validates deletes (its ``verbs=create;update;delete``)."""
        if self.admission is None or (spec.group, spec.plural) != ("serving.kserve.io", "localmodelcaches"):
            return
        isvcs = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o
                 for o in self._kserve_objects("inferenceservices")}  # fmt: skip
        refusal = _admission.local_model_cache_delete_refusal(old, isvcs)
        if refusal is not None:
            raise ApiError(403, refusal, "Forbidden")

    def _update(self, spec: ResourceSpec, request: kmock.Request, kind: str) -> JSON:
        assert request.name is not None
        namespace = self._key_ns(spec, request.namespace)
        old = self._current(self._canonical[spec.resource], namespace, request.name)
        if old is None:
            raise self._not_found(spec, request.name)
        body = self._body(request)
        if kind != "json" and isinstance(body, dict):
            self._check_rv(spec, old, body)
        candidate = patched(old, body, kind)
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
        new = self._structural(spec, new, old)
        meta = new["metadata"]
        if sub is None:
            new = self._admit(spec, new, old)
            meta = new["metadata"]
        if new == old:
            return present(old, spec)  # a no-op write: no new version, no watch event (as in k8s)
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }:
            meta["generation"] = int(old_meta.get("generation", 0)) + 1
        committed = self._commit(spec, new, "MODIFIED")
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._hard_delete(spec, committed)
        return present(committed, spec)

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
        obj_key: Key = (canon, namespace, request.name)
        old = self._current(canon, namespace, request.name)
        if sub == "status":
            scoped: JSON = {"status": applied["status"]} if "status" in applied else {}
        else:
            scoped = {k: v for k, v in applied.items() if not (k == "status" and spec.status_subresource)}
        types = {**META_LIST_TYPES, **spec.list_types}
        if old is None:
            if sub == "status":
                raise self._not_found(spec, request.name)
            body = copy.deepcopy(applied)
            body.setdefault("metadata", {})["name"] = request.name
            created = self._create(spec, namespace, body)
            self._store.managers[obj_key] = {(manager, None): applied_paths(scoped, types)}
            return 201, created

        self._check_rv(spec, old, applied)
        managers = self._store.managers.setdefault(obj_key, {})
        candidate = apply_owned(old, scoped, managers, (manager, sub), force=force, types=types)
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
        self._admit_delete(spec, old)
        return present(self._begin_delete(spec, old, cascade=options.get("propagationPolicy") != "Orphan"), spec)

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
            "metadata": {"resourceVersion": str(self._store.rv)},
            "items": [present(obj, spec) for obj in items],
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
                schema=(version.get("schema") or {}).get("openAPIV3Schema") or None,
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


#: etcd3's answer to a continue token older than the compaction (Kubernetes v1.31 storage/etcd3/store.go,
#: compactedContinue, without the fresh token it may add).
CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter."
)


def _list_key(obj: JSON) -> str:
    """The order lists page in: etcd's keys, namespace then name."""
    return f"{obj['metadata'].get('namespace') or ''}/{obj['metadata']['name']}"


def _encode_continue(start: str, rv: int) -> str:
    """A continue token as apiserver's storage.EncodeContinue writes one: base64 of ``{"v", "rv", "start"}``."""
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[str, int]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return str(raw["start"]), int(raw["rv"])
    except (ValueError, KeyError, TypeError):
        raise ApiError(400, "continue key is not valid: illegal base64 data or JSON", "BadRequest") from None
