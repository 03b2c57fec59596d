"""The anomaly predictor's detector limit under concurrency, and its state directory treated as untrusted:
only regular files, each within a fit's limits, with what was skipped listed instead of dropped silently."""

from __future__ import annotations

import asyncio
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
