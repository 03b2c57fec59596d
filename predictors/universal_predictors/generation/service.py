"""The OpenAI layer over any :class:`~universal_predictors.generation.engine.Engine`.

Everything here is engine-independent: prompts (chat templates, token-id prompts), context checks,
stop strings matched across token boundaries (held back until they cannot be a stop, never emitted),
``n`` and per-choice seeds, JSON-schema constraints for ``response_format`` and forced tools, tool-call
parsing, usage from the tokenizer's own counts, SSE streaming, and cancellation when the client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from universal_predictors import metrics
from universal_predictors.errors import APIError, InternalError, InvalidRequest
from universal_predictors.generation.engine import (
    Engine,
    GenerationRequest,
    JSONSchemaConstraint,
    NoChatTemplate,
    SamplingParams,
    TokenLogprob,
)
from universal_predictors.generation.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from universal_predictors.http import CLIENT_CLOSED

logger = logging.getLogger(__name__)

#: ``max_tokens`` when a completions request names none (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass
class Choice:
    """What one choice produced, as it streams and at the end."""

    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Delta:
    """A piece of one choice's output for streaming."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass
class Plan:
    """A validated request, ready to run: one entry per choice."""

    prompts: list[list[int]]  # per prompt
    jobs: list[tuple[int, GenerationRequest]]  # (prompt index, request) per choice
    stops: list[str]
    prompt_tokens: int


@dataclass
class _Shape:
    """What distinguishes chat from completions responses; the rest of serving them is shared."""

    id_prefix: str  # "chatcmpl" / "cmpl"
    unary_object: str
    chunk_object: str
    unary_choice: Callable[[Choice], dict[str, Any]]  # a finished choice in the unary response
    opening: list[dict[str, Any]]  # choice entries streamed first, one event each
    delta: Callable[[Delta], list[dict[str, Any]]]  # choice entries for one delta, one event each
    closing: Callable[[list[Choice]], list[dict[str, Any]]]  # choice entries after the last delta


class StopMatcher:
    """Finds stop strings in streamed text across token boundaries; holds back a possible prefix."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was found (emission ends there)."""
        if not self.stops:
            return text, False
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buffer[: min(hits)], True
        keep = 0
        for stop in self.stops:  # the longest buffer suffix that could still grow into a stop string
            for size in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:size]):
                    keep = max(keep, size)
                    break
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _context_error(context: int, prompt: int, requested: int | None) -> InvalidRequest:
    asked = f" and {requested} tokens requested for the completion" if requested else ""
    return InvalidRequest(
        f"This model's maximum context length is {context} tokens. However, the prompt is {prompt} tokens{asked}; "
        f"at least one token must remain for the completion. Shorten the prompt.",
        param="messages",
        code="context_length_exceeded",
    )


async def _until_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body is already read: nothing else can arrive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _GenerationStream(StreamingResponse):
    """An SSE response that watches its client and always runs ``close`` (which stops the generation).

    Starlette's own disconnect watch depends on the ASGI server's spec version (from 2.4 on, a gone
    client is noticed only when a write fails, so a sequence still queued or in prefill would run on),
    and when the client left before the body started, the body iterator never runs at all, so neither
    can be what stops a generation."""

    def __init__(
        self,
        content: AsyncIterator[str],
        close: Callable[[], Awaitable[None]],
        *,
        media_type: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(super().__call__(scope, receive, send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
            if body.done():
                body.result()  # what the server should see (a failed write)
        finally:
            for task in (body, gone):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self._close()


class GenerationService:
    """The OpenAI chat/completions behaviour of one served model."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    # -- validation and planning ----------------------------------------------------------------------

    def _check_capabilities(self, body: SamplingFields, logprobs: int | None) -> None:
        caps = self.engine.capabilities
        backend = self.engine.backend.value
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) and not caps.penalties:
                raise InvalidRequest(f"{name}: the {backend} backend does not support penalties", param=name)
        if logprobs is not None:
            if not caps.logprobs:
                raise InvalidRequest(f"logprobs: the {backend} backend does not return logprobs", param="logprobs")
            if logprobs > caps.max_top_logprobs:
                raise InvalidRequest(
                    f"top_logprobs: at most {caps.max_top_logprobs} on the {backend} backend", param="top_logprobs"
                )

    def _params(
        self, body: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None, choice: int
    ) -> SamplingParams:
        context = self.engine.context_length
        if prompt_len >= context:
            raise _context_error(context, prompt_len, max_tokens)
        remaining = context - prompt_len
        seed = body.seed + choice if body.seed is not None else None
        return SamplingParams(
            max_tokens=min(max_tokens, remaining) if max_tokens is not None else remaining,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
        )

    def _plan(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        constraint: JSONSchemaConstraint | None,
    ) -> Plan:
        if constraint is not None and not self.engine.capabilities.constraints:
            raise InvalidRequest(
                f"{constraint.param}: the {self.engine.backend.value} backend cannot constrain output",
                param=constraint.param,
            )
        if constraint is not None and constraint.schema is not None:
            from universal_predictors.generation.constraints import check_schema

            try:  # one verdict on every engine (vLLM's own backend would silently ignore what it lacks)
                check_schema(constraint.schema)
            except ValueError as exc:
                raise InvalidRequest(f"{constraint.param}: {exc}", param=constraint.param) from None
        jobs = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                params = self._params(body, len(ids), max_tokens, logprobs, i)
                jobs.append((p, GenerationRequest(uuid.uuid4().hex, ids, params, constraint)))
        self.engine.check_capacity(len(jobs))  # overload: a 503 before any stream starts
        return Plan(prompts, jobs, body.stops(), sum(len(ids) for ids in prompts))

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = []
        for m in body.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                message["name"] = m.name
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            messages.append(message)
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        try:
            text = self.engine.apply_chat_template(messages, tools)
        except NoChatTemplate as exc:
            raise InvalidRequest(
                f"{exc}; use /v1/completions with a prompt instead", param="messages", code="chat_template_missing"
            ) from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        return self.engine.tokenize(text, add_special_tokens=False)

    @staticmethod
    def _tool_constraint(body: ChatCompletionRequest) -> tuple[JSONSchemaConstraint | None, str | None]:
        """The constraint a forced tool choice needs, and the forced function's name (named choice)."""
        choice = body.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None, None
        if not body.tools:
            raise InvalidRequest("tool_choice: needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            for tool in body.tools:
                if tool.function.name == choice.function.name:
                    return JSONSchemaConstraint(tool.function.parameters, param="tools"), tool.function.name
            raise InvalidRequest(f"tool_choice: no tool named {choice.function.name!r}", param="tool_choice")
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "arguments": t.function.parameters,
                },
                "required": ["name", "arguments"],
            }
            for t in body.tools
        ]
        return JSONSchemaConstraint(options[0] if len(options) == 1 else {"anyOf": options}, param="tools"), None

    def plan_chat(self, body: ChatCompletionRequest) -> tuple[Plan, str | None]:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self._check_capabilities(body, logprobs)
        constraint, forced = self._tool_constraint(body)
        if constraint is None and body.response_format is not None:
            if body.response_format.type == "json_object":
                constraint = JSONSchemaConstraint(None)
            elif body.response_format.type == "json_schema":
                assert body.response_format.json_schema is not None
                constraint = JSONSchemaConstraint(body.response_format.json_schema.schema_ or {"type": "object"})
        ids = self._chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return self._plan(body, [ids], max_tokens, logprobs, constraint), forced

    def plan_completion(self, body: CompletionRequest) -> Plan:
        self._check_capabilities(body, body.logprobs)
        if body.suffix:
            raise InvalidRequest("suffix: not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest("best_of: only best_of == n is supported", param="best_of")
        if isinstance(body.prompt, str):
            prompts = [self.engine.tokenize(body.prompt, add_special_tokens=True)]
        elif body.prompt and isinstance(body.prompt[0], int):
            prompts = [[int(t) for t in body.prompt]]
        else:
            prompts = [self.engine.tokenize(str(p), add_special_tokens=True) for p in body.prompt]
        if any(not ids for ids in prompts):
            raise InvalidRequest("prompt: must not be empty", param="prompt")
        vocab = self.engine.vocab_size
        if any(t < 0 or t >= vocab for ids in prompts for t in ids):
            raise InvalidRequest(f"prompt: a token id is outside the vocabulary (0..{vocab - 1})", param="prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return self._plan(body, prompts, max_tokens, body.logprobs, None)

    # -- running --------------------------------------------------------------------------------------

    async def run_choice(
        self,
        index: int,
        request: GenerationRequest,
        stops: Sequence[str],
        emit: Callable[[Delta], Awaitable[None]],
        entered: asyncio.Event | None = None,
    ) -> Choice:
        """Generate one choice, calling ``emit`` with each piece of text that is final.

        ``entered`` is set in the same task step that enters the engine's ``generate``, which decides
        admission before its first await: once a waiter sees it set, the engine has taken or refused
        the sequence."""
        choice = Choice(index)
        matcher = StopMatcher(stops)
        started = last = time.perf_counter()
        stream = self.engine.generate(request)
        try:
            try:
                if entered is not None:
                    entered.set()
                async for chunk in stream:
                    now = time.perf_counter()
                    if choice.tokens == 0:
                        metrics.TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(now - started)
                    else:
                        metrics.INTER_TOKEN_LATENCY.labels(self.model_name).observe(now - last)
                    last = now
                    choice.tokens += len(chunk.token_ids)
                    text, stopped = matcher.push(chunk.text)
                    if chunk.finish_reason is not None and not stopped:
                        text += matcher.flush()
                    logprobs = chunk.logprobs or []
                    choice.text += text
                    choice.logprobs += logprobs
                    if stopped or chunk.finish_reason is not None:
                        choice.finish_reason = "stop" if stopped else chunk.finish_reason
                    if text or logprobs or choice.finish_reason:
                        await emit(Delta(index, text, logprobs, choice.finish_reason))
                    if stopped:
                        break
            except ValueError as exc:  # a request the engine cannot take; with a schema, most likely the schema
                param = request.constraint.param if request.constraint is not None else None
                raise InvalidRequest(str(exc), param=param) from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # async generators have aclose()
        if choice.finish_reason is None:  # the engine ended without saying why
            choice.finish_reason = "stop"
        return choice

    def start_all(
        self, plan: Plan, emit: Callable[[Delta], Awaitable[None]], entered: Sequence[asyncio.Event] | None = None
    ) -> list[asyncio.Future[Choice]]:
        return [
            asyncio.ensure_future(self.run_choice(i, req, plan.stops, emit, entered[i] if entered else None))
            for i, (_, req) in enumerate(plan.jobs)
        ]

    async def run_all(
        self,
        plan: Plan,
        emit: Callable[[Delta], Awaitable[None]],
        started: list[asyncio.Future[Choice]] | None = None,
    ) -> list[Choice]:
        """All choices concurrently (they batch together in the engine). However this ends (done, an
        error, cancelled), every choice has left its engine's ``generate`` when it returns."""
        tasks = started if started is not None else self.start_all(plan, emit)
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)  # their engine-side cleanup (abort, slot freed) has run

    async def run_unary(self, request: Request, plan: Plan) -> list[Choice] | None:
        """Run to the end; None (and a counted cancellation) if the client goes away first, whether
        before its first token or after."""

        async def ignore(_: Delta) -> None:
            return None

        work = asyncio.ensure_future(self.run_all(plan, ignore))
        watcher = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            metrics.CANCELLED.labels(self.model_name).inc()
            return None
        finally:
            for task in (work, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _admitted(self, plan: Plan, emit: Callable[[Delta], Awaitable[None]]) -> list[asyncio.Future[Choice]]:
        """Start every choice and wait until the engine has admitted them all, so that an overloaded
        engine's refusal (or any error before generation) is the response's status, not an event after
        a 200. Raises that error, with every choice stopped."""
        entered = [asyncio.Event() for _ in plan.jobs]
        tasks = self.start_all(plan, emit, entered)
        for event, task in zip(entered, tasks, strict=True):  # each decides admission in its first step
            waiter: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
            await asyncio.wait({waiter, cast("asyncio.Future[Any]", task)}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            error = failed[0].exception()
            assert error is not None
            raise error
        return tasks

    async def stream(
        self,
        plan: Plan,
        render: Callable[[Delta], list[dict[str, Any]]],
        first: list[dict[str, Any]],
        final: Callable[[list[Choice]], list[dict[str, Any]]],
    ) -> Response:
        """An SSE response: ``first`` events, one per rendered delta, ``final(choices)`` events, [DONE].

        Generation runs from admission on, owned by the response: however the response ends (all sent,
        the client gone before the first token or mid-stream, the body never started), its choices are
        stopped, a cancellation is counted unless everything was sent, and the request leaves
        ``universal_predictor_in_flight`` (where it stays, unlike the handler, until then)."""
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()

        async def emit(delta: Delta) -> None:
            await queue.put(delta)

        started = await self._admitted(plan, emit)
        work = asyncio.ensure_future(self.run_all(plan, emit, started))
        work.add_done_callback(lambda _: queue.put_nowait(None))
        in_flight = metrics.IN_FLIGHT.labels(self.model_name)
        in_flight.inc()
        completed = False

        async def events() -> AsyncIterator[str]:
            nonlocal completed
            for event in first:
                yield f"data: {json.dumps(event)}\n\n"
            while True:
                delta = await queue.get()
                if delta is None:
                    break
                for rendered in render(delta):
                    yield f"data: {json.dumps(rendered)}\n\n"
            try:
                choices = work.result()
            except APIError as error:
                yield f"data: {json.dumps(error.body())}\n\n"
                completed = True
                return
            except Exception:
                logger.exception("streamed generation failed")
                yield f"data: {json.dumps(InternalError().body())}\n\n"
                completed = True
                return
            for event in final(choices):
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
            completed = True

        async def close() -> None:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            if not completed:  # the client went away: before the first token, mid-stream, or before the body
                metrics.CANCELLED.labels(self.model_name).inc()
            in_flight.dec()
            metrics.LAST_REQUEST.labels(self.model_name).set_to_current_time()  # the stream's end is a use too

        return _GenerationStream(
            events(),
            close,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- OpenAI responses -----------------------------------------------------------------------------

    @staticmethod
    def _usage(plan: Plan, choices: Sequence[Choice]) -> dict[str, int]:
        completion = sum(c.tokens for c in choices)
        return {
            "prompt_tokens": plan.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": plan.prompt_tokens + completion,
        }

    @staticmethod
    def _chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        return {
            "content": [
                {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top]}
                for lp in logprobs
            ]
        }

    @staticmethod
    def _completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
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

    def _tool_message(self, body: ChatCompletionRequest, choice: Choice, forced: str | None) -> dict[str, Any]:
        """The assistant message for a finished choice, with tool calls parsed out when tools apply."""
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if not body.tools or body.tool_choice == "none":
            return message
        calls = _parse_tool_calls(choice.text, forced)
        if calls and choice.finish_reason != "length":
            known = {t.function.name for t in body.tools}
            calls = [c for c in calls if c["function"]["name"] in known]
        if calls and choice.finish_reason != "length":
            before = choice.text.partition(_TOOL_OPEN)[0].strip() if forced is None else ""
            message["content"] = before or None  # text before the first call block, as a stream sends it
            message["tool_calls"] = calls
            choice.finish_reason = "tool_calls"
        return message

    async def _respond(self, request: Request, body: SamplingFields, plan: Plan, shape: _Shape) -> Response:
        """The unary JSON response or the SSE stream for ``plan``, in ``shape``'s form."""
        created, rid = int(time.time()), f"{shape.id_prefix}-{uuid.uuid4().hex}"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        if not body.stream:
            choices = await self.run_unary(request, plan)
            if choices is None:
                return Response(status_code=CLIENT_CLOSED)  # nobody is listening; the status is for logs and metrics
            out = [shape.unary_choice(c) for c in choices]
            return JSONResponse(
                {
                    "id": rid,
                    "object": shape.unary_object,
                    "created": created,
                    "model": self.model_name,
                    "choices": out,
                    "usage": self._usage(plan, choices),
                }
            )

        def event(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
            out = {
                "id": rid,
                "object": shape.chunk_object,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                out["usage"] = usage
            return out

        def render(delta: Delta) -> list[dict[str, Any]]:
            return [event([entry]) for entry in shape.delta(delta)]

        def final(choices: list[Choice]) -> list[dict[str, Any]]:
            events = [event([entry]) for entry in shape.closing(choices)]
            if include_usage:
                events.append(event([], self._usage(plan, choices)))
            return events

        return await self.stream(plan, render, [event([entry]) for entry in shape.opening], final)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        plan, forced = self.plan_chat(body)
        tools_active = bool(body.tools) and body.tool_choice != "none"
        known = {t.function.name for t in body.tools or []}
        streamers = [ToolCallStreamer(forced, body.tool_choice == "required", known) for _ in plan.jobs]

        def unary_choice(c: Choice) -> dict[str, Any]:
            message = self._tool_message(body, c, forced)  # sets finish_reason "tool_calls" for a call
            return {
                "index": c.index,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": self._chat_logprobs(c.logprobs) if body.logprobs else None,
            }

        def delta(d: Delta) -> list[dict[str, Any]]:
            if tools_active:  # the finish comes from closing(), once the whole output is parsed
                pieces = streamers[d.index].push(d.text)
                return [{"index": d.index, "delta": piece, "finish_reason": None, "logprobs": None} for piece in pieces]
            return [
                {
                    "index": d.index,
                    "delta": {"content": d.text} if d.text else {},
                    "finish_reason": d.finish_reason,
                    "logprobs": self._chat_logprobs(d.logprobs) if body.logprobs else None,
                }
            ]

        def closing(choices: list[Choice]) -> list[dict[str, Any]]:
            entries: list[dict[str, Any]] = []
            if not tools_active:
                return entries
            for c in choices:
                streamer = streamers[c.index]
                message = self._tool_message(body, c, forced)
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
        shape = _Shape("chatcmpl", "chat.completion", "chat.completion.chunk", unary_choice, opening, delta, closing)
        return await self._respond(request, body, plan, shape)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        plan = self.plan_completion(body)
        echoes = [self.engine.detokenize(ids) if body.echo else "" for ids in plan.prompts]

        def unary_choice(c: Choice) -> dict[str, Any]:
            echo = echoes[plan.jobs[c.index][0]]
            logprobs = self._completion_logprobs(c.logprobs, len(echo)) if body.logprobs is not None else None
            return {"index": c.index, "text": echo + c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}

        def delta(d: Delta) -> list[dict[str, Any]]:
            logprobs = self._completion_logprobs(d.logprobs, 0) if body.logprobs is not None else None
            return [{"index": d.index, "text": d.text, "finish_reason": d.finish_reason, "logprobs": logprobs}]

        opening = [
            {"index": i, "text": echoes[p], "finish_reason": None, "logprobs": None}
            for i, (p, _) in enumerate(plan.jobs)
            if echoes[p]
        ]
        shape = _Shape("cmpl", "text_completion", "text_completion", unary_choice, opening, delta, lambda _: [])
        return await self._respond(request, body, plan, shape)

    async def complete_text(self, prompt: str, max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS) -> str:
        """Greedy text for one prompt (KServe v1/v2 text in, text out)."""
        ids = self.engine.tokenize(prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.engine.context_length:
            raise _context_error(self.engine.context_length, len(ids), max_tokens)
        params = SamplingParams(max_tokens=min(max_tokens, self.engine.context_length - len(ids)), temperature=0.0)

        async def ignore(_: Delta) -> None:
            return None

        choice = await self.run_choice(0, GenerationRequest(uuid.uuid4().hex, ids, params), [], ignore)
        return choice.text


def _parse_tool_calls(text: str, forced: str | None) -> list[dict[str, Any]]:
    """Tool calls in a model's output: the forced function's bare arguments, ``<tool_call>{...}</tool_call>``
    blocks, or a whole-output ``{"name", "arguments"}`` object."""

    def call(name: str, arguments: Any) -> dict[str, Any]:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }

    def load(fragment: str) -> Any:
        with contextlib.suppress(ValueError):
            return json.loads(fragment)
        return None

    stripped = text.strip()
    if forced is not None:
        value = load(stripped)
        return [call(forced, stripped)] if isinstance(value, dict) else []  # as generated, like a stream
    candidates = []
    rest = stripped
    while "<tool_call>" in rest:
        _, _, after = rest.partition("<tool_call>")
        inner, _, rest = after.partition("</tool_call>")
        candidates.append(inner.strip())
    if not candidates:
        candidates = [stripped]
    calls = []
    for fragment in candidates:
        split = _split_call(fragment)
        if split is not None:
            calls.append(call(*split))
            continue
        value = load(fragment)
        if isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
            calls.append(
                call(
                    value["name"],
                    value["arguments"] if isinstance(value["arguments"], str) else json.dumps(value["arguments"]),
                )
            )
    return calls


#: The head of a call object up to where its arguments start: ``{"name": ..., "arguments": `` or, as a
#: constraint may allow, ``{"arguments": `` with the name after them (``_CALL_TAIL``).
_CALL_HEAD = re.compile(r'\s*\{\s*(?:"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*)?"arguments"\s*:\s*')
_NAME_AFTER = re.compile(r'\s*,\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CALL_TAIL = re.compile(r'\s*(?:,\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*)?\}\s*')
_TOOL_OPEN, _TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _json_value_end(text: str) -> int | None:
    """Where the JSON object/array starting ``text`` ends (exclusive), or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _split_call(fragment: str) -> tuple[str, str] | None:
    """A call object's name and its arguments as the model wrote them (so a streamed call and a unary
    one carry the same text), or None when ``fragment`` is not such an object."""
    head = _CALL_HEAD.match(fragment)
    if head is None:
        return None
    rest = fragment[head.end() :]
    end = _json_value_end(rest) if rest[:1] == "{" else None
    tail = _CALL_TAIL.fullmatch(rest[end:]) if end is not None else None
    if end is None or tail is None or (head.group(1) is None) == (tail.group(1) is None):
        return None  # not a call, or the name missing or given twice
    try:
        name, args = json.loads(f'"{head.group(1) or tail.group(1)}"'), json.loads(rest[:end])
    except ValueError:
        return None
    return (name, rest[:end]) if isinstance(name, str) and isinstance(args, dict) else None


class ToolCallStreamer:
    """Turns one choice's streamed text into chat deltas when tools apply: content while the output
    cannot (yet) be a tool call, then OpenAI-style ``tool_calls`` deltas (a first one with index, id,
    type and name; then pieces of ``arguments`` as they are generated).

    A forced named function's output is its bare arguments; ``required`` and ``auto`` calls are
    ``{"name", "arguments"}`` objects (for ``auto`` inside ``<tool_call>`` blocks, or the whole output);
    what cannot be streamed safely (a whole-output object under ``auto``) is sent at the end.
    """

    def __init__(self, forced: str | None, required: bool, known: set[str]) -> None:
        self.forced, self.required, self.known = forced, required, known
        self.text = ""  # everything generated so far
        self.pos = 0  # text before this is handled (emitted or deliberately dropped)
        self.mode = "args" if forced else "call" if required else "undecided"
        self.calls = 0  # tool calls started
        self.pending_ws = ""  # whitespace inside arguments held until something follows it
        self.args_start = 0  # where the current call's arguments object starts in ``text``

    def _start_call(self, name: str) -> dict[str, Any]:
        self.calls += 1
        return {
            "tool_calls": [
                {
                    "index": self.calls - 1,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            ]
        }

    def _args(self, piece: str) -> list[dict[str, Any]]:
        piece = self.pending_ws + piece
        stripped = piece.rstrip()
        self.pending_ws = piece[len(stripped) :]
        if not stripped:
            return []
        return [{"tool_calls": [{"index": self.calls - 1, "function": {"arguments": stripped}}]}]

    def push(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        while True:
            rest = self.text[self.pos :]
            if self.mode == "args":  # a forced function's bare arguments
                if self.calls == 0:
                    if not rest.strip():
                        return out
                    assert self.forced is not None
                    out.append(self._start_call(self.forced))
                    self.pos += len(rest) - len(rest.lstrip())
                    continue
                out += self._args(rest)
                self.pos = len(self.text)
                return out
            if self.mode == "undecided":
                body = rest.lstrip()
                if not body or (len(body) < len(_TOOL_OPEN) and _TOOL_OPEN.startswith(body)):
                    return out  # could still become a tool call: hold it
                if body.startswith(_TOOL_OPEN):
                    self.pos += len(rest) - len(body) + len(_TOOL_OPEN)
                    self.mode = "call"
                    continue
                if body.startswith("{"):
                    self.mode = "whole"  # maybe a whole-output call object: only the end can tell
                    return out
                self.mode = "content"
                continue
            if self.mode == "content":  # plain text; a <tool_call> may still follow it
                at = rest.find(_TOOL_OPEN)
                if at >= 0:
                    if rest[:at]:
                        out.append({"content": rest[:at]})
                    self.pos += at + len(_TOOL_OPEN)
                    self.mode = "call"
                    continue
                keep = next((n for n in range(min(len(_TOOL_OPEN) - 1, len(rest)), 0, -1)
                             if rest.endswith(_TOOL_OPEN[:n])), 0)  # fmt: skip
                if rest[: len(rest) - keep]:
                    out.append({"content": rest[: len(rest) - keep]})
                self.pos += len(rest) - keep
                return out
            if self.mode == "call":  # waiting for the head of a call object
                head = _CALL_HEAD.match(rest)
                if head is None or not rest[head.end() :]:
                    return out
                # The name comes first, or is the only tool's (required); else only the end can tell.
                only = next(iter(self.known)) if self.required and len(self.known) == 1 else None
                name = json.loads(f'"{head.group(1)}"') if head.group(1) is not None else only
                if name is None and rest[head.end()] == "{":  # the name follows the arguments: wait for it
                    end = _json_value_end(rest[head.end() :])
                    after = _NAME_AFTER.match(rest, head.end() + end) if end is not None else None
                    if after is None:
                        return out
                    name = json.loads(f'"{after.group(1)}"')
                if rest[head.end()] != "{" or name not in self.known:
                    self.mode = "whole"  # not a call we can stream: decided at the end
                    return out
                out.append(self._start_call(name))
                self.pos += head.end()
                self.args_start = self.pos
                self.mode = "call_args"
                continue
            if self.mode == "call_args":  # the arguments object of a call, until it closes
                end = _json_value_end(self.text[self.args_start :])
                if end is None:
                    out += self._args(rest)
                    self.pos = len(self.text)
                    return out
                out += self._args(self.text[self.pos : self.args_start + end])
                self.pending_ws = ""
                self.pos = self.args_start + end
                self.mode = "after_call" if self.forced is None and not self.required else "between"
                continue
            if self.mode == "after_call":  # the call object's "}" and the block's end: dropped
                close = rest.find(_TOOL_CLOSE)
                if close < 0:
                    return out
                self.pos += close + len(_TOOL_CLOSE)
                self.mode = "between"
                continue
            if self.mode == "between":  # after a <tool_call> block only another block counts
                body = rest.lstrip()
                if body.startswith(_TOOL_OPEN):
                    self.pos += len(rest) - len(body) + len(_TOOL_OPEN)
                    self.mode = "call"
                    continue
                return out
            return out  # "whole": everything waits for the end

    def finish(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The last deltas, given the unary message for the whole text (from ``_tool_message``)."""
        if self.calls:
            return []  # the calls were streamed; what is left is their closing syntax
        if message.get("tool_calls"):  # a call only the whole output could reveal
            return [{"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}]
        rest = self.text[self.pos :]
        return [{"content": rest}] if rest else []
