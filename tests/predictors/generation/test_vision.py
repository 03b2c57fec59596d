"""Vision-language chat on the transformers engine: a real predictor process serving the tiny LLaVA
(:mod:`.tiny_vlm`), the real ``openai`` client, real rendered images. Greedy output equals the same model
run in-process by transformers (processor + generate); image and text requests share batches; streaming,
JSON-schema output and tool calls work with an image in the prompt; every limit and bad input is a 400/413
naming the part; an image URL is fetched from an allowed loopback server (what is refused before a
fetch, loopback without the explicit allowance included, is pinned in tests/predictors/test_image_urls.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.predictors.generation.conftest import EngineCase, start_engine
from tests.predictors.generation.tiny_vlm import Reference, VlmShape, data_url, png_bytes, render_image
from tests.predictors.harness import PredictorProcess
from tests.predictors.image_server import ImageServer, image_server
from universal_predictors.catalog import Backend

MODEL = "tiny-vlm"
MAX_IMAGES = 3
MAX_BYTES = 60_000
MAX_PIXELS = 250_000

CASE = EngineCase(
    Backend.TRANSFORMERS,
    "transformers",
    engine_args=(
        ("max_images", str(MAX_IMAGES)),
        ("max_image_bytes", str(MAX_BYTES)),
        ("max_image_pixels", str(MAX_PIXELS)),
        ("image_url_hosts", "127.0.0.1"),
        ("image_url_allow_private", "true"),  # the test server is on loopback: allowed explicitly
    ),
)


@pytest.fixture(scope="module")
def images_served() -> Iterator[ImageServer]:
    with image_server() as running:
        yield running


@pytest.fixture(scope="module")
def predictor(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    with start_engine(CASE, tiny_vlm_dir, tmp_path_factory.mktemp("vlm-transformers"), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(predictor: PredictorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_vlm_dir: Path) -> Reference:
    return Reference(tiny_vlm_dir)


def image_part(image: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image), "detail": "low"}}


def user(*parts: Any) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


PICTURE = render_image("A1")
OTHER = render_image("ZZ", color="red")


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)  # type: ignore[arg-type]


def error_of(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    error = caught.value
    assert isinstance(error.body, dict)
    assert set(error.body) >= {"message", "type", "param", "code"}
    return error


# -- outputs -----------------------------------------------------------------------------------------


def test_models_list_says_the_model_takes_images(predictor: PredictorProcess) -> None:
    card = httpx.get(f"{predictor.openai_url}/models", timeout=10).json()["data"][0]
    assert card["vision"] is True
    assert card["vision_family"] == "llava"


def test_two_images_in_a_message_give_the_tokens_transformers_gives_in_process(
    client: openai.OpenAI, reference: Reference
) -> None:
    messages = user("Compare", image_part(PICTURE), "with", image_part(OTHER), "please.")
    response = chat(client, messages, max_tokens=10, logprobs=True)
    expected, prompt_len = reference.generate(
        [
            {"type": "text", "text": "Compare"},
            {"type": "image", "image": PICTURE},
            {"type": "text", "text": "with"},
            {"type": "image", "image": OTHER},
            {"type": "text", "text": "please."},
        ],
        10,
    )
    assert [entry.token for entry in response.choices[0].logprobs.content] == [reference.token(t) for t in expected]
    assert response.choices[0].message.content == reference.text(expected)
    # Usage counts the image tokens as the engine runs them: 16 per image, in the processor's prompt.
    assert response.usage.prompt_tokens == prompt_len
    assert prompt_len > 2 * VlmShape().image_tokens
    assert response.usage.completion_tokens == len(expected) == 10


def test_the_image_changes_the_answer(client: openai.OpenAI) -> None:
    a = chat(client, user("Describe it.", image_part(PICTURE)), max_tokens=8).choices[0].message.content
    b = chat(client, user("Describe it.", image_part(OTHER)), max_tokens=8).choices[0].message.content
    assert a != b


def test_image_and_text_requests_batched_together_match_their_solo_outputs(
    predictor: PredictorProcess, client: openai.OpenAI
) -> None:
    requests = [user("Describe it.", image_part(render_image(str(i), color=c))) for i, c in enumerate(["red", "green"])]
    requests += [[{"role": "user", "content": f"Tell me about the river {i}."}] for i in range(2)]
    requests += [user("Describe it.", image_part(PICTURE))]
    solo = [chat(client, m, max_tokens=12).choices[0].message.content for m in requests]

    async def together() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0) as aclient:
            results = await asyncio.gather(
                *(
                    aclient.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=12)  # type: ignore[arg-type]
                    for m in requests * 2
                )
            )
        return [r.choices[0].message.content for r in results]

    assert asyncio.run(together()) == solo * 2


def test_streaming_with_an_image_equals_the_unary_answer(client: openai.OpenAI) -> None:
    messages = user(image_part(PICTURE), "What is this?")
    whole = chat(client, messages, max_tokens=10)
    chunks = list(chat(client, messages, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    both = chat(client, messages, max_tokens=10, n=2)  # the n choices share one processed prompt
    assert [c.message.content for c in both.choices] == [whole.choices[0].message.content] * 2
    assert both.usage.prompt_tokens == whole.usage.prompt_tokens


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["city", "count"],
    "additionalProperties": False,
}


def test_json_schema_output_with_an_image_in_the_prompt(client: openai.OpenAI) -> None:
    response = chat(
        client,
        user("Which city is on the picture?", image_part(PICTURE)),
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), CITY)


def test_a_forced_tool_call_with_an_image_in_the_prompt(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "tag_image", "parameters": CITY}}]
    messages = user("Tag this picture.", image_part(PICTURE))
    for stream in (False, True):
        kwargs: dict[str, Any] = {"tools": tools, "tool_choice": "required", "max_tokens": 60}
        if not stream:
            call = chat(client, messages, **kwargs).choices[0].message.tool_calls[0]
            name, arguments = call.function.name, call.function.arguments
        else:
            chunks = list(chat(client, messages, stream=True, **kwargs))
            deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
            name = next(d.function.name for d in deltas if d.function and d.function.name)
            arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        assert name == "tag_image"
        jsonschema.validate(json.loads(arguments), CITY)


def test_an_image_url_from_an_allowed_host_is_fetched(client: openai.OpenAI, images_served: ImageServer) -> None:
    images_served.bodies["picture.png"] = png_bytes(PICTURE)
    by_url = {"type": "image_url", "image_url": {"url": images_served.url("/picture.png")}}
    fetched = chat(client, user("Describe it.", by_url), max_tokens=8).choices[0].message.content
    inline = chat(client, user("Describe it.", image_part(PICTURE)), max_tokens=8).choices[0].message.content
    assert fetched == inline
    assert "/picture.png" in images_served.requests


def test_text_only_requests_still_work_on_a_vision_model(client: openai.OpenAI) -> None:
    response = chat(client, [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], max_tokens=4)
    assert response.usage.completion_tokens == 4


# -- refusals ----------------------------------------------------------------------------------------

FIELD = "messages[0].content[1].image_url"


def data(payload: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(payload).decode()}}


@pytest.mark.parametrize(
    ("part", "code", "says"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not-base64@@@"}},
            "invalid_base64",
            "base64",
        ),
        (data(b"just some text, not a picture"), "unsupported_image_format", "PNG, JPEG, TIFF or WebP"),
        (data(png_bytes(PICTURE, "GIF"), "image/gif"), "unsupported_image_format", "received GIF"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "invalid_image_url", "base64"),
        ({"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}, "invalid_image_url", "http(s)"),
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            "image_url_not_allowed",
            "image_url_hosts",
        ),
    ],
    ids=["bad-base64", "not-an-image", "gif", "not-base64-data-url", "other-scheme", "host-not-allowed"],
)
def test_bad_images_are_400_naming_the_part(client: openai.OpenAI, part: dict[str, Any], code: str, says: str) -> None:
    error = error_of(lambda: chat(client, user("Look:", part), max_tokens=2))
    assert error.status_code == 400
    assert error.body["param"] == FIELD
    assert error.body["code"] == code
    assert says in error.body["message"]  # type: ignore[index]


def test_more_images_than_max_images_is_413(client: openai.OpenAI) -> None:
    parts = [image_part(PICTURE)] * (MAX_IMAGES + 1)
    error = error_of(lambda: chat(client, user("Many:", *parts), max_tokens=2))
    assert error.status_code == 413
    assert error.body["code"] == "too_many_images"
    assert f"the limit max_images is {MAX_IMAGES}" in error.body["message"]  # type: ignore[index]
    assert error.body["param"] == f"messages[0].content[{MAX_IMAGES + 1}].image_url"  # type: ignore[index]


def test_an_image_over_the_byte_or_pixel_limit_is_413(client: openai.OpenAI) -> None:
    import random

    from PIL import Image

    noise = Image.frombytes("RGB", (200, 200), random.Random(0).randbytes(200 * 200 * 3))  # incompressible
    assert len(png_bytes(noise)) > MAX_BYTES
    error = error_of(lambda: chat(client, user("Big:", image_part(noise)), max_tokens=2))
    assert error.status_code == 413
    assert "max_image_bytes" in error.body["message"]
    wide = Image.new("RGB", (1000, 300), "white")  # small file, many pixels
    assert len(png_bytes(wide)) < MAX_BYTES
    error = error_of(lambda: chat(client, user("Wide:", image_part(wide)), max_tokens=2))
    assert error.status_code == 413
    assert error.body["param"] == FIELD
    assert f"1000x300 is 300000 pixels; the limit max_image_pixels is {MAX_PIXELS}" in error.body["message"]  # type: ignore[index]


def test_a_large_image_within_the_limits_is_downscaled_and_answered(client: openai.OpenAI) -> None:
    large = render_image("big", size=(480, 360))
    response = chat(client, user("Describe it.", image_part(large)), max_tokens=3)
    assert response.usage.completion_tokens == 3


def test_images_outside_user_messages_and_other_part_types_are_400(client: openai.OpenAI) -> None:
    system = [{"role": "system", "content": [image_part(PICTURE)]}, {"role": "user", "content": "Hi"}]
    error = error_of(lambda: chat(client, system, max_tokens=2))
    assert error.status_code == 400
    assert "only allowed in user messages" in error.body["message"]
    audio = user("Hear:", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    error = error_of(lambda: chat(client, audio, max_tokens=2))
    assert error.status_code == 400
    assert "input_audio" in error.body["message"]


# -- engine args ---------------------------------------------------------------------------------------


def test_the_image_limits_are_the_openai_layers_engine_args_on_every_backend(
    tiny_llama_dir: Path, tiny_llama_gguf: Path
) -> None:
    """The engines, which reject keys they do not know, never see them; a bad value stops start-up naming it."""
    from universal_predictors.base import StartupError
    from universal_predictors.catalog import Task
    from universal_predictors.config import PredictorConfig
    from universal_predictors.tasks.generate import GeneratePredictor

    def config(backend: Backend, **engine_args: str) -> PredictorConfig:
        source = tiny_llama_gguf if backend is Backend.LLAMACPP else tiny_llama_dir
        return PredictorConfig(
            model_name="m", task=Task.GENERATE, backend=backend, source=str(source), engine_args=engine_args
        )

    for backend in (Backend.TRANSFORMERS, Backend.LLAMACPP):
        predictor = GeneratePredictor(config(backend, max_images="2", image_url_hosts="a.example.com, *.b.example.com"))
        assert predictor.service.image_args.max_images == 2
        assert predictor.service.image_args.url_policy().hosts == ("a.example.com", "*.b.example.com")
    with pytest.raises(StartupError) as error:
        GeneratePredictor(config(Backend.TRANSFORMERS, max_image_bytes="lots"))
    assert "'max_image_bytes'" in str(error.value)
    assert "\n" not in str(error.value)


# -- the engine's batching, in-process ------------------------------------------------------------------


def test_image_rows_share_one_prefill_and_join_a_running_batch_with_their_solo_tokens(tiny_vlm_dir: Path) -> None:
    """The transformers engine itself: three image prompts and a text prompt arrive together (one prefill,
    one vision-tower pass), then an image prompt joins the running batch (a cache merge); every sequence
    gets the tokens it gets alone."""
    from universal_predictors.catalog import Task
    from universal_predictors.config import PredictorConfig
    from universal_predictors.generation.engine import GenerationRequest, SamplingParams
    from universal_predictors.generation.engines.transformers import TransformersArgs, TransformersEngine

    config = PredictorConfig(
        model_name=MODEL, task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(tiny_vlm_dir)
    )
    engine = TransformersEngine(config, TransformersArgs(batch_wait_ms=100))
    engine.load()
    steps: list[tuple[str, int, int]] = []
    engine.step_hook = lambda stage, rows, columns: steps.append((stage, rows, columns))

    def image_request(i: int, max_tokens: int = 12) -> GenerationRequest:
        parts = [{"type": "text", "text": f"Picture {i}:"}, {"type": "image"}]
        prompt = engine.multimodal_prompt([{"role": "user", "content": parts}], None, [render_image(str(i))])
        return GenerationRequest(f"i{i}", prompt.prompt_ids, SamplingParams(max_tokens, 0.0), None, prompt)

    chat_text = engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    text = GenerationRequest("t", engine.tokenize(chat_text, add_special_tokens=False), SamplingParams(100, 0.0))

    async def run(request: GenerationRequest, started: asyncio.Event | None = None) -> list[int]:
        ids: list[int] = []
        async for chunk in engine.generate(request):
            ids += chunk.token_ids
            if started is not None:
                started.set()
        return ids

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        solo = [await run(r) for r in (image_request(0), image_request(1), image_request(2), text, image_request(3, 6))]
        steps.clear()
        started = asyncio.Event()
        first = asyncio.gather(*(run(image_request(i)) for i in range(3)), run(text, started))
        await started.wait()  # the first prefill is done and the batch decodes: the next one joins it
        late = await run(image_request(3, 6))
        return solo, [*(await first), late]

    try:
        solo, batched = asyncio.run(scenario())
    finally:
        engine.unload()
    assert batched == solo
    prefills = [i for i, (stage, _, _) in enumerate(steps) if stage == "prefill"]
    assert [steps[i][1] for i in prefills] == [4, 1]  # three image rows and a text row in one prefill, then one
    after = [rows for stage, rows, _ in steps[prefills[1] :] if stage == "decode"]
    assert max(after) >= 2  # the late image row decoded in the running batch (its cache merged)
