"""``task: embed``: OpenAI ``/openai/v1/embeddings`` over a sentence-transformers model, micro-batched."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from universal_predictors.base import UniversalPredictor
from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.config import Backend, Task
from universal_predictors.devices import detect_device, release_memory
from universal_predictors.errors import InvalidRequest
from universal_predictors.http import parse_json


class EmbedEngineArgs(BaseModel):
    """Engine arguments of the embedding predictor."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=32, ge=1, le=1024)
    max_wait_ms: float = Field(default=5.0, ge=0, le=1000)
    device: str = "auto"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request; unknown extension fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] = Field(description="A string or a list of strings.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class EmbedPredictor(UniversalPredictor):
    """One embedding model; sentences from concurrent requests share forward passes."""

    task = Task.EMBED
    EngineArgs = EmbedEngineArgs

    def load(self) -> bool:
        from sentence_transformers import SentenceTransformer

        args: EmbedEngineArgs = self.engine_args
        self.device = detect_device(args.device)
        self.model = SentenceTransformer(self.config.source, device=self.device, local_files_only=True)
        self.model.eval()
        self.backend = Backend.TRANSFORMERS
        self.batcher: MicroBatcher[str, np.ndarray] = MicroBatcher(
            self._encode_batch,
            model_name=self.name,
            policy=BatchPolicy(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms),
            cost=len,
        )
        return True

    def unload(self) -> None:
        if hasattr(self, "model"):
            del self.model
            release_memory(getattr(self, "device", "cpu"))

    def _encode_batch(self, sentences: Sequence[str]) -> list[np.ndarray]:
        import torch

        with torch.inference_mode():
            vectors = self.model.encode(list(sentences), batch_size=len(sentences), convert_to_numpy=True)
        return list(vectors)

    def count_tokens(self, texts: Sequence[str]) -> int:
        encoded = self.model.tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
        return sum(len(ids) for ids in encoded)

    async def embed(self, texts: list[str]) -> list[np.ndarray]:
        return await self.batcher.submit_many(texts)

    async def infer(self, instances: list[Any]) -> list[Any]:
        texts = [str(x) for x in instances]
        return [v.tolist() for v in await self.embed(texts)]

    def describe(self) -> dict[str, Any]:
        dims = self.model.get_sentence_embedding_dimension() if self.ready else None
        return {"dimensions": dims}

    def add_routes(self, router: APIRouter) -> None:
        @self.route("embeddings")
        async def embeddings(request: Request) -> Response:
            body = await parse_json(request, EmbeddingRequest)
            self.check_model(body.model)
            self.require_ready()
            texts = [body.input] if isinstance(body.input, str) else body.input
            if not texts:
                raise InvalidRequest("input: must not be empty", param="input")
            if body.dimensions is not None:
                raise InvalidRequest("dimensions: this model does not support truncated embeddings", param="dimensions")
            vectors = await self.embed(texts)
            data = []
            for index, vector in enumerate(vectors):
                value: Any = (
                    base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
                    if body.encoding_format == "base64"
                    else [float(x) for x in vector]
                )
                data.append({"object": "embedding", "index": index, "embedding": value})
            tokens = self.count_tokens(texts)
            return JSONResponse(
                {
                    "object": "list",
                    "data": data,
                    "model": self.name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        router.add_api_route("/openai/v1/embeddings", embeddings, methods=["POST"])
