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
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

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


# -- the fitted detectors' budgets (issue 31, item 17) ---------------------------------------------------

#: ECOD keeps five float64 copies of its training matrix (measured 5.1-5.3), estimated as six: 40,000 x 16
#: values (5.1 MB) hold about 32 MiB once fitted, so a budget of 80 MiB takes two such detectors.
BIG_ROWS, BIG_COLUMNS = 40_000, 16
MEMORY_BUDGET_MB = 80
FITS = 12


def big_rows(seed: int) -> list[list[float]]:
    return np.round(np.random.default_rng(seed).normal(size=(BIG_ROWS, BIG_COLUMNS)), 3).tolist()


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_fits_past_the_memory_budget_are_413s_and_the_process_holds_no_more(tmp_path: Path) -> None:
    """Before the budget, twelve such fits held every detector: about 330 MiB more RSS (2.8 GB at max_cells)."""
    config = anomaly_config(max_detector_memory_mb=str(MEMORY_BUDGET_MB))
    with running_predictor(config, tmp_path / "logs") as predictor, predictor.client(timeout=300) as client:
        data = big_rows(0)
        client.post("/v1/anomaly/fit", json={"detector": "warm", "algorithm": "ecod", "data": rows(100)})
        before = rss_kib(predictor.process.pid)
        responses = [client.post("/v1/anomaly/fit", json={"detector": f"d{i}", "algorithm": "ecod", "data": data})
                     for i in range(FITS)]  # fmt: skip
        rise = (rss_kib(predictor.process.pid) - before) * 1024
        assert [r.status_code for r in responses] == [200, 200] + [413] * (FITS - 2)
        error = responses[-1].json()["error"]
        assert (error["code"], error["param"]) == ("detector_budget_exceeded", "data")
        assert f"ecod, {BIG_ROWS} rows x {BIG_COLUMNS} columns" in error["message"]
        assert "(engine arg max_detector_memory_mb)" in error["message"]
        assert f"of the budget of {MEMORY_BUDGET_MB:.1f} MiB" in error["message"]
        assert "Delete a detector no longer needed (DELETE /v1/anomaly/detectors/{name})" in error["message"]
        assert rise < 2 * MEMORY_BUDGET_MB * 2**20, f"RSS rose {rise / 2**20:.0f} MiB"
        # Deleting one frees its share; refitting a name replaces it within the budget.
        assert client.delete("/v1/anomaly/detectors/d0").status_code == 200
        assert (
            client.post("/v1/anomaly/fit", json={"detector": "d2", "algorithm": "ecod", "data": data}).status_code
            == 200
        )
        assert (
            client.post("/v1/anomaly/fit", json={"detector": "d2", "algorithm": "ecod", "data": data}).status_code
            == 200
        )


def test_a_detector_alone_over_the_budget_says_to_fit_it_smaller(tmp_path: Path) -> None:
    config = anomaly_config(max_detector_memory_mb="16")
    with running_predictor(config, tmp_path / "logs") as predictor, predictor.client(timeout=300) as client:
        response = client.post("/v1/anomaly/fit", json={"detector": "big", "algorithm": "ecod", "data": big_rows(1)})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["message"].endswith("Fit it on fewer rows or columns.")


def test_detector_files_past_the_state_budget_are_413s_and_skipped_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # One file of 40,000 x 16 float64 values is 5.4 MB: two do not fit in 8 MiB.
    config = anomaly_config(state, max_state_mb="8")
    with running_predictor(config, tmp_path / "logs") as predictor, predictor.client(timeout=300) as client:
        first = client.post("/v1/anomaly/fit", json={"detector": "a", "algorithm": "pca", "data": big_rows(2)})
        second = client.post("/v1/anomaly/fit", json={"detector": "b", "algorithm": "pca", "data": big_rows(3)})
    assert first.status_code == 200, first.text
    assert second.status_code == 413, second.text
    assert "(engine arg max_state_mb)" in second.json()["error"]["message"]
    assert [p.name for p in (state / "anomaly-detectors").glob("*.npz")] == ["a.npz"]
    # A smaller budget at the next start skips the file instead of loading it, and says why.
    with running_predictor(anomaly_config(state, max_state_mb="4"), tmp_path / "logs2") as predictor:
        listed = httpx.get(f"{predictor.url}/v1/anomaly/detectors", timeout=30).json()
    assert listed["data"] == []
    assert [s["file"] for s in listed["skipped"]] == ["a.npz"]
    assert "max_state_mb" in listed["skipped"][0]["reason"]
