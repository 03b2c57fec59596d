"""The llama.cpp engine: one GGUF model, one engine thread, a bounded queue of waiting sequences.

llama-cpp-python's ``Llama`` holds one context with one KV cache, so the engine thread runs one
sequence at a time, in arrival order; the KV cache of the previous sequence is kept and its longest
common prefix with the next prompt is reused (chat turns and ``n`` choices share their prompt). The
decode loop is ours rather than ``Llama.generate`` so that each sequence gets its own sampler chain
(seed, penalties, ``ignore_eos``), logprobs come from the logits llama.cpp already computed, a JSON
schema constraint masks those logits in place (llguidance) before the sampler chain reads them, and an
abandoned sequence (client gone, stop string matched) is dropped between two tokens.

``n_ctx`` is the GGUF's training context, capped by what the container's memory limit (cgroup, not
the host's RAM) leaves for the KV cache once the weights are in: :func:`plan_context`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import gc
import logging
import math
import os
import queue
import random
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import _internals
from pydantic import BaseModel, ConfigDict, Field

from universal_predictors import metrics
from universal_predictors.base import StartupError
from universal_predictors.config import Backend, PredictorConfig
from universal_predictors.errors import Unavailable
from universal_predictors.generation import constraints
from universal_predictors.generation.engine import (
    Engine,
    EngineCapabilities,
    GenerationChunk,
    GenerationRequest,
    beyond_capacity,
)
from universal_predictors.generation.engines.common import drain_tokens

logger = logging.getLogger(__name__)

#: llama-cpp-python's wrappers around llama.cpp's model and sampler (untyped: typed as Any here).
llama_internals: Any = _internals

MIB = 1 << 20
#: Memory kept free beyond weights and KV cache: llama.cpp's compute buffers, Python, the HTTP server.
RESERVE_BYTES = 512 * MIB
RESERVE_FRACTION = 0.10
#: A computed context smaller than this means the model does not really fit: refuse to start.
MIN_CONTEXT = 256
#: cgroup v1 reports "no limit" as a huge page-aligned number; anything above this is unlimited.
_UNLIMITED = 1 << 60


class LlamaCppArgs(BaseModel):
    """``--engine-arg`` keys of the llama.cpp engine."""

    model_config = ConfigDict(extra="forbid")

    #: Context size; default: the GGUF's training context capped by the memory limit.
    n_ctx: int | None = Field(default=None, ge=16)
    #: Layers offloaded to the GPU: -1 all (when llama.cpp was built with GPU support), 0 none.
    n_gpu_layers: int = Field(default=-1, ge=-1)
    #: CPU threads for decoding; default: half the CPUs this container may use (llama.cpp's threads spin,
    #: and a second thread per core, or a neighbour's load, slows decoding down). Prompt processing
    #: uses all of them.
    n_threads: int | None = Field(default=None, ge=1, le=1024)
    #: Prompt tokens evaluated per llama.cpp batch.
    n_batch: int = Field(default=512, ge=1, le=65536)
    #: Sequences that may wait behind the running one; more are refused with 503 and Retry-After.
    max_queue: int = Field(default=64, ge=1, le=100_000)


# -- pure helpers (unit-tested) ---------------------------------------------------------------------


def find_gguf(source: str | Path, pattern: str | None) -> Path:
    """The one GGUF file ``source`` + ``pattern`` name; ValueError naming the pattern and the files found.

    ``source`` is a folder (``pattern`` is a glob inside it, default ``*.gguf``) or a single file
    (then ``pattern``, if given, must match its name).
    """
    path = Path(source)
    if path.is_file():
        if pattern and not fnmatch.fnmatch(path.name, pattern):
            raise ValueError(f"--source-file {pattern!r} does not match the source file {path.name!r}")
        return path
    if not path.is_dir():
        raise ValueError(f"the source {str(path)!r} is neither a GGUF file nor a folder")
    glob = pattern or "*.gguf"
    matches = sorted(p for p in path.glob(glob) if p.is_file())
    if len(matches) == 1:
        return matches[0]
    present = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.suffix == ".gguf")
    found = ", ".join(present[:20]) + (" ..." if len(present) > 20 else "") if present else "no .gguf files"
    if not matches:
        raise ValueError(f"--source-file {glob!r} matches no file in {path} (found: {found})")
    names = ", ".join(str(p.relative_to(path)) for p in matches[:20])
    raise ValueError(f"--source-file {glob!r} matches {len(matches)} files in {path} ({names}); "
                     "make the pattern pick exactly one")  # fmt: skip


def container_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit in bytes from cgroup v2 (``memory.max``) or v1
    (``memory.limit_in_bytes``); None when there is no limit."""
    for candidate in (
        cgroup_root / "memory.max",
        cgroup_root / "memory" / "memory.limit_in_bytes",
        cgroup_root / "memory.limit_in_bytes",
    ):
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        with contextlib.suppress(ValueError):
            value = int(text)
            return value if 0 < value < _UNLIMITED else None
    return None


def physical_memory() -> int:
    """The machine's RAM: the limit when the container has none."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not a POSIX system that says
        return 8 << 30


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache size depends on, from GGUF metadata."""

    train_context: int
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        """f16 K and V for every layer: llama.cpp's default cache type."""
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * 2

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> ModelShape:
        arch = metadata.get("general.architecture", "llama")

        def number(key: str, default: int | None = None) -> int:
            value = metadata.get(f"{arch}.{key}")
            if value is None:
                if default is None:
                    raise ValueError(f"the GGUF metadata lacks {arch}.{key}")
                return default
            return int(float(value))

        heads = number("attention.head_count")
        head_dim = number("embedding_length") // max(heads, 1)
        return cls(
            train_context=number("context_length"),
            layers=number("block_count"),
            kv_heads=number("attention.head_count_kv", heads),
            key_dim=number("attention.key_length", head_dim),
            value_dim=number("attention.value_length", head_dim),
        )


def plan_context(shape: ModelShape, weights_bytes: int, memory_limit: int | None, requested: int | None) -> int:
    """``n_ctx``: the training context, capped by the KV cache that fits in ``memory_limit`` after the
    weights and a reserve (``None``: no cap). An explicit ``requested`` wins if it is valid.
    ValueError says what does not fit, with the numbers."""
    if memory_limit is None:
        fit = shape.train_context
        budget = None
    else:
        reserve = max(RESERVE_BYTES, int(memory_limit * RESERVE_FRACTION))
        budget = memory_limit - weights_bytes - reserve
        fit = max(0, budget) // max(1, shape.kv_bytes_per_token)

    def mib(n: int) -> str:
        return f"{n / MIB:.0f} MiB"

    if requested is not None:
        if requested > shape.train_context:
            raise ValueError(f"n_ctx={requested} exceeds the model's training context ({shape.train_context})")
        if requested > fit:
            assert memory_limit is not None
            assert budget is not None
            raise ValueError(
                f"n_ctx={requested} needs {mib(requested * shape.kv_bytes_per_token)} of KV cache, but the memory "
                f"limit {mib(memory_limit)} leaves {mib(max(0, budget))} after the weights ({mib(weights_bytes)}) "
                f"and a reserve; lower n_ctx or raise the memory limit"
            )
        return requested
    n_ctx = min(shape.train_context, fit)
    if n_ctx < min(MIN_CONTEXT, shape.train_context):
        assert memory_limit is not None
        raise ValueError(
            f"the model does not fit: the memory limit {mib(memory_limit)} leaves room for {fit} tokens of KV "
            f"cache ({shape.kv_bytes_per_token} bytes each) after the weights ({mib(weights_bytes)}); "
            f"raise the memory limit"
        )
    return n_ctx


def default_threads() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cpus)


# -- the engine ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    grammar: str | None  # llguidance grammar of the constraint, checked before admission
    abandoned: bool = False  # set from the event loop: the consumer went away

    def send(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is listening
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class LlamaCppEngine(Engine):
    """A GGUF model on llama.cpp."""

    backend = Backend.LLAMACPP
    EngineArgs = LlamaCppArgs
    capabilities = EngineCapabilities(penalties=True, logprobs=True, max_top_logprobs=20, constraints=True)

    def __init__(self, config: PredictorConfig, args: BaseModel) -> None:
        super().__init__(config, args)
        assert isinstance(args, LlamaCppArgs)
        self.largs = args
        # Resolving the file and validating n_ctx are cheap (metadata only): a bad pattern or n_ctx
        # stops start-up with one line instead of failing the load later.
        try:
            self.path = find_gguf(config.source, config.source_file)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.gpu_offload = bool(llama_cpp.llama_supports_gpu_offload()) and args.n_gpu_layers != 0
        try:
            self.metadata = self._read_metadata(self.path)
            self.shape = ModelShape.from_metadata(self.metadata)
            # Offloaded weights and cache live in GPU memory, which the cgroup limit does not cover.
            limit = None if self.gpu_offload else (container_memory_limit() or physical_memory())
            self.n_ctx = plan_context(self.shape, self.path.stat().st_size, limit, args.n_ctx)
        except ValueError as exc:
            raise StartupError(f"{self.path.name}: {exc}") from None
        self.memory_limit = limit
        self.n_threads_batch = default_threads()
        self.n_threads = args.n_threads or max(1, self.n_threads_batch // 2)
        self._queue: queue.SimpleQueue[_Seq | None] = queue.SimpleQueue()
        #: Sequences admitted and not yet finished (running + waiting); only touched on the event loop.
        self._outstanding = 0
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})  # token bytes, without / with specials
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._llm: Any = None

    @staticmethod
    def _read_metadata(path: Path) -> dict[str, str]:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True  # metadata and tokenizer only: no tensors, no context
        try:
            model = llama_internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"llama.cpp cannot read this GGUF file ({exc})") from None
        try:
            return dict(model.metadata())
        finally:
            model.close()

    # -- lifecycle ------------------------------------------------------------------------------------

    def load(self) -> None:
        self._llm = llama_cpp.Llama(
            str(self.path),
            n_ctx=self.n_ctx,
            n_batch=min(self.largs.n_batch, self.n_ctx),
            n_gpu_layers=self.largs.n_gpu_layers if self.gpu_offload else 0,
            n_threads=self.n_threads,
            n_threads_batch=max(self.n_threads, self.n_threads_batch),
            verbose=False,
        )
        llm = self._llm
        self._n_vocab = int(llm.n_vocab())
        self._vocab_ptr = llm._model.vocab
        self._eos = frozenset(t for t in range(self._n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab_ptr, t))
        if not self._eos and llm.token_eos() >= 0:
            self._eos = frozenset({int(llm.token_eos())})
        self._lltokenizer: Any = None
        try:
            self._lltokenizer = constraints.llamacpp_tokenizer(self._vocab_ptr, self._n_vocab, sorted(self._eos))
        except ValueError as exc:  # a vocabulary llguidance cannot read: constrained requests get a 400
            logger.warning("constrained decoding unavailable for this vocabulary: %s", exc)
        bos, eos = int(llm.token_bos()), int(llm.token_eos())
        self._special = {
            "bos_token": self.token_text(bos) if bos >= 0 else "",
            "eos_token": self.token_text(eos) if eos >= 0 else "",
        }
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.config.model_name}", daemon=True)
        self._thread.start()
        logger.info(
            "llama.cpp engine: %s, n_ctx %d (training %d, memory limit %s), %s, %d threads",
            self.path.name,
            self.n_ctx,
            self.shape.train_context,
            f"{self.memory_limit // MIB} MiB" if self.memory_limit else "GPU",
            f"n_gpu_layers {self.largs.n_gpu_layers}" if self.gpu_offload else "CPU only",
            self.n_threads,
        )

    def unload(self) -> None:
        self._stopping = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        gc.collect()

    # -- tokenizer ------------------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.n_ctx

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # special=True: special tokens written in the text are parsed as such, as transformers does.
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        # Not Llama.detokenize: it drops the first space after BOS (a SentencePiece habit) and truncates
        # pieces longer than 32 bytes.
        return b"".join(self._piece(t, False) for t in token_ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self._piece(token_id, True).decode("utf-8", errors="replace")

    def _piece(self, token_id: int, special: bool) -> bytes:
        cache = self._pieces[special]
        piece = cache.get(token_id)
        if piece is None:
            size = 64
            while True:
                buffer = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self._vocab_ptr, token_id, buffer, size, 0, special)
                if n >= 0:
                    piece = buffer.raw[:n]
                    break
                size = -n  # the piece needs this many bytes
            cache[token_id] = piece
        return piece

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template") or None

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self._special)

    def describe(self) -> dict[str, Any]:
        return {
            "gguf_file": self.path.name,
            "n_ctx": self.n_ctx,
            "training_context": self.shape.train_context,
            "gpu_offload": self.gpu_offload,
            "n_threads": self.n_threads,
            "max_queue": self.largs.max_queue,
        }

    def check_capacity(self, sequences: int = 1) -> None:
        capacity = self.largs.max_queue + 1  # the waiting ones + the one running
        if sequences > capacity:
            raise beyond_capacity(sequences, capacity, "one running + engine arg max_queue")
        if self._outstanding + sequences > capacity:
            raise self._overloaded()

    def _overloaded(self) -> Unavailable:
        waiting = max(0, self._outstanding - 1)
        return Unavailable(f"The model is overloaded ({waiting} sequences waiting); retry shortly.",
                           code="overloaded")  # fmt: skip

    # -- requests (event loop side) -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        params = request.params
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_ids) + params.max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(request.prompt_ids)}) + max_tokens ({params.max_tokens}) "
                             f"exceeds the context ({self.n_ctx})")  # fmt: skip
        if any(not 0 <= t < self._n_vocab for t in request.prompt_ids):
            raise ValueError(f"prompt: a token id is outside the vocabulary (0..{self._n_vocab - 1})")
        grammar = None
        if request.constraint is not None:
            if self._lltokenizer is None:
                raise ValueError("this model's vocabulary cannot be read for constrained decoding")
            # Before the first await: an unenforceable schema is the response's 400, streamed or not.
            grammar = constraints.grammar_for(request.constraint)
        self.check_capacity(1)
        seq = _Seq(request, asyncio.get_running_loop(), asyncio.Queue(), grammar)
        self._outstanding += 1
        self._queue.put(seq)
        metrics.QUEUE_DEPTH.labels(self.config.model_name).set(self._queue.qsize())
        try:
            async with contextlib.aclosing(drain_tokens(self, seq.out, params.logprobs is not None)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            seq.abandoned = True  # the engine thread stops it before its next token
            self._outstanding -= 1

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            seq = self._queue.get()
            metrics.QUEUE_DEPTH.labels(self.config.model_name).set(self._queue.qsize())
            if seq is None:
                break
            if seq.abandoned:
                continue
            try:
                self._generate_one(seq)
            except Exception as exc:  # a failed sequence fails alone, not the engine
                logger.exception("generation failed")
                seq.send(RuntimeError(f"generation failed: {exc}"))
                with contextlib.suppress(Exception):
                    self._llm.reset()  # the cache state is unknown: start the next sequence afresh
        while True:  # whoever still waits learns that the engine is gone
            try:
                left = self._queue.get_nowait()
            except queue.Empty:
                break
            if left is not None:
                left.send(RuntimeError("the engine is shutting down"))

    def _sampler(self, seq: _Seq) -> Any:
        params = seq.request.params
        sampler = llama_internals.LlamaSampler()
        bias = {t: -math.inf for t in self._eos} if params.ignore_eos else {}
        if bias:
            sampler.add_logit_bias(self._n_vocab, bias)
        if params.presence_penalty or params.frequency_penalty:
            # OpenAI's penalties count every generated token: a window the size of the context.
            sampler.add_penalties(self._n_vocab, self.n_ctx, 1.0, params.frequency_penalty, params.presence_penalty)
        if params.temperature <= 1e-5:
            sampler.add_greedy()
        else:
            if params.top_p < 1.0:
                sampler.add_top_p(params.top_p, 1)
            sampler.add_temp(params.temperature)
            seed = params.seed if params.seed is not None else random.getrandbits(32)
            sampler.add_dist(seed & 0xFFFFFFFF)
        return sampler

    def _reuse_prefix(self, prompt: list[int]) -> int:
        """Keep the KV cache of the longest common prefix with the previous sequence (at least the last
        prompt token is evaluated again: its logits pick the first token); returns the kept length."""
        llm = self._llm
        limit = min(int(llm.n_tokens), len(prompt) - 1)
        common = 0
        if limit > 0:
            same = np.asarray(llm.input_ids[:limit]) == np.asarray(prompt[:limit], dtype=np.intc)
            common = limit if bool(same.all()) else int(np.argmin(same))
        if common and not llm._ctx.kv_cache_seq_rm(-1, common, -1):
            common = 0  # this model's cache cannot be truncated (recurrent): start afresh
        if common:
            llm.n_tokens = common
        else:
            llm.reset()
        return common

    def _generate_one(self, seq: _Seq) -> None:
        llm = self._llm
        params = seq.request.params
        prompt = list(seq.request.prompt_ids)
        kept = self._reuse_prefix(prompt)
        sampler = self._sampler(seq)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
        model = self.config.model_name
        pending = prompt[kept:]
        metrics.PROMPT_TOKENS.labels(model).inc(len(pending))
        matcher = constraints.matcher(self._lltokenizer, seq.grammar) if seq.grammar is not None else None
        masks = constraints.allocate_masks(1, self._n_vocab) if matcher is not None else None
        generated = 0
        try:
            while not (seq.abandoned or self._stopping):
                llm.eval(pending)
                # The model's logprobs, before the constraint masks the logits in place for the sampler.
                logprobs = self._log_softmax(self._logits()) if params.logprobs is not None else None
                if matcher is not None and masks is not None:
                    if matcher.is_error():
                        raise constraints.matcher_failure(matcher)
                    allowed = constraints.unpack_masks(constraints.fill_masks([matcher], masks), self._n_vocab)
                    self._logits()[~allowed[0]] = -np.inf
                token = int(sampler.sample(llm._ctx, -1))
                lp, top = 0.0, list[tuple[int, float]]()
                if logprobs is not None and params.logprobs is not None:
                    lp, top = self._chosen_and_top(logprobs, token, params.logprobs)
                generated += 1
                complete = False
                if matcher is not None:
                    matcher.consume_token(token)
                    complete = matcher.is_stopped()
                # A complete value ends at the EOS its mask now forces, or here when no EOS may or can follow.
                finish: str | None = None
                if token in stops or (complete and (params.ignore_eos or generated >= params.max_tokens)):
                    finish = "stop"
                elif generated >= params.max_tokens:
                    finish = "length"
                metrics.TOKENS_GENERATED.labels(model).inc()
                seq.send((token, lp, top, finish))
                if finish is not None:
                    return
                pending = [token]
        finally:
            sampler.close()

    def _logits(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The last position's logits: a view of llama.cpp's buffer, which the sampler reads."""
        pointer = llama_cpp.llama_get_logits_ith(self._llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))

    @staticmethod
    def _log_softmax(logits: np.ndarray[Any, np.dtype[np.float32]]) -> np.ndarray[Any, np.dtype[np.float64]]:
        shifted = logits.astype(np.float64)
        shifted -= shifted.max()
        result: np.ndarray[Any, np.dtype[np.float64]] = shifted - np.log(np.exp(shifted).sum())
        return result

    @staticmethod
    def _chosen_and_top(
        logprobs: np.ndarray[Any, np.dtype[np.float64]], token: int, k: int
    ) -> tuple[float, list[tuple[int, float]]]:
        top: list[tuple[int, float]] = []
        if k > 0:
            best = np.argpartition(-logprobs, k - 1)[:k]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = [(int(t), float(logprobs[t])) for t in best]
        return float(logprobs[token]), top
