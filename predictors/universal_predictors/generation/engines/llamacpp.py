"""The llama.cpp engine: one GGUF model, ``n_parallel`` slots decoded together, a bounded queue behind them.

Continuous batching on llama-cpp-python's low-level API. One engine thread owns the llama.cpp context,
whose KV cache has one stream per slot (a llama.cpp sequence id, ``n_ctx`` tokens each). Every step is
one ``llama_decode`` of a batch holding the next token of each generating sequence and, in what room is
left of ``n_batch``, chunks of the prompts still being read: a request joins between two steps, a
finished or abandoned one leaves between two steps, and a long prompt never stalls the running streams.
A new sequence takes the free slot whose cache shares the longest prefix with its prompt (system prompts,
chat history, ``n`` choices), so only the rest is evaluated. Each sequence has its own sampler chain
(seed, penalties, ``ignore_eos``) run in C; only rows that ask for logprobs or carry a JSON schema
constraint touch the logits in Python (llguidance masks them in place before the sampler reads them).
Detokenization is incremental, on the event loop side.

Why the low-level API rather than driving llama.cpp's own ``llama-server`` behind our OpenAI layer:
llguidance constraints (the same ones the transformers engine enforces, checked once by the OpenAI
layer) need the logits between decode and sampling, which the server exposes only when built with Rust;
the token-exact stops, per-token logprobs of the model before masking, and the per-sequence cancellation
the OpenAI layer relies on map one to one onto this loop; and the measured cost of the Python step is
small beside the decode (``bench/generation_llamacpp.py`` compares against ``llama-server`` built from
the same vendored llama.cpp; the README's performance section has the numbers).

LoRA adapters (GGUF LoRAs, :mod:`.llamacpp_lora`) are loaded with llama.cpp's adapter API, at most
``max_loras`` at once (the least recently used idle one is freed). llama.cpp applies an adapter to the whole
context, every sequence of a decode, so a step makes one ``llama_decode`` per adapter in use (the base is one
group): each sequence still advances once a step, but ``n`` groups cost ``n`` decodes of fewer rows and
``n - 1`` switches of the context's adapter, after each of which llama.cpp re-plans its compute graph instead
of reusing the last one (``sched_reserve``: about 1 ms on CPU). A slot's cached prefix is reused only by a
sequence on the same adapter (its K and V were computed through it). ``bench/lora_llamacpp.py``, 8 sequences on
a ~30M Llama (rank-16 adapters), 2 CPU cores shared with other jobs, best of 3-5 alternating rounds: all on one
adapter 0.91-0.94x the base's tokens/s (base 372-471), spread over 4 adapters 0.33-0.55x: the split decodes, not
the LoRA matmuls, are the cost. Not measured: a larger model or a GPU.

``n_ctx`` (per slot) is the GGUF's training context, capped by what the container's memory limit
(cgroup, not the host's RAM) leaves for the KV cache of all slots once the weights are in; ``n_parallel``
defaults from the CPUs (:func:`default_parallel`) and drops until each slot keeps a useful context:
:func:`plan_slots`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import gc
import itertools
import logging
import math
import queue
import random
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import llama_cpp
import numpy as np
from llama_cpp import _internals
from pydantic import BaseModel, ConfigDict, Field, field_validator

from universal_predictors import metrics
from universal_predictors.base import StartupError
from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig
from universal_predictors.generation import constraints
from universal_predictors.generation.adapters import AdapterMismatch, AdapterRef, make_room
from universal_predictors.generation.engine import (
    Engine,
    EngineCapabilities,
    GenerationChunk,
    GenerationRequest,
    MultimodalPrompt,
    SamplingParams,
    VisionSupport,
    sampling_defaults,
)
from universal_predictors.generation.engines.admission import Admission, QueuedSequence, stream_from_engine_thread
from universal_predictors.generation.engines.llamacpp_lora import check_lora_fits, gguf_header, lora_file
from universal_predictors.generation.engines.llamacpp_vision import (
    MAX_IMAGE_PIXELS,
    ImageChunk,
    MtmdPrompt,
    Projector,
    Segment,
    find_projector,
)
from universal_predictors.host import (
    container_memory_limit,
    default_threads,
    gpu_free_memory,
    physical_cores,
    physical_memory,
)

logger = logging.getLogger(__name__)

#: llama-cpp-python's wrappers around llama.cpp's model and sampler (untyped: typed as Any here).
llama_internals: Any = _internals

MIB = 1 << 20
#: Memory kept free beyond weights and KV cache: llama.cpp's compute buffers, Python, the HTTP server.
RESERVE_BYTES = 512 * MIB
RESERVE_FRACTION = 0.10
#: A computed context smaller than this means the model does not really fit: refuse to start.
MIN_CONTEXT = 256
#: Below this context per slot (or the training context, if smaller), the default uses fewer slots.
USEFUL_SLOT_CONTEXT = 4096
#: A free slot is chosen for its cached prefix only when that covers more than this share of the prompt.
SLOT_SIMILARITY = 0.1
#: The most slots the default picks (llama-server's own automatic choice is 4, tools/server/server.cpp).
MAX_DEFAULT_PARALLEL = 8


#: KV cache types llama.cpp accepts (llama-server's ``--cache-type-k``; common/arg.cpp) -> (ggml type, bytes per
#: element: a q8_0 block is 32 values in 34 bytes, q4_0 32 in 18, ...).
CACHE_TYPES: Mapping[str, tuple[int, float]] = {
    "f32": (llama_cpp.GGML_TYPE_F32, 4.0),
    "f16": (llama_cpp.GGML_TYPE_F16, 2.0),
    "q8_0": (llama_cpp.GGML_TYPE_Q8_0, 34 / 32),
    "q5_1": (llama_cpp.GGML_TYPE_Q5_1, 24 / 32),
    "q5_0": (llama_cpp.GGML_TYPE_Q5_0, 22 / 32),
    "q4_1": (llama_cpp.GGML_TYPE_Q4_1, 20 / 32),
    "q4_0": (llama_cpp.GGML_TYPE_Q4_0, 18 / 32),
    "iq4_nl": (llama_cpp.GGML_TYPE_IQ4_NL, 18 / 32),
}
CacheType = Literal["f32", "f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
SPLIT_MODES = {
    "none": llama_cpp.LLAMA_SPLIT_MODE_NONE,
    "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
    "row": llama_cpp.LLAMA_SPLIT_MODE_ROW,
}
#: Context per slot on a GPU whose free memory cannot be read (no NVML): a bound, not the training context.
DEFAULT_GPU_CONTEXT = 8192


class LlamaCppArgs(BaseModel):
    """``--engine-arg`` keys of the llama.cpp engine."""

    model_config = ConfigDict(extra="forbid")

    #: Context of each slot (prompt + output of one sequence); default: the GGUF's training context capped
    #: by the memory limit shared among the slots.
    n_ctx: int | None = Field(default=None, ge=16)
    #: Sequences decoded together (slots); default: two per CPU, 2 to 8, fewer when memory leaves a slot
    #: less than a useful context (:func:`plan_slots`).
    n_parallel: int | None = Field(default=None, ge=1, le=256)
    #: Layers offloaded to the GPU: -1 all (when llama.cpp was built with GPU support), 0 none.
    n_gpu_layers: int = Field(default=-1, ge=-1)
    #: CPU threads for decoding; default: the physical cores this container may use (hyperthread siblings
    #: count once, capped by the cgroup's CPU quota), llama.cpp's own default. Its threads spin at their
    #: barriers (the predictor leaves OpenMP's wait policy active for llama.cpp), so a core shared with a
    #: busy neighbour stalls them: lower it on shared nodes. Prompt processing uses every CPU allowed.
    n_threads: int | None = Field(default=None, ge=1, le=1024)
    #: Tokens per llama.cpp batch: one per generating sequence, the rest prompt chunks.
    n_batch: int = Field(default=512, ge=1, le=65536)
    #: Flash attention (llama.cpp's fused kernel). Default: llama.cpp's own choice per device when layers are
    #: offloaded to a GPU (llama-cpp-python's ``Llama`` would force it off there); off on CPU, where its f16
    #: accumulation moves logprobs in the third decimal; on whenever ``type_v`` is quantized, which needs it.
    flash_attn: bool | None = None
    #: KV cache element types (llama-server's ``--cache-type-k/-v``): quantized caches hold more context.
    type_k: CacheType = "f16"
    type_v: CacheType = "f16"
    #: How a model is split over several GPUs: by layer, by row, or not at all (``main_gpu`` only).
    split_mode: Literal["none", "layer", "row"] = "layer"
    #: The GPU for the whole model (``split_mode=none``) or for intermediate results.
    main_gpu: int = Field(default=0, ge=0)
    #: Share of the model per GPU, comma-separated (``"3,1"``); default: by free memory, llama.cpp's choice.
    tensor_split: str | None = None
    #: Sequences that may wait for a free slot; more are refused with 503 and Retry-After.
    max_queue: int = Field(default=64, ge=1, le=100_000)
    #: LoRA adapters resident at once (vLLM's name); the least recently used one with no running sequence is
    #: freed to make room. The rest stay on disk and load on first use.
    max_loras: int = Field(default=8, ge=1, le=1024)

    @field_validator("tensor_split")
    @classmethod
    def _shares(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            shares = [float(part) for part in value.split(",")]
        except ValueError:
            raise ValueError(f"tensor_split {value!r}: comma-separated numbers, one per GPU (e.g. 3,1)") from None
        if not shares or any(share < 0 for share in shares) or sum(shares) <= 0:
            raise ValueError(f"tensor_split {value!r}: non-negative shares, not all zero")
        if len(shares) > llama_cpp.llama_max_devices():
            raise ValueError(f"tensor_split {value!r}: at most {llama_cpp.llama_max_devices()} GPUs")
        return value

    def flash_attention(self, gpu: bool) -> bool | None:
        """True/False, or None for llama.cpp's own choice (on a GPU). ValueError when the caches need it."""
        quantized_v = self.type_v not in ("f32", "f16")
        if quantized_v and self.flash_attn is False:
            raise ValueError(f"type_v={self.type_v} needs flash_attn (llama.cpp quantizes the V cache only with "
                             "flash attention); drop flash_attn=false or use type_v=f16")  # fmt: skip
        if self.flash_attn is not None:
            return self.flash_attn
        if quantized_v:
            return True
        return None if gpu else False


# -- pure helpers (unit-tested) ---------------------------------------------------------------------


#: GGUF metadata keys of a model's sampling defaults -> generation_config.json's names (llama.cpp src/llama-arch.cpp,
#: LLM_KV_GENERAL_SAMPLING_*).
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k"}  # fmt: skip


def gguf_sampling_defaults(metadata: Mapping[str, str]) -> dict[str, float]:
    """The sampling defaults a GGUF's metadata carries (llama.cpp hands metadata over as strings)."""
    out: dict[str, float] = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        with contextlib.suppress(KeyError, ValueError):
            out[name] = float(metadata[key])
    return out


def flash_attn_type(choice: bool | None) -> int:
    """llama.cpp's flash-attention setting for a resolved choice: on, off, or (None) its own per device."""
    if choice is None:
        return int(llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)
    return int(llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if choice else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def find_gguf(source: str | Path, pattern: str | None, exclude: Path | None = None) -> Path:
    """The one GGUF file ``source`` + ``pattern`` name; ValueError naming the pattern and the files found.

    ``source`` is a folder (``pattern`` is a glob inside it, default ``*.gguf``) or a single file
    (then ``pattern``, if given, must match its name). ``exclude`` (the projector) is never the answer.
    """
    path = Path(source)
    if path.is_file():
        if pattern and not fnmatch.fnmatch(path.name, pattern):
            raise ValueError(f"--source-file {pattern!r} does not match the source file {path.name!r}")
        return path
    if not path.is_dir():
        raise ValueError(f"the source {str(path)!r} is neither a GGUF file nor a folder")
    glob = pattern or "*.gguf"
    matches = sorted(p for p in path.glob(glob) if p.is_file() and p != exclude)
    if len(matches) == 1:
        return matches[0]
    present = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.suffix == ".gguf")
    found = ", ".join(present[:20]) + (" ..." if len(present) > 20 else "") if present else "no .gguf files"
    if not matches:
        raise ValueError(f"--source-file {glob!r} matches no file in {path} (found: {found})")
    names = ", ".join(str(p.relative_to(path)) for p in matches[:20])
    raise ValueError(f"--source-file {glob!r} matches {len(matches)} files in {path} ({names}); "
                     "make the pattern pick exactly one")  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache size depends on, from GGUF metadata."""

    train_context: int
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    #: Bytes per cached element of K and of V (``type_k``/``type_v``): f16, llama.cpp's default, is 2.
    k_bytes: float = 2.0
    v_bytes: float = 2.0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token for every layer, in the cache types chosen (f16 unless set)."""
        return math.ceil(self.layers * self.kv_heads * (self.key_dim * self.k_bytes + self.value_dim * self.v_bytes))

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


def plan_context(
    shape: ModelShape,
    weights_bytes: int,
    memory_limit: int | None,
    requested: int | None,
    slots: int = 1,
    limit_name: str = "the memory limit",
) -> int:
    """``n_ctx`` of each of ``slots`` slots: the training context, capped by the KV cache of all slots that
    fits in ``memory_limit`` (``limit_name``: the container's memory limit, or the GPU's free memory) after
    the weights and a reserve (``None``: no cap). An explicit ``requested`` wins if it is valid. ValueError
    says what does not fit, with the numbers."""
    if memory_limit is None:
        fit = shape.train_context
        budget = None
    else:
        reserve = max(RESERVE_BYTES, int(memory_limit * RESERVE_FRACTION))
        budget = memory_limit - weights_bytes - reserve
        fit = max(0, budget) // max(1, shape.kv_bytes_per_token * slots)

    def mib(n: int) -> str:
        return f"{n / MIB:.0f} MiB"

    if requested is not None:
        if requested > shape.train_context:
            raise ValueError(f"n_ctx={requested} exceeds the model's training context ({shape.train_context})")
        if requested > fit:
            assert memory_limit is not None
            assert budget is not None
            each = f" for each of {slots} slots (n_parallel)" if slots > 1 else ""
            raise ValueError(
                f"n_ctx={requested} needs {mib(requested * shape.kv_bytes_per_token)} of KV cache{each}, but "
                f"{limit_name} ({mib(memory_limit)}) leaves {mib(max(0, budget))} after the weights "
                f"({mib(weights_bytes)}) and a reserve; lower n_ctx{' or n_parallel' if slots > 1 else ''} "
                f"or raise {limit_name}"
            )
        return requested
    n_ctx = min(shape.train_context, fit)
    if n_ctx < min(MIN_CONTEXT, shape.train_context):
        assert memory_limit is not None
        raise ValueError(
            f"the model does not fit: {limit_name} ({mib(memory_limit)}) leaves room for {fit} tokens of KV "
            f"cache ({shape.kv_bytes_per_token} bytes each){' per slot' if slots > 1 else ''} after the weights "
            f"({mib(weights_bytes)}); raise {limit_name}{' or lower n_parallel' if slots > 1 else ''}"
        )
    return n_ctx


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = np.asarray(a[:n], dtype=np.int64) == np.asarray(b[:n], dtype=np.int64)
    return n if bool(same.all()) else int(np.argmin(same))


def default_parallel(cpus: int) -> int:
    """Slots when none are asked for: two per CPU, at least 2 (a second stream hides the first one's
    sampling and streaming time), at most :data:`MAX_DEFAULT_PARALLEL`."""
    return max(2, min(MAX_DEFAULT_PARALLEL, 2 * cpus))


def plan_slots(
    shape: ModelShape,
    weights_bytes: int,
    memory_limit: int | None,
    n_ctx: int | None,
    n_parallel: int | None,
    cpus: int,
    limit_name: str = "the memory limit",
) -> tuple[int, int]:
    """``(n_ctx per slot, n_parallel)``. Explicit values win when they fit (ValueError with the numbers
    otherwise). By default, the most slots up to :func:`default_parallel` whose context stays at least
    :data:`USEFUL_SLOT_CONTEXT` (or ``n_ctx`` when given, or the training context when smaller); one
    slot when memory allows no more."""
    if n_parallel is not None:
        return plan_context(shape, weights_bytes, memory_limit, n_ctx, n_parallel, limit_name), n_parallel
    useful = n_ctx if n_ctx is not None else min(USEFUL_SLOT_CONTEXT, shape.train_context)
    for slots in range(default_parallel(cpus), 1, -1):
        with contextlib.suppress(ValueError):
            context = plan_context(shape, weights_bytes, memory_limit, n_ctx, slots, limit_name)
            if context >= useful:
                return context, slots
    return plan_context(shape, weights_bytes, memory_limit, n_ctx, 1, limit_name), 1


# -- the engine ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Seq(QueuedSequence):
    """One sequence, from admission to its last token. The fields here belong to the engine thread."""

    slot: _Slot | None = None
    keys: list[int] = field(default_factory=list)  # the prompt's cache keys (its ids, image cells negative)
    pending: list[int] = field(default_factory=list)  # tokens to evaluate next: a prompt's rest, then the last sampled
    segments: deque[Segment] = field(default_factory=deque)  # what of the prompt follows ``pending`` (images)
    sampler: Any = None
    matcher: Any = None
    stops: frozenset[int] = frozenset()
    generated: int = 0
    lora: _Lora | None = None  # the adapter it generates with; None: the base

    @property
    def prefilling(self) -> bool:
        return self.generated == 0


@dataclass(eq=False)
class _Slot:
    """A llama.cpp sequence id with its own part of the KV cache, and the tokens that part holds."""

    seq_id: int
    cached: list[int] = field(default_factory=list)  # keys (token ids; an image's cells its negative key)
    #: The adapter the cached cells were computed with (K and V depend on it): a prefix is shared only with it.
    lora: _Lora | None = None
    seq: _Seq | None = None
    last_used: int = 0
    #: Images in the cache: (first cell, cells, positions); an image may take fewer positions than cells (M-RoPE).
    images: list[tuple[int, int, int]] = field(default_factory=list)
    next_pos: int = 0  # the position of the next cell

    def position(self, cell: int) -> int:
        """The position of cache cell ``cell`` (``cell`` at an image boundary)."""
        return cell - sum(n - n_pos for start, n, n_pos in self.images if start + n <= cell)

    def cut(self, cell: int) -> int:
        """``cell`` moved back to the start of an image it falls inside: an image is cached whole or not at all."""
        for start, n, _ in self.images:
            if start < cell < start + n:
                return start
        return cell

    def keep(self, cells: int) -> None:
        """Forget the cache past ``cells`` (an image boundary)."""
        del self.cached[cells:]
        self.images = [image for image in self.images if image[0] + image[1] <= cells]
        self.next_pos = self.position(cells)

    def reset(self) -> None:
        self.keep(0)


@dataclass(eq=False)
class _Lora:
    """A LoRA adapter llama.cpp holds (``llama_adapter_lora_init``); compared by identity, so a new version
    of the same name never shares a slot's cached prefix with the old one."""

    name: str
    path: Path
    handle: Any  # llama_adapter_lora_p; None once freed


class _Batch:
    """A ``llama_batch`` whose arrays are numpy buffers, filled a slice at a time rather than item by item.

    Each token belongs to one sequence: ``seq_id[i]`` points at ``seq[i]``, so the sequence ids are one
    int32 array as well. Not built by ``llama_batch_init``, so never handed to ``llama_batch_free``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        int_p = ctypes.POINTER(ctypes.c_int32)
        self._seq_ptrs = (int_p * capacity)(
            *(ctypes.cast(self.seq.ctypes.data + 4 * i, int_p) for i in range(capacity))
        )
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.tokens.ctypes.data_as(int_p),
            embd=None,
            pos=self.pos.ctypes.data_as(int_p),
            n_seq_id=self.n_seq_id.ctypes.data_as(int_p),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.size = 0

    def clear(self) -> None:
        self.size = 0

    def add(self, tokens: Sequence[int], start: int, seq_id: int, want_logits: bool) -> int:
        """Append ``tokens`` at positions ``start..`` of ``seq_id``; returns the batch index of the last one."""
        n, k = self.size, len(tokens)
        self.tokens[n : n + k] = tokens
        self.pos[n : n + k] = np.arange(start, start + k, dtype=np.int32)
        self.seq[n : n + k] = seq_id
        self.logits[n : n + k] = 0
        self.logits[n + k - 1] = 1 if want_logits else 0
        self.size = n + k
        return n + k - 1


class LlamaCppEngine(Engine):
    """A GGUF model on llama.cpp, decoding ``n_parallel`` sequences in one batch."""

    backend = Backend.LLAMACPP
    EngineArgs = LlamaCppArgs
    capabilities = EngineCapabilities(
        penalties=True, logprobs=True, max_top_logprobs=20, constraints=True, adapters=True
    )

    def __init__(self, config: PredictorConfig, args: BaseModel) -> None:
        super().__init__(config, args)
        assert isinstance(args, LlamaCppArgs)
        self.largs = args
        # Resolving the file and validating n_ctx are cheap (metadata only): a bad pattern or n_ctx
        # stops start-up with one line instead of failing the load later.
        try:
            self.projector_path = (
                find_projector(config.source, config.source_projector_file) if config.source_projector_file else None
            )
            self.path = find_gguf(config.source, config.source_file, exclude=self.projector_path)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self._projector: Projector | None = None
        self.gpu_offload = bool(llama_cpp.llama_supports_gpu_offload()) and args.n_gpu_layers != 0
        self.n_threads_batch = default_threads()
        self.n_threads = args.n_threads or physical_cores()
        try:
            self.flash_attn = args.flash_attention(self.gpu_offload)
            self.metadata = self._read_metadata(self.path)
            # The GGUF's own sampling defaults, as llama-server reads them (engine.SAMPLING_DEFAULT_BOUNDS).
            self.sampling_defaults = sampling_defaults(gguf_sampling_defaults(self.metadata))
            shape = ModelShape.from_metadata(self.metadata)
            self.shape = replace(shape, k_bytes=CACHE_TYPES[args.type_k][1], v_bytes=CACHE_TYPES[args.type_v][1])
            self.n_ctx, self.n_parallel, self.memory_limit = self._plan(args)
        except ValueError as exc:
            raise StartupError(f"{self.path.name}: {exc}") from None
        self._queue: queue.SimpleQueue[_Seq | None] = queue.SimpleQueue()
        # The waiting ones + one per slot.
        self.admission = Admission(self.n_parallel, args.max_queue, "engine args n_parallel + max_queue")
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})  # token bytes, without / with specials
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._model: Any = None
        self._ctx: Any = None
        #: The LoRA adapters loaded (llama.cpp), least recently used first.
        self._adapters: OrderedDict[str, _Lora] = OrderedDict()
        #: Sequences using each adapter now (queued or running): an adapter in use is never freed.
        self._adapter_users: Counter[str] = Counter()
        #: Serializes loading and freeing adapters (their checks read files: not under the model lock).
        self._adapter_lock = threading.Lock()
        #: Held by the engine thread for each step, and by loading or freeing an adapter: the context's adapter
        #: set never names a freed adapter, and no adapter's buffers are written while a decode reads them.
        self._model_lock = threading.Lock()
        #: The adapter set on the context now (None: the base); changed by the engine thread only between decodes.
        self._lora_on: _Lora | None = None
        #: The base's GGUF header, read on the first adapter load: (architecture, tensor shapes).
        self._base_header: tuple[str, dict[str, tuple[int, ...]]] | None = None
        #: Called on the engine thread before every ``llama_decode`` with (adapter name or None, batch tokens);
        #: a test seam, None in service.
        self.step_hook: Callable[[str | None, int], None] | None = None

    def _plan(self, args: LlamaCppArgs) -> tuple[int, int, int | None]:
        """``(n_ctx per slot, n_parallel, the memory limit planned against)``.

        On CPU, or with part of the layers on a GPU, the container's memory limit holds the weights and the
        cache of the layers left on the CPU. With every layer offloaded both live in GPU memory, which the
        cgroup does not cover: the GPUs' free memory caps the context (the split's GPUs: ``main_gpu`` alone
        with ``split_mode=none``), and where it cannot be read, :data:`DEFAULT_GPU_CONTEXT` does."""
        weights = self.path.stat().st_size
        on_gpu = self.shape.layers if args.n_gpu_layers < 0 else min(args.n_gpu_layers, self.shape.layers)
        share = on_gpu / max(1, self.shape.layers) if self.gpu_offload else 0.0
        if share < 1.0:
            limit = container_memory_limit() or physical_memory()
            cpu_shape = replace(self.shape, k_bytes=self.shape.k_bytes * (1 - share),
                                v_bytes=self.shape.v_bytes * (1 - share))  # fmt: skip
            n_ctx, slots = plan_slots(cpu_shape, int(weights * (1 - share)), limit, args.n_ctx, args.n_parallel,
                                      self.n_threads_batch)  # fmt: skip
            return n_ctx, slots, limit
        devices = [args.main_gpu] if args.split_mode == "none" else None
        free = gpu_free_memory(devices)
        shape = self.shape
        if free is None and args.n_ctx is None:
            shape = replace(shape, train_context=min(shape.train_context, DEFAULT_GPU_CONTEXT))
        n_ctx, slots = plan_slots(shape, weights, free, args.n_ctx, args.n_parallel, self.n_threads_batch,
                                  limit_name="the GPUs' free memory")  # fmt: skip
        return n_ctx, slots, free

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
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = self.largs.n_gpu_layers if self.gpu_offload else 0
        model_params.split_mode = SPLIT_MODES[self.largs.split_mode]
        model_params.main_gpu = self.largs.main_gpu
        if self.largs.tensor_split is not None:
            shares = [float(part) for part in self.largs.tensor_split.split(",")]
            self._tensor_split = (ctypes.c_float * llama_cpp.llama_max_devices())(*shares)  # kept alive with the model
            model_params.tensor_split = self._tensor_split
        self._model = llama_internals.LlamaModel(path_model=str(self.path), params=model_params, verbose=False)
        params = llama_cpp.llama_context_default_params()
        # One KV stream per slot (not unified): a slot's context is its own, so a sequence never finds the
        # cache full, and attention reads only its own sequence's cells.
        params.n_ctx = self.n_ctx * self.n_parallel
        params.n_seq_max = self.n_parallel
        params.kv_unified = False
        self._n_batch = max(self.n_parallel, min(self.largs.n_batch, params.n_ctx))
        params.n_batch = self._n_batch
        params.n_ubatch = self._n_ubatch = min(self._n_batch, 512)
        params.n_threads = self.n_threads
        params.n_threads_batch = max(self.n_threads, self.n_threads_batch)
        params.no_perf = True
        # The resolved choice (LlamaCppArgs.flash_attention): None is llama.cpp's own per device, AUTO (llama.cpp
        # include/llama.h, llama_flash_attn_type; llama-context.cpp resolves it when the context is made).
        params.flash_attn_type = flash_attn_type(self.flash_attn)
        # The cache element types the context plan counted (llama.h llama_context_params.type_k/type_v, f16 by
        # default): without them llama.cpp allocates f16 and the planned context does not fit.
        params.type_k = CACHE_TYPES[self.largs.type_k][0]
        params.type_v = CACHE_TYPES[self.largs.type_v][0]
        self._ctx = llama_internals.LlamaContext(model=self._model, params=params, verbose=False)
        # llama-cpp-python prints every llama.cpp log line unless its logger is set: an adapter switch logs the
        # graph's re-planning at INFO, lines per decode. Warnings and errors only, unless set already.
        llama_log = logging.getLogger("llama-cpp-python")
        if llama_log.level == logging.NOTSET:
            llama_log.setLevel(logging.WARNING)
        self._memory = llama_cpp.llama_get_memory(self._ctx.ctx)
        if self.projector_path is not None:
            try:
                threads = max(self.n_threads, self.n_threads_batch)
                self._projector = Projector(self.projector_path, self._model.model, threads,
                                            use_gpu=self.gpu_offload, flash_attn=self.flash_attn)  # fmt: skip
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        self._n_vocab = int(self._model.n_vocab())
        self._vocab_ptr = self._model.vocab
        self._eos = frozenset(t for t in range(self._n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab_ptr, t))
        if not self._eos and self._model.token_eos() >= 0:
            self._eos = frozenset({int(self._model.token_eos())})
        self._lltokenizer: Any = None
        try:
            self._lltokenizer = constraints.llamacpp_tokenizer(self._vocab_ptr, self._n_vocab, sorted(self._eos))
        except ValueError as exc:  # a vocabulary llguidance cannot read: constrained requests get a 400
            logger.warning("constrained decoding unavailable for this vocabulary: %s", exc)
        bos, eos = int(self._model.token_bos()), int(self._model.token_eos())
        self._special = {
            "bos_token": self.token_text(bos) if bos >= 0 else "",
            "eos_token": self.token_text(eos) if eos >= 0 else "",
        }
        self._slots = [_Slot(seq_id) for seq_id in range(self.n_parallel)]
        self._batch = _Batch(self._n_batch)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.config.model_name}", daemon=True)
        self._thread.start()
        logger.info(
            "llama.cpp engine: %s, %d slots x n_ctx %d (training %d, memory limit %s), %s, %d threads",
            self.path.name,
            self.n_parallel,
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
        if self._projector is not None:
            self._projector.close()
            self._projector = None
        with self._adapter_lock, self._model_lock:
            for name in list(self._adapters):  # before the model, which would free them itself
                self._free_adapter(name)
        for resource in (self._ctx, self._model):
            if resource is not None:
                resource.close()
        self._ctx = self._model = None
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
        return list(self._model.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True))

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
            "projector_file": self.projector_path.name if self.projector_path else None,
            "n_ctx": self.n_ctx,
            "n_parallel": self.n_parallel,
            "training_context": self.shape.train_context,
            "gpu_offload": self.gpu_offload,
            "flash_attn": self.flash_attn,
            "kv_cache_types": f"{self.largs.type_k}/{self.largs.type_v}",
            "n_threads": self.n_threads,
            "max_queue": self.largs.max_queue,
            "max_loras": self.largs.max_loras,
        }

    def check_capacity(self, sequences: int = 1) -> None:
        self.admission.check(sequences)

    # -- LoRA adapters ----------------------------------------------------------------------------------

    @property
    def adapters_loaded(self) -> list[str]:
        """The resident adapters, least recently used first."""
        return list(self._adapters)

    def load_adapter(self, adapter: AdapterRef) -> bool:
        """Make ``adapter`` resident (a blocking call: run it off the event loop). False when it already was.

        Its GGUF header is checked against the base's before llama.cpp reads it (:func:`check_lora_fits`: an
        :class:`AdapterMismatch` leaves the base serving as it was); the least recently used adapter no
        sequence uses is freed when ``max_loras`` are resident; when every one is in use, 503 until one
        finishes. The load itself holds the model lock: decoding pauses while llama.cpp copies the weights."""
        with self._adapter_lock:
            resident = self._adapters.get(adapter.name)
            if resident is not None and resident.path == adapter.path:
                self._adapters.move_to_end(adapter.name)
                return False
            started = time.monotonic()
            path = lora_file(adapter.path)
            if self._base_header is None:
                metadata, shapes = gguf_header(self.path)
                self._base_header = (metadata.get("general.architecture", ""), shapes)
            check_lora_fits(path, *self._base_header)
            with self._model_lock:
                if resident is not None:  # a new version of the same name: the old one goes first
                    self._free_adapter(adapter.name)
                make_room(self._adapters, self._adapter_users, self.largs.max_loras, self._free_adapter,
                          self.config.model_name)  # fmt: skip
                handle = llama_cpp.llama_adapter_lora_init(self._model.model, str(path).encode("utf-8"))
                if not handle:
                    raise AdapterMismatch(f"llama.cpp could not load the LoRA {path.name} onto this base model "
                                          "(its log says why)")  # fmt: skip
                self._adapters[adapter.name] = _Lora(adapter.name, adapter.path, handle)
        elapsed = time.monotonic() - started
        metrics.ADAPTER_LOADS.labels(self.config.model_name, adapter.name).inc()
        metrics.ADAPTER_LOAD_SECONDS.labels(self.config.model_name, adapter.name).observe(elapsed)
        logger.info("LoRA adapter %s loaded from %s in %.2f s", adapter.name, path, elapsed)
        return True

    def unload_adapter(self, name: str) -> bool:
        """Free ``name`` if resident and unused (an adapter removed from the model's list); False otherwise."""
        with self._adapter_lock, self._model_lock:
            if name not in self._adapters or self._adapter_users[name] > 0:
                return False
            self._free_adapter(name)
            return True

    def _free_adapter(self, name: str) -> None:
        """Free ``name``'s weights (under both locks): first off the context, which must never name a freed one."""
        lora = self._adapters.pop(name)
        if self._lora_on is lora:
            self._use_lora(None)
        llama_cpp.llama_adapter_lora_free(lora.handle)
        lora.handle = None
        logger.info("LoRA adapter %s unloaded", name)

    # -- images -----------------------------------------------------------------------------------------

    @property
    def vision(self) -> VisionSupport | None:
        return VisionSupport(max_pixels=MAX_IMAGE_PIXELS) if self._projector is not None else None

    def multimodal_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        images: Sequence[Any],
    ) -> MultimodalPrompt:
        """The chat template rendered with each image as ``mtmd``'s marker, then tokenized by ``mtmd`` (the
        family's image tokens, its preprocessing and slicing). ``prompt_ids`` hold one id per KV cell, an image's
        cells as the placeholder id 0 (usage counts them, as llama.cpp does); the engine runs the chunks."""
        projector = self._projector
        if projector is None:
            return super().multimodal_prompt(messages, tools, images)
        text = self.apply_chat_template(projector.template_messages(messages), tools)
        prompt = projector.tokenize(text, images)
        if not prompt.segments or not isinstance(prompt.segments[-1], list):
            raise ValueError("the prompt ends with an image; the chat template must end with text")
        ids = [k if k >= 0 else 0 for k in prompt.keys]
        return MultimodalPrompt(prompt_ids=ids, images=tuple(images), inputs=prompt, image_tokens=prompt.image_tokens)

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
        multimodal = request.multimodal.inputs if request.multimodal is not None else None
        if multimodal is not None and not isinstance(multimodal, MtmdPrompt):
            raise ValueError("the prompt's images were not prepared by this engine")
        grammar = None
        if request.constraint is not None:
            if self._lltokenizer is None:
                raise ValueError("this model's vocabulary cannot be read for constrained decoding")
            # Before the first await: an unenforceable schema is the response's 400, streamed or not.
            grammar = constraints.grammar_for(request.constraint)
        seq = _Seq(request, asyncio.get_running_loop(), asyncio.Queue(), grammar)
        seq.keys = list(multimodal.keys) if multimodal is not None else list(request.prompt_ids)
        adapter = request.adapter.name if request.adapter is not None else None
        if adapter is not None:
            self._adapter_users[adapter] += 1  # before loading: no other load may evict it from here on
        try:
            if request.adapter is not None:
                self.check_capacity(1)  # a request the queue refuses loads nothing
                await asyncio.to_thread(self.load_adapter, request.adapter)
                seq.lora = self._adapters[request.adapter.name]
                metrics.ADAPTER_REQUESTS.labels(self.config.model_name, adapter).inc()
            stream = stream_from_engine_thread(self, self.admission, seq, self._queue.put)
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    if adapter is not None:
                        metrics.ADAPTER_TOKENS.labels(self.config.model_name, adapter).inc(len(chunk.token_ids))
                    yield chunk
        finally:
            if adapter is not None:
                self._adapter_users[adapter] -= 1

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        waiting: deque[_Seq] = deque()
        running: list[_Seq] = []
        model = self.config.model_name
        try:
            while not self._stopping:
                # New arrivals: wait for one when idle, else take what came in since the last step.
                try:
                    while True:
                        item = self._queue.get(block=not (running or waiting))
                        if item is None:
                            return
                        waiting.append(item)
                except queue.Empty:
                    pass
                for seq in [s for s in running if s.abandoned]:
                    self._release(seq, running)
                while waiting and waiting[0].abandoned:
                    waiting.popleft()
                while waiting and (slot := self._free_slot(waiting[0])) is not None:
                    seq = waiting.popleft()
                    if not seq.abandoned:
                        self._admit(seq, slot, running)
                metrics.QUEUE_DEPTH.labels(model).set(len(waiting))
                if running:
                    with self._model_lock:
                        self._step(running)
        finally:
            failure = RuntimeError("the engine is shutting down")
            for seq in [*running, *waiting]:
                seq.send(failure)
            while True:
                try:
                    left = self._queue.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    left.send(failure)

    def _free_slot(self, seq: _Seq) -> _Slot | None:
        """The free slot whose cache shares the longest prefix with the prompt when that prefix is more than
        :data:`SLOT_SIMILARITY` of the prompt, else the least recently used one (whose cache is worth least).
        llama-server picks its slots the same way (``--slot-prompt-similarity``, default 0.1:
        tools/server/server-context.cpp, common/common.h of the vendored llama.cpp)."""
        free = [slot for slot in self._slots if slot.seq is None]
        if not free:
            return None
        prompt = seq.keys
        shared = {slot.seq_id: common_prefix(slot.cached, prompt) if slot.lora is seq.lora else 0 for slot in free}
        best = max(free, key=lambda slot: (shared[slot.seq_id], -slot.last_used))
        if shared[best.seq_id] > SLOT_SIMILARITY * len(prompt):
            return best
        return min(free, key=lambda slot: slot.last_used)

    def _admit(self, seq: _Seq, slot: _Slot, running: list[_Seq]) -> None:
        """Put ``seq`` into ``slot``: keep the cached common prefix (the last prompt token is always evaluated
        again, as its logits pick the first token), build its sampler and constraint matcher."""
        seq.prefill_started_ns = seq.prefill_started_ns or time.time_ns()  # its wait in the queue ends here
        prompt = seq.keys
        common = slot.cut(min(common_prefix(slot.cached, prompt), len(prompt) - 1)) if slot.lora is seq.lora else 0
        slot.lora = seq.lora
        if not llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, slot.position(common), -1):
            # This model's cache cannot be cut (recurrent): start the slot afresh.
            llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
            common = 0
        slot.keep(common)
        try:
            seq.matcher = constraints.matcher(self._lltokenizer, seq.grammar) if seq.grammar is not None else None
        except Exception as exc:  # a failed sequence fails alone
            seq.send(RuntimeError(f"generation failed: {exc}"))
            return
        seq.sampler = self._sampler(seq.request.params)
        seq.stops = frozenset(seq.request.params.stop_token_ids) | (
            frozenset() if seq.request.params.ignore_eos else self._eos
        )
        multimodal = seq.request.multimodal
        if multimodal is None:
            seq.pending = list(prompt[common:])
        else:  # the segments past the cached prefix (which ends at an image boundary)
            skip = common
            for segment in multimodal.inputs.segments:
                size = len(segment) if isinstance(segment, list) else segment.n_tokens
                if skip >= size:
                    skip -= size
                    continue
                seq.segments.append(segment[skip:] if isinstance(segment, list) else segment)
                skip = 0
            seq.pending = []
            self._next_text(seq)
        seq.slot, slot.seq = slot, seq
        running.append(seq)
        metrics.PROMPT_TOKENS.labels(self.config.model_name).inc(len(prompt) - common)

    @staticmethod
    def _next_text(seq: _Seq) -> None:
        """Move the next text segment into ``pending`` when nothing is pending and text comes next."""
        if not seq.pending and seq.segments and isinstance(seq.segments[0], list):
            seq.pending = list(seq.segments.popleft())  # type: ignore[arg-type]

    def _evaluate_images(self, running: list[_Seq]) -> None:
        """Each prefilling sequence whose prompt continues with an image: the image into its slot's cache (one
        image chunk at a time, outside the shared batch: its embeddings are not tokens), then its next text."""
        projector = self._projector
        for seq in list(running):
            while not seq.pending and seq.segments and isinstance(seq.segments[0], ImageChunk):
                image = seq.segments.popleft()
                slot = seq.slot
                assert slot is not None
                assert projector is not None
                assert isinstance(image, ImageChunk)
                self._use_lora(seq.lora)  # the image's embeddings go through the adapted layers too
                try:
                    next_pos = projector.evaluate(self._ctx.ctx, image, slot.next_pos, slot.seq_id, self._n_batch,
                                                  self._n_ubatch)  # fmt: skip
                except RuntimeError as exc:
                    logger.error("%s", exc)
                    llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
                    slot.reset()
                    seq.send(RuntimeError(f"generation failed: {exc}"))
                    self._release(seq, running)
                    break
                slot.images.append((len(slot.cached), image.n_tokens, next_pos - slot.next_pos))
                slot.cached.extend([image.key] * image.n_tokens)
                slot.next_pos = next_pos
                self._next_text(seq)

    def _release(self, seq: _Seq, running: list[_Seq]) -> None:
        slot = seq.slot
        if slot is not None:
            slot.seq = None
            slot.last_used = next(_USE_COUNTER)
        seq.slot = None
        running.remove(seq)
        if seq.sampler is not None:
            seq.sampler.close()
            seq.sampler = None

    def _step(self, running: list[_Seq]) -> None:
        """One ``llama_decode`` per adapter in use (the base counts as one): each sequence advances once per step.

        A LoRA applies to the whole context, so the sequences are grouped by adapter, and the context's adapter
        is switched between the groups' decodes, starting with the one set now (``n`` groups: ``n - 1``
        switches a step). Tokens go to the event loop once, after the last group."""
        if self._projector is not None:
            self._evaluate_images(running)
            if not running:
                return
        groups: dict[_Lora | None, list[_Seq]] = {}
        for seq in running:
            groups.setdefault(seq.lora, []).append(seq)
        tokens: list[tuple[_Seq, Any]] = []
        for lora in sorted(groups, key=lambda lora: lora is not self._lora_on):  # stable: the current one first
            self._use_lora(lora)
            tokens += self._decode(groups[lora], running)
        # One wake-up of the event loop per step, not one per sequence: each wake-up costs the loop a
        # self-pipe round trip and, on a machine with as many decode threads as cores, a decode thread its core.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Seq, Any]]] = {}
        for seq, item in tokens:
            by_loop.setdefault(seq.loop, []).append((seq, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is listening
                loop.call_soon_threadsafe(_deliver, items)

    def _use_lora(self, lora: _Lora | None) -> None:
        """Set the context's adapters to ``lora`` alone (None: none). llama.cpp then re-plans its compute graph
        on the next decode (``sched_need_reserve``, src/llama-context.cpp): the cost of each switch."""
        if lora is self._lora_on:
            return
        if lora is None:
            llama_cpp.llama_set_adapters_lora(self._ctx.ctx, None, 0, None)
        else:
            handles = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(lora.handle)
            llama_cpp.llama_set_adapters_lora(self._ctx.ctx, handles, 1, (ctypes.c_float * 1)(1.0))
        self._lora_on = lora

    def _decode(self, group: list[_Seq], running: list[_Seq]) -> list[tuple[_Seq, Any]]:
        """One ``llama_decode`` of ``group`` (sequences on the adapter set now): a token from each generating
        sequence, then prompt chunks up to ``n_batch`` (a long prompt is evaluated over several steps while the
        others keep streaming), then sampling (before the next decode overwrites the logits)."""
        batch = self._batch
        batch.clear()
        outputs: list[tuple[_Seq, int]] = []
        for seq in sorted(group, key=lambda s: s.prefilling):  # generating ones first: they always fit
            room = batch.capacity - batch.size
            if room <= 0:
                break
            if not seq.pending:  # an image comes next: evaluated before the next step
                continue
            slot = seq.slot
            assert slot is not None
            take = seq.pending[:room]
            last = len(take) == len(seq.pending) and not seq.segments
            index = batch.add(take, slot.next_pos, slot.seq_id, want_logits=last)
            slot.cached.extend(take)
            slot.next_pos += len(take)
            del seq.pending[: len(take)]
            if last:
                outputs.append((seq, index))
        if batch.size == 0:
            return []
        batch.struct.n_tokens = batch.size
        if self.step_hook is not None:
            self.step_hook(self._lora_on.name if self._lora_on is not None else None, batch.size)
        code = llama_cpp.llama_decode(self._ctx.ctx, batch.struct)
        if code != 0:
            self._decode_failed(code, group, running)
            return []
        tokens: list[tuple[_Seq, Any]] = []
        for seq, index in outputs:
            try:
                tokens.append((seq, self._sample(seq, index, running)))
            except Exception as exc:  # a failed sequence fails alone, not the engine
                logger.exception("generation failed")
                tokens.append((seq, RuntimeError(f"generation failed: {exc}")))
                self._release(seq, running)
        return tokens

    def _decode_failed(self, code: int, group: list[_Seq], running: list[_Seq]) -> None:
        """The batch's sequences fail (their cache state is unknown: the slots start afresh); the engine goes on."""
        logger.error("llama_decode returned %d for a batch of %d tokens", code, self._batch.size)
        failure = RuntimeError(f"generation failed: llama_decode returned {code}")
        for seq in [s for s in group if s in running]:
            if seq.slot is not None:
                llama_cpp.llama_memory_seq_rm(self._memory, seq.slot.seq_id, -1, -1)
                seq.slot.reset()
            seq.send(failure)
            self._release(seq, running)

    def _sample(self, seq: _Seq, index: int, running: list[_Seq]) -> Any:
        """Pick the sequence's next token; returns what its consumer gets (:data:`admission.TokenItem`)."""
        params = seq.request.params
        ctx = self._ctx.ctx
        logprobs = None
        if params.logprobs is not None or seq.matcher is not None:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self._n_vocab,))
            # The model's logprobs, before the constraint masks the logits in place for the sampler.
            if params.logprobs is not None:
                logprobs = self._log_softmax(logits)
            if seq.matcher is not None:
                if seq.matcher.is_error():
                    raise constraints.matcher_failure(seq.matcher)
                masks = constraints.allocate_masks(1, self._n_vocab)
                allowed = constraints.unpack_masks(constraints.fill_masks([seq.matcher], masks), self._n_vocab)
                logits[~allowed[0]] = -np.inf
        token = int(llama_cpp.llama_sampler_sample(seq.sampler.sampler, ctx, index))
        lp, top = 0.0, list[tuple[int, float]]()
        if logprobs is not None and params.logprobs is not None:
            lp, top = self._chosen_and_top(logprobs, token, params.logprobs)
        seq.generated += 1
        complete = False
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
            complete = seq.matcher.is_stopped()
        # A complete value ends at the EOS its mask now forces, or here when no EOS may or can follow.
        finish: str | None = None
        if token in seq.stops or (complete and (params.ignore_eos or seq.generated >= params.max_tokens)):
            finish = "stop"
        elif seq.generated >= params.max_tokens:
            finish = "length"
        metrics.TOKENS_GENERATED.labels(self.config.model_name).inc()
        if finish is not None:
            self._release(seq, running)
        else:
            seq.pending = [token]
        return (token, lp, top, finish)

    def _sampler(self, params: SamplingParams) -> Any:
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
            if params.top_k > 0:
                sampler.add_top_k(params.top_k)
            if params.top_p < 1.0:
                sampler.add_top_p(params.top_p, 1)
            sampler.add_temp(params.temperature)
            seed = params.seed if params.seed is not None else random.getrandbits(32)
            sampler.add_dist(seed & 0xFFFFFFFF)
        return sampler

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


def _deliver(items: list[tuple[_Seq, Any]]) -> None:
    """On the event loop: hand each sequence its token (or failure)."""
    for seq, item in items:
        seq.out.put_nowait(item)


#: Orders slot use, for least-recently-used choice among slots whose caches share nothing with a prompt.
_USE_COUNTER = itertools.count(1)
