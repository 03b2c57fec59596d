"""What every predictor guarantees, pinned on a real process serving the real all-MiniLM-L6-v2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.predictors.harness import PredictorProcess, run_predictor_cli, running_predictor
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig


def test_readiness_and_model_list_describe_the_loaded_model(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        assert client.get("/v2/health/ready").json() == {"ready": True}
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["id"] == "all-minilm-l6-v2"
    assert card["object"] == "model"
    assert card["task"] == "embed"
    assert card["backend"] == "transformers"
    assert card["ready"] is True


def test_unknown_model_is_a_404_naming_the_served_one(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        response = client.post("/openai/v1/embeddings", json={"model": "gpt-4", "input": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "all-minilm-l6-v2" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        (b'{"model": "all-minilm-l6-v2"}', "input"),
        (b'{"model": "all-minilm-l6-v2", "input": 5}', "input"),
        (b'{"model": "all-minilm-l6-v2", "input": "x", "encoding_format": "int8"}', "encoding_format"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(
    embed_predictor: PredictorProcess, body: bytes, param: str | None
) -> None:
    with embed_predictor.client() as client:
        response = client.post("/openai/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "Traceback" not in response.text


def test_unknown_fields_are_ignored(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        response = client.post(
            "/openai/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "x", "some_extension": {"a": 1}}
        )
    assert response.status_code == 200


def test_kserve_v1_and_v2_protocols_answer(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        v1 = client.post("/v1/models/all-minilm-l6-v2:predict", json={"instances": ["hello"]})
        v2 = client.post(
            "/v2/models/all-minilm-l6-v2/infer",
            json={"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["hello", "world"]}]},
        )
        live = client.get("/")
    assert v1.status_code == 200
    assert len(v1.json()["predictions"][0]) == 384
    assert v2.status_code == 200
    assert v2.json()["outputs"][0]["shape"] == [2]
    assert live.json() == {"status": "alive"}


def test_metrics_count_requests_by_outcome(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        client.post("/openai/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "count me"})
        client.post("/openai/v1/embeddings", json={"model": "nope", "input": "x"})
        text = client.get("/metrics").text
    assert 'universal_predictor_requests_total{model="all-minilm-l6-v2",outcome="ok",route="embeddings"}' in text
    assert 'universal_predictor_requests_total{model="all-minilm-l6-v2",outcome="not_found",route="embeddings"}' in text
    assert "universal_predictor_batch_size_bucket" in text


def test_body_over_the_limit_is_a_413_naming_the_limit(minilm_path: Path, tmp_path: Path) -> None:
    config = PredictorConfig(model_name="small-limit", task=Task.EMBED, source=str(minilm_path))
    with (
        running_predictor(config, tmp_path, env={"UNIVERSAL_MAX_BODY_BYTES": "1024"}) as predictor,
        predictor.client() as client,
    ):
        response = client.post("/openai/v1/embeddings", json={"model": "small-limit", "input": "x" * 4096})
    assert response.status_code == 413
    assert "1024 bytes" in response.json()["error"]["message"]


def test_unknown_engine_argument_stops_start_up_with_one_line(minilm_path: Path) -> None:
    result = run_predictor_cli(
        ["--model_name=m", "--task=embed", f"--source={minilm_path}", "--engine-arg=max_batch_sise=8"]
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "max_batch_sise" in line
    assert "max_batch_size" in line  # the known keys are listed


def test_a_model_that_cannot_load_exits_non_zero_with_the_reason(tmp_path: Path) -> None:
    config = PredictorConfig(model_name="missing", task=Task.EMBED, source=str(tmp_path / "nowhere"))
    with pytest.raises(AssertionError, match="exited with 1"), running_predictor(config, tmp_path, ready_within=120):
        pass
