"""Tests of the in-process Kubernetes API emulator (real HTTP: aiohttp, lightkube, kubectl, kopf)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import lightkube
import pytest
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType

from universal_simcluster.apiserver import (
    KubeEmulator,
    ServedEmulator,
    WriteKey,
    human_duration,
    jsonpath,
    parse_api_path,
    parse_field_selector,
    parse_label_selector,
    register_builtins,
    register_crd,
    serve_emulator,
)

GROUP, VERSION = "universal.ai", "v1alpha1"
UM_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/default/universalmodels"
ISVC_PATH = "/apis/serving.kserve.io/v1beta1/namespaces/default/inferenceservices"
UM_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"universalmodels.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "plural": "universalmodels",
            "singular": "universalmodel",
            "kind": "UniversalModel",
            "listKind": "UniversalModelList",
            "shortNames": ["um"],
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Task", "type": "string", "jsonPath": ".spec.task"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                ],
            }
        ],
    },
}
UniversalModel = create_namespaced_resource(GROUP, VERSION, "UniversalModel", "universalmodels")

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[ServedEmulator]:
    async with serve_emulator(tmp_path, crds=[UM_CRD]) as srv:
        yield srv


def um(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "UniversalModel",
        "metadata": {"name": name},
        "spec": {"task": "generate", **spec},
    }


async def call(
    emu: KubeEmulator, method: str, path: str, body: Any = None, content_type: str = "application/json", **params: str
) -> tuple[int, Any]:
    """One real HTTP request to the served emulator; returns (status, parsed JSON)."""
    data = None if body is None else json.dumps(body)
    async with emu.request(method, path, data=data, params=params, headers={"Content-Type": content_type}) as response:
        return response.status, await response.json()


async def watch(emu: KubeEmulator, path: str, **params: str) -> list[dict[str, Any]]:
    """Read a watch stream until the server ends it (use with ``timeoutSeconds``)."""
    async with emu.get(path, params={"watch": "true", **params}) as response:
        assert response.status == 200
        return [json.loads(line) for line in (await response.read()).splitlines() if line.strip()]


async def eventually(check: Callable[[], Any], within: float = 10.0) -> Any:
    """Poll a condition with a deadline (for the asynchronous kopf operator only)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------------ pure helpers


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("a=1", {"a": "1"}, True),
        ("a==1", {"a": "2"}, False),
        ("a!=1", {}, True),
        ("a", {"a": "x"}, True),
        ("!a", {"a": "x"}, False),
        ("a in (1, 2),b notin (3)", {"a": "2", "b": "4"}, True),
        ("a in (1,2),b notin (3)", {"a": "2", "b": "3"}, False),
        ("", {}, True),
    ],
)
def test_label_selector_parsing(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert parse_label_selector(selector)(labels) is expected


def test_field_selector_and_jsonpath_and_age() -> None:
    obj = {
        "metadata": {"name": "x", "namespace": "ns"},
        "status": {"conditions": [{"type": "Other", "status": "False"}, {"type": "Ready", "status": "True"}]},
    }
    assert parse_field_selector("metadata.name=x,metadata.namespace==ns")(obj)
    assert not parse_field_selector("metadata.name!=x")(obj)
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath(obj, ".status.conditions[?(@.type=='Other')].status") == ["False"]
    assert jsonpath(obj, ".status.conditions[0].type") == ["Other"]
    assert jsonpath(obj, ".spec.task") == []
    assert [human_duration(s) for s in (5, 119, 180, 3600 * 5 + 60, 86400 * 3)] == ["5s", "119s", "3m", "5h1m", "3d"]
    core = parse_api_path("/api/v1/namespaces/default")
    assert (core.plural, core.name, core.namespace) == ("namespaces", "default", None)
    assert parse_api_path("/api/v1/namespaces/default/status").subresource == "status"
    custom = parse_api_path(f"{UM_PATH}/m1/status")
    assert (custom.group, custom.namespace, custom.name, custom.subresource) == (GROUP, "default", "m1", "status")


# ------------------------------------------------------------------------------------------ stamping


async def test_create_and_updates_stamp_metadata(served: ServedEmulator) -> None:
    emu = served.emulator
    status, created = await call(emu, "POST", UM_PATH, um("m1", model="a"))
    assert status == 201
    meta = created["metadata"]
    assert meta["generation"] == 1
    assert meta["uid"]
    assert meta["namespace"] == "default"
    assert datetime.datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
    rv1 = int(meta["resourceVersion"])

    _, spec_patched = await call(
        emu, "PATCH", f"{UM_PATH}/m1", {"spec": {"model": "b"}}, "application/merge-patch+json"
    )
    _, label_patched = await call(
        emu, "PATCH", f"{UM_PATH}/m1", {"metadata": {"labels": {"x": "y"}}}, "application/merge-patch+json"
    )
    _, status_patched = await call(
        emu, "PATCH", f"{UM_PATH}/m1/status", {"status": {"phase": "Ready"}}, "application/merge-patch+json"
    )
    rvs = [int(o["metadata"]["resourceVersion"]) for o in (spec_patched, label_patched, status_patched)]
    assert rv1 < rvs[0] < rvs[1] < rvs[2] == emu.resource_version
    assert [o["metadata"]["generation"] for o in (spec_patched, label_patched, status_patched)] == [2, 2, 2]
    assert {o["metadata"]["uid"] for o in (spec_patched, label_patched, status_patched)} == {meta["uid"]}

    # A no-op patch changes nothing: no new resourceVersion (as in Kubernetes).
    _, same = await call(emu, "PATCH", f"{UM_PATH}/m1", {"spec": {"model": "b"}}, "application/merge-patch+json")
    assert same["metadata"]["resourceVersion"] == str(rvs[2])

    # Duplicates are 409 AlreadyExists; generateName works (kopf's events use it).
    status, dup = await call(emu, "POST", UM_PATH, um("m1"))
    assert (status, dup["reason"]) == (409, "AlreadyExists")
    status, event = await call(
        emu,
        "POST",
        "/api/v1/namespaces/default/events",
        {"metadata": {"generateName": "kopf-event-"}, "involvedObject": {"name": "m1"}, "message": "hi"},
    )
    assert status == 201
    assert event["metadata"]["name"].startswith("kopf-event-")
    assert emu.get_object("events", "default", event["metadata"]["name"])["message"] == "hi"


async def test_list_reports_kind_api_version_and_resource_version(served: ServedEmulator) -> None:
    emu = served.emulator
    await call(emu, "POST", UM_PATH, um("m1"))
    _, listed = await call(emu, "GET", UM_PATH)
    assert listed["apiVersion"] == f"{GROUP}/{VERSION}"
    assert listed["kind"] == "UniversalModelList"
    assert listed["metadata"]["resourceVersion"] == str(emu.resource_version)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["m1"]
    _, namespaces = await call(emu, "GET", "/api/v1/namespaces")
    assert (namespaces["apiVersion"], namespaces["kind"]) == ("v1", "NamespaceList")
    _, default = await call(emu, "GET", "/api/v1/namespaces/default")
    assert default["status"] == {"phase": "Active"}
    assert [o["metadata"]["name"] for o in emu.list_objects("universalmodels")] == ["m1"]


# ------------------------------------------------------------------------------------------ watches


async def test_watch_resumes_after_resource_version(served: ServedEmulator) -> None:
    emu = served.emulator
    await call(emu, "POST", UM_PATH, um("a"))
    await call(emu, "POST", UM_PATH, um("b"))
    _, listed = await call(emu, "GET", UM_PATH)
    await call(emu, "PATCH", f"{UM_PATH}/a", {"spec": {"model": "x"}}, "application/merge-patch+json")
    await call(emu, "DELETE", f"{UM_PATH}/b")

    resumed = await watch(emu, UM_PATH, resourceVersion=listed["metadata"]["resourceVersion"], timeoutSeconds="0.1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in resumed] == [("MODIFIED", "a"), ("DELETED", "b")]
    assert resumed[-1]["object"]["metadata"]["resourceVersion"] == str(emu.resource_version)

    fresh = await watch(emu, UM_PATH, timeoutSeconds="0.1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in fresh] == [("ADDED", "a")]

    streamed = await watch(
        emu,
        UM_PATH,
        sendInitialEvents="true",
        resourceVersionMatch="NotOlderThan",
        allowWatchBookmarks="true",
        timeoutSeconds="0.1",
    )
    assert [e["type"] for e in streamed] == ["ADDED", "BOOKMARK"]
    assert streamed[-1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_watch_streams_live_events(served: ServedEmulator) -> None:
    emu = served.emulator
    since = str(emu.resource_version)
    async with emu.get(UM_PATH, params={"watch": "true", "resourceVersion": since}) as response:
        await call(emu, "POST", UM_PATH, um("live"))
        line = await asyncio.wait_for(response.content.readline(), timeout=5)
    event = json.loads(line)
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "live")


async def test_a_watch_from_a_compacted_resource_version_is_an_expired_error_event(served: ServedEmulator) -> None:
    """Kubernetes v1.31 storage/cacher/watch_cache.go: 200, one ERROR event (410 Expired), the end; a client lists
    again. lightkube, as the gateway uses it, raises it as an ApiError with status 410."""
    emu = served.emulator
    await call(emu, "POST", UM_PATH, um("a"))
    _, listed = await call(emu, "GET", UM_PATH)
    old = listed["metadata"]["resourceVersion"]
    await call(emu, "PATCH", f"{UM_PATH}/a", {"spec": {"model": "x"}}, "application/merge-patch+json")
    emu.compact()
    [event] = await watch(emu, UM_PATH, resourceVersion=old, timeoutSeconds="0.1")
    assert event["type"] == "ERROR"
    status = event["object"]
    assert (status["code"], status["reason"], status["status"]) == (410, "Expired", "Failure")
    assert status["message"] == f"too old resource version: {old} ({emu.resource_version})"
    # From the compaction point on, resuming works.
    assert await watch(emu, UM_PATH, resourceVersion=str(emu.resource_version), timeoutSeconds="0.1") == []
    UM = create_namespaced_resource(GROUP, VERSION, "UniversalModel", "universalmodels")
    async with lightkube.AsyncClient(config=lightkube.KubeConfig.from_file(served.kubeconfig)) as client:
        with pytest.raises(lightkube.ApiError) as caught:
            async for _ in client.watch(UM, namespace="default", resource_version=old):
                pass
    assert caught.value.status.code == 410


async def test_expired_watches_end_with_an_error_event_mid_stream(served: ServedEmulator) -> None:
    emu = served.emulator
    async with emu.get(UM_PATH, params={"watch": "true", "resourceVersion": str(emu.resource_version)}) as response:
        await call(emu, "POST", UM_PATH, um("live"))
        first = json.loads(await asyncio.wait_for(response.content.readline(), timeout=5))
        emu.expire_watches()
        second = json.loads(await asyncio.wait_for(response.content.readline(), timeout=5))
        assert await asyncio.wait_for(response.content.read(), timeout=5) == b""  # the stream ended
    assert first["type"] == "ADDED"
    assert second["type"] == "ERROR"
    assert second["object"]["code"] == 410


async def test_an_object_leaving_or_entering_a_watched_selector_is_deleted_or_added(served: ServedEmulator) -> None:
    """storage/cacher/cache_watcher.go convertToWatchEvent: a watcher filtering by labels sees the transitions."""
    emu = served.emulator
    await call(emu, "POST", UM_PATH, dict(um("a"), metadata={"name": "a", "labels": {"tier": "gpu"}}))
    since = str(emu.resource_version)
    labels = {"metadata": {"labels": {"tier": "cpu"}}}
    await call(emu, "PATCH", f"{UM_PATH}/a", labels, "application/merge-patch+json")
    await call(emu, "PATCH", f"{UM_PATH}/a", {"metadata": {"labels": {"tier": "gpu"}}}, "application/merge-patch+json")
    await call(emu, "PATCH", f"{UM_PATH}/a", {"spec": {"model": "y"}}, "application/merge-patch+json")
    events = await watch(emu, UM_PATH, labelSelector="tier=gpu", resourceVersion=since, timeoutSeconds="0.1")
    assert [e["type"] for e in events] == ["DELETED", "ADDED", "MODIFIED"]
    gone = events[0]["object"]
    assert gone["metadata"]["labels"] == {"tier": "gpu"}  # the object as the watcher last matched it
    assert int(gone["metadata"]["resourceVersion"]) == int(since) + 1  # at the event's resourceVersion


async def test_lists_come_in_pages_with_limit_and_continue(served: ServedEmulator, tmp_path: Path) -> None:
    """storage/etcd3/store.go GetList: ``limit``, ``metadata.continue``, ``remainingItemCount``; kubectl pages with
    --chunk-size; a token from before a compaction is 410 Expired."""
    emu = served.emulator
    for name in "edcba":
        await call(emu, "POST", UM_PATH, um(name))
    _, first = await call(emu, "GET", UM_PATH, limit="2")
    assert [i["metadata"]["name"] for i in first["items"]] == ["a", "b"]
    assert first["metadata"]["remainingItemCount"] == 3
    token = first["metadata"]["continue"]
    _, second = await call(emu, "GET", UM_PATH, limit="2", **{"continue": token})
    assert [i["metadata"]["name"] for i in second["items"]] == ["c", "d"]
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    _, last = await call(emu, "GET", UM_PATH, limit="2", **{"continue": second["metadata"]["continue"]})
    assert [i["metadata"]["name"] for i in last["items"]] == ["e"]
    assert "continue" not in last["metadata"]
    done = await served.kubectl("get", "universalmodels", "--chunk-size=2", "-o", "name", "-v=6", check=True)
    assert done.stdout.split() == [f"universalmodel.{GROUP}/{n}" for n in "abcde"]
    assert done.stderr.count("limit=2") >= 3  # three pages asked for
    await call(emu, "POST", UM_PATH, um("f"))  # history moves on, and is compacted
    emu.compact()
    status, expired = await call(emu, "GET", UM_PATH, limit="2", **{"continue": token})
    assert status == 410
    assert expired["reason"] == "Expired"
    assert "continue parameter is too old" in expired["message"]


# ------------------------------------------------------------------------------------------ conflicts


async def test_failed_json_patch_test_is_422_and_stale_writes_are_409(served: ServedEmulator) -> None:
    emu = served.emulator
    _, created = await call(emu, "POST", UM_PATH, um("m1"))
    stale = created["metadata"]["resourceVersion"]
    await call(emu, "PATCH", f"{UM_PATH}/m1", {"spec": {"model": "new"}}, "application/merge-patch+json")

    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": stale},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]},
    ]
    status, body = await call(emu, "PATCH", f"{UM_PATH}/m1", ops, "application/json-patch+json")
    assert (status, body["reason"], body["kind"]) == (422, "Invalid", "Status")
    assert "finalizers" not in emu.get_object("universalmodels", "default", "m1")["metadata"]

    fresh = emu.get_object("universalmodels", "default", "m1")["metadata"]["resourceVersion"]
    ops[0]["value"] = fresh
    status, body = await call(emu, "PATCH", f"{UM_PATH}/m1", ops, "application/json-patch+json")
    assert status == 200
    assert body["metadata"]["finalizers"] == ["x"]

    status, body = await call(
        emu,
        "PATCH",
        f"{UM_PATH}/m1",
        {"metadata": {"resourceVersion": stale}, "spec": {}},
        "application/merge-patch+json",
    )
    assert (status, body["reason"]) == (409, "Conflict")
    replacement = dict(um("m1", model="put"), metadata={"name": "m1", "resourceVersion": stale})
    status, body = await call(emu, "PUT", f"{UM_PATH}/m1", replacement)
    assert (status, body["reason"]) == (409, "Conflict")
    replacement["metadata"]["resourceVersion"] = fresh_rv = emu.get_object("universalmodels", "default", "m1")[
        "metadata"
    ]["resourceVersion"]
    status, body = await call(emu, "PUT", f"{UM_PATH}/m1", replacement)
    assert status == 200
    assert body["spec"]["model"] == "put"
    assert int(body["metadata"]["resourceVersion"]) > int(fresh_rv)


# ------------------------------------------------------------------------------------------ status


async def test_status_subresource_is_isolated(served: ServedEmulator) -> None:
    emu = served.emulator
    _, created = await call(emu, "POST", UM_PATH, dict(um("m1"), status={"phase": "Bogus"}))
    assert "status" not in created

    _, body = await call(
        emu,
        "PATCH",
        f"{UM_PATH}/m1/status",
        {"spec": {"task": "hacked"}, "metadata": {"labels": {"a": "b"}}, "status": {"phase": "Ready"}},
        "application/merge-patch+json",
    )
    assert body["status"] == {"phase": "Ready"}
    assert body["spec"]["task"] == "generate"
    assert "labels" not in body["metadata"]
    assert body["metadata"]["generation"] == 1

    _, body = await call(
        emu,
        "PATCH",
        f"{UM_PATH}/m1",
        {"status": {"phase": "Nope"}, "spec": {"task": "embed"}},
        "application/merge-patch+json",
    )
    assert body["status"] == {"phase": "Ready"}
    assert body["spec"]["task"] == "embed"

    # Resources without a status subresource have no /status endpoint.
    status, _ = await call(
        emu, "PATCH", "/api/v1/namespaces/default/configmaps/x/status", {}, "application/merge-patch+json"
    )
    assert status == 404

    # put_status goes over HTTP, so watchers see it as MODIFIED.
    since = str(emu.resource_version)
    await emu.put_status("universalmodels", "default", "m1", {"conditions": [{"type": "Ready", "status": "True"}]})
    events = await watch(emu, UM_PATH, resourceVersion=since, timeoutSeconds="0.1")
    assert [e["type"] for e in events] == ["MODIFIED"]
    assert events[0]["object"]["status"]["conditions"][0]["status"] == "True"
    await emu.put_status("universalmodels", "default", "m1", {"phase": "Only"}, replace=True)
    assert emu.get_object("universalmodels", "default", "m1")["status"] == {"phase": "Only"}


# ------------------------------------------------------------------------------------------ apply


async def test_server_side_apply_with_lightkube(served: ServedEmulator) -> None:
    emu = served.emulator
    client = lightkube.AsyncClient(config=lightkube.KubeConfig.from_file(served.kubeconfig), field_manager="op")
    try:
        applied = um("m1", model="a", extra={"keep": 1, "drop": 2})
        applied["metadata"]["labels"] = {"app": "x"}
        created = await client.apply(UniversalModel.from_dict(applied), field_manager="op", force=True)
        assert created.metadata.generation == 1
        assert emu.write_log[-1].status == 201

        applied["spec"]["extra"] = {"keep": 1}
        applied["spec"].pop("model")
        updated = await client.apply(UniversalModel.from_dict(applied), field_manager="op", force=True)
        assert updated.spec == {"task": "generate", "extra": {"keep": 1}}  # owned fields removed
        assert emu.write_log[-1].status == 200
        assert updated.metadata.generation == 2

        # Another manager owns other fields; a conflicting value without force is refused.
        other = {**um("m1", owner="them"), "spec": {"owner": "them"}}
        await client.apply(UniversalModel.from_dict(other), field_manager="other")
        conflicting = {**um("m1"), "spec": {"owner": "me"}}
        with pytest.raises(lightkube.ApiError) as err:
            await client.apply(UniversalModel.from_dict(conflicting), field_manager="op")
        assert err.value.status.code == 409
        forced = await client.apply(UniversalModel.from_dict(conflicting), field_manager="op", force=True)
        assert forced.spec == {"owner": "me"}  # 'op' no longer applies task/extra, so they are removed

        # Status applied to the main resource is ignored; patches to /status change only status.
        await client.apply(
            UniversalModel.from_dict({**conflicting, "status": {"phase": "Main"}}), field_manager="op", force=True
        )
        assert emu.get_object("universalmodels", "default", "m1").get("status") is None
        await client.patch(
            UniversalModel.Status,
            "m1",
            {"status": {"phase": "Ready"}, "spec": {"owner": "no"}},
            namespace="default",
            patch_type=PatchType.MERGE,
        )
        got = await client.get(UniversalModel, "m1", namespace="default")
        assert got.status == {"phase": "Ready"}
        assert got.spec == {"owner": "me"}
        async with emu.patch(
            f"{UM_PATH}/m1/status",
            data=json.dumps({**conflicting, "status": {"phase": "Applied"}}),
            params={"fieldManager": "ctl", "force": "true"},
            headers={"Content-Type": "application/apply-patch+yaml"},
        ) as response:
            assert response.status == 200
            assert (await response.json())["status"] == {"phase": "Applied"}
        names = [o.metadata.name async for o in client.list(UniversalModel, namespace="default")]
        assert names == ["m1"]
        await client.delete(UniversalModel, "m1", namespace="default")
        assert emu.get_object("universalmodels", "default", "m1") is None
    finally:
        await client.close()


async def test_server_side_apply_yaml_body_and_field_manager_required(served: ServedEmulator) -> None:
    emu = served.emulator
    yaml_body = "apiVersion: universal.ai/v1alpha1\nkind: UniversalModel\nmetadata:\n  name: y\nspec:\n  task: ocr\n"
    async with emu.patch(
        f"{UM_PATH}/y",
        data=yaml_body,
        params={"fieldManager": "me"},
        headers={"Content-Type": "application/apply-patch+yaml"},
    ) as response:
        assert response.status == 201
        assert (await response.json())["spec"] == {"task": "ocr"}
    async with emu.patch(
        f"{UM_PATH}/y", data=yaml_body, headers={"Content-Type": "application/apply-patch+yaml"}
    ) as response:
        assert response.status == 422


# ------------------------------------------------------------------------------------------ selectors


async def test_label_and_field_selectors_on_list_and_watch(served: ServedEmulator) -> None:
    emu = served.emulator
    for name, labels in [("a", {"tier": "gpu", "team": "x"}), ("b", {"tier": "cpu"}), ("c", {})]:
        await call(emu, "POST", UM_PATH, dict(um(name), metadata={"name": name, "labels": labels}))

    async def names(**params: str) -> list[str]:
        _, listed = await call(emu, "GET", UM_PATH, **params)
        return [i["metadata"]["name"] for i in listed["items"]]

    assert await names(labelSelector="tier=gpu") == ["a"]
    assert await names(labelSelector="tier!=gpu") == ["b", "c"]
    assert await names(labelSelector="tier") == ["a", "b"]
    assert await names(labelSelector="!tier") == ["c"]
    assert await names(labelSelector="tier in (gpu,cpu),team notin (y)") == ["a", "b"]
    assert await names(fieldSelector="metadata.name=b") == ["b"]
    assert await names(fieldSelector="metadata.namespace=other") == []
    events = await watch(emu, UM_PATH, labelSelector="tier=cpu", timeoutSeconds="0.1")
    assert [e["object"]["metadata"]["name"] for e in events] == ["b"]


# ------------------------------------------------------------------------------------------ GC


async def test_garbage_collection_of_owned_objects(served: ServedEmulator) -> None:
    emu = served.emulator
    _, owner = await call(emu, "POST", UM_PATH, dict(um("m1"), metadata={"name": "m1", "finalizers": ["op"]}))
    ref = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "UniversalModel",
        "name": "m1",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    isvc = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": "m1", "ownerReferences": [ref]},
        "spec": {"predictor": {}},  # KServe's CRD requires spec.predictor
    }
    await call(emu, "POST", ISVC_PATH, isvc)
    await call(
        emu,
        "POST",
        ISVC_PATH,
        {**isvc, "metadata": {"name": "held", "ownerReferences": [ref], "finalizers": ["kserve"]}},
    )
    await call(emu, "POST", ISVC_PATH, {**isvc, "metadata": {"name": "unrelated"}})
    since = str(emu.resource_version)

    status, deleting = await call(emu, "DELETE", f"{UM_PATH}/m1")
    assert status == 200
    assert deleting["metadata"]["deletionTimestamp"]
    assert emu.get_object("inferenceservices", "default", "m1") is not None  # owner still finalizing

    await call(emu, "PATCH", f"{UM_PATH}/m1", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    assert emu.get_object("universalmodels", "default", "m1") is None
    assert emu.get_object("inferenceservices", "default", "m1") is None
    assert emu.get_object("inferenceservices", "default", "held")["metadata"]["deletionTimestamp"]
    assert emu.get_object("inferenceservices", "default", "unrelated") is not None
    events = await watch(emu, ISVC_PATH, resourceVersion=since, timeoutSeconds="0.1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("DELETED", "m1"), ("MODIFIED", "held")]


# ------------------------------------------------------------------------------------------ faults & accounting


async def test_fault_injection_does_not_apply_the_write(served: ServedEmulator) -> None:
    emu = served.emulator
    await call(emu, "POST", UM_PATH, um("m1"))
    emu.inject_failures(status=409, times=2, methods={"PATCH"}, resource="universalmodels", subresource="status")
    emu.inject_failures(status=500, times=1, methods={"POST"}, resource="inferenceservices")
    rv = emu.resource_version
    for _ in range(2):
        status, body = await call(
            emu, "PATCH", f"{UM_PATH}/m1/status", {"status": {"phase": "X"}}, "application/merge-patch+json"
        )
        assert (status, body["reason"], body["kind"]) == (409, "Conflict", "Status")
    status, body = await call(emu, "POST", ISVC_PATH, {"metadata": {"name": "i"}, "spec": {}})
    assert (status, body["reason"]) == (500, "InternalError")
    assert emu.resource_version == rv
    assert emu.get_object("inferenceservices", "default", "i") is None
    status, _ = await call(emu, "PATCH", f"{UM_PATH}/m1", {"spec": {"a": 1}}, "application/merge-patch+json")
    assert status == 200  # main resource was not targeted by the status-only rule
    status, body = await call(
        emu, "PATCH", f"{UM_PATH}/m1/status", {"status": {"phase": "X"}}, "application/merge-patch+json"
    )
    assert status == 200
    assert body["status"] == {"phase": "X"}


async def test_write_accounting(served: ServedEmulator) -> None:
    emu = served.emulator
    emu.reset_writes()
    await call(emu, "POST", UM_PATH, um("m1"))
    await call(emu, "PATCH", f"{UM_PATH}/m1", {"spec": {"a": 1}}, "application/merge-patch+json")
    await call(emu, "PATCH", f"{UM_PATH}/m1/status", {"status": {"a": 1}}, "application/merge-patch+json")
    await call(emu, "GET", f"{UM_PATH}/m1")
    await emu.put_status("universalmodels", "default", "m1", {"b": 2})  # harness writes are not counted
    await call(emu, "DELETE", f"{UM_PATH}/m1")
    assert emu.writes == {
        WriteKey("universalmodels", "default", "m1", None): 3,
        WriteKey("universalmodels", "default", "m1", "status"): 1,
    }
    assert emu.writes_by_method == {"POST": 1, "PATCH": 2, "DELETE": 1}
    assert emu.write_count("universalmodels", name="m1") == 4
    assert emu.write_count(method="patch") == 2
    emu.reset_writes()
    assert not emu.writes
    assert not emu.write_log


# ------------------------------------------------------------------------------------------ kubectl


@needs_kubectl
async def test_kubectl_apply_get_delete(served: ServedEmulator, tmp_path: Path) -> None:
    emu = served.emulator
    manifest = tmp_path / "um.yaml"
    manifest.write_text(
        f"apiVersion: {GROUP}/{VERSION}\nkind: UniversalModel\nmetadata:\n  name: m1\n"
        "spec:\n  task: generate\n  model: a\n"
    )
    result = await served.kubectl("apply", "--validate=false", "-f", str(manifest), check=True)
    assert "created" in result.stdout
    result = await served.kubectl("apply", "--validate=false", "-f", str(manifest), check=True)
    assert "unchanged" in result.stdout
    manifest.write_text(manifest.read_text().replace("model: a", "model: b"))
    result = await served.kubectl("apply", "--validate=false", "-f", str(manifest), check=True)
    assert "configured" in result.stdout
    assert "Warning" not in result.stderr
    assert emu.get_object("universalmodels", "default", "m1")["spec"]["model"] == "b"

    await emu.put_status(
        "universalmodels", "default", "m1", {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}]}
    )
    owner = emu.get_object("universalmodels", "default", "m1")
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "UniversalModel", "name": "m1", "uid": owner["metadata"]["uid"]}
    await call(
        emu, "POST", ISVC_PATH, {"metadata": {"name": "m1", "ownerReferences": [ref]}, "spec": {"predictor": {}}}
    )
    await emu.put_status(
        "inferenceservices",
        "default",
        "m1",
        {"url": "http://m1.default", "conditions": [{"type": "Ready", "status": "True"}]},
    )

    result = await served.kubectl("get", "um", check=True)
    header, row = result.stdout.splitlines()
    assert header.split() == ["NAME", "TASK", "PHASE", "READY", "AGE"]
    assert row.split()[:4] == ["m1", "generate", "Ready", "True"]
    assert row.split()[4].endswith("s")
    assert "Warning" not in result.stderr
    result = await served.kubectl("get", "isvc", check=True)
    header, row = result.stdout.splitlines()
    # KServe's CRD's printer columns (v0.20.0 config/crd/full, ``additionalPrinterColumns``)
    assert header.split() == [
        "NAME",
        "URL",
        "READY",
        "PREV",
        "LATEST",
        "PREVROLLEDOUTREVISION",
        "LATESTREADYREVISION",
        "AGE",
    ]
    assert row.split()[:3] == ["m1", "http://m1.default", "True"]
    result = await served.kubectl("get", "ns", check=True)
    assert result.stdout.split()[:3] == ["NAME", "AGE", "default"]

    result = await served.kubectl("get", "um", "-o", "yaml", check=True)
    assert "kind: UniversalModel" in result.stdout
    assert "resourceVersion:" in result.stdout
    result = await served.kubectl("get", "um", "m1", "-o", "json", check=True)
    assert json.loads(result.stdout)["status"]["phase"] == "Ready"

    result = await served.kubectl("delete", "um", "m1", check=True)
    assert "deleted" in result.stdout
    assert emu.get_object("universalmodels", "default", "m1") is None
    assert emu.get_object("inferenceservices", "default", "m1") is None  # garbage-collected
    result = await served.kubectl("get", "um")
    assert "No resources found" in result.stderr


# ------------------------------------------------------------------------------------------ kopf


async def test_kopf_operator_end_to_end(served: ServedEmulator) -> None:
    """A tiny kopf operator: finalizers, status via /status, events, owned children, deletion."""
    emu = served.emulator
    registry = kopf.OperatorRegistry()
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 5
    settings.watching.reconnect_backoff = 0.1
    settings.posting.level = logging.INFO
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf")

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=served.url, token="emulator-token")

    @kopf.on.create(GROUP, VERSION, "universalmodels", registry=registry)
    async def create(name: str, namespace: str, body: Any, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        isvc = {
            "apiVersion": "serving.kserve.io/v1beta1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": {"predictor": {}},
        }
        kopf.adopt(isvc, owner=body)
        status, created = await call(emu, "POST", ISVC_PATH, isvc)
        assert status == 201, created
        kopf.info(body, reason="Created", message="isvc created")
        patch.status["phase"] = "Pending"

    @kopf.on.delete(GROUP, VERSION, "universalmodels", registry=registry)
    async def delete(**_: Any) -> None:
        pass

    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry, settings=settings, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=10)
        await call(emu, "POST", UM_PATH, um("m1"))

        def pending() -> bool:
            model = emu.get_object("universalmodels", "default", "m1") or {}
            return bool((model.get("status") or {}).get("phase") == "Pending")

        await eventually(pending)
        obj = emu.get_object("universalmodels", "default", "m1")
        assert obj["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        assert emu.get_object("inferenceservices", "default", "m1") is not None
        await eventually(lambda: any(e.get("reason") == "Created" for e in emu.list_objects("events", "default")))
        assert emu.writes[WriteKey("universalmodels", "default", "m1", "status")] >= 1

        # The server expires kopf's watch (410 mid-stream, its resourceVersion compacted away): kopf lists again and
        # handles what was created meanwhile.
        await eventually(lambda: any(a.verb == "watch" and a.plural == "universalmodels" for a in emu.access_log))
        emu.compact()
        emu.expire_watches()
        await call(emu, "POST", UM_PATH, um("m2"))
        await eventually(lambda: ((emu.get_object("universalmodels", "default", "m2") or {}).get("status") or {}).get(
            "phase") == "Pending")  # fmt: skip
        status, _ = await call(emu, "DELETE", f"{UM_PATH}/m2")
        assert status == 200

        status, _ = await call(emu, "DELETE", f"{UM_PATH}/m1")
        assert status == 200
        await eventually(lambda: emu.get_object("universalmodels", "default", "m1") is None)
        assert emu.get_object("inferenceservices", "default", "m1") is None
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)


# ------------------------------------------------------------------------------------------ registration


async def test_crds_created_through_the_api_are_served(tmp_path: Path) -> None:
    emu = KubeEmulator()
    register_builtins(emu)
    async with serve_emulator(tmp_path, emulator=emu) as srv:
        assert srv.emulator.get_object("customresourcedefinitions", None, f"universalmodels.{GROUP}") is None
        status, _ = await call(emu, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", UM_CRD)
        assert status == 201
        status, discovered = await call(emu, "GET", f"/apis/{GROUP}/{VERSION}")
        entry = next(r for r in discovered["resources"] if r["name"] == "universalmodels")
        assert entry["shortNames"] == ["um"]
        assert entry["namespaced"] is True
        assert "watch" in entry["verbs"]
        status, _ = await call(emu, "POST", UM_PATH, um("m1"))
        assert status == 201
        register_crd(emu, UM_CRD)  # idempotent
        assert len(emu.list_objects("customresourcedefinitions")) == 1


# ------------------------------------------------------------------ apply: list merging by schema


async def apply_as(emu: KubeEmulator, path: str, body: dict[str, Any], manager: str) -> dict[str, Any]:
    status, obj = await call(
        emu, "PATCH", path, body, "application/apply-patch+yaml", fieldManager=manager, force="true"
    )
    assert status in (200, 201), obj
    return dict(obj)


def schema_crd(env_list_type: dict[str, Any]) -> dict[str, Any]:
    """A CRD whose spec.env has the given list annotations (spec.args stays unannotated: atomic)."""
    env = {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    spec = {
        "type": "object",
        "properties": {"env": {**env, **env_list_type}, "args": {"type": "array", "items": {"type": "string"}}},
    }
    crd = copy.deepcopy(UM_CRD)
    crd["spec"]["versions"][0]["schema"] = {
        "openAPIV3Schema": {
            "type": "object",
            "properties": {"spec": spec},
            "x-kubernetes-preserve-unknown-fields": True,
        }
    }
    return crd


async def test_apply_merges_list_map_items_by_key_and_keeps_another_managers_items(tmp_path: Path) -> None:
    crd = schema_crd({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    async with serve_emulator(tmp_path, crds=[crd]) as srv:
        emu, path = srv.emulator, f"{UM_PATH}/m"
        await apply_as(emu, path, um("m", env=[{"name": "A", "value": "1"}], args=["--x"]), "operator")
        await apply_as(emu, path, um("m", env=[{"name": "B", "value": "webhook"}], args=["--y"]), "webhook")
        obj = await apply_as(emu, path, um("m", env=[{"name": "A", "value": "2"}], args=["--x"]), "operator")
        # env merges by name: the webhook's B survives the operator's apply; args is atomic: the last one wins.
        assert obj["spec"]["env"] == [{"name": "A", "value": "2"}, {"name": "B", "value": "webhook"}]
        assert obj["spec"]["args"] == ["--x"]
        # An item its manager stops applying goes; the other manager's stays.
        obj = await apply_as(emu, path, um("m", env=[], args=["--x"]), "operator")
        assert obj["spec"]["env"] == [{"name": "B", "value": "webhook"}]


async def test_apply_replaces_an_atomic_list_whole(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path, crds=[schema_crd({})]) as srv:  # no x-kubernetes-list-type: atomic
        emu, path = srv.emulator, f"{UM_PATH}/m"
        await apply_as(emu, path, um("m", env=[{"name": "A", "value": "1"}]), "operator")
        await apply_as(emu, path, um("m", env=[{"name": "B", "value": "webhook"}]), "webhook")
        obj = await apply_as(emu, path, um("m", env=[{"name": "A", "value": "1"}]), "operator")
        assert obj["spec"]["env"] == [{"name": "A", "value": "1"}]


async def test_apply_keeps_owner_references_of_other_writers_by_uid(served: ServedEmulator) -> None:
    emu, path = served.emulator, f"{UM_PATH}/m"
    ours = {"apiVersion": "v1", "kind": "Thing", "name": "a", "uid": "uid-a", "controller": True}
    theirs = {"apiVersion": "v1", "kind": "Thing", "name": "b", "uid": "uid-b"}
    await apply_as(emu, path, {**um("m"), "metadata": {"name": "m", "ownerReferences": [ours]}}, "operator")
    await apply_as(emu, path, {**um("m"), "metadata": {"name": "m", "ownerReferences": [theirs]}}, "other")
    obj = await apply_as(emu, path, {**um("m"), "metadata": {"name": "m", "ownerReferences": [ours]}}, "operator")
    assert obj["metadata"]["ownerReferences"] == [ours, theirs]


async def test_apply_merges_a_service_accounts_secrets_by_name(served: ServedEmulator) -> None:
    emu, path = served.emulator, "/api/v1/namespaces/default/serviceaccounts/sa"
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "sa"}}
    await apply_as(emu, path, {**account, "secrets": [{"name": "ours"}]}, "operator")
    await apply_as(emu, path, {**account, "secrets": [{"name": "theirs"}]}, "other")
    obj = await apply_as(emu, path, {**account, "secrets": [{"name": "ours-renamed"}]}, "operator")
    assert obj["secrets"] == [{"name": "theirs"}, {"name": "ours-renamed"}]
