"""``task: rerank``: ``POST /openai/v1/rerank`` and ``POST /v1/rerank`` (Cohere/Jina-shaped), micro-batched.

A model whose ``config.json`` names a ``*ForSequenceClassification`` architecture is a cross-encoder:
each (query, document) pair is scored by the head, pairs of concurrent requests sharing forward passes
(sorted by length, up to ``max_batch_size`` pairs and ``max_batch_tokens`` tokens). Scores are the
sigmoid of a single logit, or the softmax probability of label 1 for a two-label head.

Any other model is an embedding model used as a bi-encoder: the query and documents are embedded (the
embed task's engine and batcher) and scored by cosine similarity. ``/openai/v1/models`` says which
(``rerank_mode``). Documents longer than the model's limit are truncated (that is what rerankers do);
a query that leaves no room for a document is a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.catalog import Backend, Task
from universal_predictors.devices import release_memory
from universal_predictors.encoders.args import EncoderEngineArgs
from universal_predictors.encoders.base import EncoderPredictor, load_model, load_tokenizer
from universal_predictors.encoders.embedding import EmbeddingService, EmbedEngineArgs, TransformersEncoder
from universal_predictors.encoders.limits import char_limit, context_length_exceeded, input_limit, text_too_long
from universal_predictors.encoders.padding import pad_batch
from universal_predictors.errors import InvalidRequest
from universal_predictors.http import loads_json, validation_error

RerankMode = Literal["cross-encoder", "bi-encoder"]


class RerankEngineArgs(EncoderEngineArgs):
    """Engine arguments of the rerank predictor (``--engine-arg key=value``); batches count pairs (or texts)."""

    mode: Literal["auto", "cross-encoder", "bi-encoder"] = "auto"
    max_documents: int = Field(default=1000, ge=1, description="Documents one request may rank.")


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str


class RerankRequest(BaseModel):
    """Cohere/Jina rerank request; ``top_k`` is accepted for ``top_n``; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | Document] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=1)
    return_documents: bool = False

    @model_validator(mode="after")
    def _one_limit(self) -> RerankRequest:
        if self.top_n is not None and self.top_k is not None and self.top_n != self.top_k:
            raise ValueError("top_k is another name for top_n; send one of them")
        return self

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    @property
    def limit(self) -> int | None:
        return self.top_n if self.top_n is not None else self.top_k


def is_cross_encoder(source: str) -> bool:
    """A sequence-classification head in ``config.json`` makes a cross-encoder."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


Pair = tuple[list[int], list[int]]  # input ids, token type ids

_QUERY_REMEDY = "Shorten the query: it shares the model's input with each document, which is cut to fit the rest."


class CrossEncoder:
    """A sequence-classification model scoring (query, document) pairs."""

    def __init__(self, source: str, args: RerankEngineArgs) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = load_tokenizer(source)
        self.model, self.device = load_model(AutoModelForSequenceClassification, source, args)
        labels = int(self.model.config.num_labels)
        if labels not in (1, 2):
            raise ValueError(f"a reranker needs a 1- or 2-label head; {source} has {labels} labels")
        self.labels = labels
        self.max_tokens = input_limit(self.model.config, self.tokenizer, args.max_input_tokens)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.input_names = set(self.tokenizer.model_input_names)
        self.pair_specials = int(self.tokenizer.num_special_tokens_to_add(pair=True))
        self._torch = torch

    def query_tokens(self, query: str) -> int:
        return len(self.tokenizer(query, add_special_tokens=False)["input_ids"])

    def pairs(self, query: str, documents: Sequence[str]) -> list[Pair]:
        encoded = self.tokenizer(
            [query] * len(documents),
            list(documents),
            truncation="only_second",
            max_length=self.max_tokens,
            return_attention_mask=False,
        )
        types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in encoded["input_ids"]]
        return [(list(ids), list(tt)) for ids, tt in zip(encoded["input_ids"], types, strict=True)]

    def score(self, batch: Sequence[Pair]) -> list[float]:
        torch = self._torch
        features = pad_batch([ids for ids, _ in batch], self.pad_id, self.device, token_types=[tt for _, tt in batch],
                             with_token_types="token_type_ids" in self.input_names)  # fmt: skip
        with torch.inference_mode():
            logits = self.model(**features).logits.float()
            scores = torch.sigmoid(logits[:, 0]) if self.labels == 1 else torch.softmax(logits, dim=-1)[:, 1]
        return [float(s) for s in scores.cpu()]

    def close(self) -> None:
        del self.model
        release_memory(self.device)


class RerankPredictor(EncoderPredictor):
    """One reranking model: a cross-encoder, or an embedding model as a bi-encoder."""

    task = Task.RERANK
    EngineArgs = RerankEngineArgs

    def load(self) -> bool:
        args: RerankEngineArgs = self.engine_args
        mode = args.mode
        if mode == "auto":
            mode = "cross-encoder" if is_cross_encoder(self.config.source) else "bi-encoder"
        self.mode: RerankMode = mode
        policy = BatchPolicy(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                             max_batch_cost=args.max_batch_tokens)  # fmt: skip
        if mode == "cross-encoder":
            self.cross = CrossEncoder(self.config.source, args)
            self.batcher: MicroBatcher[Pair, float] = MicroBatcher(
                self.cross.score, model_name=self.name, policy=policy, cost=lambda pair: len(pair[0])
            )
            self.max_tokens = self.cross.max_tokens
        else:
            embed_args = EmbedEngineArgs(**args.model_dump(include=set(EncoderEngineArgs.model_fields)))
            self.embedder = EmbeddingService(TransformersEncoder(self.config.source, embed_args), self.name, embed_args)
            self.max_tokens = self.embedder.encoder.max_tokens
        self.backend = Backend.TRANSFORMERS
        return True

    def unload(self) -> None:
        if getattr(self, "cross", None) is not None:
            self.cross.close()
            del self.cross
        if getattr(self, "embedder", None) is not None:
            self.embedder.encoder.close()
            del self.embedder

    def card(self) -> dict[str, Any]:
        return {"rerank_mode": self.mode}

    async def scores(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """Relevance of each document to the query, and the tokens processed."""
        if self.mode == "cross-encoder":
            cross = self.cross
            # The query and each document share the model's tokens; a document is cut to fit, so the query
            # must leave room for at least one of its tokens.
            query_limit = self.max_tokens - cross.pair_specials - 1
            if len(query) > char_limit(query_limit):  # refused unread: counting its tokens costs its length
                raise text_too_long("query", len(query), query_limit, _QUERY_REMEDY)
            query_tokens = cross.query_tokens(query)
            # Only a document's first tokens are read: the rest of it is not tokenised either.
            documents = [document[: char_limit(self.max_tokens)] for document in documents]
            if query_tokens > query_limit:
                raise context_length_exceeded("query", query_tokens, query_limit, _QUERY_REMEDY)
            if len(query) * len(documents) + sum(len(d) for d in documents) <= 16_384:
                pairs = cross.pairs(query, documents)
            else:  # a big request is tokenized off the event loop
                pairs = await asyncio.to_thread(cross.pairs, query, documents)
            values = await self.batcher.submit_many(pairs)
            return values, sum(len(ids) for ids, _ in pairs)
        service = self.embedder
        [query_ids] = await service.tokenize([query], truncate=False, param="query", remedy="Shorten the query.",
                                             single=True)  # fmt: skip
        doc_ids = await service.tokenize(documents, truncate=True)
        vectors = await service.embed_ids([query_ids, *doc_ids])
        matrix = np.stack(vectors[1:])
        norms = np.linalg.norm(matrix, axis=1) * max(float(np.linalg.norm(vectors[0])), 1e-12)
        cosine = (matrix @ vectors[0]) / np.maximum(norms, 1e-12)
        return [float(c) for c in cosine], len(query_ids) + sum(len(ids) for ids in doc_ids)

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        max_docs = self.engine_args.max_documents
        if len(body.documents) > max_docs:
            raise InvalidRequest(
                f"documents: at most {max_docs} documents per request, got {len(body.documents)}", param="documents"
            )
        texts = body.texts
        empty = next((i for i, t in enumerate(texts) if not t), None)
        if empty is not None:
            raise InvalidRequest(f"documents[{empty}]: must not be empty", param=f"documents[{empty}]")
        values, tokens = await self.scores(body.query, texts)
        order = sorted(range(len(values)), key=lambda i: -values[i])  # stable: ties keep document order
        if body.limit is not None:
            order = order[: body.limit]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
            if body.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "rerank",
            "model": self.name,
            "created": int(time.time()),
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def infer(self, instances: list[Any]) -> list[Any]:
        """KServe v1/v2: each instance is a rerank request object (or its JSON text)."""
        out = []
        for index, instance in enumerate(instances):
            where = f"instances[{index}]"
            raw = loads_json(instance, where, where) if isinstance(instance, str) else instance
            try:
                body = RerankRequest.model_validate(raw)
            except ValidationError as exc:
                raise InvalidRequest(f"{where}: {validation_error(exc).message}", param=where) from None
            out.append((await self.rerank(body))["results"])
        return out

    async def rerank_request(self, body: RerankRequest, request: Request) -> dict[str, Any]:
        return await self.rerank(body)
