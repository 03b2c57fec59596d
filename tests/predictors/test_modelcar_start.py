"""A predictor beside a KServe modelcar: the model may appear only after the predictor starts.

KServe's pod webhook sets MODEL_INIT_MODE=async on the predictor of a modelcar (KServe v0.16.0
pkg/utils/storage.go ConfigureModelcarToContainer), whose sidecar links /mnt/models into the shared volume
once it runs. The predictor waits for its source (bounded) instead of failing on a missing path.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.predictors.harness import OFFLINE_ENV, PredictorProcess, free_port, predictor_command, stop, wait_ready
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig


def start(source: Path, log: Path, **env: str) -> PredictorProcess:
    config = PredictorConfig(model_name="all-minilm-l6-v2", task=Task.EMBED, source=str(source), http_port=free_port())
    with log.open("wb") as out:
        process = subprocess.Popen(predictor_command(config), stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **OFFLINE_ENV, "MODEL_INIT_MODE": "async", **env})  # fmt: skip
    return PredictorProcess(config, f"http://127.0.0.1:{config.http_port}", process, log)


def test_the_predictor_waits_for_a_modelcars_model_to_appear_then_serves_it(minilm_path: Path, tmp_path: Path) -> None:
    mount = tmp_path / "mnt" / "models"  # the sidecar's link, not there yet
    mount.parent.mkdir()
    predictor = start(mount, tmp_path / "predictor.log")
    try:
        deadline = time.monotonic() + 120
        while "waiting up to" not in predictor.log_path.read_text(errors="replace"):
            assert predictor.process.poll() is None, predictor.log_tail()
            assert time.monotonic() < deadline, predictor.log_tail()
            time.sleep(0.1)
        assert predictor.process.poll() is None  # still waiting, not failed
        mount.symlink_to(minilm_path)  # what the modelcar sidecar does once it runs
        wait_ready(predictor, 180)
        response = httpx.post(f"{predictor.openai_url}/embeddings", json={"model": "all-minilm-l6-v2", "input": "x"},
                              timeout=60)  # fmt: skip
        assert response.status_code == 200
        assert len(response.json()["data"][0]["embedding"]) == 384
    finally:
        stop(predictor.process)


def test_a_model_that_never_appears_ends_the_predictor_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "mnt" / "models"
    predictor = start(missing, tmp_path / "predictor.log", UNIVERSAL_RUNTIME_MODEL_WAIT_SECONDS="1")
    try:
        assert predictor.process.wait(timeout=120) == 1
    finally:
        stop(predictor.process)
    errors = [line for line in predictor.log_path.read_text().splitlines() if line.startswith("universal_predictors:")]
    assert errors == [
        f"universal_predictors: error: the model did not appear at {missing} within 1s (MODEL_INIT_MODE=async: "
        "KServe's modelcar sidecar provides it); check the modelcar container's image and logs, or raise "
        "UNIVERSAL_RUNTIME_MODEL_WAIT_SECONDS"
    ]
    assert "Traceback" not in predictor.log_path.read_text()
