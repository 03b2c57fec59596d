"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat machinery.

As for the Responses API (:mod:`.responses_api`), a Messages request is served as the chat it amounts to
(:func:`chat_request`): ``system`` becomes the system message; ``text`` and ``image`` blocks become text and
``image_url`` parts; an assistant turn's ``tool_use`` blocks become its tool calls and a user turn's ``tool_result``
blocks tool messages; ``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) the
chat's function tools and tool choice; ``stop_sequences`` its stop strings. The chat path then plans, constrains
and parses tool calls as for ``/v1/chat/completions``; :func:`respond` answers in Anthropic's shapes: the
``message`` object (``content`` blocks, ``stop_reason`` ``end_turn``/``max_tokens``/``stop_sequence``/``tool_use``,
``stop_sequence``, ``usage``), or its event stream (``message_start``, per block ``content_block_start``,
``content_block_delta`` of ``text_delta`` or ``input_json_delta``, ``content_block_stop``, then ``message_delta``
and ``message_stop``), and errors as ``{"type": "error", "error": {"type", "message"}}``
(:func:`anthropic_error_body`). The shapes follow Anthropic's API reference as its ``anthropic`` SDK types them
(``anthropic/types/``, and its stream accumulator ``anthropic/lib/streaming/_messages.py``), and vLLM 0.32's server
(``entrypoints/anthropic/``).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from universal_predictors.errors import APIError, InvalidRequest, anthropic_error_body
from universal_predictors.generation.chat_translation import first_error, named_event, rename_param, validated_chat
from universal_predictors.generation.planning import Plan
from universal_predictors.generation.protocol import ChatCompletionRequest
from universal_predictors.generation.responses import ChatTools, chat_shape
from universal_predictors.generation.streaming import Choice, ChoiceRunner, Delta, wants_usage_comments
from universal_predictors.http import CLIENT_CLOSED

_IGNORE = ConfigDict(extra="ignore")

BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(BaseModel):
    model_config = _IGNORE

    type: Literal["text"]
    text: str


class ImageSource(BaseModel):
    model_config = _IGNORE

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        if self.type == "base64" and not (self.media_type and self.data):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs url")
        return self

    def as_url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else str(self.url)


class ImageBlock(BaseModel):
    model_config = _IGNORE

    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(BaseModel):
    model_config = _IGNORE

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _IGNORE

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


class ThinkingBlock(BaseModel):
    """A thinking block sent back from another model's turn: nothing for this model to read."""

    model_config = _IGNORE

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class MessageParam(BaseModel):
    model_config = _IGNORE

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in BLOCK_TYPES:
                    raise ValueError(
                        f"[{index}]: a content block of type {kind!r} is not supported; send text, image, tool_use "
                        "and tool_result blocks"
                    )
        return value


class ToolParam(BaseModel):
    model_config = _IGNORE

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = _IGNORE

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool choice of type tool needs the tool's name")
        return self


def client_tools_only(value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` when every one is a client tool (``name``, ``description``, ``input_schema``)."""
    for index, tool in enumerate(value or []):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise ValueError(
                f"[{index}]: a tool of type {kind!r} is not supported; only client tools (name, description, "
                "input_schema) run here (server tools are Anthropic's own)"
            )
        try:
            ToolParam.model_validate(tool)
        except ValidationError as exc:
            raise ValueError(f"[{index}].{first_error(exc)}") from None
    return value


class OutputFormat(BaseModel):
    model_config = _IGNORE

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: ``format`` (a JSON schema the output must match: Anthropic's structured outputs, enforced
    by the same constrained decoding as chat's ``response_format``); ``effort`` is accepted, as ``thinking`` is."""

    model_config = _IGNORE

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages``. ``thinking`` is accepted for a model without a thinking mode (nothing is thought);
    ``metadata`` and Anthropic-only fields (``service_tier``, ``container``, ...) are ignored, as unknown fields are;
    server tools (a tool with a ``type`` such as ``web_search_20250305``) are a 400 naming the tool."""

    model_config = _IGNORE

    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("tools", mode="after")
    @classmethod
    def _client_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return client_tools_only(value)

    def client_tools(self) -> list[ToolParam]:
        return [ToolParam.model_validate(tool) for tool in self.tools or []]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what the same messages, system and tools cost as input."""

    model_config = _IGNORE

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("tools", mode="after")
    @classmethod
    def _client_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return client_tools_only(value)

    def as_messages(self) -> MessagesRequest:
        return MessagesRequest(
            model=self.model, max_tokens=1, messages=self.messages, system=self.system, tools=self.tools,
            tool_choice=self.tool_choice,
        )  # fmt: skip


# -- the request as a chat -----------------------------------------------------------------------------------------


def _text_of(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content if isinstance(block, TextBlock))


def chat_request(body: MessagesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request that asks the same of the model, and where each chat message came from (``system`` or
    ``messages[i]``); InvalidRequest for what has no chat equivalent."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system)})
        origins.append("system")
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            for block in blocks:
                if isinstance(block, ImageBlock | ToolResultBlock):
                    raise InvalidRequest(
                        f"{where}.content: an assistant turn holds text and tool_use blocks, not {block.type}",
                        param=f"{where}.content",
                    )
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            turn: dict[str, Any] = {"role": "assistant", "content": _text_of(blocks) or (None if calls else "")}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
            origins.append(where)
            continue
        parts: list[dict[str, Any]] = []
        for position, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                if any(isinstance(b, ImageBlock) for b in block.content if not isinstance(block.content, str)):
                    raise InvalidRequest(
                        f"{where}.content[{position}].content: images in a tool result are not supported here; "
                        "send them in a user turn's image block",
                        param=f"{where}.content[{position}].content",
                    )
                text = _text_of(block.content)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {text}" if block.is_error else text})  # fmt: skip
                origins.append(where)
            elif isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append({"type": "image_url", "image_url": {"url": block.source.as_url()}})
            elif isinstance(block, ToolUseBlock):
                raise InvalidRequest(
                    f"{where}.content[{position}]: tool_use blocks belong in assistant turns", param=where
                )
        if parts:
            text_only = all(p["type"] == "text" for p in parts)
            content: Any = "".join(p["text"] for p in parts) if text_only else parts
            messages.append({"role": "user", "content": content})
            origins.append(where)
    tools = body.client_tools()
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences or None,
        "stream": body.stream,
    }
    if tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in tools
        ]
    if body.output_config is not None and body.output_config.format is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": body.output_config.format.schema_},
        }
    choice = body.tool_choice
    if choice is not None and tools:
        if choice.type == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    elif choice is not None and choice.type in ("any", "tool"):
        raise InvalidRequest("tool_choice: needs tools", param="tool_choice")
    return validated_chat(chat, lambda error: renamed(error, origins)), origins


#: Chat field names in the chat path's errors, as a Messages caller knows them.
_PARAMS = {"stop": "stop_sequences", "max_tokens": "max_tokens", "messages": "messages", "tools": "tools",
           "response_format": "output_config.format"}  # fmt: skip


def renamed(error: APIError, origins: list[str]) -> APIError:
    """``error`` naming the Messages field: ``messages[i]`` of the chat becomes the turn it came from, ``stop`` is
    ``stop_sequences``, an image part's ``image_url`` the image block's ``source``."""
    return rename_param(error, _PARAMS, origins, suffixes={".image_url": ".source"})


# -- the answer --------------------------------------------------------------------------------------------------


def stop_reason(choice: Choice, calls: bool) -> str:
    if calls:
        return "tool_use"
    if choice.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if choice.stop is not None else "end_turn"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(plan: Plan, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": plan.prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message(message_id: str, model: str, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def unary_content(body: MessagesRequest, tools: ChatTools, choice: Choice) -> tuple[list[dict[str, Any]], str]:
    """The content blocks of a finished choice (its text, then one ``tool_use`` per call: the first only under
    ``disable_parallel_tool_use``) and its ``stop_reason``."""
    message = tools.message(choice)
    calls = message.get("tool_calls") or []
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        calls = calls[:1]
    content: list[dict[str, Any]] = []
    text = message.get("content") or ""
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [
        {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c["function"]["arguments"])}
        for c in calls
    ]
    return content, stop_reason(choice, bool(calls))


class _EventWriter:
    """Anthropic's streamed events from the chat path's delta pieces: a ``text`` block opened at the first text,
    a ``tool_use`` block at each call's first piece, each closed (``content_block_stop``) when the next opens."""

    def __init__(self, message: dict[str, Any], single_call: bool) -> None:
        self.message = message
        self.single_call = single_call
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.calls: dict[int, int] = {}  # chat call index -> block index

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def pieces(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for entry in entries:
            delta = entry.get("delta") or {}
            text = delta.get("content") or ""
            if text:
                if self.open != "text":
                    events += self._start({"type": "text", "text": ""})
                events.append({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "text_delta", "text": text}})  # fmt: skip
            for piece in delta.get("tool_calls") or []:
                events += self._call(piece)
        return events

    def _call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        position = piece["index"]
        if position > 0 and self.single_call:
            return []
        events: list[dict[str, Any]] = []
        function = piece.get("function") or {}
        if position not in self.calls:
            block = {"type": "tool_use", "id": piece.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                     "name": function.get("name", ""), "input": {}}  # fmt: skip
            events += self._start(block)
            self.calls[position] = self.index
        if self.calls[position] != self.index or self.open != "tool_use":
            return events
        arguments = function.get("arguments") or ""
        if arguments:
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})  # fmt: skip
        return events

    def closing(self, plan: Plan, choice: Choice) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.index < 0:  # nothing generated: an empty text block, as the unary answer has
            events += self._start({"type": "text", "text": ""})
        events += self._close()
        reason = stop_reason(choice, bool(self.calls))
        stop = choice.stop if reason == "stop_sequence" else None
        events.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                       "usage": {"output_tokens": choice.tokens}})  # fmt: skip
        events.append({"type": "message_stop"})
        return events


async def respond(
    runner: ChoiceRunner, request: Request, body: MessagesRequest, chat: ChatCompletionRequest, plan: Plan,
    tools: ChatTools,
) -> Response:  # fmt: skip
    """The ``message``, or its event stream, for a planned chat of one choice."""
    message_id = f"msg_{uuid.uuid4().hex}"
    if not body.stream:
        choices = await runner.run_unary(request, plan)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        [choice] = choices
        content, reason = unary_content(body, tools, choice)
        answer = _message(message_id, plan.model or runner.model_name, content, _usage(plan, choice.tokens))
        answer["stop_reason"] = reason
        answer["stop_sequence"] = choice.stop if reason == "stop_sequence" else None
        return JSONResponse(answer)

    shape = chat_shape(chat, plan, tools)
    single = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    writer = _EventWriter(_message(message_id, plan.model or runner.model_name, [], _usage(plan, 0)), single)

    def render(delta: Delta) -> list[dict[str, Any]]:
        return writer.pieces(shape.delta(delta))

    def final(choices: list[Choice]) -> list[dict[str, Any]]:
        [choice] = choices
        return writer.pieces(shape.closing(choices)) + writer.closing(plan, choice)

    def failed(error: APIError) -> list[dict[str, Any]]:
        return [anthropic_error_body(error)]

    return await runner.stream(plan, render, writer.opening(), final, frame=named_event, failed=failed, done=None,
                               usage_comments=wants_usage_comments(request))  # fmt: skip
