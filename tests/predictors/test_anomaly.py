"""``task: anomaly`` on real predictor processes: PyOD detectors fitted, scored, persisted and reloaded."""

from __future__ import annotations

import io
import json
import math
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

MODEL = "anomaly"
#: A source that does not exist: anomaly detectors are fitted at run time, the source is never read.
MISSING_SOURCE = "/nonexistent/anomaly-source"
ALGORITHMS = ["iforest", "ecod", "copod", "hbos", "lof", "knn", "ocsvm", "pca"]
#: What every algorithm must reach on the held-out set of :func:`gaussian_with_outliers` (seed 7).
#: Measured there (and on seeds 3 and 11): precision 0.87-1.0, recall 0.9-1.0 for every algorithm.
MIN_PRECISION = 0.8
MIN_RECALL = 0.8


def gaussian_with_outliers(rng: np.random.Generator, inliers: int, outliers: int) -> tuple[np.ndarray, np.ndarray]:
    """4-D standard normal rows, then outliers: normal rows with 3 of 4 coordinates pushed to +-5..8."""
    rows = rng.normal(size=(inliers + outliers, 4))
    for index in range(inliers, inliers + outliers):
        columns = rng.choice(4, size=3, replace=False)
        rows[index, columns] = rng.choice([-1, 1], size=3) * rng.uniform(5, 8, size=3)
    truth = np.r_[np.zeros(inliers, dtype=bool), np.ones(outliers, dtype=bool)]
    return rows, truth


@pytest.fixture(scope="module")
def dataset() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    train, _ = gaussian_with_outliers(rng, 500, 25)  # contamination 0.05, unlabelled at fit
    test, test_truth = gaussian_with_outliers(rng, 200, 20)
    return {"train": train.tolist(), "test": test.tolist(), "test_truth": test_truth}


def config(state_dir: Path | None, **engine_args: str) -> PredictorConfig:
    return PredictorConfig(
        model_name=MODEL,
        task=Task.ANOMALY,
        source=MISSING_SOURCE,
        state_dir=str(state_dir) if state_dir else None,
        engine_args=engine_args,
    )


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("anomaly-state")


@pytest.fixture(scope="module")
def persistent(state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    """A predictor with a state directory (as the operator runs it with spec.state)."""
    with running_predictor(config(state_dir), tmp_path_factory.mktemp("anomaly-logs")) as predictor:
        yield predictor


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    """A predictor without a state directory, with a default detector for KServe v1/v2 and a small cell limit."""
    cfg = config(None, default_detector="gauss", max_cells="20000")
    with running_predictor(cfg, tmp_path_factory.mktemp("anomaly-memory-logs")) as predictor:
        yield predictor


def post(predictor: PredictorProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    with predictor.client() as client:
        return client.post(path, json=body)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    body: dict[str, Any] = response.json()["error"]
    return body


# -- detection quality ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_finds_injected_outliers_with_stated_precision_and_recall(
    persistent: PredictorProcess, dataset: dict[str, Any], algorithm: str
) -> None:
    fitted = ok(
        post(
            persistent,
            "/v1/anomaly/fit",
            {"detector": f"gauss-{algorithm}", "algorithm": algorithm, "data": dataset["train"], "contamination": 0.05},
        )
    )
    assert (fitted["algorithm"], fitted["n_samples"], fitted["n_features"]) == (algorithm, 525, 4)
    assert fitted["persisted"] is True
    result = ok(post(persistent, "/v1/anomaly/detect", {"detector": f"gauss-{algorithm}", "data": dataset["test"]}))
    assert result["threshold"] == fitted["threshold"]
    assert result["threshold_source"] == "contamination"
    flagged = np.array([row["is_anomaly"] for row in result["data"]])
    truth = dataset["test_truth"]
    true_positives = int((flagged & truth).sum())
    precision = true_positives / max(int(flagged.sum()), 1)
    recall = true_positives / int(truth.sum())
    assert precision >= MIN_PRECISION, f"{algorithm}: precision {precision:.3f}"
    assert recall >= MIN_RECALL, f"{algorithm}: recall {recall:.3f}"


def test_normalised_score_is_sigmoid_of_median_and_iqr_and_threshold_comes_from_contamination(
    in_memory: PredictorProcess, dataset: dict[str, Any]
) -> None:
    train = dataset["train"]
    fitted = ok(post(in_memory, "/v1/anomaly/fit", {"detector": "norm-check", "data": train, "contamination": 0.05}))
    scored = ok(post(in_memory, "/v1/anomaly/score", {"detector": "norm-check", "data": train}))
    # For iforest the training scores PyOD keeps equal decision_function on the training rows.
    raw = np.array([row["raw_score"] for row in scored["data"]])
    q25, median, q75 = np.percentile(raw, [25, 50, 75])
    expected = 1 / (1 + np.exp(-(raw - median) / (2 * (q75 - q25))))
    np.testing.assert_allclose([row["score"] for row in scored["data"]], expected, rtol=1e-9, atol=1e-12)
    raw_threshold = np.percentile(raw, 95)
    assert fitted["threshold"] == pytest.approx(1 / (1 + math.exp(-(raw_threshold - median) / (2 * (q75 - q25)))))
    detected = ok(post(in_memory, "/v1/anomaly/detect", {"detector": "norm-check", "data": train}))
    assert detected["summary"]["anomalies"] == int((raw > raw_threshold).sum())


def test_request_threshold_overrides_the_default(in_memory: PredictorProcess, dataset: dict[str, Any]) -> None:
    ok(post(in_memory, "/v1/anomaly/fit", {"detector": "override", "algorithm": "knn", "data": dataset["train"]}))
    body = {"detector": "override", "data": dataset["test"]}
    strict = ok(post(in_memory, "/v1/anomaly/detect", {**body, "threshold": 1}))
    lenient = ok(post(in_memory, "/v1/anomaly/detect", {**body, "threshold": 0}))
    assert (strict["threshold"], strict["threshold_source"]) == (1, "request")
    assert strict["summary"]["anomalies"] == 0  # sigmoid scores are < 1
    assert lenient["summary"]["anomalies"] == len(dataset["test"])


# -- persistence ---------------------------------------------------------------------------------------------


def _poisoned_files(directory: Path) -> None:
    """Files a compromised writer could leave in the state dir: none may crash start-up or be unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "garbage.npz").write_bytes(b"not a zip file")
    # A pickle that would create a file if it were ever unpickled.
    marker = directory.parent / "PWNED"
    payload = pickle.dumps(_Exploit(str(marker)))
    (directory / "pickled.npz").write_bytes(payload)
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array([_Exploit(str(marker))], dtype=object), X=np.zeros((3, 2)))
    (directory / "objects.npz").write_bytes(buffer.getvalue())
    meta = {"format": 1, "name": "tampered", "algorithm": "iforest", "params": {"n_jobs": 64}, "contamination": 0.1,
            "normalization": "standardization", "features": {"n_columns": 2, "schema": None, "categories": {}},
            "fitted_at": 0}  # fmt: skip
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), X=np.zeros((10, 2)),
             training_scores=np.zeros(10))  # fmt: skip
    (directory / "tampered.npz").write_bytes(buffer.getvalue())


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def test_restart_on_the_same_state_dir_returns_the_same_scores_and_skips_bad_files(
    dataset: dict[str, Any], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    probe = dataset["test"][:40]
    amounts, countries = [10.0, 12.5, 11.0, 9.5] * 25, ["DE", "FR", "DE", "NL"] * 25
    rows = [{"amount": a, "country": c} for a, c in zip(amounts, countries, strict=True)]
    fits = {
        "iso": {"algorithm": "iforest", "data": dataset["train"], "params": {"n_estimators": 50}},
        "lof-z": {"algorithm": "lof", "data": dataset["train"], "normalization": "zscore"},
        "payments": {"algorithm": "ecod", "data": rows, "schema": {"amount": "numeric", "country": "categorical"}},
    }
    probes = {"iso": probe, "lof-z": probe, "payments": [*rows[:4], {"amount": 500, "country": "DE"}]}
    before: dict[str, Any] = {}
    with running_predictor(config(state), tmp_path / "first") as first:
        for name, body in fits.items():
            assert ok(post(first, "/v1/anomaly/fit", {"detector": name, **body}))["persisted"] is True
            before[name] = ok(post(first, "/v1/anomaly/detect", {"detector": name, "data": probes[name]}))
        with first.client() as client:
            listed_before = ok(client.get("/v1/anomaly/detectors"))["data"]
    _poisoned_files(state / "anomaly-detectors")

    with running_predictor(config(state), tmp_path / "second") as second:
        with second.client() as client:
            listed_after = ok(client.get("/v1/anomaly/detectors"))["data"]
        after = {n: ok(post(second, "/v1/anomaly/detect", {"detector": n, "data": probes[n]})) for n in fits}
        log = second.log_path.read_text()

    assert listed_after == listed_before  # same names, algorithms, schema, thresholds, fitted_at
    for name in fits:
        for old, new in zip(before[name]["data"], after[name]["data"], strict=True):
            assert new["raw_score"] == pytest.approx(old["raw_score"], abs=1e-9, rel=0)
            assert new["score"] == pytest.approx(old["score"], abs=1e-9, rel=0)
            assert new["is_anomaly"] == old["is_anomaly"]
        assert after[name]["threshold"] == pytest.approx(before[name]["threshold"], abs=1e-9, rel=0)
    for bad in ("garbage", "pickled", "objects", "tampered"):
        assert f"{bad}.npz" in log, f"no warning about {bad}.npz"
    assert not (state / "PWNED").exists()


def test_delete_removes_the_detector_from_memory_and_disk(
    persistent: PredictorProcess, state_dir: Path, dataset: dict[str, Any]
) -> None:
    ok(post(persistent, "/v1/anomaly/fit", {"detector": "doomed", "algorithm": "hbos", "data": dataset["train"]}))
    path = state_dir / "anomaly-detectors" / "doomed.npz"
    assert path.exists()
    with persistent.client() as client:
        deleted = ok(client.delete("/v1/anomaly/detectors/doomed"))
        assert deleted == {"object": "anomaly.detector.deleted", "name": "doomed", "deleted": True}
        assert not path.exists()
        names = [d["name"] for d in ok(client.get("/v1/anomaly/detectors"))["data"]]
        assert "doomed" not in names
        assert error(client.get("/v1/anomaly/detectors/doomed"), 404)["code"] == "detector_not_found"
        assert "'doomed'" in error(client.delete("/v1/anomaly/detectors/doomed"), 404)["message"]
    assert (
        error(post(persistent, "/v1/anomaly/score", {"detector": "doomed", "data": [[0, 0, 0, 0]]}), 404)["param"]
        == "detector"
    )


def test_without_a_state_dir_fits_say_persisted_false_and_the_model_card_says_so(
    in_memory: PredictorProcess, dataset: dict[str, Any]
) -> None:
    fitted = ok(post(in_memory, "/v1/anomaly/fit", {"detector": "volatile", "data": dataset["train"][:100]}))
    assert fitted["persisted"] is False
    with in_memory.client() as client:
        [card] = ok(client.get("/openai/v1/models"))["data"]
        listed = ok(client.get("/v1/anomaly/detectors"))
    assert (card["task"], card["backend"]) == ("anomaly", "pyod")
    assert card["persistence"] is False
    assert card["detectors"] == len(listed["data"]) >= 1
    assert listed["persistence"] is False


def test_model_card_reports_persistence_with_a_state_dir(persistent: PredictorProcess) -> None:
    with persistent.client() as client:
        [card] = ok(client.get("/openai/v1/models"))["data"]
    assert card["persistence"] is True
    assert set(ALGORITHMS) <= set(card["algorithms"])


# -- names and schema ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "/etc/x", "a/b", "..", ".hidden", "", "x" * 65, "a b", "a\\b", "é"])
def test_detector_names_that_are_not_plain_file_names_are_rejected(
    persistent: PredictorProcess, state_dir: Path, name: str
) -> None:
    before = sorted(p.name for p in state_dir.rglob("*"))
    response = post(persistent, "/v1/anomaly/fit", {"detector": name, "data": [[1.0], [2.0], [3.0]]})
    assert error(response, 400)["param"] == "detector"
    assert sorted(p.name for p in state_dir.rglob("*")) == before


@pytest.mark.parametrize("path", ["a%2Fb", "..%2Fx", "a/b", ".hidden"])
def test_path_names_that_are_not_detector_names_are_400s(persistent: PredictorProcess, path: str) -> None:
    with persistent.client() as client:
        for response in (client.delete(f"/v1/anomaly/detectors/{path}"), client.get(f"/v1/anomaly/detectors/{path}")):
            assert error(response, 400)["param"] == "name"


def test_schema_with_categorical_fields_round_trips(persistent: PredictorProcess) -> None:
    rng = np.random.default_rng(3)
    rows = [
        {"amount": float(rng.normal(50, 5)), "country": str(rng.choice(["DE", "FR", "NL"])), "card": bool(i % 2),
         "note": "ignored extra key"}
        for i in range(300)
    ]  # fmt: skip
    schema = {"amount": "numeric", "country": "categorical", "card": "categorical"}
    fitted = ok(post(persistent, "/v1/anomaly/fit", {"detector": "payments", "algorithm": "iforest", "data": rows,
                                                      "schema": schema, "contamination": 0.02}))  # fmt: skip
    assert fitted["schema"] == schema
    assert fitted["categories"] == {"country": ["DE", "FR", "NL"], "card": ["false", "true"]}
    assert (fitted["n_features"], fitted["n_encoded_features"]) == (3, 6)
    with persistent.client() as client:
        assert ok(client.get("/v1/anomaly/detectors/payments"))["schema"] == schema
    probe = [{"amount": 50.0, "country": "FR", "card": True}, {"amount": 400.0, "country": "DE", "card": False},
             {"amount": 50.0, "country": "US", "card": True}]  # fmt: skip
    result = ok(post(persistent, "/v1/anomaly/detect", {"detector": "payments", "data": probe}))
    assert [row["is_anomaly"] for row in result["data"][:2]] == [False, True]
    # An unseen category is not an error: it encodes as all zeros and is reported.
    assert result["unseen_categories"] == {"count": 1, "examples": [{"index": 2, "field": "country", "value": "US"}]}
    missing = post(persistent, "/v1/anomaly/score", {"detector": "payments", "data": [{"amount": 1, "card": True}]})
    assert error(missing, 400)["param"] == "data[0].country"
    numeric_rows = post(persistent, "/v1/anomaly/score", {"detector": "payments", "data": [[1, 2, 3]]})
    assert "schema" in error(numeric_rows, 400)["message"]


# -- malformed input -----------------------------------------------------------------------------------------

ROWS = [[0.0, 1.0], [1.0, 0.0], [0.5, 0.5], [0.2, 0.1]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"data": ROWS}, "detector"),
        ({"detector": "m"}, "data"),
        ({"detector": "m", "data": []}, "data"),
        ({"detector": "m", "data": "1,2"}, "data"),
        ({"detector": "m", "data": ROWS, "algorithm": "autoencoder"}, "algorithm"),
        ({"detector": "m", "data": ROWS, "contamination": 0.7}, "contamination"),
        ({"detector": "m", "data": ROWS, "params": {"n_jobs": 8}}, "params.n_jobs"),
        ({"detector": "m", "data": ROWS, "params": {"n_estimators": 0}}, "params.n_estimators"),
        ({"detector": "m", "data": ROWS, "algorithm": "knn", "params": {"metric": "callable"}}, "params.metric"),
        ({"detector": "m", "data": ROWS, "normalization": "softmax"}, "normalization"),
        ({"detector": "m", "data": ROWS, "contamnation": 0.1}, "contamnation"),
        ({"detector": "m", "data": [[0.0, 1.0], [1.0]]}, "data[1]"),
        ({"detector": "m", "data": [[0.0, 1.0], [1.0, "2"]]}, "data[1][1]"),
        ({"detector": "m", "data": [[0.0, 1.0], [True, 2.0]]}, "data[1][0]"),
        ({"detector": "m", "data": [[0.0, 1.0], [None, 2.0]]}, "data[1][0]"),
        ({"detector": "m", "data": [[0.0, 1.0], [10**400, 2.0]]}, "data[1][0]"),
        ({"detector": "m", "data": [[]]}, "data[0]"),
        ({"detector": "m", "data": ["a", "b"]}, "data[0]"),
        ({"detector": "m", "data": [{"a": 1}, {"a": 2}]}, "schema"),
        ({"detector": "m", "data": [{"a": 1}], "schema": {"a": "text"}}, "schema.a"),
        ({"detector": "m", "data": [{"a": 1}, {"b": 2}], "schema": {"a": "numeric"}}, "data[1].a"),
        ({"detector": "m", "data": [{"a": 1}, {"a": [2]}], "schema": {"a": "categorical"}}, "data[1].a"),
        ({"detector": "m", "data": ROWS, "algorithm": "lof"}, "data"),  # 4 rows, 20 neighbours
    ],
)
def test_malformed_fit_bodies_are_400s_naming_the_field(
    persistent: PredictorProcess, body: dict[str, Any], param: str
) -> None:
    assert error(post(persistent, "/v1/anomaly/fit", body), 400)["param"] == param


def test_non_finite_json_numbers_are_400s(persistent: PredictorProcess) -> None:
    with persistent.client() as client:
        response = client.post(
            "/v1/anomaly/fit",
            content=b'{"detector": "m", "data": [[1.0, 2.0], [NaN, 1.0]]}',
            headers={"Content-Type": "application/json"},
        )
    assert error(response, 400)["param"] == "data[1][0]"


def test_scoring_errors_name_the_detector_the_row_and_the_expected_width(
    persistent: PredictorProcess, dataset: dict[str, Any]
) -> None:
    ok(post(persistent, "/v1/anomaly/fit", {"detector": "width4", "algorithm": "ecod", "data": dataset["train"]}))
    unknown = error(post(persistent, "/v1/anomaly/detect", {"detector": "nope", "data": [[1, 2, 3, 4]]}), 404)
    assert "'nope'" in unknown["message"]
    assert unknown["param"] == "detector"
    width = error(post(persistent, "/v1/anomaly/score", {"detector": "width4", "data": [[1, 2, 3, 4], [1, 2, 3]]}), 400)
    assert width["param"] == "data[1]"
    assert "expected 4 features, got 3" in width["message"]
    value = error(post(persistent, "/v1/anomaly/score", {"detector": "width4", "data": [[1, 2, "x", 4]]}), 400)
    assert value["param"] == "data[0][2]"
    threshold = error(post(persistent, "/v1/anomaly/detect", {"detector": "width4", "data": [[1, 2, 3, 4]],
                                                              "threshold": "high"}), 400)  # fmt: skip
    assert threshold["param"] == "threshold"
    other_model = error(post(persistent, "/v1/anomaly/score", {"model": "x", "detector": "width4", "data": [[1]]}), 404)
    assert other_model["param"] == "model"


def test_requests_over_the_cell_limit_are_413s_naming_the_engine_arg(in_memory: PredictorProcess) -> None:
    rows = [[0.0, 1.0, 2.0, 3.0]] * 5001  # 20,004 values against max_cells=20000
    response = post(in_memory, "/v1/anomaly/fit", {"detector": "big", "data": rows})
    assert "max_cells" in error(response, 413)["message"]


# -- KServe protocols ----------------------------------------------------------------------------------------


def test_kserve_v1_and_v2_score_with_the_default_detector(in_memory: PredictorProcess, dataset: dict[str, Any]) -> None:
    ok(post(in_memory, "/v1/anomaly/fit", {"detector": "gauss", "data": dataset["train"], "contamination": 0.05}))
    probe = [[0.0, 0.0, 0.0, 0.0], [8.0, -8.0, 8.0, 0.0]]
    json_rows = [json.dumps(row) for row in probe]
    expected = ok(post(in_memory, "/v1/anomaly/detect", {"detector": "gauss", "data": probe}))["data"]
    with in_memory.client() as client:
        v1 = ok(client.post(f"/v1/models/{MODEL}:predict", json={"instances": probe}))["predictions"]
        v2_numbers = ok(
            client.post(
                f"/v2/models/{MODEL}/infer",
                json={
                    "inputs": [
                        {"name": "rows", "shape": [2, 4], "datatype": "FP64", "data": [x for row in probe for x in row]}
                    ]
                },
            )
        )
        v2_json = ok(
            client.post(
                f"/v2/models/{MODEL}/infer",
                json={"inputs": [{"name": "rows", "shape": [2], "datatype": "BYTES", "data": json_rows}]},
            )
        )
        bad = client.post(f"/v1/models/{MODEL}:predict", json={"instances": [[1, 2]]})
    assert [p["is_anomaly"] for p in v1] == [False, True]
    for got, want in zip(v1, expected, strict=True):
        assert (got["raw_score"], got["score"]) == (want["raw_score"], want["score"])
    for response in (v2_numbers, v2_json):
        assert response["outputs"][0]["shape"] == [2]
        assert [json.loads(item) for item in response["outputs"][0]["data"]] == v1
    assert "expected 4 features, got 2" in error(bad, 400)["message"]


def test_kserve_protocol_without_a_default_detector_is_a_400_saying_how_to_choose(
    persistent: PredictorProcess, dataset: dict[str, Any]
) -> None:
    for name in ("one", "two"):
        ok(post(persistent, "/v1/anomaly/fit", {"detector": name, "algorithm": "copod", "data": dataset["train"]}))
    with persistent.client() as client:
        response = client.post(f"/v1/models/{MODEL}:predict", json={"instances": [[0, 0, 0, 0]]})
    assert "default_detector" in error(response, 400)["message"]
