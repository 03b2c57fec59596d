"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery, on every engine.

A Responses request is a chat in other clothes: :func:`chat_request` turns its ``instructions`` and ``input`` items
(messages with ``input_text``/``input_image``/``output_text`` parts, ``function_call`` and ``function_call_output``
items) into chat messages, its function ``tools``/``tool_choice`` and ``text.format`` into the chat fields that
mean the same, and the chat path then plans, constrains, runs and parses tool calls exactly as for
``/v1/chat/completions``. What differs is the answer: :func:`respond` builds the ``response`` object (``output``
items, ``status``, ``incomplete_details``, ``usage``) and, streamed, Responses' event sequence, translated from the
chat deltas (:class:`_EventWriter`): ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` or
``response.function_call_arguments.delta``, their ``.done`` events and ``response.output_item.done``, and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ran out). The shapes follow OpenAI's API
reference as the ``openai`` SDK's types and stream helper (``openai/lib/streaming/responses/_responses.py``)
consume them, and vLLM 0.32's server (``entrypoints/openai/responses/``).

Stateless here: the predictor neither stores responses nor reads ``previous_response_id``. The gateway keeps the
conversation (``universal_gateway.responses_store``: it serves every replica's clients and outlives a model scaled to
zero) and marks a request it keeps with ``RESPONSES_STORED_HEADER``: the input is then the whole conversation, and the
answer echoes ``store`` and ``previous_response_id``. Without the mark (a predictor called directly, a gateway
without a store) a response says ``"store": false``, and ``previous_response_id`` or an ``item_reference`` is a 400
saying to send the conversation as input items.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from universal_predictors.config import RESPONSES_STORED_HEADER
from universal_predictors.errors import APIError, InvalidRequest
from universal_predictors.generation.chat_translation import first_error, named_event, rename_param, validated_chat
from universal_predictors.generation.planning import Plan
from universal_predictors.generation.protocol import ChatCompletionRequest
from universal_predictors.generation.responses import ChatTools, chat_logprobs, chat_shape
from universal_predictors.generation.streaming import Choice, ChoiceRunner, Delta, wants_usage_comments
from universal_predictors.http import CLIENT_CLOSED

_IGNORE = ConfigDict(extra="ignore")

#: Input item types understood here; a message may leave ``type`` out (OpenAI's "easy" input message).
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
#: Content part types of an input message (``output_text``/``refusal``: an earlier assistant turn sent back).
PART_TYPES = ("input_text", "input_image", "output_text", "refusal")


class InputText(BaseModel):
    model_config = _IGNORE

    type: Literal["input_text"]
    text: str


class OutputText(BaseModel):
    model_config = _IGNORE

    type: Literal["output_text"]
    text: str


class Refusal(BaseModel):
    model_config = _IGNORE

    type: Literal["refusal"]
    refusal: str


class InputImage(BaseModel):
    model_config = _IGNORE

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"

    @model_validator(mode="after")
    def _url(self) -> InputImage:
        if self.file_id is not None and self.image_url is None:
            raise ValueError("file_id: uploaded files are not served here; send the image as image_url (a data URL)")
        if not self.image_url:
            raise ValueError("image_url is required")
        return self


Part = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]


def _known_parts(value: Any) -> Any:
    if isinstance(value, list):
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                raise ValueError(
                    f"content[{index}]: a content part of type {kind!r} is not supported; send "
                    f"{', '.join(PART_TYPES)} parts"
                )
    return value


class MessageItem(BaseModel):
    model_config = _IGNORE

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _known_parts(value)


class FunctionCallItem(BaseModel):
    model_config = _IGNORE

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _IGNORE

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[Part]

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _known_parts(value)


class ReasoningItem(BaseModel):
    """A reasoning item sent back from another model's response: nothing for this model to read."""

    model_config = _IGNORE

    type: Literal["reasoning"]


class ItemReference(BaseModel):
    model_config = _IGNORE

    type: Literal["item_reference"]
    id: str


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference,
    Field(discriminator="type"),
]


class FunctionTool(BaseModel):
    model_config = _IGNORE

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = _IGNORE

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = _IGNORE

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        return self


class TextConfig(BaseModel):
    model_config = _IGNORE

    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Fields OpenAI defines that do not apply to a self-hosted model (``service_tier``,
    ``prompt_cache_key``, ``safety_identifier``, ...) are ignored, as unknown fields are; ``reasoning`` is accepted
    for a model without a reasoning mode (and echoed); what would change the answer and cannot be honoured is a 400
    naming it (``background``, ``conversation``, ``previous_response_id``, hosted tools)."""

    model_config = _IGNORE

    model: str
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    conversation: Any = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, dict):
                    continue
                kind = item.get("type", "message")
                if kind not in ITEM_TYPES:
                    raise ValueError(
                        f"[{index}]: an input item of type {kind!r} is not supported; send messages, function_call "
                        "and function_call_output items"
                    )
                if "type" not in item:
                    value[index] = {**item, "type": "message"}
        return value

    @field_validator("tools", mode="after")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for index, tool in enumerate(value or []):
            if tool.get("type") != "function":
                raise ValueError(
                    f"[{index}]: a tool of type {tool.get('type')!r} is not supported; only function tools run "
                    "here (hosted tools such as web_search are OpenAI's own)"
                )
            try:
                FunctionTool.model_validate(tool)
            except ValidationError as exc:
                raise ValueError(f"[{index}].{first_error(exc)}") from None
        return value

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(tool) for tool in self.tools or []]

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or []) or bool(self.top_logprobs)


# -- the request as a chat -----------------------------------------------------------------------------------------

#: Chat field names in the chat path's errors, as a Responses caller knows them.
_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


def renamed(error: APIError, origins: list[str] | None = None) -> APIError:
    """``error`` with a chat field name (its ``param`` and its message's prefix) as the Responses field: ``messages[i]``
    becomes the input item it came from (``origins[i]``: ``instructions`` or ``input[j]``)."""
    return rename_param(error, _PARAMS, origins, words={"response_format": "text.format"})


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """Responses content as chat content: text parts (input or earlier output) and image_url parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, InputImage):
            parts.append({"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}})
        else:
            parts.append({"type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text})
    return parts


def _text(content: str | list[Any], where: str) -> str:
    out = _content(content)
    if isinstance(out, str):
        return out
    if any(p["type"] != "text" for p in out):
        raise InvalidRequest(f"{where}: only text is accepted here (images go in user messages)", param=where)
    return "".join(p["text"] for p in out)


def chat_request(body: ResponsesRequest, stored: bool = False) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request that asks the same of the model, and where each of its messages came from
    (``instructions``, ``input[j]``); InvalidRequest for what has no chat equivalent. ``stored``: the gateway keeps
    the conversation (its response store), and ``input`` is the whole of it already."""
    if body.previous_response_id is not None and not stored:
        raise InvalidRequest(
            "previous_response_id: responses are not stored here (the gateway runs with --responses-store off, or "
            "the predictor was called directly); send the whole conversation as input items (earlier output items "
            "included)",
            param="previous_response_id",
            code="stored_responses_unavailable",
        )
    if body.background:
        raise InvalidRequest("background: background responses are not supported; leave it false", param="background")
    if body.conversation is not None:
        raise InvalidRequest("conversation: conversations are not supported; send input items", param="conversation")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if isinstance(item, MessageItem):
            role = item.role
            content = _content(item.content) if role == "user" else _text(item.content, f"{where}.content")
            messages.append({"role": role, "content": content})
            origins.append(where if not isinstance(body.input, str) else "input")
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]  # the text of the turn, then its calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            origins.append(where)
        elif isinstance(item, ItemReference):
            raise InvalidRequest(
                f"{where}: item references are not supported; send the item itself",
                param=where,
                code="stored_responses_unavailable",
            )
        # ReasoningItem: another model's reasoning, nothing to render for this one.
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("input: needs at least one message or item besides the instructions", param="input")
    tools = body.function_tools()
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stream": body.stream,
        "logprobs": body.wants_logprobs(),
        "top_logprobs": body.top_logprobs,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters or {"type": "object", "properties": {}},
                    "strict": t.strict,
                },
            }
            for t in tools
        ]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict},
        }
    return validated_chat(chat, lambda error: renamed(error, origins)), origins


# -- the answer --------------------------------------------------------------------------------------------------


def _usage(plan: Plan, choice: Choice | None) -> dict[str, Any] | None:
    if choice is None:
        return None
    return {
        "input_tokens": plan.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": choice.tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": plan.prompt_tokens + choice.tokens,
    }


class _Response:
    """The ``response`` object of one request, as it stands (created, in progress, finished)."""

    def __init__(self, body: ResponsesRequest, model: str, stored: bool = False) -> None:
        self.body, self.model, self.stored = body, model, stored
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def snapshot(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text is not None else TextFormat(type="text")
        tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id if self.stored else None,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": self.stored and body.store,
            "temperature": body.temperature,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": tool_choice.model_dump() if isinstance(tool_choice, FunctionChoice) else tool_choice,
            "tools": [{**t.model_dump(exclude_none=True)} for t in body.function_tools()],
            "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def unary_output(
    body: ResponsesRequest, tools: ChatTools, choice: Choice, logprobs: bool
) -> tuple[str, list[dict[str, Any]]]:
    """The status and output items of a finished choice: the message (when it has text, or nothing else was
    made), then one ``function_call`` item per call (only the first when ``parallel_tool_calls`` is false)."""
    message = tools.message(choice)
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    calls = message.get("tool_calls") or []
    if not body.parallel_tool_calls:
        calls = calls[:1]
    output = []
    text = message.get("content") or ""
    if text or not calls:
        entries = chat_logprobs(choice.logprobs)["content"] if logprobs else None
        output.append(_message_item(_new_id("msg"), text, status, entries))
    output += [_call_item(_new_id("fc"), call, status) for call in calls]
    return status, output


class _EventWriter:
    """Responses' streamed events, from the chat path's delta pieces (``{"content": ...}``, ``{"tool_calls":
    [...]}``): each output item opened when its first piece arrives, closed (its ``.done`` events) when the next
    item starts or the response ends, every event numbered in order."""

    def __init__(self, response: _Response, parallel: bool) -> None:
        self.response, self.parallel = response, parallel
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # as streamed, finished ones in their final form
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> its item
        self.logprobs: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        created = self.response.snapshot("in_progress", [])
        return [self.event("response.created", response=created), self.event("response.in_progress", response=created)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] = self.logprobs
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self.event("response.output_text.done", **common, text=part["text"], logprobs=self.logprobs))
            events.append(self.event("response.content_part.done", **common, part=part))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=added))
        if item["type"] == "message":
            part = _text_part("", None)
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "message":
            events += self._start(_message_item(_new_id("msg"), "", "in_progress", None))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        self.logprobs += logprobs
        index = self.items.index(self.open)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return events

    def call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        index = piece["index"]
        if index > 0 and not self.parallel:
            return []  # parallel_tool_calls false: the first call only
        events: list[dict[str, Any]] = []
        function = piece.get("function") or {}
        if index not in self.calls:
            call = {"id": piece.get("id") or _new_id("call"), "function": {"name": function.get("name", ""),
                                                                            "arguments": ""}}  # fmt: skip
            item = _call_item(_new_id("fc"), call, "in_progress")
            self.calls[index] = item
            events += self._start(item)
        item = self.calls[index]
        if item is not self.open:  # pieces of an earlier call after a later one started: not in any format here
            return events
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=arguments,
                )
            )
        return events

    def pieces(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Events for chat chunk entries (``{"delta": {...}, "logprobs": ...}``)."""
        events: list[dict[str, Any]] = []
        for entry in entries:
            delta = entry.get("delta") or {}
            logprobs = (entry.get("logprobs") or {}).get("content") or []
            events += self.text(delta.get("content") or "", logprobs)
            for piece in delta.get("tool_calls") or []:
                events += self.call(piece)
        return events

    def closing(self, plan: Plan, choice: Choice) -> list[dict[str, Any]]:
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        events: list[dict[str, Any]] = []
        if not self.items:  # nothing was generated: an empty message, as the unary answer has
            events += self._start(_message_item(_new_id("msg"), "", "in_progress", None))
        events += self._close(status)
        final = self.response.snapshot(status, self.items, _usage(plan, choice))
        events.append(self.event(f"response.{status}", response=final))
        return events

    def failed(self, error: APIError) -> list[dict[str, Any]]:
        code = error.code or error.error_type
        failure = self.event("error", code=code, message=error.message, param=error.param)
        snapshot = self.response.snapshot("failed", self.items, error={"code": code, "message": error.message})
        return [failure, self.event("response.failed", response=snapshot)]


async def respond(
    runner: ChoiceRunner, request: Request, body: ResponsesRequest, chat: ChatCompletionRequest, plan: Plan,
    tools: ChatTools,
) -> Response:  # fmt: skip
    """The ``response`` object, or its event stream, for a planned chat of one choice."""
    stored = request.headers.get(RESPONSES_STORED_HEADER) is not None
    response = _Response(body, plan.model or runner.model_name, stored=stored)
    logprobs = body.wants_logprobs()
    if not body.stream:
        choices = await runner.run_unary(request, plan)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        [choice] = choices
        status, output = unary_output(body, tools, choice, logprobs)
        return JSONResponse(response.snapshot(status, output, _usage(plan, choice)))

    shape = chat_shape(chat, plan, tools)
    writer = _EventWriter(response, body.parallel_tool_calls)

    def render(delta: Delta) -> list[dict[str, Any]]:
        return writer.pieces(shape.delta(delta))

    def final(choices: list[Choice]) -> list[dict[str, Any]]:
        [choice] = choices
        events = writer.pieces(shape.closing(choices))
        return events + writer.closing(plan, choice)

    failed: Callable[[APIError], list[dict[str, Any]]] = writer.failed
    return await runner.stream(plan, render, writer.opening(), final, frame=named_event, failed=failed, done=None,
                               usage_comments=wants_usage_comments(request))  # fmt: skip
