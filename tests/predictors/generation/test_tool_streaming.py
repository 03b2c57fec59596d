"""Tool-call streaming under ``tool_choice: auto``: a weak test model never writes ``<tool_call>`` blocks
on its own, so the text a real model would write is fed to the OpenAI layer's streamer in every split."""

from __future__ import annotations

import json
from typing import Any

import pytest

from universal_predictors.generation.service import ToolCallStreamer, _parse_tool_calls

KNOWN = {"get_weather", "get_time"}
TEXT = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a } in {"}}'
    '</tool_call>\n<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>'
)


def assemble(text: str, size: int) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``text`` in ``size``-character pieces; return the streamed content and the assembled calls
    (as the openai client assembles them: by index, concatenating arguments)."""
    streamer = ToolCallStreamer(None, False, KNOWN)
    deltas = [d for i in range(0, len(text), size) for d in streamer.push(text[i : i + size])]
    calls = _parse_tool_calls(text, None)
    deltas += streamer.finish({"role": "assistant", "content": None, "tool_calls": calls} if calls else {})
    content = "".join(d.get("content", "") for d in deltas)
    assembled: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            call = assembled.setdefault(piece["index"], {"name": None, "arguments": ""})
            call["name"] = call["name"] or piece.get("function", {}).get("name")
            call["arguments"] += piece.get("function", {}).get("arguments") or ""
    return content, [assembled[i] for i in sorted(assembled)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_auto_streams_content_then_each_call_whatever_the_chunking(size: int) -> None:
    content, calls = assemble(TEXT, size)
    assert content.strip() == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "note": "a } in {"}
    assert json.loads(calls[1]["arguments"]) == {"zone": "CET"}
    unary = _parse_tool_calls(TEXT, None)  # the unary response carries the same argument text
    assert [c["function"]["arguments"] for c in unary] == [c["arguments"] for c in calls]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_auto_text_that_only_looks_like_a_call_start_is_content(size: int) -> None:
    text = "<tool is not a call> and {braces} and <tool_c"
    assert assemble(text, size) == (text, [])


def test_a_whole_output_call_object_under_auto_is_sent_whole_at_the_end() -> None:
    text = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    content, calls = assemble(text, 2)
    assert content == ""
    assert calls == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
