"""The OpenAI chat/completions contract, pinned on a real predictor process per engine with the real
``openai`` client. Adding an engine is one entry in ``ENGINES``; an engine whose package is missing is
skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.predictors.generation.conftest import EngineCase, case_predictor, engine_params, start_engine
from tests.predictors.generation.tiny_llama import write_gguf
from tests.predictors.generation.tiny_vlm import data_url, render_image
from tests.predictors.harness import PredictorProcess
from universal_predictors.catalog import Backend
from universal_predictors.config import USAGE_COMMENTS_HEADER

ENGINES = [
    EngineCase(Backend.TRANSFORMERS, "transformers"),
    EngineCase(Backend.LLAMACPP, "llama_cpp", gguf=True),
    # fp32 (vLLM downcasts to bf16 on CPU) so batched and solo greedy outputs agree; a small KV cache.
    EngineCase(
        Backend.VLLM,
        "vllm",
        engine_args=(("dtype", "float32"), ("enforce_eager", "true"), ("kv_cache_memory_bytes", "256M")),
    ),
]

MODEL = "tiny-llama"


@pytest.fixture(scope="module", params=engine_params(ENGINES), ids=lambda case: case.backend.value)
def engine_case(request: pytest.FixtureRequest) -> EngineCase:
    case: EngineCase = request.param
    return case


@pytest.fixture(scope="module")
def predictor(
    engine_case: EngineCase, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PredictorProcess]:
    with case_predictor(engine_case, request, tmp_path_factory, "gen") as running:
        yield running


@pytest.fixture(scope="module")
def client(predictor: PredictorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def metric(predictor: PredictorProcess, name: str) -> float:
    text = httpx.get(f"{predictor.url}/metrics", timeout=10).text
    match = re.search(rf'^{name}\{{model="{MODEL}"\}} ([0-9.e+]+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def chat(client: openai.OpenAI, content: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)  # type: ignore[call-overload,no-any-return]


# -- basics -----------------------------------------------------------------------------------------


def test_models_list_reports_the_resolved_backend_and_context(
    predictor: PredictorProcess, engine_case: EngineCase
) -> None:
    [card] = httpx.get(f"{predictor.openai_url}/models").json()["data"]
    assert card["id"] == MODEL
    assert card["backend"] == engine_case.backend.value
    assert card["context_length"] == 512


def test_chat_returns_text_with_the_tokenizers_true_usage(client: openai.OpenAI, tokenizer: object) -> None:
    response = chat(client, "Hello there", max_tokens=7, temperature=0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}],
        add_generation_prompt=True,  # type: ignore[attr-defined]
        tokenize=False,
    )
    prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == prompt_tokens + 7


def test_streamed_chat_equals_the_unary_answer_and_reports_usage_last(client: openai.OpenAI) -> None:
    unary = chat(client, "Tell me about Oslo", max_tokens=12, temperature=0)
    stream = chat(
        client, "Tell me about Oslo", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stream_carries_its_token_counts_as_comments_when_the_gateway_asks(predictor: PredictorProcess) -> None:
    """With the gateway's header, a comment before each piece gives the tokens so far (over both choices) and the
    last one the answer's usage; without it, no comment (clients never see them: the gateway takes them out)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about Oslo"}], "max_tokens": 10,
            "temperature": 0, "n": 2, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    url = f"{predictor.openai_url}/chat/completions"
    asked = httpx.post(url, json=body, headers={USAGE_COMMENTS_HEADER: "1"}, timeout=120).text
    plain = httpx.post(url, json=body, timeout=120).text
    events = [e for e in asked.split("\n\n") if e]
    counts = [json.loads(e.removeprefix(": usage ")) for e in events if e.startswith(": usage ")]
    assert ": usage" not in plain

    def texts(stream: str) -> dict[int, str]:
        out: dict[int, str] = {}
        for event in stream.split("\n\n"):
            if event.startswith("data: {"):
                for choice in json.loads(event.removeprefix("data: "))["choices"]:
                    out[choice["index"]] = out.get(choice["index"], "") + (choice["delta"].get("content") or "")
        return out

    assert texts(asked) == texts(plain)  # the same answer, the comments aside
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]  # the usage chunk, before [DONE]
    assert counts[-1] == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]}
    generated = [c["completion_tokens"] for c in counts]
    assert generated == sorted(generated)
    assert generated[-1] == 20  # two choices of 10
    first_piece = next(i for i, e in enumerate(events) if '"content": "' in e and '"content": ""' not in e)
    assert events[first_piece - 1].startswith(": usage ")  # the count comes before the piece it counts


def test_completions_unary_and_streamed_agree(client: openai.OpenAI) -> None:
    unary = client.completions.create(model=MODEL, prompt="The river in Paris", max_tokens=10, temperature=0)
    streamed = client.completions.create(
        model=MODEL, prompt="The river in Paris", max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed)
    assert text == unary.choices[0].text
    assert unary.choices[0].finish_reason == "length"
    assert unary.usage is not None
    assert unary.usage.completion_tokens == 10


def test_completions_take_a_list_of_prompts_each_with_n_choices(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=["one", "two three"], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: both choices of a prompt agree
    assert response.usage is not None
    assert response.usage.completion_tokens == 12


# -- stops, lengths, seeds ---------------------------------------------------------------------------


def test_a_stop_string_split_across_tokens_ends_the_text_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Numbers: 1 2 3", max_tokens=24, temperature=0, logprobs=0)
    tokens = full.choices[0].logprobs.tokens  # type: ignore[union-attr]
    text = full.choices[0].text
    assert "".join(tokens) == text
    # A stop made of the end of one token and the start of the next, first occurring at that boundary.
    for i in range(2, len(tokens) - 1):
        left, right = tokens[i], tokens[i + 1]
        if left.isprintable() and right.isprintable() and left.strip() and right.strip():
            stop = left[-1] + right[0]
            boundary = len("".join(tokens[: i + 1]))
            if text.find(stop) == boundary - 1:
                break
    else:
        pytest.fail(f"no usable token boundary in {tokens!r}")
    stopped = client.completions.create(model=MODEL, prompt="Numbers: 1 2 3", max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: boundary - 1]
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="Numbers: 1 2 3", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: boundary - 1]


def test_max_tokens_beyond_the_context_is_clipped_and_reported_as_length(
    client: openai.OpenAI, tokenizer: object
) -> None:
    prompt = " river" * 500
    prompt_tokens = len(tokenizer(prompt)["input_ids"])  # type: ignore[operator]
    assert prompt_tokens < 512
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 512 - prompt_tokens


def test_a_prompt_over_the_context_is_a_400_with_the_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, "river " * 700, max_tokens=5)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert "512" in error["message"]


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(client: openai.OpenAI) -> None:
    first = chat(client, "Pick words", max_tokens=16, temperature=1.0, seed=7).choices[0].message.content
    again = chat(client, "Pick words", max_tokens=16, temperature=1.0, seed=7).choices[0].message.content
    other = chat(client, "Pick words", max_tokens=16, temperature=1.0, seed=8).choices[0].message.content
    assert first == again
    assert first != other


def test_n_gives_independent_choices(client: openai.OpenAI) -> None:
    response = chat(client, "Pick words", max_tokens=16, temperature=1.0, seed=3, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content != response.choices[1].message.content
    assert response.usage is not None
    assert response.usage.completion_tokens == 32


# -- structured output and tools ---------------------------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "open": {"type": "boolean"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "open", "unit"],
}


def test_json_schema_output_parses_and_validates(client: openai.OpenAI) -> None:
    response = chat(
        client,
        "Describe a city as JSON",
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), CITY_SCHEMA)


def test_json_object_output_is_a_json_object(client: openai.OpenAI) -> None:
    response = chat(
        client, "Anything as JSON", max_tokens=120, temperature=1.0, seed=1, response_format={"type": "json_object"}
    )
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content or ""), dict)
    else:  # an unbounded object may run out of tokens: then it says so
        assert response.choices[0].finish_reason == "length"


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY_SCHEMA},
}


def test_a_forced_tool_call_returns_arguments_that_validate(client: openai.OpenAI) -> None:
    response = chat(
        client,
        "Weather in Paris?",
        max_tokens=300,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)  # type: ignore[union-attr]


def test_tool_choice_required_picks_one_of_the_tools(client: openai.OpenAI) -> None:
    response = chat(
        client,
        "Weather in Lima?",
        max_tokens=300,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        stream=True,
    )
    chunks = list(response)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # The first piece names the call; later pieces carry only more of its arguments.
    assert [c.function.name for c in calls if c.function and c.function.name] == ["get_weather"]
    arguments = "".join(c.function.arguments or "" for c in calls if c.function)
    jsonschema.validate(json.loads(arguments), CITY_SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_a_streamed_tool_call_arrives_in_pieces_and_assembles_to_the_unary_call(
    client: openai.OpenAI, tool_choice: object
) -> None:
    kwargs: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 300,
        "temperature": 0,
        "tools": [WEATHER_TOOL],
        "tool_choice": tool_choice,
    }
    unary = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    [unary_call] = unary.choices[0].message.tool_calls or []
    with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
        pieces = [
            call
            for event in stream
            if event.type == "chunk" and event.chunk.choices
            for call in event.chunk.choices[0].delta.tool_calls or []
        ]
        final = stream.get_final_completion()
    # The first piece names the call as soon as it is known; the arguments follow in later pieces
    # (as many as the engine's chunks: a fast engine may deliver them in one) that name nothing.
    head, *rest = pieces
    assert head.id
    assert head.type == "function"
    assert head.function is not None
    assert (head.function.name, head.function.arguments) == ("get_weather", "")
    assert rest
    assert all(p.id is None and p.function is not None and p.function.name is None for p in rest)
    assert all(p.index == 0 for p in pieces)
    [streamed_call] = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == unary.choices[0].finish_reason == "tool_calls"
    assert streamed_call.function.name == unary_call.function.name == "get_weather"  # type: ignore[union-attr]
    assert streamed_call.function.arguments == unary_call.function.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(streamed_call.function.arguments), CITY_SCHEMA)  # type: ignore[union-attr]


# Every bound constrained decoding must enforce, at once. The model has random weights (the weakest
# model there is) and samples at temperature 1.0: a valid answer comes from the constraint, never luck.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 5},
        "count": {"type": "integer", "minimum": 3, "maximum": 7},
        "ratio": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 9},
        "color": {"enum": ["red", "green", "blue"]},
        "grid": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
            },
        },
    },
    "required": ["code", "count", "ratio", "color", "grid"],
    "additionalProperties": False,
}

BOUNDED_TOOL = {
    "type": "function",
    "function": {
        "name": "book_trip",
        "description": "Book a trip",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 6},
                "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                "budget": {"type": "number", "exclusiveMinimum": 0, "maximum": 500},
            },
            "required": ["city", "nights", "budget"],
            "additionalProperties": False,
        },
    },
}


def load_constrained(text: str, engine_case: EngineCase) -> object:
    """Constrained output as strict JSON on every engine (no raw control characters in strings: vLLM's xgrammar
    backend let a tab through; its guidance backend, which the vLLM engine now uses, does not)."""
    return json.loads(text, strict=True)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_bounds_hold_for_a_random_model_sampling_freely(
    client: openai.OpenAI, engine_case: EngineCase, seed: int
) -> None:
    response = chat(
        client,
        "Describe anything as JSON",
        max_tokens=400,
        temperature=1.0,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED_SCHEMA}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(load_constrained(choice.message.content or "", engine_case), BOUNDED_SCHEMA)


@pytest.mark.parametrize(
    ("seed", "tool_choice"),
    [(1, {"type": "function", "function": {"name": "book_trip"}}), (2, "required"), (3, "required")],
    ids=["named", "required-2", "required-3"],
)
def test_a_forced_tool_calls_arguments_keep_the_tools_bounds(
    client: openai.OpenAI, engine_case: EngineCase, seed: int, tool_choice: object
) -> None:
    response = chat(
        client,
        "Book me a trip",
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        tools=[BOUNDED_TOOL],
        tool_choice=tool_choice,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "book_trip"  # type: ignore[union-attr]
    arguments = load_constrained(call.function.arguments, engine_case)  # type: ignore[union-attr]
    jsonschema.validate(arguments, BOUNDED_TOOL["function"]["parameters"])  # type: ignore[index]


NOT_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("param", ["response_format", "tools"])
def test_a_schema_keyword_that_cannot_be_enforced_is_a_400_naming_it_and_the_param(
    predictor: PredictorProcess, param: str, stream: bool
) -> None:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 20,
        "stream": stream,
    }
    if param == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "neg", "schema": NOT_SCHEMA}}
    else:
        body["tools"] = [{"type": "function", "function": {"name": "neg", "parameters": NOT_SCHEMA}}]
        body["tool_choice"] = {"type": "function", "function": {"name": "neg"}}
    response = httpx.post(f"{predictor.openai_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text  # the status itself, not an error event after a 200
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "'not'" in error["message"]


def test_logprobs_and_top_logprobs_come_per_token(client: openai.OpenAI) -> None:
    response = chat(client, "Hi", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token


# -- errors ------------------------------------------------------------------------------------------


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("chat/completions", b"{nope", None),
        ("chat/completions", b'{"model": "tiny-llama"}', "messages"),
        ("chat/completions", b'{"model": "tiny-llama", "messages": []}', "messages"),
        (
            "chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}',
            "messages[0].role",
        ),
        (
            "chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "temperature": 9}',
            "temperature",
        ),
        (
            "chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            "max_tokens",
        ),
        (
            "chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
            b'"response_format": {"type": "json_schema"}}',
            "response_format",
        ),
        (
            "chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
            "tool_choice",
        ),
        (
            "chat/completions",
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
            b'"tools": [{"type": "function", "function": {"name": "f"}}], '
            b'"tool_choice": {"type": "function", "function": {"name": "g"}}}',
            "tool_choice",
        ),
        ("completions", b'{"model": "tiny-llama", "prompt": 5}', "prompt"),
        ("completions", b'{"model": "tiny-llama", "prompt": [99999]}', "prompt"),
        ("completions", b'{"model": "tiny-llama", "prompt": "x", "n": 0}', "n"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(
    predictor: PredictorProcess, path: str, body: bytes, param: str | None
) -> None:
    response = httpx.post(
        f"{predictor.openai_url}/{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "Traceback" not in response.text


def test_an_image_to_a_model_without_a_vision_part_is_a_400_naming_the_model(
    client: openai.OpenAI, predictor: PredictorProcess
) -> None:
    picture = data_url(render_image())
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": picture}}],
        },
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "images_not_supported"
    assert body["param"] == "messages[1].content[1].image_url"
    assert f"The model {MODEL!r} has no vision encoder" in body["message"]
    card = httpx.get(f"{predictor.openai_url}/models", timeout=10).json()["data"][0]
    assert card["vision"] is False
    # Text parts alone are text: still answered.
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]
    assert client.chat.completions.create(model=MODEL, messages=text_parts, max_tokens=2).usage is not None  # type: ignore[arg-type,union-attr]


def test_token_id_prompts_are_checked_against_the_engines_vocabulary_size(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    ok = client.completions.create(model=MODEL, prompt=[1, vocab - 1], max_tokens=1, temperature=0)
    assert ok.usage is not None
    assert ok.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, vocab], max_tokens=1)
    assert info.value.body["param"] == "prompt"  # type: ignore[index]
    assert f"(0..{vocab - 1})" in info.value.body["message"]  # type: ignore[index]


def test_unknown_extension_fields_are_ignored(predictor: PredictorProcess) -> None:
    response = httpx.post(
        f"{predictor.openai_url}/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "top_k": 5,
            "repetition_penalty": 1.1,
            "some_vendor_field": {"a": 1},
        },
    )
    assert response.status_code == 200


def test_penalties_are_honoured_or_refused_by_name(client: openai.OpenAI, engine_case: EngineCase) -> None:
    response = httpx.post(
        f"{client.base_url}chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "presence_penalty": 1.5,
            "frequency_penalty": 1.0,
        },
    )
    if response.status_code == 400:
        assert response.json()["error"]["param"] in ("presence_penalty", "frequency_penalty")
    else:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8


def test_a_model_without_a_chat_template_refuses_chat_but_completes(
    engine_case: EngineCase, tiny_llama_no_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    source = tiny_llama_no_template
    if engine_case.gguf:
        source = write_gguf(tiny_llama_no_template, tmp_path_factory.mktemp("plain-gguf") / "plain.gguf")
    with start_engine(engine_case, source, tmp_path_factory.mktemp("plain")) as plain:
        plain_client = openai.OpenAI(base_url=plain.openai_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            chat(plain_client, "Hi", max_tokens=2)
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "chat_template_missing"
        assert plain_client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_kserve_v1_and_v2_take_text_and_return_text(predictor: PredictorProcess, client: openai.OpenAI) -> None:
    expected = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0).choices[0].text
    v1 = httpx.post(
        f"{predictor.url}/v1/models/{MODEL}:predict",
        timeout=60,
        json={"instances": ["Hello", {"prompt": "Hello", "max_tokens": 5}]},
    )
    v2 = httpx.post(
        f"{predictor.url}/v2/models/{MODEL}/infer",
        timeout=60,
        json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["Hello"]}]},
    )
    assert v1.status_code == 200, v1.text
    assert v1.json()["predictions"][1] == expected
    assert v2.status_code == 200, v2.text
    assert isinstance(v2.json()["outputs"][0]["data"][0], str)


# -- concurrency and cancellation --------------------------------------------------------------------


def test_32_concurrent_streams_match_their_solo_greedy_outputs(
    predictor: PredictorProcess, client: openai.OpenAI
) -> None:
    places = [
        (w, c)
        for w in ("river", "market", "museum", "garden")
        for c in ("Paris", "Oslo", "Lima", "Cairo", "Quito", "Seoul", "Dakar", "Hanoi")
    ]
    prompts = [f"Request {i}: the {w} in {c}" for i, (w, c) in enumerate(places)]
    assert len(prompts) == 32
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
    ]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0) as aclient:

            async def one(prompt: str) -> str:
                stream = await aclient.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    assert asyncio.run(together()) == alone


COUNTS_SCHEMA = {
    "type": "object",
    "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["flags"],
    "additionalProperties": False,
}


#: Eight different requests, each with its own constraint, sampling and stop: (label, chat request fields).
def _schema_format(name: str, schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


MIXED_REQUESTS: list[tuple[str, dict[str, object]]] = [
    ("city schema, greedy", {"response_format": _schema_format("c", CITY_SCHEMA), "temperature": 0}),
    ("flags schema, seeded", {"response_format": _schema_format("f", COUNTS_SCHEMA), "temperature": 0.9, "seed": 7}),
    ("json object, greedy", {"response_format": {"type": "json_object"}, "temperature": 0}),
    ("forced tool call", {"tools": [WEATHER_TOOL], "temperature": 0,
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("free text with logprobs", {"temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("free text, seeded", {"temperature": 1.0, "seed": 11}),
    ("free text with a stop string", {"temperature": 0, "stop": ["e"]}),
    ("city schema, seeded", {"response_format": _schema_format("c", CITY_SCHEMA), "temperature": 1.0, "seed": 3}),
]  # fmt: skip


def test_8_concurrent_streams_with_different_constraints_match_their_solo_outputs(
    predictor: PredictorProcess, engine_case: EngineCase
) -> None:
    """Each sequence keeps its own constraint, sampler, seed and stops while batched with the others."""

    async def one(aclient: openai.AsyncOpenAI, index: int, fields: dict[str, object]) -> tuple[str, str, object]:
        stream = await aclient.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=[{"role": "user", "content": f"Request {index}: weather in Oslo?"}],
            max_tokens=40, stream=True, **fields,
        )  # fmt: skip
        text, arguments, finish = "", "", None
        tokens: list[str] = []
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            arguments += "".join(c.function.arguments or "" for c in choice.delta.tool_calls or [] if c.function)
            tokens += [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
            finish = choice.finish_reason or finish
        return text + arguments, "".join(tokens), finish

    async def run(together: bool) -> list[tuple[str, str, object]]:
        async with openai.AsyncOpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0) as aclient:
            calls = [one(aclient, i, fields) for i, (_, fields) in enumerate(MIXED_REQUESTS)]
            if together:
                return list(await asyncio.gather(*calls))
            return [await call for call in calls]

    alone = asyncio.run(run(together=False))
    together = asyncio.run(run(together=True))
    for (label, fields), solo, batched in zip(MIXED_REQUESTS, alone, together, strict=True):
        assert batched == solo, label
        if "response_format" in fields and fields["response_format"] != {"type": "json_object"} and solo[2] == "stop":
            response_format = fields["response_format"]
            assert isinstance(response_format, dict)
            jsonschema.validate(json.loads(solo[0]), response_format["json_schema"]["schema"])
        if "stop" in fields:
            assert "e" not in solo[0], label
    # The constraints really differed: the outputs are not all one shape.
    assert len({solo[0] for solo in alone}) == len(alone)


def test_a_client_that_disconnects_mid_stream_stops_its_generation(
    predictor: PredictorProcess, client: openai.OpenAI
) -> None:
    cancelled = metric(predictor, "universal_predictor_cancelled_total")
    generated = metric(predictor, "universal_predictor_generated_tokens_total")
    stream = client.completions.create(model=MODEL, prompt="Go on", max_tokens=480, temperature=0, stream=True)
    for seen, _ in enumerate(stream):
        if seen == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while metric(predictor, "universal_predictor_cancelled_total") <= cancelled:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    # The sequence left the batch: a later request completes and the total never reaches the 480 asked.
    chat(client, "after", max_tokens=2)
    assert metric(predictor, "universal_predictor_generated_tokens_total") - generated < 480


# -- /tokenize and /detokenize (vLLM's routes and shapes; issue 25 item 5) -------------------------------


def tokenize(predictor: PredictorProcess, **body: object) -> httpx.Response:
    return httpx.post(f"{predictor.url}/tokenize", json={"model": MODEL, **body}, timeout=60)


def test_tokenize_gives_the_tokenizers_ids_and_detokenize_the_text_back(
    predictor: PredictorProcess, tokenizer: object
) -> None:
    text = "The river in Paris, said the guide."
    response = tokenize(predictor, prompt=text, return_token_strs=True)
    assert response.status_code == 200, response.text
    answer = response.json()
    expected = tokenizer(text)["input_ids"]  # type: ignore[operator]  # special tokens added, as vLLM's default
    assert answer["tokens"] == expected
    assert answer["count"] == len(expected)
    assert answer["max_model_len"] == 512
    assert len(answer["token_strs"]) == len(expected)
    bare = tokenize(predictor, prompt=text, add_special_tokens=False).json()
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert bare["token_strs"] is None
    back = httpx.post(f"{predictor.url}/detokenize", json={"model": MODEL, "tokens": answer["tokens"]}, timeout=60)
    assert back.status_code == 200, back.text
    assert back.json()["prompt"].strip() == text


def test_tokenize_counts_a_chat_as_chat_completions_bills_it(
    predictor: PredictorProcess, client: openai.OpenAI
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    counted = tokenize(predictor, messages=messages).json()
    billed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)  # type: ignore[arg-type]
    assert billed.usage is not None
    assert counted["count"] == billed.usage.prompt_tokens
    # Without the generation prompt, fewer tokens; continuing a final assistant message ends with its text.
    without = tokenize(predictor, messages=messages, add_generation_prompt=False).json()
    assert without["count"] < counted["count"]
    assert counted["tokens"][: without["count"]] == without["tokens"]
    prefill = [*messages, {"role": "assistant", "content": "Sure:"}]
    opened = tokenize(predictor, messages=prefill, continue_final_message=True, return_token_strs=True).json()
    text = httpx.post(f"{predictor.url}/detokenize", json={"model": MODEL, "tokens": opened["tokens"]}).json()
    assert text["prompt"].endswith("Sure:")


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        ("tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None, "either prompt"),
        ("tokenize", {"prompt": "a", "add_generation_prompt": True}, None, "go with messages"),
        (
            "tokenize",
            {
                "messages": [{"role": "user", "content": "b"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            None,
            "cannot both be true",
        ),
        (
            "tokenize",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is it?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
            "counts text only",
        ),
        ("detokenize", {"tokens": [1, 10**9]}, "tokens[1]", "outside the vocabulary"),
        ("detokenize", {"tokens": [-1]}, None, "tokens"),
    ],
)
def test_tokenizer_routes_refuse_bad_requests_with_a_400_naming_the_problem(
    predictor: PredictorProcess, route: str, body: dict[str, object], param: str | None, says: str
) -> None:
    response = httpx.post(f"{predictor.url}/{route}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"]
    if param is not None:
        assert error["param"] == param


# -- grammars: structured_outputs regex, choice and Lark/GBNF grammars ---------------------------------------
# Random regexes and Lark grammars, each of bounded length (no unbounded repetition), so that the grammar must
# complete within max_tokens and the sequence end by the grammar: every output is then a whole sentence of it,
# checked by independent parsers (Python's re, the lark package's Earley parser).

_REGEX_ATOMS = st.sampled_from(["a", "b", "x", "7", "-", r"\.", " ", "[a-c]", "[0-9]", r"\d", "[xyz]", "é"])


def _regexes() -> st.SearchStrategy[str]:
    return st.recursive(
        _REGEX_ATOMS,
        lambda inner: st.one_of(
            st.lists(inner, min_size=2, max_size=3).map("".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(" + "|".join(parts) + ")"),
            st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(lambda t: f"({t[0]}){{{t[1]},{t[1] + t[2]}}}"),
            inner.map(lambda part: f"({part})?"),
        ),
        max_leaves=6,
    )


_LARK_ATOMS = st.sampled_from(['"a"', '"yes"', '"no"', '"-"', '"42"', "/[0-9]{1,3}/", "/[a-c]{2}/", '" "'])


def _lark_grammars() -> st.SearchStrategy[str]:
    """A Lark grammar of 1-3 rules, each referring only to rules defined after it (no recursion)."""

    def expression(names: list[str]) -> st.SearchStrategy[str]:
        atoms = st.one_of(_LARK_ATOMS, st.sampled_from(names)) if names else _LARK_ATOMS
        return st.recursive(
            atoms,
            lambda inner: st.one_of(
                st.lists(inner, min_size=2, max_size=3).map(" ".join),
                st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(" + " | ".join(parts) + ")"),
                inner.map(lambda part: f"[{part}]"),
            ),
            max_leaves=5,
        )

    @st.composite
    def grammar(draw: st.DrawFn) -> str:
        count = draw(st.integers(1, 3))
        names = [f"r{i}" for i in range(count)]
        rules = [f"{name}: {draw(expression(names[i + 1 :]))}" for i, name in enumerate(names)]
        return "\n".join(["start: r0", *rules])

    return grammar()


def structured(client: openai.OpenAI, content: str, **fields: object) -> openai.types.chat.ChatCompletion:
    return chat(client, content, max_tokens=120, temperature=1.0, extra_body=fields)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(regex=_regexes(), seed=st.integers(0, 2**31))
def test_regex_outputs_always_match_their_regex(client: openai.OpenAI, regex: str, seed: int) -> None:
    response = structured(client, "Say anything", seed=seed, structured_outputs={"regex": regex})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", (regex, choice.message.content)
    assert re.fullmatch(regex, choice.message.content or ""), (regex, choice.message.content)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(grammar=_lark_grammars(), seed=st.integers(0, 2**31))
def test_lark_grammar_outputs_always_parse_under_their_grammar(client: openai.OpenAI, grammar: str, seed: int) -> None:
    import lark

    response = structured(client, "Say anything", seed=seed, structured_outputs={"grammar": grammar})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", (grammar, choice.message.content)
    lark.Lark(grammar, parser="earley", lexer="dynamic").parse(choice.message.content or "")


def test_a_gbnf_grammar_and_a_choice_list_are_enforced_unary_and_streamed(client: openai.OpenAI) -> None:
    gbnf = 'root ::= answer " " [0-9] [0-9]?\nanswer ::= "yes" | "no"'
    choices = ["red", "green", "blue sky", "ünïcode"]
    for seed in range(3):
        text = structured(client, "Pick", seed=seed, structured_outputs={"grammar": gbnf}).choices[0].message.content
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?", text or ""), text
        picked = structured(client, "Pick", seed=seed, structured_outputs={"choice": choices}).choices[0]
        assert picked.message.content in choices
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Pick"}], max_tokens=40, temperature=1.0, seed=seed,
            stream=True, extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == picked.message.content


def test_the_legacy_guided_fields_constrain_chat_and_completions(client: openai.OpenAI) -> None:
    """vLLM 0.32 ignores ``guided_*`` with a warning; clients still send them, and they are honoured here."""
    text = structured(client, "Phone?", seed=1, guided_regex=r"\d{3}-\d{4}").choices[0].message.content
    assert re.fullmatch(r"\d{3}-\d{4}", text or ""), text
    picked = structured(client, "Pick", seed=2, guided_choice=["left", "right"]).choices[0].message.content
    assert picked in ("left", "right")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_json = structured(client, "JSON", seed=3, guided_json=schema).choices[0]
    assert as_json.finish_reason == "stop"
    assert set(json.loads(as_json.message.content or "")) == {"n"}
    completion = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=30, temperature=1.0, seed=4,
        extra_body={"structured_outputs": {"regex": "[A-F]{2}[0-9]{2}"}},
    )  # fmt: skip
    assert re.fullmatch("[A-F]{2}[0-9]{2}", completion.choices[0].text), completion.choices[0].text


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "look-around"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs", 'unknown name: "x"'),
        ({"structured_outputs": {"grammar": "start: <|im_end|>"}}, "structured_outputs", "special tokens"),
        ({"guided_grammar": "root ::= [a-"}, "guided_grammar", "the grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "json is not valid JSON"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, None, "one structured output constraint"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "cannot be combined with response_format",
        ),
    ],
    ids=[
        "look-around",
        "bad-class",
        "unknown-rule",
        "special-token",
        "legacy-bad-gbnf",
        "two-kinds",
        "no-kind",
        "empty-choice",
        "structural-tag",
        "bad-json",
        "new-and-legacy",
        "with-response-format",
    ],
)
def test_a_grammar_that_cannot_be_enforced_is_a_400_naming_the_problem(
    predictor: PredictorProcess, fields: dict[str, object], param: str | None, says: str
) -> None:
    for stream in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": stream}
        response = httpx.post(f"{predictor.openai_url}/chat/completions", json=body | fields, timeout=60)
        assert response.status_code == 400, response.text  # the status itself, not an error event after a 200
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param
        assert says in error["message"], error["message"]
