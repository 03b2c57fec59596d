"""``task: embed``: OpenAI ``/openai/v1/embeddings``, micro-batched, on transformers or llama.cpp.

The engines and their micro-batcher are :mod:`universal_predictors.encoders.embedding` (shared with
``rerank``'s bi-encoder mode); this module holds the OpenAI request, its checks and the response.

A model supports ``dimensions`` (Matryoshka truncation) only when it declares it: a
``matryoshka_dimensions`` list in ``config.json`` or ``config_sentence_transformers.json`` (the key
jina-embeddings-v3 uses), or the ``matryoshka_dimensions`` engine argument (comma-separated).
"""

from __future__ import annotations

import base64
import logging
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from universal_predictors.catalog import Backend, Task
from universal_predictors.encoders.base import EncoderPredictor
from universal_predictors.encoders.embedding import EmbeddingService, EmbedEngineArgs, LlamaCppEncoder, open_encoder
from universal_predictors.errors import InvalidRequest

logger = logging.getLogger(__name__)

#: OpenAI's own limit on inputs per request.
MAX_INPUTS = 2048


def truncate_dimensions(vector: np.ndarray, dims: int, renormalize: bool) -> np.ndarray:
    """Matryoshka truncation: keep the first ``dims`` values, renormalised when the model normalises."""
    cut = vector[:dims]
    if renormalize:
        norm = float(np.linalg.norm(cut))
        cut = cut / max(norm, 1e-12)
    return cut.astype(np.float32)


# -- the predictor ------------------------------------------------------------------------------------


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request plus ``truncate``; other unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of lists of token ids."
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool = Field(
        default=False, description="Extension: cut inputs longer than the model's limit instead of a 400."
    )


class EmbedPredictor(EncoderPredictor):
    """One embedding model; inputs from concurrent requests share forward passes."""

    task = Task.EMBED
    EngineArgs = EmbedEngineArgs

    def load(self) -> bool:
        args: EmbedEngineArgs = self.engine_args
        encoder = open_encoder(self.config.source, self.config.source_file, self.backend, args)
        self.backend = Backend.LLAMACPP if isinstance(encoder, LlamaCppEncoder) else Backend.TRANSFORMERS
        self.service = EmbeddingService(encoder, self.name, args)
        self.max_tokens = encoder.max_tokens
        return True

    def unload(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.encoder.close()
            del self.service

    def card(self) -> dict[str, Any]:
        encoder = self.service.encoder
        return {
            "dimensions": encoder.dimensions,
            "normalized": encoder.normalized,
            "matryoshka_dimensions": encoder.matryoshka,
            "engine": getattr(encoder, "mode", self.backend.value),
        }

    async def prepare(self, body: EmbeddingRequest) -> list[list[int]]:
        """The request's inputs as checked token-id lists (400 naming the input on any problem)."""
        raw = body.input
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise InvalidRequest("input: must not be empty", param="input")
        if len(raw) > MAX_INPUTS:
            raise InvalidRequest(f"input: at most {MAX_INPUTS} inputs per request, got {len(raw)}", param="input")
        service = self.service
        if isinstance(raw[0], int):  # one sequence of token ids
            sequences = service.check_ids([raw], body.truncate, "input")
            service.check_lengths(sequences, "input")
            return sequences
        if isinstance(raw[0], list):
            sequences = service.check_ids(raw, body.truncate, "input")
        else:
            texts: list[str] = raw
            empty = next((i for i, t in enumerate(texts) if not t), None)
            if empty is not None:
                raise InvalidRequest(f"input[{empty}]: must not be an empty string", param=f"input[{empty}]")
            sequences = await service.tokenize(texts, body.truncate)
        service.check_lengths(sequences, "input")
        return sequences

    def check_dimensions(self, dims: int | None) -> None:
        if dims is None:
            return
        encoder = self.service.encoder
        if dims == encoder.dimensions:
            return
        if not encoder.matryoshka:
            raise InvalidRequest(
                f"dimensions: this model does not support truncated embeddings (it is not declared Matryoshka-"
                f"trained); omit dimensions or ask for {encoder.dimensions}",
                param="dimensions",
            )
        if dims > encoder.dimensions:
            raise InvalidRequest(
                f"dimensions: {dims} is more than the model's {encoder.dimensions}", param="dimensions"
            )

    async def infer(self, instances: list[Any]) -> list[Any]:
        if not instances or not all(isinstance(x, str) and x for x in instances):
            raise InvalidRequest("instances: a non-empty list of non-empty strings", param="instances")
        body = EmbeddingRequest(model=self.name, input=list(instances))
        vectors = await self.service.embed_ids(await self.prepare(body))
        return [v.tolist() for v in vectors]

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        self.check_dimensions(body.dimensions)
        sequences = await self.prepare(body)
        vectors = await self.service.embed_ids(sequences)
        encoder = self.service.encoder
        dims = body.dimensions
        data = []
        for index, vector in enumerate(vectors):
            if dims is not None and dims != encoder.dimensions:
                vector = truncate_dimensions(vector, dims, encoder.normalized)
            value: Any = (
                base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
                if body.encoding_format == "base64"
                else np.ascontiguousarray(vector, dtype=np.float32)
            )
            data.append({"object": "embedding", "index": index, "embedding": value})
        tokens = sum(len(s) for s in sequences)
        payload = {
            "object": "list",
            "data": data,
            "model": self.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        # orjson writes float32 arrays directly (shortest round-trip form): the standard json module
        # spent more time on a 16 x 384 response than the model did, holding the GIL meanwhile.
        return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
