"""``task: embed`` on a real predictor process serving the real all-MiniLM-L6-v2."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.predictors.harness import PredictorProcess

#: The session fixtures (extra predictor processes, in-process reference models) live there.
pytest_plugins = ["tests.predictors.fixtures_encoders"]

MODEL = "all-minilm-l6-v2"
SENTENCES = [
    "A man is playing a guitar on the stage.",
    "The new movie is awesome.",
    "Stock markets fell sharply after the announcement of higher interest rates by the central bank.",
    "hi",
    "Quantum computers use qubits, which can be in superpositions of states, to perform some calculations faster.",
]


def embed(predictor: PredictorProcess, body: dict[str, Any]) -> httpx.Response:
    with predictor.client() as client:
        return client.post("/openai/v1/embeddings", json={"model": predictor.config.model_name, **body})


def vectors_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def test_a_sentence_is_closer_to_its_paraphrase_than_to_an_unrelated_one(embed_predictor: PredictorProcess) -> None:
    texts = ["The cat sits on the mat.", "A cat is sitting on a rug.", "The stock market crashed today."]
    anchor, paraphrase, unrelated = vectors_of(embed(embed_predictor, {"input": texts}))
    assert float(anchor @ paraphrase) > float(anchor @ unrelated) + 0.3
    assert np.linalg.norm(anchor) == pytest.approx(1.0, abs=1e-5)


def test_vectors_equal_in_process_sentence_transformers_encode(
    embed_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    served = vectors_of(embed(embed_predictor, {"input": SENTENCES}))
    reference = minilm_in_process.encode(SENTENCES, convert_to_numpy=True)
    assert served.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(served, reference, atol=1e-5, rtol=0)


def test_base64_decodes_to_the_same_floats(embed_predictor: PredictorProcess) -> None:
    floats = vectors_of(embed(embed_predictor, {"input": SENTENCES[:2]}))
    response = embed(embed_predictor, {"input": SENTENCES[:2], "encoding_format": "base64"})
    assert response.status_code == 200
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in response.json()["data"]]
    np.testing.assert_array_equal(np.stack(decoded), floats)


def test_usage_counts_the_tokenizers_tokens(embed_predictor: PredictorProcess, minilm_in_process: Any) -> None:
    expected = sum(len(ids) for ids in minilm_in_process.tokenizer(SENTENCES)["input_ids"])
    usage = embed(embed_predictor, {"input": SENTENCES}).json()["usage"]
    assert usage == {"prompt_tokens": expected, "total_tokens": expected}


def test_openai_client_embeddings_create_works_unchanged(
    embed_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    client = OpenAI(base_url=embed_predictor.openai_url, api_key="x", max_retries=0)
    many = client.embeddings.create(model=MODEL, input=SENTENCES)  # the client asks for base64 by default
    one = client.embeddings.create(model=MODEL, input="hi", encoding_format="float")
    reference = minilm_in_process.encode(SENTENCES)
    np.testing.assert_allclose(np.array([d.embedding for d in many.data]), reference, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(one.data[0].embedding), reference[3], atol=1e-5, rtol=0)
    assert many.model == MODEL
    assert many.usage.prompt_tokens > len(SENTENCES)


def _batches_over_one(predictor: PredictorProcess, metric: Callable[..., float]) -> float:
    with predictor.client() as client:
        text = client.get("/metrics").text
    name = predictor.config.model_name
    total = metric(text, "universal_predictor_batch_size_count", model=name)
    singles = metric(text, "universal_predictor_batch_size_bucket", model=name, le="1.0")
    return total - singles


@pytest.mark.parametrize("fixture", ["embed_predictor", "plain_embed_predictor"])
def test_64_concurrent_requests_return_what_each_would_alone(
    request: pytest.FixtureRequest, fixture: str, metric: Callable[..., float]
) -> None:
    predictor: PredictorProcess = request.getfixturevalue(fixture)
    # Distinct texts of very different lengths, so a mixed-up or mis-ordered result cannot pass.
    texts = [f"request {i}: " + " ".join(SENTENCES[i % len(SENTENCES)].split()[: 1 + i % 11]) for i in range(64)]
    alone = [vectors_of(embed(predictor, {"input": t}))[0] for t in texts]
    before = _batches_over_one(predictor, metric)

    def send(text: str) -> np.ndarray:
        return vectors_of(embed(predictor, {"input": text}))[0]

    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        together = list(pool.map(send, texts))
    for i, (mine, reference) in enumerate(zip(together, alone, strict=True)):
        np.testing.assert_allclose(mine, reference, atol=1e-5, rtol=0, err_msg=f"request {i}")
    assert _batches_over_one(predictor, metric) > before, "no batch of more than one request formed"


def test_over_length_input_is_a_400_naming_the_input_and_the_lengths(
    embed_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    long_text = "word " * 400
    length = len(minilm_in_process.tokenizer(long_text)["input_ids"])
    response = embed(embed_predictor, {"input": ["short", long_text]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "input[1]"
    assert error["code"] == "context_length_exceeded"
    assert str(length) in error["message"]
    assert "256" in error["message"]
    assert "truncate" in error["message"]


def test_truncate_extension_cuts_over_length_input_to_the_limit(
    embed_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    long_text = "The quick brown fox jumps over the lazy dog. " * 60
    response = embed(embed_predictor, {"input": [long_text, "short"], "truncate": True})
    served = vectors_of(response)
    # sentence-transformers itself cuts to max_seq_length (256): the same vector.
    np.testing.assert_allclose(served, minilm_in_process.encode([long_text, "short"]), atol=1e-5, rtol=0)
    assert response.json()["usage"]["prompt_tokens"] == 256 + 3


def test_token_id_input_gives_the_vectors_of_the_text(
    embed_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    ids = minilm_in_process.tokenizer(SENTENCES[:3])["input_ids"]
    by_text = vectors_of(embed(embed_predictor, {"input": SENTENCES[:3]}))
    many = embed(embed_predictor, {"input": ids})
    one = embed(embed_predictor, {"input": ids[0]})
    np.testing.assert_allclose(vectors_of(many), by_text, atol=1e-5, rtol=0)
    np.testing.assert_allclose(vectors_of(one)[0], by_text[0], atol=1e-5, rtol=0)
    assert many.json()["usage"]["prompt_tokens"] == sum(len(x) for x in ids)


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([101, 99999999, 102], "input[0]"),
        ([[101, 102], [101, -1, 102]], "input[1]"),
        ([[101, 102], []], "input[1]"),
        ([], "input"),
        (["fine", ""], "input[1]"),
        ([1.5, 2], "input"),
    ],
)
def test_bad_inputs_are_400s_naming_the_input(embed_predictor: PredictorProcess, value: Any, param: str) -> None:
    response = embed(embed_predictor, {"input": value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_dimensions_on_a_model_without_matryoshka_is_a_400_saying_so(embed_predictor: PredictorProcess) -> None:
    response = embed(embed_predictor, {"input": "x", "dimensions": 128})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "dimensions"
    assert "does not support truncated embeddings" in error["message"]
    assert embed(embed_predictor, {"input": "x", "dimensions": 384}).status_code == 200


def test_models_list_describes_the_embedding_model(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["dimensions"] == 384
    assert card["max_input_tokens"] == 256
    assert card["normalized"] is True
    assert card["matryoshka_dimensions"] is None
    assert card["engine"] == "sentence-transformers"


def test_kserve_v1_returns_the_openai_vectors(embed_predictor: PredictorProcess) -> None:
    with embed_predictor.client() as client:
        v1 = client.post(f"/v1/models/{MODEL}:predict", json={"instances": SENTENCES[:2]})
        bad = client.post(f"/v1/models/{MODEL}:predict", json={"instances": [""]})
    np.testing.assert_allclose(
        np.array(v1.json()["predictions"]), vectors_of(embed(embed_predictor, {"input": SENTENCES[:2]})), atol=1e-6
    )
    assert bad.status_code == 400


def test_plain_transformers_directory_gets_mean_pooling_and_normalisation(
    plain_embed_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    # all-MiniLM-L6-v2's own pipeline is mean pooling + normalisation: the plain directory must match it.
    served = vectors_of(embed(plain_embed_predictor, {"input": SENTENCES}))
    np.testing.assert_allclose(served, minilm_in_process.encode(SENTENCES), atol=1e-5, rtol=0)
    with plain_embed_predictor.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["engine"] == "transformers"
    assert card["max_input_tokens"] == 512
    assert card["matryoshka_dimensions"] == [384, 256, 128]


def test_dimensions_truncate_and_renormalise_when_the_model_declares_matryoshka(
    plain_embed_predictor: PredictorProcess,
) -> None:
    full = vectors_of(embed(plain_embed_predictor, {"input": SENTENCES[:2]}))
    cut = vectors_of(embed(plain_embed_predictor, {"input": SENTENCES[:2], "dimensions": 128}))
    assert cut.shape == (2, 128)
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6, rtol=0)
    too_many = embed(plain_embed_predictor, {"input": "x", "dimensions": 385})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "dimensions"


def test_llamacpp_serves_a_gguf_model_with_the_vectors_transformers_computes(
    llamacpp_embed_predictor: PredictorProcess, tiny_llama_embed_dirs: tuple[Path, Path]
) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = ["The river in Paris is open from 3 to 11, said the guide.", "Hello, how are you today?"]
    response = embed(llamacpp_embed_predictor, {"input": texts})
    served = vectors_of(response)
    # A GGUF without a pooling type: the token states are mean-pooled, then L2-normalised.
    hf_dir = tiny_llama_embed_dirs[0]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModel.from_pretrained(hf_dir).eval()
    ids = [tokenizer(t)["input_ids"] for t in texts]
    for row, seq in enumerate(ids):
        with torch.inference_mode():
            state = model(torch.tensor([seq])).last_hidden_state[0].mean(0).numpy()
        np.testing.assert_allclose(served[row], state / np.linalg.norm(state), atol=5e-4, rtol=0)
    assert response.json()["usage"]["prompt_tokens"] == sum(len(s) for s in ids)
    np.testing.assert_allclose(vectors_of(embed(llamacpp_embed_predictor, {"input": ids})), served, atol=1e-5)
    too_long = embed(llamacpp_embed_predictor, {"input": "Paris " * 200})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "input[0]"
    assert embed(llamacpp_embed_predictor, {"input": "Paris " * 200, "truncate": True}).status_code == 200
    with llamacpp_embed_predictor.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert (card["backend"], card["engine"], card["max_input_tokens"]) == ("llamacpp", "llamacpp", 64)
