"""Storage: one global resourceVersion, an event log per resource and server-side apply's owners.

The objects themselves live in kmock's store (``KubernetesEmulator._objects``: each key keeps its history and a
deletion mark); this module stamps every write with the next resourceVersion, keeps the log a watch resumes from
(``watch?resourceVersion=N`` replays exactly what came after ``N``) and wakes the watches waiting for it.

What it imitates (Kubernetes v1.31): one resourceVersion counter across all resources is etcd's revision, which
``staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go`` writes into every object; the log and its window are
the watch cache's (``storage/cacher/watch_cache.go``): ``compact`` drops the oldest events, after which a watch
resuming from before them is answered with ``too old resource version: N (M)``, 410 Expired
(``getAllEventsSinceLocked``), as an ERROR event in a 200 stream (``cacher.go`` Watch: ``newErrWatcher``).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass

import kmock

from universal_simcluster.apiserver.patch import Managers
from universal_simcluster.apiserver.resources import JSON

#: A stored object's key: (canonical resource, namespace or None, name).
Key = tuple[kmock.resource, str | None, str]


@dataclass(frozen=True)
class Event:
    """One watch event as logged: the resourceVersion it was written at, its type and the object."""

    rv: int
    type: str
    obj: JSON
    #: The object before this write (None for a create): a watch with a selector compares the two, as the watch
    #: cache's cacheWatcher does (storage/cacher/cache_watcher.go, convertToWatchEvent).
    prev: JSON | None = None


class Store:
    """The versioned side of the object store (the objects are kmock's, passed to each call)."""

    def __init__(self) -> None:
        self.rv = 1
        self.log: dict[kmock.resource, list[Event]] = {}
        self._log_rvs: dict[kmock.resource, list[int]] = {}
        #: Server-side apply's field owners, per object.
        self.managers: dict[Key, Managers] = {}
        self.wakeup = asyncio.Event()
        self.closed = False
        #: The oldest resourceVersion a watch may still resume after (``compact`` moves it): an older one is 410
        #: Expired, as the watch cache answers one that left its window.
        self.oldest = 0
        #: Bumped by ``expire_watches``: every open watch then ends with an ERROR event (410 Expired).
        self.expiry = 0

    def compact(self, upto: int | None = None) -> None:
        """Forget the events up to resourceVersion ``upto`` (default: all so far), as etcd's compaction and the watch
        cache's sliding window do: a watch resuming from before it, and a list continued from before it, then get
        410 Expired."""
        upto = self.rv if upto is None else upto
        self.oldest = max(self.oldest, upto)
        for canon, rvs in self._log_rvs.items():
            keep = bisect.bisect_right(rvs, upto)
            del rvs[:keep]
            del self.log[canon][:keep]

    def expire_watches(self) -> None:
        """End every open watch with an ERROR event carrying 410 Expired (what a client sees when the API server's
        watch cache drops it: the watcher's events no longer fit the window)."""
        self.expiry += 1
        self.wake()

    def too_old(self, rv: int) -> bool:
        """Whether resuming after ``rv`` needs events already compacted (watch_cache.go: ``rv < oldest-1``)."""
        return 0 < rv < self.oldest

    def wake(self) -> None:
        """Wake every watch waiting for the next event."""
        self.wakeup.set()
        self.wakeup = asyncio.Event()

    def close(self) -> None:
        """End every watch stream (they see ``closed`` once woken)."""
        self.closed = True
        self.wake()

    def events(self, canon: kmock.resource) -> list[Event]:
        """The event log of a resource (the live list: a watch reads on from its cursor)."""
        return self.log.setdefault(canon, [])

    def cursor_after(self, canon: kmock.resource, rv: int) -> int:
        """The log position of the first event written after resourceVersion ``rv``."""
        return bisect.bisect_right(self._log_rvs.setdefault(canon, []), rv)

    def commit(self, objects: kmock.ObjectsArray, key: Key, new: JSON, event: str) -> JSON:
        """Stamp the next resourceVersion on ``new``, store it (or its deletion) and log the watch event."""
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        prev = current(objects, key)
        if event == "DELETED":
            objects[key].delete()
            self.managers.pop(key, None)
        elif key in objects:
            objects[key].history.append(new)
        else:
            objects[key] = new
        self.events(key[0]).append(Event(self.rv, event, new, prev))
        self._log_rvs.setdefault(key[0], []).append(self.rv)
        self.wake()
        return new


def current(objects: kmock.ObjectsArray, key: Key) -> JSON | None:
    """The live object at ``key`` (None: absent or deleted)."""
    if key not in objects:
        return None
    obj = objects[key]
    return None if obj.deleted else obj.raw


def select(
    objects: kmock.ObjectsArray,
    canon: kmock.resource,
    namespace: str | None,
    predicate: Callable[[JSON], bool],
) -> list[JSON]:
    """The live objects of a resource (in ``namespace``, or all) that match, sorted by namespace and name."""
    found = [
        obj.raw
        for (res, ns, _), obj in objects.items()
        if res == canon and not obj.deleted and (namespace is None or ns == namespace) and predicate(obj.raw)
    ]
    found.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
    return found
