"""The transformers engine: continuous batching of every active sequence on one engine thread.

Each step runs ONE forward pass for all active sequences: new arrivals are prefilled together
(left-padded) and their KV cache merged into the running batch; then every sequence decodes one token
per step. Rows are left-padded to a common length and the attention mask hides the padding, so a
sequence sees exactly the tokens it would see alone. Finished or abandoned sequences leave the batch
at the next step (their rows dropped from the cache). Tokens go back to each request's asyncio queue
with ``call_soon_threadsafe``: the event loop never waits on the model.
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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from universal_predictors import metrics
from universal_predictors.config import Backend, PredictorConfig
from universal_predictors.devices import detect_device, dtype_for, release_memory
from universal_predictors.errors import Unavailable
from universal_predictors.generation import constraints
from universal_predictors.generation.engine import (
    Engine,
    EngineCapabilities,
    GenerationChunk,
    GenerationRequest,
    beyond_capacity,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)
from universal_predictors.generation.engines.common import drain_tokens

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


@dataclass(eq=False)
class _Seq:
    """One sequence in the engine thread's batch."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    grammar: str | None  # llguidance grammar of the constraint, checked before admission
    generator: Any  # torch.Generator
    matcher: Any = None  # llguidance.LLMatcher, made on the engine thread when the sequence arrives
    generated: list[int] = field(default_factory=list)
    counts: Any = None  # per-token counts for penalties (a tensor), lazily
    next_token: int | None = None  # sampled, not yet in the KV cache
    abandoned: bool = False  # set from the event loop when the consumer goes away
    finished: bool = False

    def send(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is listening
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class TransformersEngine(Engine):
    """A causal LM from a Hugging Face directory, served with continuous batching."""

    backend = Backend.TRANSFORMERS
    EngineArgs = TransformersArgs
    capabilities = EngineCapabilities(penalties=True, logprobs=True, max_top_logprobs=20, constraints=True)

    def __init__(self, config: PredictorConfig, args: BaseModel) -> None:
        super().__init__(config, args)
        assert isinstance(args, TransformersArgs)
        self.targs = args
        self._incoming: queue.SimpleQueue[_Seq | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.device = "cpu"
        #: Sequences admitted and not yet finished (running + waiting); only touched on the event loop.
        self._outstanding = 0

    # -- lifecycle ------------------------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        source = Path(self.config.source)
        self.device = detect_device(self.targs.device)
        dtype = dtype_for(self.device, self.targs.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, local_files_only=True, attn_implementation=self.targs.attn_implementation
        )
        self.model: Any = model.to(self.device)
        self.model.eval()
        eos: set[int] = set()
        with contextlib.suppress(OSError):
            gen = GenerationConfig.from_pretrained(source, local_files_only=True)
            ids = gen.eos_token_id
            eos.update(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos = frozenset(eos)
        limits = [getattr(self.model.config, "max_position_embeddings", None), self.targs.max_model_len]
        self._context = min(x for x in limits if x) if any(limits) else 2048
        self._vocab = int(self.model.config.vocab_size)
        # The logits width (config.vocab_size) may exceed the tokenizer's: llguidance masks the rest.
        self._lltokenizer: Any = None
        try:
            self._lltokenizer = constraints.hf_tokenizer(self.tokenizer, self._vocab, sorted(self._eos))
        except ValueError as exc:  # a slow (Python) tokenizer: constrained requests get a 400
            logger.warning("constrained decoding unavailable for this tokenizer: %s", exc)
        self._masks = constraints.allocate_masks(self.targs.max_batch_size, self._vocab)
        self._torch = torch
        # transformers renamed ``past_key_values`` to ``cache``; pass whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.config.model_name}", daemon=True)
        self._thread.start()
        logger.info("transformers engine on %s (%s), context %d", self.device, dtype, self._context)

    def unload(self) -> None:
        self._stopping = True
        self._incoming.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        for name in ("model", "tokenizer"):
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
        return tokenizer_chat_template(self.tokenizer)

    @property
    def special_tokens(self) -> dict[str, str]:
        return tokenizer_special_tokens(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def describe(self) -> dict[str, Any]:
        return {"device": self.device, "max_batch_size": self.targs.max_batch_size, "max_queue": self.targs.max_queue}

    def check_capacity(self, sequences: int = 1) -> None:
        capacity = self.targs.max_batch_size + self.targs.max_queue
        if sequences > capacity:
            raise beyond_capacity(sequences, capacity, "engine args max_batch_size + max_queue")
        if self._outstanding + sequences > capacity:
            waiting = max(0, self._outstanding - self.targs.max_batch_size)
            raise Unavailable(
                f"The model is overloaded ({waiting} sequences waiting); retry shortly.", code="overloaded"
            )

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
        grammar = None
        if request.constraint is not None:
            if self._lltokenizer is None:
                raise ValueError("this model's tokenizer is not a fast tokenizer: output cannot be constrained")
            # Before the first await: an unenforceable schema is the response's 400, streamed or not.
            grammar = constraints.grammar_for(request.constraint)
        # Admit before the first await, so that concurrent requests cannot all pass the check at once.
        self.check_capacity(1)
        self._outstanding += 1
        try:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(request.params.seed if request.params.seed is not None else random.getrandbits(63))
            seq = _Seq(request, asyncio.get_running_loop(), asyncio.Queue(), grammar, generator)
            self._incoming.put(seq)
        except BaseException:
            self._outstanding -= 1
            raise
        try:
            async with contextlib.aclosing(drain_tokens(self, seq.out, request.params.logprobs is not None)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            seq.abandoned = True  # the engine thread drops it at its next step
            self._outstanding -= 1

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch = self._torch
        active: list[_Seq] = []
        cache: Any = None
        mask: Any = None  # [rows, cache length] 1 = real token
        with torch.inference_mode():
            while not self._stopping:
                arrivals: list[_Seq] = []
                if not active:
                    first = self._incoming.get()
                    if first is None:
                        break
                    arrivals.append(first)
                    if self.targs.batch_wait_ms > 0:
                        time.sleep(self.targs.batch_wait_ms / 1000)  # let concurrent requests join the prefill
                while len(active) + len(arrivals) < self.targs.max_batch_size:
                    try:
                        item = self._incoming.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        self._stopping = True
                        break
                    arrivals.append(item)
                arrivals = [s for s in arrivals if not s.abandoned and self._start_matcher(s)]
                metrics.QUEUE_DEPTH.labels(self.config.model_name).set(self._incoming.qsize())
                try:
                    if arrivals:
                        new_cache, new_mask = self._prefill(arrivals)
                        if active:
                            cache, mask = self._merge(cache, mask, new_cache, new_mask)
                        else:
                            cache, mask = new_cache, new_mask
                        active += arrivals
                    active, cache, mask = self._drop_done(active, cache, mask)
                    if active:
                        cache, mask = self._decode(active, cache, mask)
                        active, cache, mask = self._drop_done(active, cache, mask)
                except Exception as exc:  # a failed step fails its sequences, not the engine
                    logger.exception("generation step failed")
                    for seq in active + arrivals:
                        seq.send(RuntimeError(f"generation failed: {exc}"))
                    active, cache, mask = [], None, None
        for seq in active:
            seq.send(RuntimeError("the engine is shutting down"))

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
        width = max(len(s.request.prompt_ids) for s in seqs)
        pad = next(iter(self._eos), 0)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            prompt = list(seq.request.prompt_ids)
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        metrics.PROMPT_TOKENS.labels(self.config.model_name).inc(int(mask.sum()))
        self._sample(seqs, out.logits[:, -1, :])
        return self._cache_of(out), mask

    def _decode(self, seqs: list[_Seq], cache: Any, mask: Any) -> tuple[Any, Any]:
        torch = self._torch
        ids = torch.tensor([[s.next_token] for s in seqs], dtype=torch.long, device=self.device)
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones((len(seqs), 1), dtype=mask.dtype, device=mask.device)], dim=1)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache}
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
            token = self._pick(scores, params.temperature, params.top_p, seq.generator)
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

    def _pick(self, scores: Any, temperature: float, top_p: float, generator: Any) -> int:
        torch = self._torch
        if temperature <= 1e-5:
            return int(scores.argmax())
        probs = torch.softmax(scores / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            cut = cumulative - sorted_probs > top_p  # keep the smallest prefix reaching top_p
            sorted_probs[cut] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))

    # -- KV cache surgery -----------------------------------------------------------------------------

    def _layers(self, cache: Any) -> list[tuple[Any, Any]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

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

        layers = [
            (
                torch.cat([pad(k1, width - a_len), pad(k2, width - b_len)]),
                torch.cat([pad(v1, width - a_len), pad(v2, width - b_len)]),
            )
            for (k1, v1), (k2, v2) in zip(self._layers(cache), self._layers(new_cache), strict=True)
        ]
        merged_mask = torch.cat([pad(mask, width - a_len), pad(new_mask, width - b_len)])
        return DynamicCache(ddp_cache_data=layers, config=self.model.config), merged_mask

    def _drop_done(self, seqs: list[_Seq], cache: Any, mask: Any) -> tuple[list[_Seq], Any, Any]:
        """Remove finished and abandoned rows; trim columns that are padding in every remaining row."""
        torch = self._torch
        for seq in seqs:
            if seq.abandoned and not seq.finished:
                seq.finished = True
        keep = [i for i, s in enumerate(seqs) if not s.finished]
        if len(keep) == len(seqs):
            return seqs, cache, mask
        if not keep:
            return [], None, None
        index = torch.tensor(keep, dtype=torch.long, device=mask.device)
        mask = mask.index_select(0, index)
        start = int((mask.sum(0) > 0).nonzero()[0])  # the first column any remaining row uses
        from transformers.cache_utils import DynamicCache

        layers = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self._layers(cache)
        ]
        return [seqs[i] for i in keep], DynamicCache(ddp_cache_data=layers, config=self.model.config), mask[:, start:]
