"""A model's own sampling defaults apply where a request is silent (issue 24, item 17), on transformers and
llama.cpp here (vLLM reads the same generation_config.json; its tier runs the shared conformance).

``generation_config.json`` (transformers, vLLM: what ``vllm serve`` applies with ``generation_config="auto"``) and a
GGUF's ``general.sampling.*`` (what llama-server applies) say ``top_k: 1`` here, which makes sampling greedy whatever
the seed: a request without ``temperature`` then gets the greedy answer every time, and one that asks for a
temperature still samples with the model's ``top_k``. Real predictor processes, the real ``openai`` client."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.predictors.generation.tiny_llama import write_gguf
from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.engine import sampling_defaults
from universal_predictors.generation.engines.llamacpp import gguf_sampling_defaults

PROMPT = [{"role": "user", "content": "Tell me about the river"}]


@pytest.fixture(scope="module", params=["transformers", "llamacpp"])
def predictor(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PredictorProcess]:
    root = tmp_path_factory.mktemp(f"sampling-{request.param}")
    if request.param == "transformers":
        source = root / "hf"
        shutil.copytree(tiny_llama_dir, source)
        generation = json.loads((source / "generation_config.json").read_text()) if (
            source / "generation_config.json").exists() else {}  # fmt: skip
        (source / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1, "temperature": 0.7}))
        backend = Backend.TRANSFORMERS
    else:
        source = write_gguf(tiny_llama_dir, root / "tiny.gguf", sampling={"top_k": 1, "temp": 0.7})
        backend = Backend.LLAMACPP
    config = PredictorConfig(model_name="m", task=Task.GENERATE, backend=backend, source=str(source))
    with running_predictor(config, root / "logs") as process:
        yield process


def test_the_models_defaults_are_on_its_card_and_a_silent_request_gets_them(predictor: PredictorProcess) -> None:
    card = httpx.get(f"{predictor.openai_url}/models", timeout=30).json()["data"][0]
    assert card["sampling_defaults"] == {"temperature": 0.7, "top_k": 1.0}
    client = openai.OpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0)
    greedy = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=12, temperature=0)
    # No temperature: the model's 0.7 with its top_k of 1, greedy whatever the seed.
    for seed in (1, 2, 3):
        silent = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=12, seed=seed)
        assert silent.choices[0].message.content == greedy.choices[0].message.content
    # A temperature of its own replaces the model's; the model's top_k still holds (no request field sets it).
    hot = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=12, seed=4, temperature=2.0)
    assert hot.choices[0].message.content == greedy.choices[0].message.content


def test_only_usable_published_defaults_are_taken() -> None:
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20.0,
    }  # fmt: skip
    assert sampling_defaults({"temperature": "hot", "top_p": 0, "top_k": True, "repetition_penalty": 1.1}) == {}
    assert gguf_sampling_defaults({"general.sampling.temp": "0.600000", "general.sampling.top_k": "40",
                                   "general.name": "x"}) == {"temperature": 0.6, "top_k": 40.0}  # fmt: skip
