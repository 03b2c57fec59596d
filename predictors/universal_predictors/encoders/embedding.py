"""The embedding engines behind a micro-batcher: ``embed``'s engine, and ``rerank``'s in bi-encoder mode.

Requests are tokenized on arrival (so lengths are checked and ``usage`` is the tokenizer's true count),
then each input's token ids join a :class:`~universal_predictors.batching.MicroBatcher`: inputs of
concurrent requests are sorted by length, packed up to ``max_batch_size`` inputs and
``max_batch_tokens`` tokens, run as one forward pass on the engine thread and handed back in order.

Engines:

- ``transformers`` (``auto`` for a directory): a sentence-transformers directory (``modules.json``) runs
  its own module pipeline (pooling, dense layers); a plain transformers directory gets mean pooling.
  Normalisation follows the model (a ``Normalize`` module), L2 by default for plain directories.
- ``llamacpp`` (``auto`` for GGUF): llama-cpp-python with ``embedding=True``; pooling comes from the GGUF.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field

from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.catalog import Backend
from universal_predictors.config import is_gguf
from universal_predictors.devices import detect_device, dtype_for, is_cuda, release_memory
from universal_predictors.encoders.args import EncoderEngineArgs
from universal_predictors.encoders.limits import (
    TRUNCATE_REMEDY,
    char_limit,
    check_lengths,
    context_length_exceeded,
    input_limit,
    text_too_long,
)
from universal_predictors.encoders.padding import pad_batch
from universal_predictors.errors import InvalidRequest

#: Requests with more text than this are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 16_384


class EmbedEngineArgs(EncoderEngineArgs):
    """Engine arguments of the embedding engines (``--engine-arg key=value``)."""

    sort_window: int = Field(default=4, ge=1, le=64, description="Batches' worth of queued inputs sorted together.")
    normalize: bool | None = Field(default=None, description="Override the model's own normalisation.")
    pooling: Literal["mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens"] | None = Field(
        default=None, description="Pooling for a plain transformers directory (mean when unset)."
    )
    matryoshka_dimensions: str | None = Field(
        default=None, description="Comma-separated sizes the model was trained to be truncated to."
    )
    n_ctx: int = Field(default=2048, ge=64, description="llamacpp: context (and the longest input).")
    n_threads: int | None = Field(default=None, ge=1, description="llamacpp: CPU threads.")
    n_gpu_layers: int = Field(default=-1, description="llamacpp: layers offloaded to a GPU when there is one.")


class TextEncoder(Protocol):
    """What the predictor needs of an engine: tokens in, one vector per sequence out."""

    dimensions: int
    max_tokens: int
    normalized: bool
    vocab_size: int
    matryoshka: list[int] | None

    def tokenize(self, texts: Sequence[str], max_length: int | None) -> list[list[int]]:
        """Token ids with special tokens; cut to ``max_length`` when it is given."""
        ...

    def encode(self, batch: Sequence[list[int]]) -> list[np.ndarray]:
        """One float32 vector per token sequence (already normalised when ``normalized``)."""
        ...

    def close(self) -> None: ...


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _declared_matryoshka(source: Path, override: str | None) -> list[int] | None:
    if override:
        try:
            return sorted({int(x) for x in override.split(",") if x.strip()}, reverse=True)
        except ValueError:
            raise ValueError(f"engine arg matryoshka_dimensions={override!r}: expected integers") from None
    for name in ("config_sentence_transformers.json", "config.json"):
        dims = _read_json(source / name).get("matryoshka_dimensions")
        if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
            return sorted(set(dims), reverse=True)
    return None


class TransformersEncoder:
    """A sentence-transformers pipeline (or a plain transformers model with a pooling layer) on torch."""

    def __init__(self, source: str, args: EmbedEngineArgs) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        self.device = detect_device(args.device)
        path = Path(source)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{source} is not a transformers model directory (no config.json)")
        is_st = (path / "modules.json").exists()
        model = SentenceTransformer(source, device=self.device, local_files_only=True)
        if not is_st and args.pooling is not None:
            from sentence_transformers.sentence_transformer.modules import Pooling

            model[1] = Pooling(model.get_sentence_embedding_dimension(), pooling_mode=args.pooling)
        # Normalisation is applied here, the same way sentence-transformers' Normalize module does it, so
        # the engine argument can override what the model says in either direction.
        names = [type(module).__name__ for module in model]
        has_normalize = "Normalize" in names
        if has_normalize:
            del model[names.index("Normalize")]
        self.normalized = args.normalize if args.normalize is not None else (has_normalize or not is_st)
        dtype = dtype_for(self.device, args.dtype)
        if dtype != torch.float32:
            model.to(dtype)
        model.eval()
        self.model = model
        transformer = model[0]
        self.tokenizer = model.tokenizer
        self.lower_case = bool(getattr(transformer, "do_lower_case", False))
        # sentence-transformers prepends the default prompt (e5/bge style "query: ") to every text.
        self.prompt = model.prompts.get(model.default_prompt_name, "") if model.default_prompt_name else ""
        # The wrapped transformers model: ``auto_model`` (sentence-transformers 5), ``model`` (6).
        hf_model = getattr(transformer, "auto_model", None) or getattr(transformer, "model", None)
        hf_config = getattr(hf_model, "config", None)
        declared = int(model.max_seq_length) if model.max_seq_length else None  # sentence_bert_config.json
        self.max_tokens = input_limit(hf_config, self.tokenizer, declared, args.max_input_tokens)
        self.vocab_size = len(self.tokenizer)
        # sentence-transformers 6 renamed the method; older releases only have the old name.
        dimensions = getattr(model, "get_embedding_dimension", model.get_sentence_embedding_dimension)()
        if dimensions is None:
            raise ValueError(f"{source}: the model does not say its embedding size")
        self.dimensions = int(dimensions)
        self.matryoshka = _declared_matryoshka(path, args.matryoshka_dimensions)
        self.input_names = set(self.tokenizer.model_input_names)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.pad_left = self.tokenizer.padding_side == "left"
        self.mode = "sentence-transformers" if is_st else "transformers"

    def _prepare(self, texts: Sequence[str]) -> list[str]:
        prepared = [self.prompt + t for t in texts] if self.prompt else list(texts)
        return [t.lower() for t in prepared] if self.lower_case else prepared

    def tokenize(self, texts: Sequence[str], max_length: int | None) -> list[list[int]]:
        encoded = self.tokenizer(
            self._prepare(texts),
            add_special_tokens=True,
            truncation=max_length is not None,
            max_length=max_length,
            verbose=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [list(ids) for ids in encoded["input_ids"]]

    def encode(self, batch: Sequence[list[int]]) -> list[np.ndarray]:
        import torch

        features = pad_batch(batch, self.pad_id, self.device, left=self.pad_left,
                             with_token_types="token_type_ids" in self.input_names)  # fmt: skip
        with torch.inference_mode():
            out = self.model.forward(features)["sentence_embedding"].float()
            if self.normalized:
                out = torch.nn.functional.normalize(out, p=2, dim=1)
            vectors = out.cpu().numpy()
        return list(vectors)

    def close(self) -> None:
        del self.model
        release_memory(self.device)


class LlamaCppEncoder:
    """A GGUF embedding model on llama-cpp-python (``embedding=True``); pooling comes from the GGUF."""

    def __init__(self, source: str, file_pattern: str | None, args: EmbedEngineArgs) -> None:
        from llama_cpp import Llama

        path = _find_gguf(source, file_pattern)
        self.device = detect_device(args.device)
        self.llm = Llama(
            model_path=path,
            embedding=True,
            n_ctx=args.n_ctx,
            n_batch=args.n_ctx,  # a non-causal model needs each sequence in one micro-batch
            n_ubatch=args.n_ctx,
            n_threads=args.n_threads,
            n_gpu_layers=args.n_gpu_layers if is_cuda(self.device) else 0,
            verbose=False,
        )
        self.normalized = True if args.normalize is None else args.normalize
        self.dimensions = int(self.llm.n_embd())
        trained = int(self.llm.n_ctx_train()) if hasattr(self.llm, "n_ctx_train") else args.n_ctx
        self.max_tokens = min(args.n_ctx, trained, args.max_input_tokens or args.n_ctx)
        self.vocab_size = int(self.llm.n_vocab())
        self.matryoshka = _declared_matryoshka(Path(path).parent, args.matryoshka_dimensions)
        self.mode = "llamacpp"

    def tokenize(self, texts: Sequence[str], max_length: int | None) -> list[list[int]]:
        out = [list(self.llm.tokenize(t.encode("utf-8"), add_bos=True, special=True)) for t in texts]
        return [ids[:max_length] for ids in out] if max_length is not None else out

    def encode(self, batch: Sequence[list[int]]) -> list[np.ndarray]:
        import llama_cpp

        llm: Any = self.llm  # llama-cpp-python's batch and context internals are only partly typed
        vectors: list[np.ndarray] = []
        # One sequence per decode: llama-cpp-python's context holds a single sequence by default.
        for seq in batch:
            llm._ctx.kv_cache_clear()
            llm._batch.reset()
            llm._batch.add_sequence(seq, 0, True)
            llm._ctx.decode(llm._batch)
            if llm.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_NONE:
                ptr = llama_cpp.llama_get_embeddings(llm._ctx.ctx)
                tokens = np.array(ptr[: len(seq) * self.dimensions], dtype=np.float32).reshape(len(seq), -1)
                vector = tokens.mean(axis=0)
            else:
                ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
                vector = np.array(ptr[: self.dimensions], dtype=np.float32)
            if self.normalized:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            vectors.append(vector.astype(np.float32))
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        return vectors

    def close(self) -> None:
        self.llm.close()
        del self.llm


def _find_gguf(source: str, pattern: str | None) -> str:
    if os.path.isfile(source):
        return source
    matches = sorted(glob.glob(os.path.join(source, pattern or "*.gguf")))
    if not matches:
        raise FileNotFoundError(f"no GGUF file matching {pattern or '*.gguf'!r} in {source}")
    return matches[0]


def open_encoder(source: str, file_pattern: str | None, backend: Backend, args: EmbedEngineArgs) -> TextEncoder:
    """The engine for ``backend`` (``auto``: llama.cpp for GGUF, transformers otherwise)."""
    if backend is Backend.LLAMACPP or (backend is Backend.AUTO and is_gguf(source, file_pattern)):
        return LlamaCppEncoder(source, file_pattern, args)
    if backend in (Backend.AUTO, Backend.TRANSFORMERS):
        return TransformersEncoder(source, args)
    raise ValueError(f"backend {backend.value} cannot serve embeddings here")


class EmbeddingService:
    """An encoder behind a micro-batcher; shared by ``embed`` and ``rerank``'s bi-encoder mode."""

    def __init__(self, encoder: TextEncoder, model_name: str, args: EmbedEngineArgs) -> None:
        self.encoder = encoder
        self.in_flight = 0
        self.max_wait_ms = args.max_wait_ms
        self.max_batch_size = args.max_batch_size
        self.max_batch_tokens = args.max_batch_tokens
        # The batcher hands over up to ``sort_window`` batches' worth of queued inputs at once, sorted by
        # length; _run cuts them into forward passes of similar lengths (less padding than sorting each
        # batch alone when a queue of mixed requests builds up).
        self.batcher: MicroBatcher[list[int], np.ndarray] = MicroBatcher(
            self._run,
            model_name=model_name,
            policy=BatchPolicy(
                max_batch_size=args.max_batch_size * args.sort_window,
                max_wait_ms=args.max_wait_ms,
                max_batch_cost=args.max_batch_tokens * args.sort_window,
            ),
            cost=len,
        )

    def _run(self, items: Sequence[list[int]]) -> list[np.ndarray]:
        """Encode length-sorted items in passes of at most ``max_batch_size`` inputs and
        ``max_batch_tokens`` padded tokens (an input over the budget runs alone)."""
        out: list[np.ndarray] = []
        chunk: list[list[int]] = []
        width = 0
        for seq in items:
            wider = max(width, len(seq))
            if chunk and (len(chunk) >= self.max_batch_size or (len(chunk) + 1) * wider > self.max_batch_tokens):
                out.extend(self.encoder.encode(chunk))
                chunk, wider = [], len(seq)
            chunk.append(seq)
            width = wider
        if chunk:
            out.extend(self.encoder.encode(chunk))
        return out

    async def tokenize(
        self, texts: Sequence[str], truncate: bool, param: str = "input", remedy: str = TRUNCATE_REMEDY,
        single: bool = False,
    ) -> list[list[int]]:  # fmt: skip
        """Token ids of ``texts`` within the encoder's limit: cut to it when ``truncate``, else a 400 naming
        ``param[i]`` (``param`` alone when ``single``) for the first text over it.

        What a text may cost is bounded before it is paid: a text over :func:`char_limit` characters is cut
        to it (``truncate``) or refused unread, and the tokenizer hands back one token past the limit at most.
        """
        limit = self.encoder.max_tokens
        most = char_limit(limit)

        def name(index: int) -> str:
            return param if single else f"{param}[{index}]"

        if truncate:
            texts = [text[:most] for text in texts]
        else:
            long = next((i for i, text in enumerate(texts) if len(text) > most), None)
            if long is not None:
                raise text_too_long(name(long), len(texts[long]), limit, remedy)
        cap = limit if truncate else limit + 1
        sequences = await self._in_thread(texts, cap)
        over = next((i for i, seq in enumerate(sequences) if len(seq) > limit), None)
        if over is not None:  # within char_limit: counting all of its tokens is bounded
            [full] = await self._in_thread([texts[over]], None)
            raise context_length_exceeded(name(over), len(full), limit, remedy)
        return sequences

    async def _in_thread(self, texts: Sequence[str], cap: int | None) -> list[list[int]]:
        """The encoder's tokens of ``texts``; off the event loop when there is much text."""
        if sum(len(t) for t in texts) <= _INLINE_TOKENIZE_CHARS:
            return self.encoder.tokenize(texts, cap)
        return await asyncio.to_thread(self.encoder.tokenize, texts, cap)

    def check_ids(self, sequences: Sequence[Sequence[int]], truncate: bool, param: str) -> list[list[int]]:
        """Token-id input: ids within the vocabulary, length within the limit (or cut when asked)."""
        out = []
        for index, seq in enumerate(sequences):
            where = f"{param}[{index}]"
            if not seq:
                raise InvalidRequest(f"{where}: must not be an empty list of token ids", param=where)
            bad = next((t for t in seq if not 0 <= t < self.encoder.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{where}: token id {bad} is outside the vocabulary (0..{self.encoder.vocab_size - 1})",
                    param=where,
                )
            out.append(list(seq[: self.encoder.max_tokens]) if truncate else list(seq))
        return out

    def check_lengths(self, sequences: Sequence[list[int]], param: str, remedy: str = TRUNCATE_REMEDY) -> None:
        """``context_length_exceeded`` naming ``param[i]``, the first sequence over the encoder's limit."""
        check_lengths([len(seq) for seq in sequences], self.encoder.max_tokens, param, remedy)

    async def embed_ids(self, sequences: Sequence[list[int]]) -> list[np.ndarray]:
        # Wait for company only when there is company: a lone request goes straight to the model (the
        # window would be pure latency), while under concurrency requests also pile up during each
        # forward pass and the next batch takes them all.
        self.in_flight += 1
        self.batcher.policy.max_wait_ms = self.max_wait_ms if self.in_flight > 1 else 0.0
        try:
            return await self.batcher.submit_many(list(sequences))
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        await self.batcher.close()
