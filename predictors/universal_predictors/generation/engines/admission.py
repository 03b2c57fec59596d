"""Admission to an engine's bounded queue, and the hand-over of admitted sequences to and from its engine thread.

- :class:`Admission`: ``slots`` running + ``max_queue`` waiting sequences at once; beyond the whole
  capacity a request is a 413 (waiting cannot help it), beyond what is free now a 503 ``overloaded``
  with ``Retry-After``. Counted on the event loop only.
- :class:`QueuedSequence`: one sequence handed to an engine thread, which ``send``s its tokens (or an
  exception) back to the sequence's asyncio queue.
- :func:`stream_from_engine_thread`: admit a sequence, enqueue it, and yield its chunks until it finishes
  or the consumer goes away (the engine thread then drops it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from universal_predictors.errors import Unavailable
from universal_predictors.generation.engine import (
    Engine,
    GenerationChunk,
    GenerationRequest,
    IncrementalDetokenizer,
    TokenLogprob,
    TopLogprob,
    beyond_capacity,
)

S = TypeVar("S", bound="QueuedSequence")

#: One generated token as the engine thread sends it: id, logprob, top alternatives, finish reason.
TokenItem = tuple[int, float, list[tuple[int, float]], Any]


def overloaded(waiting: int | None = None) -> Unavailable:
    """The 503 (with ``Retry-After``) for a request that would fit an idle engine but not this one now."""
    queued = f" ({waiting} sequences waiting)" if waiting is not None else ""
    return Unavailable(f"The model is overloaded{queued}; retry shortly.", code="overloaded")


class Admission:
    """How many sequences an engine holds at once: ``slots`` running plus ``max_queue`` waiting.

    ``outstanding`` counts the sequences admitted and not yet finished; it is touched on the event loop
    only, so a check and the count that follows it cannot interleave with another request's."""

    def __init__(self, slots: int, max_queue: int, limits: str) -> None:
        self.slots = slots
        self.max_queue = max_queue
        #: The engine args that set the capacity, named in the 413 (``engine args n_parallel + max_queue``).
        self.limits = limits
        self.outstanding = 0

    @property
    def capacity(self) -> int:
        return self.slots + self.max_queue

    @property
    def waiting(self) -> int:
        return max(0, self.outstanding - self.slots)

    def check(self, sequences: int = 1) -> None:
        """413 when ``sequences`` could never be admitted at once, 503 when they cannot be now."""
        if sequences > self.capacity:
            raise beyond_capacity(sequences, self.capacity, self.limits)
        if self.outstanding + sequences > self.capacity:
            raise overloaded(self.waiting)


@dataclass(eq=False)
class QueuedSequence:
    """One sequence handed to an engine thread; engines subclass it with their per-sequence state."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    grammar: str | None  # llguidance grammar of the constraint, checked before admission
    #: Set from the event loop when the consumer goes away: the engine thread drops it at its next step.
    abandoned: bool = field(default=False, kw_only=True)
    #: Set by the engine thread when it first takes the sequence into a prefill (``time.time_ns()``; 0: not yet).
    prefill_started_ns: int = field(default=0, kw_only=True)

    def send(self, item: Any) -> None:
        """From the engine thread: a :data:`TokenItem` or an exception, to the sequence's consumer."""
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is listening
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


async def stream_from_engine_thread(
    engine: Engine, admission: Admission, seq: S, enqueue: Callable[[S], None]
) -> AsyncGenerator[GenerationChunk, None]:
    """Admit ``seq`` (``engine.check_capacity``: 413/503), hand it to the engine thread with ``enqueue``
    and yield its chunks. The check and the count happen before the first ``await``, so concurrent
    requests cannot all pass the check at once, and a refused stream is refused before its 200."""
    engine.check_capacity(1)
    admission.outstanding += 1
    try:
        enqueue(seq)
    except BaseException:
        admission.outstanding -= 1
        raise
    try:
        want_logprobs = seq.request.params.logprobs is not None
        async with contextlib.aclosing(drain_tokens(engine, seq.out, want_logprobs)) as chunks:
            first = True
            async for chunk in chunks:
                if first:
                    chunk.prefill_started_ns = seq.prefill_started_ns or None
                    first = False
                yield chunk
    finally:
        seq.abandoned = True
        admission.outstanding -= 1


async def drain_tokens(
    engine: Engine, out: asyncio.Queue[Any], want_logprobs: bool
) -> AsyncGenerator[GenerationChunk, None]:
    """Chunks from ``out``, which receives :data:`TokenItem` tuples (or an exception to raise) from the
    engine thread, until one carries a finish reason. A slow consumer gets its backlog as one chunk."""
    detok = IncrementalDetokenizer(engine)
    while True:
        items = [await out.get()]
        while not out.empty():
            items.append(out.get_nowait())
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        finish = None
        for item in items:
            if isinstance(item, BaseException):
                raise item
            token_id, lp, top, finish = item
            ids.append(token_id)
            if want_logprobs:
                alternatives = tuple(TopLogprob(t, engine.token_text(t), v) for t, v in top)
                logprobs.append(TokenLogprob(token_id, engine.token_text(token_id), lp, alternatives))
        text = detok.push(ids)
        if finish is not None:
            text += detok.flush()
        yield GenerationChunk(ids, text, logprobs if want_logprobs else None, finish)
        if finish is not None:
            return
