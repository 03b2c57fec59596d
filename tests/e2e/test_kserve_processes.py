"""The process KServe stand-in's pure part: what it runs for a rendered InferenceService."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import EXAMPLES
from tests.factories import render
from tests.support.kserve_processes import render_launch


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
