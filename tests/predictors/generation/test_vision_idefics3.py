"""Vision-language chat on the transformers engine for the Idefics3 / SmolVLM family: a real predictor
process serving the tiny Idefics3 (:mod:`.tiny_idefics3`, here with image splitting: a 64x48 picture is 2x2
tiles plus the global image, 5 x 4 image tokens with their markers), the real ``openai`` client, real
rendered images. Greedy output equals the same model run in-process by transformers (processor + generate),
usage counts the expanded image tokens, and image rows of different tile counts prefill in one batch with
a text row, each with its solo tokens. (The LLaVA family's cases, limits and refusals: test_vision.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.predictors.generation.conftest import EngineCase, start_engine
from tests.predictors.generation.tiny_idefics3 import Idefics3Shape, build_idefics3
from tests.predictors.generation.tiny_vlm import Reference, data_url, render_image
from tests.predictors.harness import PredictorProcess
from universal_predictors.catalog import Backend

MODEL = "tiny-idefics3"
SHAPE = Idefics3Shape(longest_edge=64)  # 32x32 tiles, up to 2x2 of them plus the global image
WIDE = render_image("A1")  # 64x48: 2x2 tiles + global
STRIP = render_image("ZZ", size=(64, 24), color="red")  # 64x24: 2x1 tiles + global


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-idefics3-tiled") / "hf", SHAPE)


@pytest.fixture(scope="module")
def predictor(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    case = EngineCase(Backend.TRANSFORMERS, "transformers")
    with start_engine(case, model_dir, tmp_path_factory.mktemp("idefics3-transformers"), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(predictor: PredictorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def as_openai(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hugging Face parts (``{"type": "image", "image": PIL}``) as one OpenAI user message."""
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(p["image"])}} if p["type"] == "image" else p
        for p in content
    ]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": "Describe it."}, {"type": "image", "image": WIDE}],
        [
            {"type": "text", "text": "Compare"},
            {"type": "image", "image": WIDE},
            {"type": "text", "text": "with"},
            {"type": "image", "image": STRIP},
        ],
    ],
    ids=["one-image", "two-images"],
)
def test_tiled_images_give_the_tokens_transformers_gives_in_process(
    client: openai.OpenAI, reference: Reference, content: list[dict[str, Any]]
) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=as_openai(content),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=10,
        logprobs=True,
    )
    expected, prompt_len = reference.generate(content, 10)
    assert [entry.token for entry in response.choices[0].logprobs.content] == [reference.token(t) for t in expected]
    assert response.choices[0].message.content == reference.text(expected)
    # Usage counts the image tokens as the engine runs them: every tile's, in the processor's prompt.
    assert response.usage.prompt_tokens == prompt_len
    tiles = {id(WIDE): 5, id(STRIP): 3}
    image_tokens = sum(tiles[id(p["image"])] * SHAPE.image_tokens for p in content if p["type"] == "image")
    assert prompt_len > image_tokens
    assert response.usage.completion_tokens == len(expected) == 10


def test_models_list_names_the_family(predictor: PredictorProcess) -> None:
    card = httpx.get(f"{predictor.openai_url}/models", timeout=10).json()["data"][0]
    assert (card["vision"], card["vision_family"]) == (True, "idefics3")


def test_image_rows_of_different_tile_counts_and_a_text_row_share_one_prefill_with_their_solo_tokens(
    model_dir: Path,
) -> None:
    """The engine itself: a 2x2-tile image, a 2x1-tile image, a two-image prompt and a text prompt arrive
    together (one prefill, their tiles through the vision tower in one pass); each gets its solo tokens."""
    from universal_predictors.catalog import Task
    from universal_predictors.config import PredictorConfig
    from universal_predictors.generation.engine import GenerationRequest, SamplingParams
    from universal_predictors.generation.engines.transformers import TransformersArgs, TransformersEngine

    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(model_dir))
    engine = TransformersEngine(config, TransformersArgs(batch_wait_ms=100))
    engine.load()
    steps: list[tuple[str, int, int]] = []
    engine.step_hook = lambda stage, rows, columns: steps.append((stage, rows, columns))

    def image_request(name: str, images: list[Any]) -> GenerationRequest:
        parts = [{"type": "text", "text": f"Picture {name}:"}, *({"type": "image"} for _ in images)]
        prompt = engine.multimodal_prompt([{"role": "user", "content": parts}], None, images)
        return GenerationRequest(name, prompt.prompt_ids, SamplingParams(12, 0.0), None, prompt)

    chat_text = engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    text = GenerationRequest("t", engine.tokenize(chat_text, add_special_tokens=False), SamplingParams(12, 0.0))
    requests = [image_request("a", [WIDE]), image_request("b", [STRIP]), image_request("c", [STRIP, WIDE]), text]

    async def run(request: GenerationRequest) -> list[int]:
        return [t for chunk in [c async for c in engine.generate(request)] for t in chunk.token_ids]

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        solo = [await run(r) for r in requests]
        steps.clear()
        return solo, list(await asyncio.gather(*(run(r) for r in requests)))

    try:
        solo, batched = asyncio.run(scenario())
    finally:
        engine.unload()
    assert batched == solo
    assert all(len(ids) == 12 for ids in solo)
    assert [rows for stage, rows, _ in steps if stage == "prefill"] == [4]


def test_a_family_this_engine_cannot_prefill_is_refused_at_load_naming_the_served_ones(tmp_path: Path) -> None:
    """Qwen2-VL (3-D rotary positions): the config alone decides, before any weights are read."""
    from transformers import AutoConfig

    from universal_predictors.catalog import Task
    from universal_predictors.config import PredictorConfig
    from universal_predictors.generation.engines.transformers import TransformersArgs, TransformersEngine

    AutoConfig.for_model("qwen2_vl").save_pretrained(tmp_path)
    config = PredictorConfig(model_name="m", task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(tmp_path))
    engine = TransformersEngine(config, TransformersArgs())
    with pytest.raises(RuntimeError) as refused:
        engine.load()
    message = str(refused.value)
    assert "families idefics3, llava, smolvlm; this model is 'qwen2_vl'" in message
    assert message.endswith("serve it with backend vllm")
