"""Building OpenAI chat and completions responses from finished choices and streamed deltas: the unary
JSON body or the chunk events, usage from the tokenizer's own counts, logprobs in each API's shape, and
the assistant message with its tool calls parsed out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from universal_predictors.generation.engine import TokenLogprob
from universal_predictors.generation.planning import Plan
from universal_predictors.generation.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from universal_predictors.generation.streaming import Choice, ChoiceRunner, Delta, wants_usage_comments
from universal_predictors.generation.tools import ParsedToolCalls, ToolCallStreamer, ToolParser
from universal_predictors.generation.tools.constrained import ConstrainedCallStreamer, parse_constrained
from universal_predictors.http import CLIENT_CLOSED


@dataclass
class ResponseShape:
    """What distinguishes chat from completions responses; the rest of serving them is shared."""

    id_prefix: str  # "chatcmpl" / "cmpl"
    unary_object: str
    chunk_object: str
    unary_choice: Callable[[Choice], dict[str, Any]]  # a finished choice in the unary response
    opening: list[dict[str, Any]]  # choice entries streamed first, one event each
    delta: Callable[[Delta], list[dict[str, Any]]]  # choice entries for one delta, one event each
    closing: Callable[[list[Choice]], list[dict[str, Any]]]  # choice entries after the last delta


def usage(plan: Plan, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(c.tokens for c in choices)
    return {
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": plan.prompt_tokens + completion,
    }


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


class ChatTools:
    """How one chat request's tools read the output: the model's own format under ``auto``, the
    constraint's shape under ``required`` or a named function; nothing without tools or under ``none``."""

    def __init__(self, body: ChatCompletionRequest, forced: str | None, parser: ToolParser) -> None:
        self.active = bool(body.tools) and body.tool_choice != "none"
        self.constrained = forced is not None or body.tool_choice == "required"
        self.forced, self.parser = forced, parser
        self.known = frozenset(t.function.name for t in body.tools or [])

    def streamer(self) -> ToolCallStreamer:
        if self.constrained:
            return ConstrainedCallStreamer(self.forced, self.known, self.parser.call_id)
        return self.parser.streamer(self.known)

    def parse(self, text: str) -> ParsedToolCalls:
        if self.constrained:
            return parse_constrained(text, self.forced, self.parser.call_id)
        return self.parser.parse(text)

    def message(self, choice: Choice) -> dict[str, Any]:
        """The assistant message for a finished choice, with its tool calls when tools apply (and then
        ``finish_reason`` "tool_calls")."""
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if not self.active or choice.finish_reason == "length":
            return message
        parsed = self.parse(choice.text)
        calls = [c for c in parsed.calls if c["function"]["name"] in self.known]
        if calls:
            message["content"] = parsed.content  # the text before the first call, as a stream sends it
            message["tool_calls"] = calls
            choice.finish_reason = "tool_calls"
        return message


def chat_shape(body: ChatCompletionRequest, plan: Plan, tools: ChatTools) -> ResponseShape:
    streamers = [tools.streamer() for _ in plan.jobs]

    def unary_choice(c: Choice) -> dict[str, Any]:
        message = tools.message(c)  # sets finish_reason "tool_calls" for a call
        return {
            "index": c.index,
            "message": message,
            "finish_reason": c.finish_reason,
            "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None,
        }

    def delta(d: Delta) -> list[dict[str, Any]]:
        if tools.active:  # the finish comes from closing(), once the whole output is parsed
            pieces = streamers[d.index].push(d.text)
            return [{"index": d.index, "delta": piece, "finish_reason": None, "logprobs": None} for piece in pieces]
        return [
            {
                "index": d.index,
                "delta": {"content": d.text} if d.text else {},
                "finish_reason": d.finish_reason,
                "logprobs": chat_logprobs(d.logprobs) if body.logprobs else None,
            }
        ]

    def closing(choices: list[Choice]) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        if not tools.active:
            return entries
        for c in choices:
            streamer = streamers[c.index]
            message = tools.message(c)
            if streamer.calls and c.finish_reason == "stop":
                c.finish_reason = "tool_calls"
            pieces = streamer.finish(message) or [{}]
            for n, piece in enumerate(pieces):
                finish = c.finish_reason if n == len(pieces) - 1 else None
                entries.append({"index": c.index, "delta": piece, "finish_reason": finish, "logprobs": None})
        return entries

    opening = [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        for i in range(len(plan.jobs))
    ]
    return ResponseShape("chatcmpl", "chat.completion", "chat.completion.chunk", unary_choice, opening, delta, closing)


def completion_shape(body: CompletionRequest, plan: Plan, echoes: list[str]) -> ResponseShape:
    def unary_choice(c: Choice) -> dict[str, Any]:
        echo = echoes[plan.jobs[c.index][0]]
        logprobs = completion_logprobs(c.logprobs, len(echo)) if body.logprobs is not None else None
        return {"index": c.index, "text": echo + c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}

    def delta(d: Delta) -> list[dict[str, Any]]:
        logprobs = completion_logprobs(d.logprobs, 0) if body.logprobs is not None else None
        return [{"index": d.index, "text": d.text, "finish_reason": d.finish_reason, "logprobs": logprobs}]

    opening = [
        {"index": i, "text": echoes[p], "finish_reason": None, "logprobs": None}
        for i, (p, _) in enumerate(plan.jobs)
        if echoes[p]
    ]
    return ResponseShape("cmpl", "text_completion", "text_completion", unary_choice, opening, delta, lambda _: [])


async def respond(
    runner: ChoiceRunner, request: Request, body: SamplingFields, plan: Plan, shape: ResponseShape
) -> Response:
    """The unary JSON response or the SSE stream for ``plan``, in ``shape``'s form."""
    created, rid = int(time.time()), f"{shape.id_prefix}-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    model = plan.model or runner.model_name

    if not body.stream:
        choices = await runner.run_unary(request, plan)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)  # nobody is listening; the status is for logs and metrics
        out = [shape.unary_choice(c) for c in choices]
        return JSONResponse(
            {
                "id": rid,
                "object": shape.unary_object,
                "created": created,
                "model": model,
                "choices": out,
                "usage": usage(plan, choices),
            }
        )

    def event(choices: list[dict[str, Any]], counts: Any = None) -> dict[str, Any]:
        out = {"id": rid, "object": shape.chunk_object, "created": created, "model": model, "choices": choices}
        if include_usage:
            out["usage"] = counts
        return out

    def render(delta: Delta) -> list[dict[str, Any]]:
        return [event([entry]) for entry in shape.delta(delta)]

    def final(choices: list[Choice]) -> list[dict[str, Any]]:
        events = [event([entry]) for entry in shape.closing(choices)]
        if include_usage:
            events.append(event([], usage(plan, choices)))
        return events

    return await runner.stream(
        plan, render, [event([entry]) for entry in shape.opening], final, usage_comments=wants_usage_comments(request)
    )
