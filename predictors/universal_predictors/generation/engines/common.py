"""What the engines with their own engine thread share: turning a sequence's token queue into chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from universal_predictors.generation.engine import (
    Engine,
    GenerationChunk,
    IncrementalDetokenizer,
    TokenLogprob,
    TopLogprob,
)

#: One generated token as the engine thread sends it: id, logprob, top alternatives, finish reason.
TokenItem = tuple[int, float, list[tuple[int, float]], Any]


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
