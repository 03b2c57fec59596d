"""``task: classify``: ``POST /v1/classify`` over a transformers sequence-classification model.

Also home of :class:`EncoderTaskPredictor`, the part classify and NER share: loading a transformers
encoder and its fast tokenizer, the input-length rule (400 naming the text, unless the request asks
for ``truncate``), tokenisation off the event loop, and micro-batched forward passes on the engine
thread (texts sorted by token count, padded per batch, ``torch.inference_mode()``).

Scores follow the model's ``problem_type`` the way transformers' text-classification pipeline reads
it: ``multi_label_classification`` (or a single output) -> sigmoid per label, ``regression`` -> the
raw value, anything else -> softmax over the labels. ``--engine-arg score_function=...`` overrides it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from universal_predictors.base import UniversalPredictor
from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.config import Backend, Task
from universal_predictors.devices import detect_device, dtype_for, release_memory
from universal_predictors.errors import InvalidRequest, RequestTooLarge
from universal_predictors.http import parse_json

#: Model types whose position table reserves ``pad_token_id + 1`` slots before the first position.
_OFFSET_POSITIONS = {
    "roberta",
    "xlm-roberta",
    "camembert",
    "longformer",
    "data2vec-text",
    "xmod",
    "roberta-prelayernorm",
}


class EncoderEngineArgs(BaseModel):
    """Engine arguments shared by the encoder tasks (classify, ner)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=32, ge=1, le=4096, description="Texts per forward pass at most.")
    max_wait_ms: float = Field(default=5.0, ge=0, le=1000, description="How long a batch waits for others.")
    max_batch_tokens: int = Field(default=16384, ge=1, description="Sum of the token counts in one batch at most.")
    max_length: int | None = Field(default=None, ge=2, description="Cap below the model's own input limit.")
    max_texts: int = Field(default=1024, ge=1, description="Texts per request at most (413 above).")
    device: str = "auto"
    dtype: str = "auto"


@dataclass(frozen=True)
class Encoded:
    """One tokenised text: ids with the special tokens, and what NER needs to map back to characters."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    special: list[bool]
    words: list[int | None]
    truncated: bool


class TextsRequest(BaseModel):
    """Fields every encoder task route takes; unknown fields are ignored."""

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


def input_limit(model_config: Any, tokenizer: Any, cap: int | None) -> int:
    """The most tokens (special tokens included) one input may have."""
    limits = []
    positions = getattr(model_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        if getattr(model_config, "model_type", "") in _OFFSET_POSITIONS:
            positions -= (getattr(model_config, "pad_token_id", None) or 1) + 1
        limits.append(positions)
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < 1_000_000:  # transformers uses ~1e30 for "unset"
        limits.append(declared)
    if cap is not None:
        limits.append(cap)
    return min(limits) if limits else 512


class EncoderTaskPredictor(UniversalPredictor):
    """A transformers encoder with a task head, fed by a :class:`MicroBatcher`."""

    EngineArgs: ClassVar[type[BaseModel]] = EncoderEngineArgs
    #: Whether items need offsets and word ids (NER) or just ids (classify).
    needs_offsets: ClassVar[bool] = False

    def auto_model_class(self) -> Any:
        raise NotImplementedError

    def load(self) -> bool:
        import torch
        import transformers
        from transformers import AutoTokenizer

        args: EncoderEngineArgs = self.engine_args
        self.device = detect_device(args.device)
        self.dtype = dtype_for(self.device, args.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.source, local_files_only=True)
        if self.needs_offsets and not getattr(self.tokenizer, "is_fast", False):
            raise RuntimeError(f"task {self.task.value} needs a fast tokenizer (tokenizer.json) for character offsets")
        major = int(transformers.__version__.split(".")[0])
        dtype_kw = "dtype" if major >= 5 else "torch_dtype"  # renamed in transformers 5
        model = self.auto_model_class().from_pretrained(
            self.config.source, local_files_only=True, trust_remote_code=False, **{dtype_kw: self.dtype}
        )
        self.model = model.to(self.device).eval()
        self.labels: list[str] = [str(self.model.config.id2label[i]) for i in range(self.model.config.num_labels)]
        self.max_tokens = input_limit(self.model.config, self.tokenizer, args.max_length)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
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
        batch = self.tokenizer(list(texts), truncation=False, **kwargs)
        over = [i for i, ids in enumerate(batch["input_ids"]) if len(ids) > self.max_tokens]
        if over and not truncate:
            first = over[0]
            raise InvalidRequest(
                f"{field}[{first}]: {len(batch['input_ids'][first])} tokens is over the model's limit of "
                f'{self.max_tokens}; shorten it or send "truncate": true',
                param=f"{field}[{first}]",
                code="context_length_exceeded",
            )
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
                    truncated=i in replaced,
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
        torch = self._torch
        width = max(len(item.ids) for item in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : len(item.ids)] = torch.tensor(item.ids, dtype=torch.long)
            mask[row, : len(item.ids)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            logits = logits.float().cpu().numpy()
        if logits.ndim == 2:  # sequence classification: one row per text
            return [logits[row] for row in range(len(items))]
        return [logits[row, : len(item.ids)] for row, item in enumerate(items)]

    async def run(self, items: list[Encoded]) -> list[np.ndarray]:
        return await self.batcher.submit_many(items)

    def strings(self, instances: list[Any]) -> list[str]:
        """KServe v1/v2 instances as texts: each must be a string."""
        if not instances:
            raise InvalidRequest("instances: must not be empty", param="instances")
        for i, value in enumerate(instances):
            if not isinstance(value, str):
                raise InvalidRequest(f"instances[{i}]: must be a string", param=f"instances[{i}]")
        return list(instances)

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


# -- classify ---------------------------------------------------------------------------------------

ScoreFunction = Literal["softmax", "sigmoid", "none"]


def score_function(problem_type: str | None, num_labels: int) -> ScoreFunction:
    """What turns logits into scores, read from the model's configuration as transformers does."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def apply_score_function(logits: np.ndarray, function: ScoreFunction) -> np.ndarray:
    values: np.ndarray = logits.astype(np.float64)
    if function == "softmax":
        shifted = np.exp(values - values.max())
        values = shifted / shifted.sum()
    elif function == "sigmoid":
        values = 1.0 / (1.0 + np.exp(-values))
    return values


class ClassifyEngineArgs(EncoderEngineArgs):
    """Engine arguments of the classify predictor."""

    score_function: Literal["auto", "softmax", "sigmoid", "none"] = "auto"


class ClassifyRequest(TextsRequest):
    top_k: int | None = Field(default=None, ge=1, description="How many labels all_scores lists (default all).")
    threshold: float | None = Field(
        default=None, ge=0, le=1, description="Labels scoring at least this are listed in labels."
    )


class ClassifyPredictor(EncoderTaskPredictor):
    """One sequence classifier; texts from concurrent requests share forward passes."""

    task = Task.CLASSIFY
    EngineArgs = ClassifyEngineArgs

    def auto_model_class(self) -> Any:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification

    def after_load(self) -> None:
        chosen = self.engine_args.score_function
        problem_type = getattr(self.model.config, "problem_type", None)
        self.function: ScoreFunction = chosen if chosen != "auto" else score_function(problem_type, len(self.labels))
        self.problem_type = problem_type

    def describe(self) -> dict[str, Any]:
        if not hasattr(self, "model"):
            return {}
        return {
            "labels": self.labels,
            "problem_type": self.problem_type,
            "score_function": self.function,
            "max_input_tokens": self.max_tokens,
        }

    def result(self, logits: np.ndarray, top_k: int | None, threshold: float | None) -> dict[str, Any]:
        """One text's answer: the best label, all (or top_k) scores sorted, the labels over threshold."""
        scores = apply_score_function(logits, self.function)
        order = np.argsort(-scores, kind="stable")  # ties keep the model's label order
        best = int(order[0])
        if threshold is None and self.function == "sigmoid":
            threshold = 0.5
        chosen = (
            [self.labels[best]]
            if threshold is None
            else [self.labels[int(i)] for i in order if float(scores[int(i)]) >= threshold]
        )
        listed = order if top_k is None else order[:top_k]
        return {
            "label": self.labels[best],
            "score": float(scores[best]),
            "labels": chosen,
            "all_scores": [{"label": self.labels[int(i)], "score": float(scores[int(i)])} for i in listed],
        }

    async def infer(self, instances: list[Any]) -> list[Any]:
        self.require_ready()
        items = await self.encode(self.strings(instances), truncate=False, field="instances")
        return [self.result(logits, None, None) for logits in await self.run(items)]

    def add_routes(self, router: APIRouter) -> None:
        @self.route("classify")
        async def classify(request: Request) -> Response:
            body = await parse_json(request, ClassifyRequest)
            self.check_model(body.model)
            self.require_ready()
            items = await self.encode(body.text_list(), body.truncate)
            outputs = await self.run(items)
            entries = [self.result(logits, body.top_k, body.threshold) for logits in outputs]
            return self.list_response(items, entries, body.truncate)

        router.add_api_route("/v1/classify", classify, methods=["POST"])
