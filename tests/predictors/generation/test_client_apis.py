"""OpenAI's Responses API through ``universal-runtime serve`` on each engine, driven by the real ``openai`` SDK and
an OpenAI Agents SDK agent: unary, the stream helper and its event sequence, a function tool round trip, structured
output (``text.format`` and ``responses.parse``), ``max_output_tokens`` ending a response as incomplete, and the 400s
for what cannot be honoured. The answers are checked against the same model's chat completions, which the suite in
test_conformance.py pins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.predictors.generation.conftest import EngineCase, engine_params, require_engine
from tests.predictors.generation.test_conformance import ENGINES, MODEL
from tests.predictors.generation.tiny_vlm import data_url, render_image

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module", params=engine_params(ENGINES), ids=lambda case: case.backend.value)
def engine_case(request: pytest.FixtureRequest) -> EngineCase:
    case: EngineCase = request.param
    return case


@pytest.fixture(scope="module")
def gateway(
    engine_case: EngineCase, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """``universal-runtime serve`` with the tiny model on ``engine_case``'s engine: the path users take locally."""
    require_engine(engine_case)
    source = request.getfixturevalue("tiny_llama_gguf" if engine_case.gguf else "tiny_llama_dir")
    args = "".join(f"    {key}: {json.dumps(value)}\n" for key, value in engine_case.engine_args)
    folder = tmp_path_factory.mktemp(f"responses-{engine_case.backend.value}")
    (folder / "model.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {name: tiny}\n"
        f"spec:\n  task: generate\n  servedName: {MODEL}\n  backend: {engine_case.backend.value}\n"
        f'  source: {{uri: "{source}"}}\n' + (f"  engineArgs:\n{args}" if args else "")
    )
    with running_gateway([folder], folder / "logs", env=dict(engine_case.env)) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=300)


def test_a_response_says_what_the_same_chat_says_with_the_same_token_counts(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Weather in Oslo?", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=12,
        temperature=0,
    )
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message"
    assert message.role == "assistant"
    assert response.usage is not None
    assert chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
        assert response.incomplete_details is None
    assert response.store is True  # serve keeps it (tests/gateway/test_stored_responses.py): the default, as OpenAI


def test_a_previous_response_id_chain_answers_as_the_whole_conversation_would(client: openai.OpenAI) -> None:
    """serve keeps responses (SQLite in its state directory): the second turn names the first, and gets what the
    whole conversation sent as items gets."""
    first = client.responses.create(model=MODEL, input="Hi there", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    explicit = client.responses.create(
        model=MODEL, max_output_tokens=6, temperature=0, store=False,
        input=[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}],
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.output_text == explicit.output_text
    assert second.usage is not None
    assert explicit.usage is not None
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_max_output_tokens_ends_the_response_as_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=2, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == 2
    assert response.output[0].status == "incomplete"


#: A bounded object (short string, small integer): the random model's constrained output always completes.
TRIP_FORMAT = {
    "type": "json_schema",
    "name": "trip",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "nights": {"type": "integer", "maximum": 9}},
        "required": ["city", "nights"],
        "additionalProperties": False,
    },
}


def test_the_stream_helper_gets_the_full_event_sequence_and_the_unary_answer(client: openai.OpenAI) -> None:
    fields: dict[str, object] = {"model": MODEL, "input": "Hello there", "max_output_tokens": 60, "temperature": 0,
                                 "text": {"format": TRIP_FORMAT}}  # fmt: skip
    unary = client.responses.create(**fields)  # type: ignore[call-overload]
    assert unary.status == "completed"
    with client.responses.stream(**fields) as stream:  # type: ignore[call-overload]
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == unary.output_text
    assert final.output_text == unary.output_text
    assert final.usage == unary.usage
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client: openai.OpenAI) -> None:
    fields: dict[str, object] = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 3, "temperature": 0}
    unary = client.responses.create(**fields)  # type: ignore[call-overload]
    with client.responses.stream(**fields) as stream:  # type: ignore[call-overload]
        events = list(stream)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    [item] = last.response.output
    assert item.type == "message"
    assert item.status == "incomplete"
    assert item.content[0].text == unary.output_text  # type: ignore[union-attr]
    assert last.response.usage == unary.usage


def test_a_function_tool_round_trip(client: openai.OpenAI) -> None:
    """The model is made to call the tool, the call's output goes back as an item, and the model answers."""
    first = client.responses.create(
        model=MODEL, input="Weather in Oslo for 2 days?", tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    assert call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[arg-type]
    assert first.status == "completed"
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Oslo for 2 days?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert [item.type for item in second.output] == ["message"]
    # The call and its output are in the prompt: it is longer than the question alone plus the call's text.
    alone = client.responses.create(model=MODEL, input="Weather in Oslo for 2 days?", max_output_tokens=1)
    assert second.usage is not None
    assert alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens + len(call.arguments) // 8


def test_a_streamed_forced_call_arrives_as_argument_deltas_of_one_function_call_item(client: openai.OpenAI) -> None:
    fields: dict[str, object] = {
        "model": MODEL, "input": "Weather?", "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "temperature": 0,
    }  # fmt: skip
    unary = client.responses.create(**fields)  # type: ignore[call-overload]
    with client.responses.stream(**fields) as stream:  # type: ignore[call-overload]
        events = list(stream)
        final = stream.get_final_response()
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call"
    assert added.item.name == "get_weather"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [unary_call] = unary.output
    assert unary_call.type == "function_call"
    assert arguments == done.arguments == unary_call.arguments
    assert [item.type for item in final.output] == ["function_call"]


class Trip(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: str = pydantic.Field(max_length=10)
    nights: int = pydantic.Field(ge=1, le=9)


def test_structured_output_by_text_format_and_by_responses_parse(client: openai.OpenAI) -> None:
    schema = Trip.model_json_schema()
    for seed in (1, 2):
        response = client.responses.create(
            model=MODEL, input="Plan a trip", temperature=1.0, max_output_tokens=80,
            text={"format": {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}},
            extra_body={"seed": seed},
        )  # fmt: skip
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), schema)
    parsed = client.responses.parse(model=MODEL, input="Plan a trip", text_format=Trip, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Trip)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id", "'resp_x' was not found"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input", "'computer_call' is not supported"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item references are not supported"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {"type": "string"}}}}},
            "text.format",
            "'not'",
        ),
        ({"background": True}, "background", "not supported"),
    ],
    ids=[
        "previous-id",
        "hosted-tool",
        "unknown-item",
        "item-reference",
        "max-output-0",
        "required-no-tools",
        "bad-schema",
        "background",
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    gateway: GatewayProcess, fields: dict[str, object], param: str, says: str
) -> None:
    for stream in (False, True):
        body = {"model": MODEL, "input": "x", "max_output_tokens": 4, "stream": stream} | fields
        response = httpx.post(f"{gateway.base_url}/responses", json=body, timeout=300)
        assert response.status_code == 400, response.text  # the status itself, not an event after a 200
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, error
        assert says in error["message"], error["message"]


def test_an_image_to_a_model_without_vision_names_the_input_item(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            instructions="Look closely.",
            input=[
                {"role": "user", "content": "Hi"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": data_url(render_image()), "detail": "auto"},
                    ],
                },
            ],
        )
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "images_not_supported"
    assert body["param"] == "input[1].content[1].image_url"


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    sky: str = pydantic.Field(max_length=8)
    warm: bool


def test_an_openai_agents_sdk_agent_calls_its_function_tool_and_returns_its_structured_output(
    gateway: GatewayProcess,
) -> None:
    """An agent as the Agents SDK's quick start builds one (Responses API, its default), made to call its tool first
    (the random-weight model would not choose to): the tool runs with the model's arguments, the call and its output go
    back to the model, and the final output is the structured type."""
    import agents

    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(
        city: Annotated[str, pydantic.Field(max_length=10)], days: Annotated[int, pydantic.Field(ge=1, le=9)]
    ) -> str:
        """The weather in a city for some days."""
        calls.append((city, days))
        return "clear and warm"

    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers
    model = agents.OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    )
    agent = agents.Agent(
        name="Forecaster",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        output_type=Forecast,
        model=model,
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=120, temperature=0.7),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Oslo for 2 days?", max_turns=4)
    assert len(calls) == 1  # forced once; the SDK then resets tool_choice, and the structured answer ends the run
    assert isinstance(calls[0][0], str)
    assert isinstance(calls[0][1], int)
    assert isinstance(result.final_output, Forecast)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"


# -- Anthropic's Messages API ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(gateway: GatewayProcess) -> anthropic.Anthropic:
    """The Anthropic SDK pointed at `serve`, its key sent as x-api-key (the gateway here has none configured)."""
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300)


#: Greedy decoding: an extension field now (the Anthropic SDK's create() no longer takes temperature).
GREEDY = {"temperature": 0}

BOOK = {
    "name": "book_room",
    "description": "Book a hotel room",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "nights": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "nights"],
        "additionalProperties": False,
    },
}


def test_a_message_says_what_the_same_chat_says_with_the_same_token_counts(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=12,
        temperature=0,
    )
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == MODEL
    [block] = message.content
    assert block.type == "text"
    assert block.text == chat.choices[0].message.content
    assert chat.usage is not None
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    counted = claude.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Weather in Oslo?"}]
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(claude: anthropic.Anthropic) -> None:
    free = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Go on"}])  # fmt: skip
    text = free.content[0].text  # type: ignore[union-attr]
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    cut = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "Go on"}])  # fmt: skip
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]  # type: ignore[union-attr]


def test_the_stream_has_anthropics_event_sequence_and_the_unary_answer(claude: anthropic.Anthropic) -> None:
    fields: dict[str, object] = {"model": MODEL, "max_tokens": 10, "extra_body": GREEDY,
                                 "messages": [{"role": "user", "content": "Hello there"}]}  # fmt: skip
    unary = claude.messages.create(**fields)  # type: ignore[arg-type]
    with claude.messages.stream(**fields) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
        text = stream.text_stream  # consumed already: the accumulated message is the check
    del text
    kinds = [e.type for e in events if e.type not in ("text",)]
    assert kinds[0] == "message_start"
    assert kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert [block.model_dump(exclude={"parsed_output"}) for block in final.content] == [
        block.model_dump() for block in unary.content
    ]
    assert final.stop_reason == unary.stop_reason
    assert final.usage.output_tokens == unary.usage.output_tokens
    assert final.usage.input_tokens == unary.usage.input_tokens


def test_a_tool_use_round_trip_streamed_and_unary(claude: anthropic.Anthropic) -> None:
    fields: dict[str, object] = {
        "model": MODEL, "max_tokens": 80, "extra_body": GREEDY, "tools": [BOOK],
        "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "Book Oslo for 2 nights"}],
    }  # fmt: skip
    first = claude.messages.create(**fields)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "book_room"
    jsonschema.validate(use.input, BOOK["input_schema"])  # type: ignore[arg-type]
    with claude.messages.stream(**fields) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input  # the input_json_delta pieces assemble to the unary input
    second = claude.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, tools=[BOOK],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "Book Oslo for 2 nights"},
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "booked: #41"}]},
        ],
    )  # fmt: skip
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


class Room(pydantic.BaseModel):
    """Bounded by enums and booleans: the SDK strips length and range keywords from the schema it sends (Anthropic's
    structured outputs do not take them), so those would not bound the random model's output."""

    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Oslo", "Rome", "Lima"]
    breakfast: bool


def test_structured_output_by_output_config_and_messages_parse(claude: anthropic.Anthropic) -> None:
    parsed = claude.messages.parse(
        model=MODEL, max_tokens=80, output_format=Room, messages=[{"role": "user", "content": "Book a room"}]
    )
    assert parsed.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, Room)


def test_an_image_block_to_a_model_without_vision_is_an_anthropic_400(claude: anthropic.Anthropic) -> None:
    picture = data_url(render_image()).split(",", 1)[1]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=MODEL, max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}},
            ]}],
        )  # fmt: skip
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "has no vision encoder" in body["error"]["message"]
    assert body["error"]["message"].startswith("messages[0].content[1].source: The model")


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "only client tools",
        ),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400, "'document'"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, 400, "temperature"),
        ({"max_tokens": 4, "model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "'nope'"),
    ],
    ids=["no-max-tokens", "server-tool", "document-block", "temperature", "unknown-model"],
)
def test_refusals_on_the_messages_route_are_in_anthropics_shape(
    gateway: GatewayProcess, body: dict[str, object], status: int, says: str
) -> None:
    for stream in (False, True):
        response = httpx.post(f"{gateway.url}/v1/messages", json={"model": MODEL, "stream": stream} | body, timeout=300)
        assert response.status_code == status, response.text
        error = response.json()
        assert error["type"] == "error"
        assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert says in error["error"]["message"]
