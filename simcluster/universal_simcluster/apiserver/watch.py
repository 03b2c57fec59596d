"""Watch: ``?watch=true`` streams newline-delimited events until the client leaves, the timeout passes or the
emulator closes.

Without ``resourceVersion`` (or with ``0``) the stream starts with an ADDED event per matching object;
``sendInitialEvents=true`` ends that batch with a BOOKMARK annotated ``k8s.io/initial-events-end``; with
``resourceVersion=N`` it replays the log after ``N``. A watched object that stops matching a label selector
produces no synthetic DELETED event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp.web
import kmock

from universal_simcluster.apiserver.errors import ApiError
from universal_simcluster.apiserver.resources import JSON, ResourceSpec, present
from universal_simcluster.apiserver.selectors import matcher
from universal_simcluster.apiserver.storage import Store, select


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
    else:
        cursor = store.cursor_after(canon, int(since))

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
                    queue.append({"type": event.type, "object": present(obj, spec)})
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
