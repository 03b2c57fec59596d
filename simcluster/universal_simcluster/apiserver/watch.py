"""Watch: ``?watch=true`` streams newline-delimited events until the client leaves, the timeout passes or the
emulator closes.

Without ``resourceVersion`` (or with ``0``) the stream starts with an ADDED event per matching object;
``sendInitialEvents=true`` ends that batch with a BOOKMARK annotated ``k8s.io/initial-events-end``; with
``resourceVersion=N`` it replays the log after ``N``, or, once ``N`` has been compacted away
(:meth:`~universal_simcluster.apiserver.storage.Store.compact`), answers one ERROR event, 410 Expired, in a 200 stream,
as Kubernetes v1.31's watch cache does (storage/cacher/watch_cache.go, cacher.go). ``Store.expire_watches`` ends
every open watch the same way. An object that starts or stops matching the watch's selector arrives as ADDED or
DELETED, as the watch cache's cacheWatcher converts it (:func:`transition`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import aiohttp.web
import kmock

from universal_simcluster.apiserver.errors import ApiError
from universal_simcluster.apiserver.resources import JSON, ResourceSpec, present
from universal_simcluster.apiserver.selectors import matcher
from universal_simcluster.apiserver.storage import Event, Store, select


async def serve_watch(
    request: kmock.Request,
    spec: ResourceSpec,
    canon: kmock.resource,
    store: Store,
    objects: kmock.ObjectsArray,
    *,
    poll_interval: float,
) -> aiohttp.web.StreamResponse:
    """Stream watch events: initial ADDED (or a replay after ``resourceVersion``), then live ones.

    ``poll_interval``: how often an idle watch checks whether its client went away.
    """
    assert request._raw_request is not None
    params = request.params
    predicate = matcher(params, request.name)
    since = params.get("resourceVersion", "")
    initial = params.get("sendInitialEvents") == "true"
    if since and not since.isdigit():
        raise ApiError(400, f"invalid resourceVersion: {since!r}")

    # Snapshot synchronously (no awaits) so that nothing slips between the snapshot & the log.
    queue: list[JSON] = []
    log = store.events(canon)
    if initial or not since or since == "0":
        ns = request.namespace if spec.namespaced else None
        queue = [{"type": "ADDED", "object": present(obj, spec)} for obj in select(objects, canon, ns, predicate)]
        cursor = len(log)
        if initial:
            queue.append(
                {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": spec.kind,
                        "apiVersion": spec.api_version,
                        "metadata": {
                            "resourceVersion": str(store.rv),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    },
                }
            )
    elif store.too_old(int(since)):
        # Kubernetes v1.31 storage/cacher/watch_cache.go getAllEventsSinceLocked; cacher.go Watch answers it as an
        # ERROR event of a 200 stream (newErrWatcher), which clients meet as "410 Gone" and answer with a new list.
        return await _expired(request, f"too old resource version: {since} ({store.oldest})")
    else:
        cursor = store.cursor_after(canon, int(since))

    def in_scope(obj: JSON) -> bool:
        return request.namespace is None or not spec.namespaced or obj["metadata"].get("namespace") == request.namespace

    timeout = params.get("timeoutSeconds")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + float(timeout) if timeout else None
    response = aiohttp.web.StreamResponse(status=200)
    response.content_type = "application/json"
    await response.prepare(request._raw_request)
    transport = request._raw_request.transport
    expiry = store.expiry
    try:
        while True:
            if store.expiry != expiry:  # Store.expire_watches: this watcher was dropped by the server
                await response.write(json.dumps(expired_event("too old resource version: the watch was expired "
                                                              "by the server")).encode() + b"\n")  # fmt: skip
                break
            while cursor < len(log):
                event = log[cursor]
                cursor += 1
                kind, obj = transition(event, lambda o: in_scope(o) and predicate(o))
                if kind is not None:
                    queue.append({"type": kind, "object": present(obj, spec)})
            if queue:
                await response.write(b"".join(json.dumps(item).encode() + b"\n" for item in queue))
                queue = []
                continue  # more may have arrived while writing
            if store.closed or transport is None or transport.is_closing():
                break
            wait = poll_interval
            if deadline is not None:
                wait = min(wait, deadline - loop.time())
                if wait <= 0:
                    break
            wakeup = store.wakeup
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=wait)
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client went away; nothing to tell it
    return response


def expired_event(message: str) -> JSON:
    """The ERROR event of an expired watch: a ``v1 Status``, 410, reason Expired (apimachinery's NewResourceExpired)."""
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
              "reason": "Expired", "code": 410}  # fmt: skip
    return {"type": "ERROR", "object": status}


async def _expired(request: kmock.Request, message: str) -> aiohttp.web.StreamResponse:
    """A watch that can only say it expired: 200, one ERROR event, the end."""
    assert request._raw_request is not None
    response = aiohttp.web.StreamResponse(status=200)
    response.content_type = "application/json"
    await response.prepare(request._raw_request)
    with contextlib.suppress(ConnectionError, RuntimeError):
        await response.write(json.dumps(expired_event(message)).encode() + b"\n")
        await response.write_eof()
    return response


def transition(event: Event, passes: Callable[[JSON], bool]) -> tuple[str | None, JSON]:
    """What a watcher with filter ``passes`` sees of a logged event (Kubernetes v1.31 storage/cacher/cache_watcher.go,
    convertToWatchEvent): MODIFIED while the object matches before and after, ADDED when it starts to match, DELETED
    (the previous object, at the event's resourceVersion) when it stops, nothing when it matches neither time. A
    deletion matches nowhere after it."""
    now = event.type != "DELETED" and passes(event.obj)
    before = event.prev is not None and passes(event.prev)
    if now and before:
        return ("ADDED" if event.type == "ADDED" else "MODIFIED"), event.obj
    if now:
        return "ADDED", event.obj
    if before:
        if event.type == "DELETED":
            return "DELETED", event.obj
        prev = event.prev
        assert prev is not None
        return "DELETED", {**prev, "metadata": {**prev["metadata"], "resourceVersion": str(event.rv)}}
    return None, event.obj
