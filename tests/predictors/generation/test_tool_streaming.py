"""Tool calls under ``tool_choice: auto`` in each model family's format, unary and streamed.

A weak test model never writes tool calls on its own, so the text real models write (Qwen 2.5 and
Hermes ``<tool_call>`` blocks, Llama 3.1/3.2 JSON, Mistral v0.3's ``[TOOL_CALLS]`` list) is fed to each
format's parser whole (the unary response) and to its streamer in every split (as tokens arrive): the
streamed content and call pieces, assembled as the openai client assembles them, equal the unary message.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from universal_predictors.generation.tools import TOOL_PARSERS, ToolParser

KNOWN = frozenset({"get_weather", "get_time"})

HERMES_TWO_CALLS = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a } in {"}}'
    '</tool_call>\n<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>'
)
#: Qwen2.5-7B-Instruct's layout: each block on its own lines.
QWEN = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
#: Llama 3.1-8B-Instruct with custom tools; 3.2 separates several calls with ";".
LLAMA = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
LLAMA_PYTHON_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
LLAMA_TWO_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'
)
#: Mistral-7B-Instruct-v0.3, with the [TOOL_CALLS] token kept and (special tokens skipped) dropped.
MISTRAL = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}}]'
)
MISTRAL_BARE = ' [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'
MISTRAL_AFTER_TEXT = 'Checking both.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]'

OSLO = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
OSLO_SHORT = {"name": "get_weather", "arguments": {"city": "Oslo"}}
CET = {"name": "get_time", "arguments": {"zone": "CET"}}

#: (format, model text, the content before the calls, the calls)
CALLS = [
    ("hermes", HERMES_TWO_CALLS, "Let me check.", [{**OSLO, "arguments": {"city": "Oslo", "note": "a } in {"}}, CET]),
    ("hermes", QWEN, None, [OSLO, CET]),
    ("llama3_json", LLAMA, None, [OSLO]),
    ("llama3_json", LLAMA_PYTHON_TAG, None, [OSLO]),
    ("llama3_json", LLAMA_TWO_CALLS, None, [OSLO_SHORT, CET]),
    ("mistral", MISTRAL, None, [OSLO, CET]),
    ("mistral", MISTRAL_BARE, None, [OSLO]),
    ("mistral", MISTRAL_AFTER_TEXT, "Checking both.", [CET]),
]
#: Answers that are no tool call in the format, however call-like they look.
NO_CALLS = [
    ("hermes", "<tool is not a call> and {braces} and <tool_c"),
    ("hermes", "The weather in Oslo is mild today."),
    ("llama3_json", "The weather in Oslo is mild today."),
    ("llama3_json", '{"city": "Oslo", "unit": "celsius"}'),
    ("mistral", "[1] Oslo is the capital of Norway."),
    ("mistral", "It is mild. [TOOL_CALL] is not the marker"),
]


def unary(parser: ToolParser, text: str) -> dict[str, Any]:
    """The assistant message the unary response carries (calls of unknown tools dropped)."""
    parsed = parser.parse(text)
    calls = [c for c in parsed.calls if c["function"]["name"] in KNOWN]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}


def streamed(parser: ToolParser, chunks: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``chunks``; the streamed content and the calls as the openai client assembles them (by index,
    the first piece's id and name, the arguments concatenated)."""
    streamer = parser.streamer(KNOWN)
    deltas = [d for chunk in chunks for d in streamer.push(chunk)]
    deltas += streamer.finish(unary(parser, "".join(chunks)))
    content = "".join(d.get("content") or "" for d in deltas)
    assembled: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            call = assembled.setdefault(piece["index"], {"id": piece.get("id"), "name": None, "arguments": ""})
            call["name"] = call["name"] or piece.get("function", {}).get("name")
            call["arguments"] += piece.get("function", {}).get("arguments") or ""
    return content, [assembled[i] for i in sorted(assembled)]


def split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CALLS)
def test_the_unary_message_carries_the_content_before_the_calls_and_each_call(
    fmt: str, text: str, content: str | None, calls: list[dict[str, Any]]
) -> None:
    message = unary(TOOL_PARSERS[fmt], text)
    assert message["content"] == content
    got = [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == [("function", c["name"], c["arguments"]) for c in calls]
    assert len({c["id"] for c in message["tool_calls"]}) == len(calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CALLS)
def test_streamed_pieces_assemble_to_the_unary_calls_whatever_the_chunking(
    fmt: str, text: str, content: str | None, calls: list[dict[str, Any]], size: int
) -> None:
    parser = TOOL_PARSERS[fmt]
    streamed_content, streamed_calls = streamed(parser, split(text, size))
    assert streamed_content.strip() == (content or "")
    message = unary(parser, text)  # the same argument text, as the model wrote it
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    assert all(c["id"] for c in streamed_calls)


@given(st.sampled_from(CALLS + [(fmt, text, text, []) for fmt, text in NO_CALLS]), st.data())
def test_any_split_of_model_text_streams_what_the_unary_response_says(
    case: tuple[str, str, str | None, list[dict[str, Any]]], data: st.DataObject
) -> None:
    fmt, text, _, _ = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=20)))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    parser = TOOL_PARSERS[fmt]
    content, calls = streamed(parser, chunks)
    message = unary(parser, text)
    assert content.strip() == (message["content"] or "").strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize(("fmt", "text"), NO_CALLS)
def test_text_that_only_looks_like_a_call_is_content(fmt: str, text: str, size: int) -> None:
    assert unary(TOOL_PARSERS[fmt], text) == {"role": "assistant", "content": text}
    assert streamed(TOOL_PARSERS[fmt], split(text, size)) == (text, [])


def test_a_whole_output_call_object_under_hermes_is_sent_whole_at_the_end() -> None:
    text = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    streamer = TOOL_PARSERS["hermes"].streamer(KNOWN)
    assert [d for chunk in split(text, 2) for d in streamer.push(chunk)] == []  # JSON content or a call?
    content, calls = streamed(TOOL_PARSERS["hermes"], split(text, 2))
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", '{"zone": "UTC"}')]


def test_llama_streams_the_call_before_the_output_ends() -> None:
    streamer = TOOL_PARSERS["llama3_json"].streamer(KNOWN)
    deltas = streamer.push('{"name": "get_weather", "parameters": {"city": "Os')
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'


def test_a_call_of_a_tool_the_request_does_not_offer_is_content() -> None:
    text = '[TOOL_CALLS] [{"name": "delete_everything", "arguments": {}}]'
    assert unary(TOOL_PARSERS["mistral"], text) == {"role": "assistant", "content": text}
    assert streamed(TOOL_PARSERS["mistral"], split(text, 3)) == (text, [])


def test_mistral_call_ids_are_nine_alphanumerics_as_its_template_requires() -> None:
    message = unary(TOOL_PARSERS["mistral"], MISTRAL)
    _, calls = streamed(TOOL_PARSERS["mistral"], split(MISTRAL, 5))
    for call_id in [c["id"] for c in message["tool_calls"]] + [c["id"] for c in calls]:
        assert len(call_id) == 9
        assert call_id.isalnum()
