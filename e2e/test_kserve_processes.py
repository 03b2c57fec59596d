"""The process KServe stand-in: what it runs for a rendered InferenceService, and its activator's timeout."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from lightkube import AsyncClient

from tests.conftest import EXAMPLES, eventually
from tests.factories import render
from universal_simcluster.apiserver import HARNESS_HEADER, ServedEmulator
from universal_simcluster.kserve.processes import kserve_processes, render_launch

#: The stand-in itself under test: nothing to run against a real cluster.
pytestmark = pytest.mark.stand_in


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
