"""The anomaly predictor's detector limit under concurrency, and its state directory treated as untrusted:
only regular files, each within a fit's limits, with what was skipped listed instead of dropped silently."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.predictors.harness import running_predictor
from universal_predictors.config import PredictorConfig, Task

MAX_DETECTORS = 8
CONCURRENT_FITS = 12


def anomaly_config(state_dir: Path | None = None, **engine_args: str) -> PredictorConfig:
    return PredictorConfig(
        model_name="sensors",
        task=Task.ANOMALY,
        source="/nonexistent/anomaly-source",
        state_dir=str(state_dir) if state_dir else None,
        engine_args=engine_args,
    )


def rows(count: int, seed: int = 0) -> list[list[float]]:
    return np.random.default_rng(seed).normal(size=(count, 4)).tolist()


def test_concurrent_fits_never_exceed_max_detectors(tmp_path: Path) -> None:
    config = anomaly_config(max_detectors=str(MAX_DETECTORS))
    # Enough rows that the fits queue on the one engine thread while every request is checked.
    data = rows(3000)

    async def fit_all(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            fits = [
                client.post("/v1/anomaly/fit", json={"detector": f"d{i}", "algorithm": "knn", "data": data})
                for i in range(CONCURRENT_FITS)
            ]
            return list(await asyncio.gather(*fits))

    with running_predictor(config, tmp_path / "logs") as predictor:
        responses = asyncio.run(fit_all(predictor.url))
        with predictor.client() as client:
            listed = client.get("/v1/anomaly/detectors").json()["data"]

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * MAX_DETECTORS + [400] * (CONCURRENT_FITS - MAX_DETECTORS)
    refused = [r.json()["error"] for r in responses if r.status_code == 400]
    assert {e["code"] for e in refused} == {"too_many_detectors"}
    assert all(f"the limit is {MAX_DETECTORS}" in e["message"] for e in refused)
    assert len(listed) == MAX_DETECTORS


def test_the_state_directory_loads_regular_files_within_a_fits_limits_and_lists_the_rest(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with running_predictor(anomaly_config(state), tmp_path / "first") as first, first.client() as client:
        for name, count in (("small", 20), ("big", 200)):
            response = client.post("/v1/anomaly/fit", json={"detector": name, "algorithm": "ecod", "data": rows(count)})
            assert response.status_code == 200, response.text
    detectors = state / "anomaly-detectors"
    os.mkfifo(detectors / "fifo.npz")  # opening it for reading would wait for a writer forever
    (detectors / "link.npz").symlink_to(detectors / "small.npz")
    with np.load(detectors / "big.npz") as archive:  # the big detector again, compressed: 10x max_rows inflated
        np.savez_compressed(detectors / "compressed.npz", **{k: archive[k] for k in archive.files})

    # max_rows=20: "big" (200 rows) now holds 10x what a fit may send.
    second = running_predictor(anomaly_config(state, max_rows="20"), tmp_path / "second", ready_within=60)
    with second as predictor, predictor.client() as client:
        listed: dict[str, Any] = client.get("/v1/anomaly/detectors").json()

    assert [d["name"] for d in listed["data"]] == ["small"]
    skipped = {entry["file"]: entry["reason"] for entry in listed["skipped"]}
    assert set(skipped) == {"big.npz", "compressed.npz", "fifo.npz", "link.npz"}
    assert "max_rows" in skipped["big.npz"]
    assert "a FIFO" in skipped["fifo.npz"]
    assert "a symbolic link" in skipped["link.npz"]


@pytest.mark.parametrize("limit", ["max_features", "max_cells"])
def test_state_files_over_the_column_and_cell_limits_are_skipped(tmp_path: Path, limit: str) -> None:
    state = tmp_path / "state"
    with running_predictor(anomaly_config(state), tmp_path / "first") as first, first.client() as client:
        response = client.post("/v1/anomaly/fit", json={"detector": "wide", "algorithm": "ecod", "data": rows(30)})
        assert response.status_code == 200, response.text
    value = {"max_features": "3", "max_cells": "100"}[limit]  # 30 x 4 = 120 values
    second = running_predictor(anomaly_config(state, **{limit: value}), tmp_path / "second")
    with second as predictor, predictor.client() as client:
        listed = client.get("/v1/anomaly/detectors").json()
    assert listed["data"] == []
    assert limit in listed["skipped"][0]["reason"]


def test_a_detector_name_ending_in_a_newline_is_a_400_and_writes_nothing(tmp_path: Path) -> None:
    """Issue 31, item 16: names were checked with ``re.match`` and ``$``, which also matches before a final
    newline: "ok\n" was fitted and written as "ok\n.npz", which no request could then read or delete."""
    state = tmp_path / "state"
    with running_predictor(anomaly_config(state), tmp_path / "logs") as predictor, predictor.client() as client:
        refused = client.post("/v1/anomaly/fit", json={"detector": "ok\n", "algorithm": "ecod", "data": rows(20)})
        listed = client.get("/v1/anomaly/detectors").json()

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "detector"
    assert "'ok\\n' is not a valid detector name" in error["message"]
    assert listed["data"] == []
    assert list((state / "anomaly-detectors").iterdir()) == []


def test_a_state_file_named_for_no_detector_is_skipped_and_holds_no_slot(tmp_path: Path) -> None:
    """A file an unfixed version wrote ("ok\n.npz", its metadata naming "ok\n") is listed as skipped at load,
    saying what to do, and does not count against max_detectors (251 of them filled it for good)."""
    state = tmp_path / "state"
    with running_predictor(anomaly_config(state), tmp_path / "first") as first, first.client() as client:
        response = client.post("/v1/anomaly/fit", json={"detector": "small", "algorithm": "ecod", "data": rows(20)})
        assert response.status_code == 200, response.text
    detectors = state / "anomaly-detectors"
    with np.load(detectors / "small.npz") as archive:
        arrays = {key: archive[key] for key in archive.files}
    meta = json.loads(arrays["meta"].tobytes())
    arrays["meta"] = np.frombuffer(json.dumps({**meta, "name": "ok\n"}).encode(), dtype=np.uint8)
    with (detectors / "ok\n.npz").open("wb") as handle:  # sorts before "small.npz": loaded first, if at all
        np.savez(handle, **arrays)

    second = running_predictor(anomaly_config(state, max_detectors="1"), tmp_path / "second")
    with second as predictor, predictor.client() as client:
        listed: dict[str, Any] = client.get("/v1/anomaly/detectors").json()

    assert [d["name"] for d in listed["data"]] == ["small"]
    assert [entry["file"] for entry in listed["skipped"]] == ["ok\n.npz"]
    reason = listed["skipped"][0]["reason"]
    assert "is not named for a detector" in reason
    assert "rename or remove the file" in reason
