"""A transformers encoder with a task head over ``texts`` requests: what classify and NER share.

Loading the model and its fast tokenizer, the input-length rule (a 400 naming the text unless the
request asks for ``truncate``), tokenisation off the event loop, and micro-batched forward passes on
the engine thread (texts sorted by token count, padded per batch, ``torch.inference_mode()``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.catalog import Backend
from universal_predictors.devices import release_memory
from universal_predictors.encoders.args import EncoderEngineArgs
from universal_predictors.encoders.base import EncoderPredictor, load_model, load_tokenizer
from universal_predictors.encoders.limits import (
    SHORTEN_REMEDY,
    TRUNCATE_REMEDY,
    char_limit,
    check_chars,
    context_length_exceeded,
    input_limit,
)
from universal_predictors.encoders.padding import pad_batch
from universal_predictors.errors import InvalidRequest, RequestTooLarge


class TextsEngineArgs(EncoderEngineArgs):
    """Engine arguments of the ``texts`` tasks (classify, NER)."""

    max_texts: int = Field(default=1024, ge=1, description="Texts per request at most (413 above).")


@dataclass(frozen=True)
class Encoded:
    """One tokenised text: ids with the special tokens, and what NER needs to map back to characters."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    special: list[bool]
    words: list[int | None]
    truncated: bool


class TextsRequest(BaseModel):
    """Fields every ``texts`` route takes; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    texts: list[str] = Field(description="A string or a list of strings.")
    truncate: bool = Field(
        default=False, description="Extension: cut texts over the model's input limit instead of a 400."
    )

    @field_validator("texts", mode="before")
    @classmethod
    def _one_text(cls, value: Any) -> Any:
        # A lone string is one text; validating it as a list keeps error paths like ``texts[3]``.
        return [value] if isinstance(value, str) else value

    def text_list(self) -> list[str]:
        return list(self.texts)


class TextsPredictor(EncoderPredictor):
    """A transformers encoder with a task head, fed by a :class:`MicroBatcher`."""

    EngineArgs: ClassVar[type[BaseModel]] = TextsEngineArgs
    #: Whether items need offsets and word ids (NER) or just ids (classify).
    needs_offsets: ClassVar[bool] = False

    def auto_model_class(self) -> Any:
        raise NotImplementedError

    def load(self) -> bool:
        import torch

        args: TextsEngineArgs = self.engine_args
        self.tokenizer = load_tokenizer(self.config.source)
        if self.needs_offsets and not getattr(self.tokenizer, "is_fast", False):
            raise RuntimeError(f"task {self.task.value} needs a fast tokenizer (tokenizer.json) for character offsets")
        self.model, self.device = load_model(self.auto_model_class(), self.config.source, args)
        self.labels: list[str] = [str(self.model.config.id2label[i]) for i in range(self.model.config.num_labels)]
        self.max_tokens = input_limit(self.model.config, self.tokenizer, args.max_input_tokens)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.with_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self.backend = Backend.TRANSFORMERS
        self._torch = torch
        self.batcher: MicroBatcher[Encoded, np.ndarray] = MicroBatcher(
            self._forward_batch,
            model_name=self.name,
            policy=BatchPolicy(
                max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, max_batch_cost=args.max_batch_tokens
            ),
            cost=lambda item: len(item.ids),
        )
        self.after_load()
        return True

    def after_load(self) -> None:
        """Task-specific set-up once the model and tokenizer exist."""

    def unload(self) -> None:
        for attribute in ("model", "tokenizer"):
            if hasattr(self, attribute):
                delattr(self, attribute)
        release_memory(getattr(self, "device", "cpu"))

    # -- tokenisation --------------------------------------------------------------------------------

    def _tokenize(self, texts: Sequence[str], truncate: bool, field: str) -> list[Encoded]:
        kwargs: dict[str, Any] = {
            "add_special_tokens": True,
            "return_special_tokens_mask": True,
            "return_attention_mask": False,
            "return_token_type_ids": False,
            "return_offsets_mapping": self.needs_offsets,
            "verbose": False,  # the over-long warning: we answer with a 400 (or truncate) instead
        }
        # KServe's instances have no truncate option: only the routes' texts can ask for it.
        remedy = TRUNCATE_REMEDY if field == "texts" else SHORTEN_REMEDY
        most = char_limit(self.max_tokens)
        shortened = {i for i, text in enumerate(texts) if len(text) > most}
        if truncate:
            texts = [text[:most] for text in texts]
        else:
            check_chars(texts, self.max_tokens, field, remedy)
        # One token past the limit tells a text is over it; the tokens after it are never handed back.
        batch = self.tokenizer(list(texts), truncation=True, max_length=self.max_tokens + 1, **kwargs)
        over = [i for i, ids in enumerate(batch["input_ids"]) if len(ids) > self.max_tokens]
        if over and not truncate:
            first = over[0]  # within char_limit: counting all of its tokens is bounded
            length = len(self.tokenizer(texts[first], add_special_tokens=True, verbose=False)["input_ids"])
            raise context_length_exceeded(f"{field}[{first}]", length, self.max_tokens, remedy)
        cut = (
            self.tokenizer([texts[i] for i in over], truncation=True, max_length=self.max_tokens, **kwargs)
            if over
            else None
        )
        replaced = dict(zip(over, range(len(over)), strict=True))
        items = []
        for i in range(len(texts)):
            source, j = (cut, replaced[i]) if cut is not None and i in replaced else (batch, i)
            ids = list(source["input_ids"][j])
            items.append(
                Encoded(
                    ids=ids,
                    offsets=[tuple(o) for o in source["offset_mapping"][j]] if self.needs_offsets else [],
                    special=[bool(s) for s in source["special_tokens_mask"][j]],
                    words=list(source.word_ids(j)) if self.needs_offsets else [],
                    truncated=i in replaced or (truncate and i in shortened),
                )
            )
        return items

    async def encode(self, texts: list[str], truncate: bool, field: str = "texts") -> list[Encoded]:
        """Check and tokenise ``texts`` off the event loop (a large request must not stall others)."""
        limit: int = self.engine_args.max_texts
        if not texts:
            raise InvalidRequest(f"{field}: must not be empty", param=field)
        if len(texts) > limit:
            raise RequestTooLarge(
                f"{field}: {len(texts)} texts is over the limit of {limit} per request (engine arg max_texts)",
                param=field,
            )
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # JSON can carry lone surrogates; the tokenizer cannot take them
                raise InvalidRequest(
                    f"{field}[{i}]: is not valid Unicode (a lone surrogate)", param=f"{field}[{i}]"
                ) from None
        return await asyncio.to_thread(self._tokenize, texts, truncate, field)

    # -- the engine thread ---------------------------------------------------------------------------

    def _forward_batch(self, items: Sequence[Encoded]) -> list[np.ndarray]:
        """One forward pass over ``items`` (sorted by length by the batcher); logits per item, float32."""
        features = pad_batch([item.ids for item in items], self.pad_id, self.device,
                             with_token_types=self.with_token_types)  # fmt: skip
        with self._torch.inference_mode():
            logits = self.model(**features).logits.float().cpu().numpy()
        if logits.ndim == 2:  # sequence classification: one row per text
            return [logits[row] for row in range(len(items))]
        return [logits[row, : len(item.ids)] for row, item in enumerate(items)]

    async def run(self, items: list[Encoded]) -> list[np.ndarray]:
        return await self.batcher.submit_many(items)

    def list_response(self, items: list[Encoded], entries: list[dict[str, Any]], truncate: bool) -> JSONResponse:
        """The OpenAI-style list body shared by /v1/classify and /v1/ner: one entry per input, in order."""
        data = []
        for index, (item, entry) in enumerate(zip(items, entries, strict=True)):
            if truncate:
                entry = {**entry, "truncated": item.truncated}
            data.append({"index": index, **entry})
        tokens = sum(len(item.ids) for item in items)
        return JSONResponse(
            {
                "object": "list",
                "model": self.name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
