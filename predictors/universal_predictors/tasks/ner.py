"""``task: ner``: ``POST /v1/ner`` over a transformers token-classification model.

Each token's scores are a softmax over the labels. Tokens become entities by one of five strategies,
named as in transformers' token-classification pipeline so its users get what they expect:

- ``none``: every token whose label is not ``O`` is an entity with its raw label (``B-PER``).
- ``simple``: tokens are labelled on their own, then adjacent tokens of one entity type are joined
  (a ``B-`` label starts a new entity); the score is the mean of the tokens' scores.
- ``first`` / ``max`` / ``average``: first every word (the tokens the tokenizer's pre-tokenizer made
  from one word) gets one label: the first token's, the most confident token's, or the argmax of the
  tokens' mean scores; then words are joined as in ``simple``. A word is never split between entities.

Words come from the fast tokenizer's word ids, not from guessing at spaces, and ``start``/``end`` are
character offsets into the text as sent (the tokenizer maps through lower-casing and accent
stripping), so ``text[start:end] == entity.text`` always holds.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from universal_predictors.catalog import Task
from universal_predictors.encoders.texts import Encoded, TextsEngineArgs, TextsPredictor, TextsRequest

Strategy = Literal["none", "simple", "first", "average", "max"]


class NerEngineArgs(TextsEngineArgs):
    """Engine arguments of the NER predictor."""

    aggregation_strategy: Strategy = "simple"


class NerRequest(TextsRequest):
    aggregation_strategy: Strategy | None = Field(
        default=None, description="none, simple, first, average or max; default: the engine arg (simple)."
    )


@dataclass
class _Unit:
    """A labelled span: one token (none, simple) or one word (first, average, max)."""

    label: int
    score: float
    start: int
    end: int


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    shifted = np.exp(values - values.max(axis=-1, keepdims=True))
    result: np.ndarray = shifted / shifted.sum(axis=-1, keepdims=True)
    return result


def split_tag(label: str) -> tuple[str, str]:
    """``B-PER`` -> (``B``, ``PER``); a label without a B-/I- prefix continues like an ``I-``."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _tokens(text: str, item: Encoded, probs: np.ndarray) -> list[tuple[int, int, int | None, np.ndarray]]:
    """(start, end, word id, scores) for each real token: special and zero-width tokens are dropped."""
    out = []
    for position, (start, end) in enumerate(item.offsets):
        if item.special[position] or end <= start:
            continue
        # An accent-stripping normaliser maps a combining mark to nothing, so the token's span stops
        # before it; the mark belongs to the letter it follows ("Jose\u0301" is one word).
        while end < len(text) and unicodedata.combining(text[end]):
            end += 1
        out.append((start, end, item.words[position], probs[position]))
    return out


def _word_units(tokens: list[tuple[int, int, int | None, np.ndarray]], strategy: Strategy) -> list[_Unit]:
    groups: list[list[tuple[int, int, int | None, np.ndarray]]] = []
    for token in tokens:
        word = token[2]
        if groups and word is not None and groups[-1][-1][2] == word:
            groups[-1].append(token)
        else:
            groups.append([token])
    units = []
    for group in groups:
        if strategy == "first":
            scores = group[0][3]
        elif strategy == "max":
            scores = max(group, key=lambda t: float(t[3].max()))[3]  # the first of equals wins
        else:
            scores = np.mean(np.stack([t[3] for t in group]), axis=0)
        label = int(scores.argmax())
        units.append(_Unit(label, float(scores[label]), group[0][0], group[-1][1]))
    return units


def aggregate(
    text: str, item: Encoded, probs: np.ndarray, labels: Sequence[str], strategy: Strategy
) -> list[dict[str, Any]]:
    """The entities of one text under ``strategy`` (see the module docstring)."""
    tokens = _tokens(text, item, probs)
    if strategy in ("none", "simple"):
        units = [_Unit(int(p.argmax()), float(p.max()), start, end) for start, end, _, p in tokens]
    else:
        units = _word_units(tokens, strategy)
    if strategy == "none":
        return [
            {"text": text[u.start : u.end], "label": labels[u.label], "start": u.start, "end": u.end, "score": u.score}
            for u in units
            if labels[u.label] != "O"
        ]
    entities: list[dict[str, Any]] = []
    group: list[_Unit] = []

    def close() -> None:
        tag = split_tag(labels[group[0].label])[1]
        if tag != "O":
            start, end = group[0].start, group[-1].end
            score = float(np.mean([u.score for u in group]))
            entities.append({"text": text[start:end], "label": tag, "start": start, "end": end, "score": score})

    for unit in units:
        prefix, tag = split_tag(labels[unit.label])
        if group and (prefix == "B" or tag != split_tag(labels[group[-1].label])[1]):
            close()
            group = []
        group.append(unit)
    if group:
        close()
    return entities


class NerPredictor(TextsPredictor):
    """One token classifier; texts from concurrent requests share forward passes."""

    task = Task.NER
    EngineArgs = NerEngineArgs
    needs_offsets = True

    def auto_model_class(self) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification

    def card(self) -> dict[str, Any]:
        types = sorted({split_tag(label)[1] for label in self.labels} - {"O"})
        return {
            "labels": self.labels,
            "entity_types": types,
            "aggregation_strategy": self.engine_args.aggregation_strategy,
        }

    async def entities(
        self, texts: list[str], strategy: Strategy | None, truncate: bool, field: str = "texts"
    ) -> tuple[list[Encoded], list[list[dict[str, Any]]]]:
        items = await self.encode(texts, truncate, field)
        outputs = await self.run(items)
        chosen: Strategy = strategy or self.engine_args.aggregation_strategy
        found = [
            aggregate(text, item, softmax_rows(logits), self.labels, chosen)
            for text, item, logits in zip(texts, items, outputs, strict=True)
        ]
        return items, found

    async def infer(self, instances: list[Any]) -> list[Any]:
        self.require_ready()
        _, found = await self.entities(self.strings(instances), None, truncate=False, field="instances")
        return [{"entities": entities} for entities in found]

    async def ner_request(self, body: NerRequest, request: Request) -> Response:
        items, found = await self.entities(body.text_list(), body.aggregation_strategy, body.truncate)
        return self.list_response(items, [{"entities": entities} for entities in found], body.truncate)
