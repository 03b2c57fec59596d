"""Running a plan's choices on the engine, and serving them as server-sent events.

Admission: a stream starts only once the engine has taken every choice, so an overloaded engine's refusal
is the response's status, not an event after a 200. Cancellation: however a response ends (all sent, the
client gone before the first token or mid-stream, the body never started), its choices leave the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from universal_predictors import metrics, tracing
from universal_predictors.config import USAGE_COMMENTS_HEADER
from universal_predictors.errors import APIError, InternalError, InvalidRequest
from universal_predictors.generation.engine import Engine, GenerationRequest, TokenLogprob
from universal_predictors.generation.planning import Plan
from universal_predictors.generation.stops import StopMatcher

logger = logging.getLogger(__name__)

Emit = Callable[["Delta"], Awaitable[None]]


@dataclass
class Choice:
    """What one choice produced, as it streams and at the end."""

    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    #: The stop string that ended it (``finish_reason`` "stop" then), if one did.
    stop: str | None = None


@dataclass
class Delta:
    """A piece of one choice's output for streaming."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    #: Tokens the choice generated since its previous delta.
    tokens: int = 0


async def ignore(_: Delta) -> None:
    return None


def sse(event: Any) -> str:
    """One server-sent event carrying ``event`` as JSON."""
    return f"data: {json.dumps(event)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_comment(prompt_tokens: int, completion_tokens: int) -> str:
    """Token counts so far, as the SSE comment a stream carries when the gateway asks (``USAGE_COMMENTS_HEADER``):
    before each piece of output (so that the gateway can stop a stream before the piece its key has no tokens
    left for), and once more with the totals before the final events. Clients ignore comments (the SSE spec's
    lines starting with a colon); the gateway takes them out (DESIGN.md, the gateway's contract with the
    predictors)."""
    return f': usage {{"prompt_tokens": {prompt_tokens}, "completion_tokens": {completion_tokens}}}\n\n'


def wants_usage_comments(request: Request) -> bool:
    return USAGE_COMMENTS_HEADER in request.headers


async def until_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body is already read: nothing else can arrive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class GenerationStream(StreamingResponse):
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
        gone = asyncio.ensure_future(until_disconnect(receive))
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


class ChoiceRunner:
    """Runs choices on one engine: stop strings, metrics, admission, unary and streamed delivery."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def run_choice(
        self,
        index: int,
        request: GenerationRequest,
        stops: Sequence[str],
        emit: Emit,
        entered: asyncio.Event | None = None,
    ) -> Choice:
        """Generate one choice, calling ``emit`` with each piece of text that is final.

        ``entered`` is set in the same task step that enters the engine's ``generate``, which decides
        admission before its first await: once a waiter sees it set, the engine has taken or refused
        the sequence."""
        choice = Choice(index)
        matcher = StopMatcher(stops)
        spans = tracing.sequence_spans()  # None unless tracing is on
        started = last = time.perf_counter()
        pending = 0  # tokens generated since the last delta
        stream = self.engine.generate(request)
        try:
            try:
                if entered is not None:
                    entered.set()
                async for chunk in stream:
                    now = time.perf_counter()
                    if choice.tokens == 0:
                        metrics.TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(now - started)
                        if spans is not None:
                            spans.token(chunk.prefill_started_ns)
                    else:
                        metrics.INTER_TOKEN_LATENCY.labels(self.model_name).observe(now - last)
                    last = now
                    choice.tokens += len(chunk.token_ids)
                    pending += len(chunk.token_ids)
                    text, stopped = matcher.push(chunk.text)
                    if chunk.finish_reason is not None and not stopped:
                        text += matcher.flush()
                    logprobs = chunk.logprobs or []
                    choice.text += text
                    choice.logprobs += logprobs
                    if stopped or chunk.finish_reason is not None:
                        choice.finish_reason = "stop" if stopped else chunk.finish_reason
                        choice.stop = matcher.matched
                    if text or logprobs or choice.finish_reason:
                        await emit(Delta(index, text, logprobs, choice.finish_reason, pending))
                        pending = 0
                    if stopped:
                        break
            except ValueError as exc:  # a request the engine cannot take; with a schema, most likely the schema
                param = request.constraint.param if request.constraint is not None else None
                raise InvalidRequest(str(exc), param=param) from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # async generators have aclose()
            if spans is not None:
                spans.end(choice.tokens, choice.finish_reason, len(request.prompt_ids))
        if choice.finish_reason is None:  # the engine ended without saying why
            choice.finish_reason = "stop"
        return choice

    def start_all(
        self, plan: Plan, emit: Emit, entered: Sequence[asyncio.Event] | None = None
    ) -> list[asyncio.Future[Choice]]:
        return [
            asyncio.ensure_future(self.run_choice(i, req, plan.stops, emit, entered[i] if entered else None))
            for i, (_, req) in enumerate(plan.jobs)
        ]

    async def run_all(
        self, plan: Plan, emit: Emit, started: list[asyncio.Future[Choice]] | None = None
    ) -> list[Choice]:
        """All choices concurrently (they batch together in the engine). However this ends (done, an
        error, cancelled), every choice has left its engine's ``generate`` when it returns."""
        tasks = started if started is not None else self.start_all(plan, emit)
        try:
            choices = list(await asyncio.gather(*tasks))
            if tracing.ACTIVE is not None:
                tracing.usage(plan.prompt_tokens, sum(c.tokens for c in choices), [c.finish_reason for c in choices])
            return choices
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)  # their engine-side cleanup (abort, slot freed) has run

    async def run_unary(self, request: Request, plan: Plan) -> list[Choice] | None:
        """Run to the end; None (and a counted cancellation) if the client goes away first, whether
        before its first token or after."""
        work = asyncio.ensure_future(self.run_all(plan, ignore))
        watcher = asyncio.ensure_future(until_disconnect(request.receive))
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

    async def _admitted(self, plan: Plan, emit: Emit) -> list[asyncio.Future[Choice]]:
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
        *,
        frame: Callable[[dict[str, Any]], str] = sse,
        failed: Callable[[APIError], list[dict[str, Any]]] = lambda error: [error.body()],
        done: str | None = SSE_DONE,
        usage_comments: bool = False,
    ) -> Response:
        """An SSE response: ``first`` events, one per rendered delta, ``final(choices)`` events, [DONE].
        ``frame`` writes one event (the Responses API names each: ``event:`` lines), ``failed`` gives the
        events for an error after the 200, ``done`` is the last line (None: nothing, as Responses streams end),
        ``usage_comments``: the token counts as comments (:data:`USAGE_COMMENTS_HEADER`).

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
                yield frame(event)
            generated = 0
            while True:
                delta = await queue.get()
                if delta is None:
                    break
                frames = "".join(frame(rendered) for rendered in render(delta))
                if usage_comments and delta.tokens:  # in the same write: one chunk, not two
                    generated += delta.tokens
                    frames = usage_comment(plan.prompt_tokens, generated) + frames
                if frames:
                    yield frames
            try:
                choices = work.result()
            except APIError as error:
                for event in failed(error):
                    yield frame(event)
                completed = True
                return
            except Exception:
                logger.exception("streamed generation failed")
                for event in failed(InternalError()):
                    yield frame(event)
                completed = True
                return
            if usage_comments:
                yield usage_comment(plan.prompt_tokens, sum(c.tokens for c in choices))
            for event in final(choices):
                yield frame(event)
            if done is not None:
                yield done
            completed = True

        async def close() -> None:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            if not completed:  # the client went away: before the first token, mid-stream, or before the body
                metrics.CANCELLED.labels(self.model_name).inc()
            in_flight.dec()
            metrics.LAST_REQUEST.labels(self.model_name).set_to_current_time()  # the stream's end is a use too

        return GenerationStream(
            events(),
            close,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
