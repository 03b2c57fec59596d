"""The transformers engine: continuous batching of every active sequence on one engine thread.

Each step runs ONE forward pass for all active sequences: new arrivals are prefilled together
(left-padded, in chunks of ``prefill_chunk`` tokens) and their KV cache merged into the running batch;
then every sequence decodes one token per step. Rows are left-padded to a common length and the
attention mask hides the padding, so a sequence sees exactly the tokens it would see alone. Finished or
abandoned sequences leave the batch at the next step (their rows dropped from the cache). Tokens go back
to each request's asyncio queue with ``call_soon_threadsafe``: the event loop never waits on the model.

Memory: the batch's KV cache (rows x its padded length) stays within a token budget: ``max_batch_tokens``,
or on CUDA what the free GPU memory after loading holds (:func:`token_budget`). A waiting sequence joins on
what it uses now, its prompt, with :data:`GROWTH_HEADROOM` tokens a row to grow, not on its worst case (a
request without ``max_tokens`` may run to the end of the context, and reserving that would run such
requests one at a time). The cache then grows on demand; when the next step would not fit, the latest
admitted sequence is preempted: its rows leave the cache, and it waits at the head of the queue to be
prefilled again from its prompt and the tokens it has generated (vLLM's recompute preemption). The context
is capped at the budget, so a sequence alone always fits. A CUDA out-of-memory error fails only the sequences of the
step it hit (a prefill: the arrivals; a merge or decode: the batch) with 503 and ``Retry-After``, then
gives the allocator's cache back. Several GPUs: the model is sharded over them (``device_map``).

Vision-language models (an image-text-to-text family in :data:`VISION_FAMILIES`: LLaVA, Idefics3/SmolVLM)
load with ``AutoModelForImageTextToText`` and their ``AutoProcessor``: a chat prompt with images is rendered
with the processor's chat template and processed there (its image placeholders expanded into image tokens,
pixel values made); at prefill the engine thread runs the model's ``get_image_features`` on the arrivals'
images (one pass when they are alike) and scatters the features into each row's image-token embeddings, then
prefills the rows together from embeddings (text rows and image rows in one batch); decoding is the
language model's, as for text.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import random
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from universal_predictors import metrics
from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig
from universal_predictors.devices import detect_device, model_dtype, release_memory
from universal_predictors.errors import Unavailable
from universal_predictors.generation import constraints
from universal_predictors.generation.adapters import AdapterMismatch, AdapterRef, check_fits, make_room, read_lora
from universal_predictors.generation.engine import (
    Engine,
    EngineCapabilities,
    GenerationChunk,
    GenerationRequest,
    MultimodalPrompt,
    NoChatTemplate,
    VisionSupport,
    render_chat_template,
    sampling_defaults,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)
from universal_predictors.generation.engines.admission import Admission, QueuedSequence, stream_from_engine_thread
from universal_predictors.generation.engines.batched_lora import BatchedLora, lora_matrices

logger = logging.getLogger(__name__)


class TransformersArgs(BaseModel):
    """``--engine-arg`` keys of the transformers engine."""

    model_config = ConfigDict(extra="forbid")

    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    #: Sequences that may wait beyond the ``max_batch_size`` running ones; more get 503 ``overloaded``.
    max_queue: int = Field(default=64, ge=0, le=100_000)
    #: How long the first request of an idle engine waits for others to share its prefill.
    batch_wait_ms: float = Field(default=2.0, ge=0, le=1000)
    max_model_len: int | None = Field(default=None, ge=16)
    attn_implementation: str = "sdpa"
    #: The batch's KV-cache budget in tokens (rows x the padded length); default: unbounded on the CPU,
    #: computed from the free GPU memory after loading on CUDA (see :func:`token_budget`).
    max_batch_tokens: int | None = Field(default=None, ge=16)
    #: The share of each GPU's memory this process may fill (vLLM's name and default).
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    #: Prompt tokens per prefill forward step (split over the rows prefilled together): bounds the
    #: activations of a long prompt, which would otherwise grow with its length in one step.
    prefill_chunk: int = Field(default=512, ge=1, le=1_000_000)
    #: LoRA adapters resident at once (vLLM's name); the least recently used one with no running sequence is
    #: unloaded to make room. The rest stay on disk and load on first use.
    max_loras: int = Field(default=8, ge=1, le=1024)


#: The smallest KV-cache budget worth serving with: below it the model is refused at load.
MIN_TOKEN_BUDGET = 16

#: Tokens a row may still grow by (or to its end, when sooner) that the batch must hold for a waiting
#: sequence to join it: without it a sequence admitted with the cache just full would be preempted again at
#: its next step. vLLM keeps a watermark of free blocks for the same reason (``watermark`` of
#: ``KVCacheManager``).
GROWTH_HEADROOM = 16


@dataclass(frozen=True)
class VisionFamily:
    """What differs between the vision-language families this engine serves: where their processed image
    inputs count images. The rest is common: 1-D positions, causal attention, and the model's own
    ``get_image_features`` giving one feature per image token, in prompt order, that replaces that
    token's embedding (what the model's ``forward`` does with ``pixel_values``)."""

    #: The processor outputs ``get_image_features`` takes (the rest, ``input_ids`` and its mask, are text).
    image_inputs: frozenset[str]
    #: The axis of every image input that counts the prompt's images: rows' images batch along it.
    image_axis: int


#: Vision-language families (``config.model_type``) this engine serves. LLaVA: ``pixel_values``
#: ``[images, C, H, W]`` (``image_sizes`` ``[images, 2]`` where its processor gives them) through the tower
#: and projector. Idefics3 / SmolVLM: the processor splits each image
#: into tiles plus the global image (``pixel_values`` ``[1, tiles, C, H, W]``, ``pixel_attention_mask``
#: ``[1, tiles, H, W]`` marking each tile's real pixels), the connector pixel-shuffles each tile's patches
#: into its image tokens. Others (Qwen2-VL's 3-D rotary positions, Gemma 3's bidirectional image attention)
#: need per-family prefill logic: vLLM serves them.
VISION_FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily(frozenset({"pixel_values", "image_sizes"}), image_axis=0),
    "idefics3": VisionFamily(frozenset({"pixel_values", "pixel_attention_mask"}), image_axis=1),
    "smolvlm": VisionFamily(frozenset({"pixel_values", "pixel_attention_mask"}), image_axis=1),
}


def vision_max_pixels(image_processor: Any) -> int | None:
    """The pixels worth keeping before the processor resizes: twice its target side each way (4x its
    pixels), so the processor's own resampling still decides the image the model sees; None if unknown."""
    for name in ("crop_size", "size"):
        size = getattr(image_processor, name, None)
        if size is None:
            continue
        get = size.get if isinstance(size, Mapping) else lambda key, size=size: getattr(size, key, None)
        most = get("max_pixels")
        if most:
            return int(most)
        side = get("shortest_edge") or max(get("height") or 0, get("width") or 0, get("longest_edge") or 0)
        if side:
            return int(4 * side * side)
    return None


def as_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with string content as one text part: processors' chat templates iterate over parts."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": [{"type": "text", "text": content}]}
        elif content is None:
            message = {**message, "content": []}
        out.append(dict(message))
    return out


@dataclass(frozen=True)
class CacheShape:
    """What a model's KV cache and one forward step cost, from its Hugging Face config."""

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, config: Any, dtype_bytes: int) -> CacheShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        return cls(
            layers=int(text.num_hidden_layers),
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            heads=heads,
            hidden=hidden,
            intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
            vocab=int(text.vocab_size),
            dtype_bytes=dtype_bytes,
        )


def step_reserve_bytes(
    shape: CacheShape, *, prefill_chunk: int, max_rows: int, context: int, eager_attention: bool = False
) -> int:
    """An estimate of one forward step's transient memory beside the KV cache: a prefill chunk's hidden
    states, projections and MLP (input and output of a block alive at once), the last position's fp32
    logits of every row with their log-softmax copy, and, with eager attention only, the chunk's attention
    scores (fp32, every head, against a full context). SDPA with a padding mask runs the memory-efficient
    kernel on CUDA, which never holds the score matrix."""
    activations = 2 * prefill_chunk * (4 * shape.hidden + 3 * shape.intermediate) * shape.dtype_bytes
    logits = max_rows * shape.vocab * 8
    scores = prefill_chunk * shape.heads * context * 4 if eager_attention else 0
    return activations + logits + scores


def token_budget(
    free_bytes: int,
    total_bytes: int,
    shape: CacheShape,
    *,
    utilization: float,
    prefill_chunk: int,
    max_rows: int,
    context: int,
    eager_attention: bool = False,
) -> int:
    """Tokens of KV cache the running batch may hold on GPUs with ``free_bytes`` of ``total_bytes`` free
    after the weights are loaded.

    The process may fill ``utilization`` of the total (vLLM's ``gpu_memory_utilization``): what is free
    beyond the ``1 - utilization`` share kept back, less one step's :func:`step_reserve_bytes`, holds the
    cache plus one layer's copy in flight (a merge, a trim or a decode's append rebuilds the cache one
    layer at a time), hence ``layers / (layers + 1)`` of it for the cache itself.
    """
    kept_back = int(total_bytes * (1 - utilization))
    reserve = step_reserve_bytes(
        shape, prefill_chunk=prefill_chunk, max_rows=max_rows, context=context, eager_attention=eager_attention
    )
    usable = free_bytes - kept_back - reserve
    if usable <= 0:
        return 0
    return usable * shape.layers // ((shape.layers + 1) * shape.kv_bytes_per_token)


def device_map_for(device: str, requested: str, gpus: int) -> str | None:
    """``device_map`` for ``from_pretrained``: ``"auto"`` (accelerate's balanced split of the layers
    over every visible GPU) when ``device: auto`` resolved to CUDA and the pod has more than one GPU;
    None (the whole model on ``device``) otherwise. An explicit device (``cuda:1``) keeps one GPU."""
    if requested == "auto" and device == "cuda" and gpus > 1:
        return "auto"
    return None


def out_of_memory(stage: str) -> Unavailable:
    """The 503 a sequence gets when a CUDA out-of-memory error hits the step it was in."""
    return Unavailable(
        f"The GPU ran out of memory during this request's {stage} step; retry shortly "
        "(a shorter prompt or a smaller max_tokens needs less).",
        code="out_of_memory",
        retry_after=1.0,
    )


@dataclass(eq=False)
class _Seq(QueuedSequence):
    """One sequence in the engine thread's batch."""

    generator: Any  # torch.Generator
    matcher: Any = None  # llguidance.LLMatcher, made on the engine thread when the sequence arrives
    generated: list[int] = field(default_factory=list)
    counts: Any = None  # per-token counts for penalties (a tensor), lazily
    next_token: int | None = None  # sampled, not yet in the KV cache
    finished: bool = False

    @property
    def context_ids(self) -> list[int]:
        """What a prefill of this sequence computes: its prompt, then what it has generated (a preempted
        sequence resumes from all of it, its last sampled token included)."""
        return [*self.request.prompt_ids, *self.generated]

    @property
    def growth(self) -> int:
        """The cache tokens this sequence may still add before its next admission check matters: up to
        :data:`GROWTH_HEADROOM`, fewer when its ``max_tokens`` ends sooner."""
        return max(1, min(GROWTH_HEADROOM, self.request.params.max_tokens - len(self.generated)))


class TransformersEngine(Engine):
    """A causal LM from a Hugging Face directory, served with continuous batching."""

    backend = Backend.TRANSFORMERS
    EngineArgs = TransformersArgs
    capabilities = EngineCapabilities(
        penalties=True, logprobs=True, max_top_logprobs=20, constraints=True, adapters=True
    )

    def __init__(self, config: PredictorConfig, args: BaseModel) -> None:
        super().__init__(config, args)
        assert isinstance(args, TransformersArgs)
        self.targs = args
        self._incoming: queue.SimpleQueue[_Seq | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: Why the device can no longer compute (a sticky CUDA error), for :meth:`health`; None while it can.
        self._dead: str | None = None
        self.device = "cpu"
        self.admission = Admission(args.max_batch_size, args.max_queue, "engine args max_batch_size + max_queue")
        #: The batch's KV-cache budget in tokens; None: unbounded.
        self.token_budget: int | None = None
        #: Called on the engine thread before every forward step with (stage, rows, columns); a test seam
        #: (an exception it raises is the step's: e.g. ``torch.OutOfMemoryError``), None in service.
        self.step_hook: Callable[[str, int, int], None] | None = None
        #: The LoRA adapters loaded into the model (PEFT), least recently used first: name -> folder.
        self._adapters: OrderedDict[str, Path] = OrderedDict()
        #: Sequences using each adapter now (queued or running): an adapter in use is never unloaded.
        self._adapter_users: Counter[str] = Counter()
        #: Held by every forward step and by loading or unloading an adapter (which rewrites the model's layers).
        self._model_lock = threading.Lock()
        #: The base model's linear layers, (in_features, out_features) by module path: read once, before PEFT
        #: wraps them, to check an adapter fits.
        self._linear_shapes: dict[str, tuple[int, int]] | None = None
        #: The resident adapters' matrices and their hooks (made with the first adapter).
        self._lora: BatchedLora | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self._torch = torch
        source = Path(self.config.source)
        self.device = detect_device(self.targs.device)
        hf_config = AutoConfig.from_pretrained(source, local_files_only=True)
        # transformers 5 names the checkpoint's dtype ``config.dtype`` (``torch_dtype`` before 4.56).
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        dtype = model_dtype(self.device, self.targs.dtype, checkpoint_dtype)
        gpus = torch.cuda.device_count() if self.device == "cuda" else 0
        device_map = device_map_for(self.device, self.targs.device, gpus)
        #: The vision-language model's processor; None for a text-only model.
        self.processor: Any = None
        auto_model: Any = AutoModelForCausalLM
        if getattr(hf_config, "vision_config", None) is not None:
            auto_model = self._vision_classes(hf_config, source)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        placement: dict[str, Any] = {"device_map": device_map} if device_map else {}
        model: Any = auto_model.from_pretrained(
            source,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=self.targs.attn_implementation,
            **placement,
        )
        if device_map is None:
            model = model.to(self.device)
        else:
            # accelerate puts what does not fit the GPUs on the CPU or disk: far too slow to serve from.
            spilled = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()} & {"cpu", "disk"})
            if spilled:
                raise RuntimeError(
                    f"the model does not fit the {gpus} GPUs: device_map placed layers on {', '.join(spilled)}"
                )
        self.model: Any = model
        self.model.eval()
        #: Where the inputs go: the embedding's device (the first GPU of a sharded model).
        self._input_device = self.model.get_input_embeddings().weight.device
        eos: set[int] = set()
        with contextlib.suppress(OSError):
            gen = GenerationConfig.from_pretrained(source, local_files_only=True)
            ids = gen.eos_token_id
            eos.update(ids if isinstance(ids, list) else [ids] if ids is not None else [])
            # Only what the file sets (to_diff_dict, as vLLM reads it), not GenerationConfig's own defaults.
            self.sampling_defaults = sampling_defaults(gen.to_diff_dict())
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos = frozenset(eos)
        text_config = self.model.config.get_text_config()
        limits = [getattr(text_config, "max_position_embeddings", None), self.targs.max_model_len]
        self._context = min(x for x in limits if x) if any(limits) else 2048
        self.token_budget = self.targs.max_batch_tokens
        if self.token_budget is None and self._input_device.type == "cuda":
            self.token_budget = self._gpu_token_budget(dtype)
        if self.token_budget is not None:
            # A sequence alone must always fit the budget: the context is what the budget can hold.
            self._context = min(self._context, self.token_budget)
        self._vocab = int(text_config.vocab_size)
        # The logits width (config.vocab_size) may exceed the tokenizer's: llguidance masks the rest.
        self._lltokenizer: Any = None
        try:
            self._lltokenizer = constraints.hf_tokenizer(self.tokenizer, self._vocab, sorted(self._eos))
        except ValueError as exc:  # a slow (Python) tokenizer: constrained requests get a 400
            logger.warning("constrained decoding unavailable for this tokenizer: %s", exc)
        self._masks = constraints.allocate_masks(self.targs.max_batch_size, self._vocab)
        # transformers renamed ``past_key_values`` to ``cache``; pass whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.config.model_name}", daemon=True)
        self._thread.start()
        logger.info(
            "transformers engine on %s (%s%s), context %d, batch KV budget %s tokens",
            self.device,
            dtype,
            f", sharded over {gpus} GPUs" if device_map else "",
            self._context,
            self.token_budget if self.token_budget is not None else "unbounded",
        )

    def _vision_classes(self, hf_config: Any, source: Path) -> Any:
        """The processor and tokenizer of a vision-language model, and its model class; RuntimeError for a
        family this engine cannot prefill (named, with where it can be served)."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        family = str(hf_config.model_type)
        if family not in VISION_FAMILIES:
            raise RuntimeError(
                f"the transformers engine serves the vision-language families {', '.join(sorted(VISION_FAMILIES))}; "
                f"this model is {family!r} (its image positions or attention need logic this engine does not "
                "have): serve it with backend vllm"
            )
        self._family = VISION_FAMILIES[family]
        self.processor = AutoProcessor.from_pretrained(source, local_files_only=True)  # type: ignore[no-untyped-call]
        self.tokenizer = self.processor.tokenizer
        self._image_token_id = int(hf_config.image_token_id)
        return AutoModelForImageTextToText

    def _gpu_token_budget(self, dtype: Any) -> int:
        """:func:`token_budget` from the free memory of every GPU the model's weights are on, now."""
        torch = self._torch
        indices = sorted({p.device.index or 0 for p in self.model.parameters() if p.device.type == "cuda"})
        free = total = 0
        for index in indices:
            device_free, device_total = torch.cuda.mem_get_info(index)
            free, total = free + device_free, total + device_total
        shape = CacheShape.from_config(self.model.config, torch.empty((), dtype=dtype).element_size())
        budget = token_budget(
            free,
            total,
            shape,
            utilization=self.targs.gpu_memory_utilization,
            prefill_chunk=self.targs.prefill_chunk,
            max_rows=self.targs.max_batch_size,
            context=self._context,
            eager_attention=self.targs.attn_implementation == "eager",
        )
        if budget < MIN_TOKEN_BUDGET:
            raise RuntimeError(
                f"no room for a KV cache: {free >> 20} MiB of {total >> 20} MiB GPU memory free after loading the "
                f"weights, {shape.kv_bytes_per_token >> 10} KiB per token, gpu_memory_utilization="
                f"{self.targs.gpu_memory_utilization}: use a larger GPU, more GPUs, or a smaller dtype or model"
            )
        return budget

    def unload(self) -> None:
        self._stopping = True
        self._incoming.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._lora is not None:
            self._lora.close()
            self._lora = None
        self._adapters.clear()
        for name in ("model", "tokenizer", "processor"):
            if hasattr(self, name):
                delattr(self, name)
        release_memory(self.device)

    # -- tokenizer ------------------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    @property
    def chat_template(self) -> str | None:
        if self.processor is not None:
            template = getattr(self.processor, "chat_template", None)
            if isinstance(template, str) and template:
                return template
        return tokenizer_chat_template(self.tokenizer)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        # A processor's template takes content as parts, text-only requests included.
        return super().apply_chat_template(
            as_parts(messages) if self.processor is not None else messages,
            tools,
            add_generation_prompt=add_generation_prompt,
        )

    @property
    def vision(self) -> VisionSupport | None:
        if self.processor is None:
            return None
        return VisionSupport(max_pixels=vision_max_pixels(getattr(self.processor, "image_processor", None)))

    def multimodal_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        images: Sequence[Any],
    ) -> MultimodalPrompt:
        template = self.chat_template
        if not template:
            raise NoChatTemplate(f"the model {self.config.model_name!r} has no chat template")
        text = render_chat_template(template, as_parts(messages), tools, self.special_tokens)
        try:
            # The rendered template holds its special tokens already (BOS included).
            inputs = self.processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
        except ValueError as exc:  # the placeholders and the images disagree (a literal <image> in the text)
            raise ValueError(f"the model's processor rejected the messages: {exc}") from None
        ids = [int(t) for t in inputs.pop("input_ids")[0]]
        image_tokens = sum(1 for t in ids if t == self._image_token_id)
        image_inputs = {k: v for k, v in inputs.items() if k in self._family.image_inputs}
        return MultimodalPrompt(ids, tuple(images), image_inputs, image_tokens)

    @property
    def special_tokens(self) -> dict[str, str]:
        return tokenizer_special_tokens(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "max_batch_size": self.targs.max_batch_size,
            "max_queue": self.targs.max_queue,
            "max_batch_tokens": self.token_budget,
            "prefill_chunk": self.targs.prefill_chunk,
            **({"vision_family": str(self.model.config.model_type)} if self.processor is not None else {}),
        }

    def check_capacity(self, sequences: int = 1) -> None:
        if self._dead is not None:  # the engine thread has stopped: nothing would ever answer
            raise Unavailable(f"{self._dead}; the predictor restarts", code="engine_dead")
        self.admission.check(sequences)

    # -- requests (event loop side) -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        import torch

        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_ids) + request.params.max_tokens > self._context:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)}) + max_tokens ({request.params.max_tokens}) "
                f"exceeds the context ({self._context})"
            )
        if request.multimodal is not None and self.processor is None:
            raise ValueError(f"the model {self.config.model_name!r} has no vision encoder")
        grammar = None
        if request.constraint is not None:
            if self._lltokenizer is None:
                raise ValueError("this model's tokenizer is not a fast tokenizer: output cannot be constrained")
            # Before the first await: an unenforceable schema is the response's 400, streamed or not.
            grammar = constraints.grammar_for(request.constraint)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(request.params.seed if request.params.seed is not None else random.getrandbits(63))
        adapter = request.adapter.name if request.adapter is not None else None
        if adapter is not None:
            self._adapter_users[adapter] += 1  # before loading: no other load may evict it from here on
        try:
            if request.adapter is not None:
                await asyncio.to_thread(self.load_adapter, request.adapter)
                metrics.ADAPTER_REQUESTS.labels(self.config.model_name, adapter).inc()
            seq = _Seq(request, asyncio.get_running_loop(), asyncio.Queue(), grammar, generator)
            stream = stream_from_engine_thread(self, self.admission, seq, self._incoming.put)
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    if adapter is not None:
                        metrics.ADAPTER_TOKENS.labels(self.config.model_name, adapter).inc(len(chunk.token_ids))
                    yield chunk
        finally:
            if adapter is not None:
                self._adapter_users[adapter] -= 1

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch = self._torch
        active: list[_Seq] = []
        waiting: deque[_Seq] = deque()  # taken from the incoming queue, not yet in the batch
        cache: Any = None
        mask: Any = None  # [rows, cache length] 1 = real token
        with torch.inference_mode():
            while not self._stopping:
                if not active and not waiting:
                    first = self._incoming.get()
                    if first is None:
                        break
                    waiting.append(first)
                    if self.targs.batch_wait_ms > 0:
                        time.sleep(self.targs.batch_wait_ms / 1000)  # let concurrent requests join the prefill
                self._take_incoming(waiting)
                arrivals = self._admit(active, waiting, 0 if mask is None else int(mask.shape[1]))
                metrics.QUEUE_DEPTH.labels(self.config.model_name).set(len(waiting) + self._incoming.qsize())
                stage = "prefill"
                hit: list[_Seq] = []  # the sequences an out-of-memory error failed in this step
                try:
                    if arrivals:
                        new_cache, new_mask = self._prefill(arrivals)
                        stage = "merge"
                        if active:
                            cache, mask = self._merge(cache, mask, new_cache, new_mask)
                        else:
                            cache, mask = new_cache, new_mask
                        new_cache = new_mask = None
                        active += arrivals
                    stage = "decode"
                    active, cache, mask = self._drop_done(active, cache, mask)
                    active, cache, mask = self._preempt_to_fit(active, cache, mask, waiting)
                    if active:
                        cache, mask = self._decode(active, cache, mask)
                        active, cache, mask = self._drop_done(active, cache, mask)
                except torch.OutOfMemoryError:
                    # A prefill builds its own cache: the running batch's is untouched and keeps going. A merge,
                    # a trim or a decode rebuilds the batch's cache layer by layer: it is lost, and so is the batch.
                    hit = arrivals if stage == "prefill" else list(dict.fromkeys(active + arrivals))
                    if stage != "prefill":
                        active, cache, mask = [], None, None
                    new_cache = new_mask = None
                except Exception as exc:  # a failed step fails its sequences, not the engine
                    logger.exception("generation step failed")
                    if isinstance(exc, torch.AcceleratorError):
                        # A device-side fault (illegal address, ECC, launch failure) poisons the CUDA context for
                        # the rest of the process: every later kernel fails too (torch 2.13 raises
                        # AcceleratorError for cudaError results, c10/cuda/CUDAException.h). Only a new process
                        # recovers: health() says so, readiness fails and the predictor exits. Set before the
                        # sequences hear of the failure, so that whoever they wake already sees the engine dead.
                        self._dead = f"the GPU reported an unrecoverable error: {exc}".splitlines()[0]
                    for seq in active + arrivals:
                        seq.send(RuntimeError(f"generation failed: {exc}"))
                    active, cache, mask = [], None, None
                    if self._dead is not None:
                        for seq in waiting:
                            seq.send(RuntimeError(self._dead))
                        waiting.clear()
                        break
                if hit:  # outside the handler: the traceback, and the tensors its frames hold, are gone now
                    self._out_of_memory(hit, stage)
        for seq in active + list(waiting):
            seq.send(RuntimeError("the engine is shutting down"))

    def health(self) -> str | None:
        return self._dead

    def _take_incoming(self, waiting: deque[_Seq]) -> None:
        """Move what has arrived to ``waiting``, without blocking; the stop marker stops the engine."""
        while True:
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._stopping = True
                return
            waiting.append(item)

    def _admit(self, active: list[_Seq], waiting: deque[_Seq], width: int) -> list[_Seq]:
        """The waiting sequences that join the batch now, first come first served, on what they use now:
        while the batch has fewer than ``max_batch_size`` rows and its padded cache with them (rows x the
        longest of ``width``, the running cache's length, and their prompts) can still grow by
        :data:`GROWTH_HEADROOM` a row within the token budget. The first that does not fit waits for rows to
        finish, and so does everything behind it (a long request is not starved). A sequence alone is
        always admitted: the context is capped at the budget."""
        arrivals: list[_Seq] = []
        rows = len(active)
        growth = max((s.growth for s in active), default=0)
        while waiting and rows < self.targs.max_batch_size:
            seq = waiting[0]
            if seq.abandoned:
                waiting.popleft()
                continue
            if self.token_budget is not None and rows:
                wider = max(width, len(seq.context_ids))
                if (rows + 1) * (wider + max(growth, seq.growth)) > self.token_budget:
                    break
            waiting.popleft()
            if self._start_matcher(seq):
                arrivals.append(seq)
                rows += 1
                width = max(width, len(seq.context_ids))
                growth = max(growth, seq.growth)
        return arrivals

    def _preempt_to_fit(
        self, active: list[_Seq], cache: Any, mask: Any, waiting: deque[_Seq]
    ) -> tuple[list[_Seq], Any, Any]:
        """Before a decode step: while the batch's cache one column longer would exceed the token budget,
        send its latest admitted sequence back to the head of ``waiting`` (its rows leave the cache; it is
        prefilled again from :attr:`_Seq.context_ids` when it fits), as vLLM's scheduler preempts the last of
        its running requests under the first-come policy (vllm/v1/core/sched/scheduler.py ``schedule`` and
        ``_preempt_request``, v0.32.0: blocks freed, ``num_computed_tokens`` reset, back to waiting). The
        oldest sequence is never preempted: alone it always fits."""
        if self.token_budget is None:
            return active, cache, mask
        while len(active) > 1 and len(active) * (int(mask.shape[1]) + 1) > self.token_budget:
            victim = active[-1]
            active, cache, mask = self._keep_rows(active, cache, mask, list(range(len(active) - 1)))
            waiting.appendleft(victim)
            metrics.PREEMPTIONS.labels(self.config.model_name).inc()
            logger.debug("preempted a sequence of %d tokens: the cache outgrew its budget", len(victim.context_ids))
        return active, cache, mask

    def _out_of_memory(self, hit: list[_Seq], stage: str) -> None:
        """Fail the sequences a CUDA out-of-memory error hit with a 503, then give the cached blocks back."""
        metrics.OUT_OF_MEMORY.labels(self.config.model_name).inc()
        logger.warning("out of GPU memory during %s: %d sequences fail with 503", stage, len(hit))
        for seq in hit:
            seq.finished = True
            seq.send(out_of_memory(stage))
        release_memory(self.device)  # gc.collect(), then torch.cuda.empty_cache() on CUDA

    def _forward(self, stage: str, seqs: list[_Seq], **inputs: Any) -> Any:
        if self.step_hook is not None:
            tokens = inputs["input_ids"] if "input_ids" in inputs else inputs["inputs_embeds"]
            rows, columns = tokens.shape[:2]
            self.step_hook(stage, int(rows), int(columns))
        with self._model_lock:
            if self._lora is None:
                return self.model(**inputs)
            # Each row through its own adapter's LoRA delta (slot 0: the base), all in one forward.
            slots = self._lora.slot_of
            self._lora.rows([slots[s.request.adapter.name] if s.request.adapter else 0 for s in seqs])
            try:
                return self.model(**inputs)
            finally:
                self._lora.rows(None)

    # -- LoRA adapters ----------------------------------------------------------------------------------

    @property
    def adapters_loaded(self) -> list[str]:
        """The resident adapters, least recently used first."""
        return list(self._adapters)

    def load_adapter(self, adapter: AdapterRef) -> bool:
        """Make ``adapter`` resident (a blocking call: run it off the event loop). False when it already was.

        Checked against the base before the model is touched (:func:`check_fits`: an :class:`AdapterMismatch`
        leaves the base serving as it was); the least recently used adapter no sequence uses is unloaded when
        ``max_loras`` are resident; when every one is in use, 503 until one finishes."""
        torch = self._torch
        with self._model_lock:
            if self._adapters.get(adapter.name) == adapter.path:
                self._adapters.move_to_end(adapter.name)
                return False
            started = time.monotonic()
            if self._linear_shapes is None:
                self._linear_shapes = {
                    name: (module.in_features, module.out_features)
                    for name, module in self.model.named_modules()
                    if isinstance(module, torch.nn.Linear)
                }
            check_fits(read_lora(adapter.path), self._linear_shapes)
            if adapter.name in self._adapters:  # a new version of the same name: the old one goes first
                self._unload(adapter.name)
            make_room(self._adapters, self._adapter_users, self.targs.max_loras, self._unload,
                      self.config.model_name)  # fmt: skip
            self._attach(adapter)
            self._adapters[adapter.name] = adapter.path
        elapsed = time.monotonic() - started
        metrics.ADAPTER_LOADS.labels(self.config.model_name, adapter.name).inc()
        metrics.ADAPTER_LOAD_SECONDS.labels(self.config.model_name, adapter.name).observe(elapsed)
        logger.info("LoRA adapter %s loaded from %s in %.2f s", adapter.name, adapter.path, elapsed)
        return True

    def unload_adapter(self, name: str) -> bool:
        """Unload ``name`` if resident and unused (an adapter removed from the model's list); False otherwise."""
        with self._model_lock:
            if name not in self._adapters or self._adapter_users[name] > 0:
                return False
            self._unload(name)
            return True

    def _attach(self, adapter: AdapterRef) -> None:
        """Put the adapter's matrices in a free slot (under the model lock)."""
        if self._lora is None:
            self._lora = BatchedLora(self.model, self.targs.max_loras, self._torch)
        try:
            matrices, _ = lora_matrices(adapter.path, self._torch)
        except AdapterMismatch:
            raise
        except Exception as exc:  # unreadable weights
            raise AdapterMismatch(f"the adapter's weights cannot be read: {exc}".splitlines()[0]) from exc
        self._lora.add(adapter.name, matrices)

    def _unload(self, name: str) -> None:
        """Free ``name``'s slot (under the model lock)."""
        assert self._lora is not None
        self._lora.remove(name)
        del self._adapters[name]
        logger.info("LoRA adapter %s unloaded", name)

    def _start_matcher(self, seq: _Seq) -> bool:
        """Give a constrained sequence its matcher; False (the sequence failed alone) if it cannot start."""
        if seq.grammar is not None:
            try:
                seq.matcher = constraints.matcher(self._lltokenizer, seq.grammar)
            except RuntimeError as exc:
                seq.send(exc)
                return False
        return True

    def _prefill(self, seqs: list[_Seq]) -> tuple[Any, Any]:
        torch = self._torch
        now = time.time_ns()
        for seq in seqs:  # the first prefill ends its wait (a preempted one's second is part of its generation)
            seq.prefill_started_ns = seq.prefill_started_ns or now
        width = max(len(s.context_ids) for s in seqs)
        pad = next(iter(self._eos), 0)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            prompt = seq.context_ids
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self._input_device), mask.to(self._input_device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Rows with images prefill from embeddings, the images' features in place of their image tokens;
        # the text rows beside them from their token embeddings (what input_ids would look up).
        embeds = self._prompt_embeddings(seqs, ids) if any(s.request.multimodal for s in seqs) else None
        # Chunks of columns, ``prefill_chunk`` tokens a step over all rows, each attending to the cache of
        # the chunks before it: the same attention as one pass, with activations bounded by the chunk.
        step = max(1, self.targs.prefill_chunk // len(seqs))
        cache: Any = None
        out: Any = None
        for start in range(0, width, step):
            end = min(width, start + step)
            past = {self._cache_kwarg: cache} if cache is not None else {}
            tokens = {"inputs_embeds": embeds[:, start:end]} if embeds is not None else {"input_ids": ids[:, start:end]}
            out = self._forward(
                "prefill",
                seqs,
                **tokens,
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                use_cache=True,
                logits_to_keep=1,
                **past,
            )
            cache = self._cache_of(out)
        metrics.PROMPT_TOKENS.labels(self.config.model_name).inc(int(mask.sum()))
        self._sample(seqs, out.logits[:, -1, :])
        return cache, mask

    def _prompt_embeddings(self, seqs: list[_Seq], ids: Any) -> Any:
        """The prompt embeddings of ``ids`` (left-padded rows of ``seqs``), each image row's image tokens
        replaced by its images' features from the vision tower (and projector or connector). The images of
        every row run through the tower in one pass when their inputs are alike (the same shape but for the
        family's image axis: LLaVA's fixed-size images, Idefics3's fixed-size tiles), joined along that
        axis; otherwise row by row."""
        torch = self._torch
        embeds = self.model.get_input_embeddings()(ids)
        rows = [(row, seq.request.multimodal.inputs) for row, seq in enumerate(seqs) if seq.request.multimodal]
        axis = self._family.image_axis

        def rest(value: Any) -> tuple[int, ...]:
            return (*value.shape[:axis], *value.shape[axis + 1 :])

        keys = set(rows[0][1])
        alike = all(set(inputs) == keys for _, inputs in rows) and all(
            len({rest(inputs[key]) for _, inputs in rows}) == 1 for key in keys
        )
        groups = [rows] if alike else [[row] for row in rows]
        for group in groups:
            joined = {key: torch.cat([inputs[key] for _, inputs in group], dim=axis) for key in keys}
            features = self._image_features(joined, embeds.dtype).to(embeds.device, embeds.dtype)
            # Features come in prompt order, row after row: each row takes as many as it has image tokens.
            counts = [int((ids[row] == self._image_token_id).sum()) for row, _ in group]
            if sum(counts) != features.shape[0]:
                raise ValueError(
                    f"the prompts have {sum(counts)} image tokens but their images give {features.shape[0]} features"
                )
            for (row, _), part in zip(group, features.split(counts), strict=True):
                embeds[row, ids[row] == self._image_token_id] = part
        return embeds

    def _image_features(self, inputs: dict[str, Any], dtype: Any) -> Any:
        """The images' features as one ``[image tokens, hidden]`` tensor, in prompt order (floating inputs
        in the model's ``dtype``; masks as they are)."""
        torch = self._torch
        moved = {
            key: value.to(self._input_device, dtype) if value.is_floating_point() else value.to(self._input_device)
            for key, value in inputs.items()
        }
        features = self.model.get_image_features(**moved)
        if hasattr(features, "pooler_output"):  # transformers 5: a model output, features in pooler_output
            features = features.pooler_output
        if isinstance(features, (list, tuple)):  # per image (LLaVA) or per batch row (Idefics3)
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1])

    def _decode(self, seqs: list[_Seq], cache: Any, mask: Any) -> tuple[Any, Any]:
        torch = self._torch
        ids = torch.tensor([[s.next_token] for s in seqs], dtype=torch.long, device=self._input_device)
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones((len(seqs), 1), dtype=mask.dtype, device=mask.device)], dim=1)
        out = self._forward(
            "decode",
            seqs,
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        metrics.BATCH_SIZE.labels(self.config.model_name).observe(len(seqs))
        self._sample(seqs, out.logits[:, -1, :])
        return self._cache_of(out), mask

    @staticmethod
    def _cache_of(out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _sample(self, seqs: list[_Seq], logits: Any) -> None:
        """Pick each sequence's next token from its row; send it; mark finished sequences."""
        torch = self._torch
        logits = logits.float()
        raw_logprobs = None
        if any(s.request.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1).cpu()  # the model's, before any constraint
        constrained = [row for row, s in enumerate(seqs) if s.matcher is not None and not (s.abandoned or s.finished)]
        if constrained:
            # One bitmask for every constrained row of this step, applied to the logits in one operation.
            masks = constraints.fill_masks([seqs[row].matcher for row in constrained], self._masks)
            constraints.apply_masks(logits, constrained, masks)
        for row, seq in enumerate(seqs):
            if seq.abandoned or seq.finished:
                seq.finished = True
                continue
            params = seq.request.params
            scores = logits[row].clone()
            if params.presence_penalty or params.frequency_penalty:
                if seq.counts is None:
                    seq.counts = torch.zeros_like(scores)
                scores -= params.frequency_penalty * seq.counts + params.presence_penalty * (seq.counts > 0).float()
            if params.ignore_eos:
                for eos in self._eos:
                    scores[eos] = float("-inf")
            if seq.matcher is not None and seq.matcher.is_error():
                seq.finished = True
                seq.send(constraints.matcher_failure(seq.matcher))
                continue
            token = self._pick(scores, params.temperature, params.top_p, seq.generator, params.top_k)
            seq.generated.append(token)
            if seq.counts is not None:
                seq.counts[token] += 1
            complete = False
            if seq.matcher is not None:
                seq.matcher.consume_token(token)
                complete = seq.matcher.is_stopped()
            lp, top = 0.0, []
            if raw_logprobs is not None and params.logprobs is not None:
                lp = float(raw_logprobs[row, token])
                if params.logprobs > 0:
                    values, indices = raw_logprobs[row].topk(params.logprobs)
                    top = list(zip(indices.tolist(), values.tolist(), strict=True))
            finish = None
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
            # A complete value ends at the EOS its mask now forces, or here when no EOS may or can follow.
            if token in stops or (complete and (params.ignore_eos or len(seq.generated) >= params.max_tokens)):
                finish = "stop"
            elif len(seq.generated) >= params.max_tokens:
                finish = "length"
            seq.next_token = token
            seq.finished = finish is not None
            metrics.TOKENS_GENERATED.labels(self.config.model_name).inc()
            seq.send((token, lp, top, finish))

    def _pick(self, scores: Any, temperature: float, top_p: float, generator: Any, top_k: int = 0) -> int:
        torch = self._torch
        if temperature <= 1e-5 or top_k == 1:
            return int(scores.argmax())
        if 0 < top_k < scores.shape[-1]:  # the k most likely only (then top_p within them, as vLLM orders them)
            kth = torch.topk(scores, top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            cut = cumulative - sorted_probs > top_p  # keep the smallest prefix reaching top_p
            sorted_probs[cut] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))

    # -- KV cache surgery -----------------------------------------------------------------------------

    def _merge(self, cache: Any, mask: Any, new_cache: Any, new_mask: Any) -> tuple[Any, Any]:
        """Stack two batches' caches, left-padding the shorter one so the last columns line up."""
        torch = self._torch
        from transformers.cache_utils import DynamicCache

        a_len, b_len = mask.shape[1], new_mask.shape[1]
        width = max(a_len, b_len)

        def pad(t: Any, extra: int) -> Any:
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[-2 if t.dim() == 4 else -1] = extra
            zeros = torch.zeros(shape, dtype=t.dtype, device=t.device)
            return torch.cat([zeros, t], dim=-2 if t.dim() == 4 else -1)

        layers = []
        # One layer at a time, each source layer let go of once copied: the peak is the cache plus one
        # layer, not two whole caches.
        for old, new in zip(cache.layers, new_cache.layers, strict=True):
            layers.append(
                (
                    torch.cat([pad(old.keys, width - a_len), pad(new.keys, width - b_len)]),
                    torch.cat([pad(old.values, width - a_len), pad(new.values, width - b_len)]),
                )
            )
            old.keys = old.values = new.keys = new.values = None
        merged_mask = torch.cat([pad(mask, width - a_len), pad(new_mask, width - b_len)])
        return DynamicCache(ddp_cache_data=layers, config=self.model.config), merged_mask

    def _drop_done(self, seqs: list[_Seq], cache: Any, mask: Any) -> tuple[list[_Seq], Any, Any]:
        """Remove finished and abandoned rows; trim columns that are padding in every remaining row."""
        for seq in seqs:
            if seq.abandoned and not seq.finished:
                seq.finished = True
        return self._keep_rows(seqs, cache, mask, [i for i, s in enumerate(seqs) if not s.finished])

    def _keep_rows(self, seqs: list[_Seq], cache: Any, mask: Any, keep: list[int]) -> tuple[list[_Seq], Any, Any]:
        """The batch of rows ``keep`` of ``seqs`` only; columns that are padding in every one of them trimmed."""
        torch = self._torch
        if len(keep) == len(seqs):
            return seqs, cache, mask
        if not keep:
            return [], None, None
        index = torch.tensor(keep, dtype=torch.long, device=mask.device)
        mask = mask.index_select(0, index)
        start = int((mask.sum(0) > 0).nonzero()[0])  # the first column any remaining row uses
        from transformers.cache_utils import DynamicCache

        layers = []
        for layer in cache.layers:  # one layer at a time, as in _merge; each on its own GPU when sharded
            rows = index.to(layer.keys.device)
            layers.append(
                (layer.keys.index_select(0, rows)[:, :, start:], layer.values.index_select(0, rows)[:, :, start:])
            )
            layer.keys = layer.values = None
        return [seqs[i] for i in keep], DynamicCache(ddp_cache_data=layers, config=self.model.config), mask[:, start:]
