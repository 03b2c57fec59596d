"""The engine interface: what the OpenAI layer needs from transformers, llama.cpp or vLLM.

An engine turns token ids into a stream of generated tokens. Everything OpenAI-specific (chat
templating policy, stop strings, ``n``, usage, tool calls, SSE) lives in :mod:`.service`, once, so the
three engines only differ where they really do:

* tokenizer and chat template: :meth:`Engine.tokenize`, :meth:`Engine.detokenize`,
  :attr:`Engine.chat_template` (rendered by :func:`render_chat_template` unless an engine overrides
  :meth:`Engine.apply_chat_template`), :attr:`Engine.context_length`, :attr:`Engine.vocab_size`,
  :attr:`Engine.eos_token_ids`;
* generation: :meth:`Engine.generate` takes a :class:`GenerationRequest` (prompt ids, a
  :class:`SamplingParams`, an optional :class:`JSONSchemaConstraint` or :class:`GrammarConstraint`) and yields
  :class:`GenerationChunk` objects. Closing the iterator (``aclose()``, or cancelling the task that
  drives it) must stop that sequence promptly and free its slot: that is how a client disconnect or
  a matched stop string ends generation;
* what it can do: :attr:`Engine.capabilities` (penalties, logprobs, constraints); the OpenAI layer
  answers 400 for what an engine cannot do, before calling it;
* images: :attr:`Engine.vision` says whether the loaded model has a vision part (None: a chat request with
  images gets a 400 naming the model, on every engine); a vision engine renders messages with images
  in :meth:`Engine.multimodal_prompt` into a :class:`MultimodalPrompt` (the prompt ids as it counts them,
  images expanded, and its own processed inputs), which reaches :meth:`Engine.generate` on
  :attr:`GenerationRequest.multimodal`. The OpenAI layer loads and checks the images first
  (``generation.chat_images``: data URLs, allowed http(s) URLs, the limits).

Engines are registered in :mod:`.engines` and chosen by ``--backend`` (``auto`` resolves there).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig
from universal_predictors.engine_args import NoEngineArgs
from universal_predictors.errors import InvalidRequest, RequestTooLarge
from universal_predictors.generation.adapters import AdapterRef

FinishReason = Literal["stop", "length"]


def beyond_capacity(sequences: int, capacity: int, limits: str) -> RequestTooLarge:
    """The 413 for a request of more sequences than the engine ever admits at once (``capacity``, set by
    the engine args named in ``limits``): waiting cannot help it, so it is not a 503 with Retry-After."""
    return RequestTooLarge(
        f"The request needs {sequences} sequences (prompts x n); this model admits at most {capacity} at once "
        f"({limits}). Send fewer prompts or a smaller n.",
        param="n",
        code="too_many_sequences",
    )


def no_vision(model_name: str, param: str | None = None) -> InvalidRequest:
    """The 400 for a chat request with images to a model without a vision part (any engine)."""
    return InvalidRequest(
        f"The model {model_name!r} has no vision encoder; send text only or serve a vision-language model "
        "(a model with an image processor: see docs/tasks/generate.md, Images in chat).",
        param=param,
        code="images_not_supported",
    )


class NoChatTemplate(Exception):
    """The model carries no chat template; chat requests get a 400 saying so."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine honours; the OpenAI layer rejects (400) what is not here."""

    penalties: bool = False  # presence_penalty / frequency_penalty
    logprobs: bool = False
    max_top_logprobs: int = 0  # the largest top_logprobs (0: only the chosen token's logprob)
    constraints: bool = True  # JSONSchemaConstraint and GrammarConstraint (response_format, tools, structured_outputs)
    adapters: bool = False  # LoRA adapters per request (GenerationRequest.adapter), several in one batch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one sequence. ``max_tokens`` is already clipped to the context.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible for that sequence alone,
    whatever else is batched with it. Generation ends with ``finish_reason="stop"`` on any of the
    engine's EOS ids or ``stop_token_ids`` (unless ``ignore_eos``), and ``"length"`` after
    ``max_tokens``. Stop *strings* are matched by the OpenAI layer, which closes the stream.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    #: Sample among the ``top_k`` most likely tokens only; 0: all (a request's ``top_k``, else the model's own
    #: generation defaults, see :func:`sampling_defaults`).
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: None: no logprobs; 0: the chosen token's logprob; k > 0: also the k most likely tokens.
    logprobs: int | None = None


@dataclass(frozen=True)
class JSONSchemaConstraint:
    """Constrained decoding: the output must be one JSON value matching ``schema``.

    ``schema=None`` means any JSON object (``response_format: json_object``). The OpenAI layer checks
    the schema once with llguidance (``constraints.check_schema``: a schema no engine can enforce exactly
    is a 400 on every engine); transformers and llama.cpp then mask each step's logits with llguidance,
    vLLM uses its own structured outputs. Once the value is complete the engine must end the sequence
    with ``finish_reason="stop"``.
    """

    schema: Mapping[str, Any] | None = None
    #: The request field the schema came from, named in the 400 when an engine cannot enforce it.
    param: str = "response_format"

    def schema_json(self) -> str:
        return json.dumps(self.schema if self.schema is not None else {"type": "object"})


@dataclass(frozen=True)
class GrammarConstraint:
    """Constrained decoding by a grammar other than a JSON schema (vLLM's ``structured_outputs`` kinds):

    * ``regex``: the whole output matches ``text``, a regular expression (Rust's ``regex`` syntax, no
      look-around or back-references);
    * ``choice``: the output is exactly one of ``choices``;
    * ``grammar``: the output is a sentence of ``text``, a Lark grammar (llguidance's dialect, with a
      ``start`` rule) or a GBNF grammar (llama.cpp's, with a ``root`` rule), converted as vLLM's guidance
      backend converts it.

    Every engine enforces it with llguidance (vLLM through its ``guidance`` backend), so one grammar means
    the same on all three; the OpenAI layer checks it once first (``constraints.check_constraint``). As
    with a schema, the engine ends the sequence with ``finish_reason="stop"`` once the grammar is complete.
    """

    kind: Literal["regex", "choice", "grammar"]
    text: str = ""
    choices: tuple[str, ...] = ()
    #: The request field it came from (``structured_outputs``, or a legacy ``guided_regex`` ...).
    param: str = "structured_outputs"

    def source(self) -> str:
        """llguidance's input for :attr:`kind`: the text, or the choices as a JSON list."""
        return json.dumps(list(self.choices)) if self.kind == "choice" else self.text


#: Any constraint an engine takes on :attr:`GenerationRequest.constraint`.
Constraint = JSONSchemaConstraint | GrammarConstraint


@dataclass(frozen=True)
class VisionSupport:
    """What the loaded model's vision part takes (:attr:`Engine.vision`)."""

    #: The most pixels an image is worth to the model's processor (its resize target): larger images are
    #: downscaled to this before processing, aspect ratio kept. None: the processor resizes on its own.
    max_pixels: int | None = None


@dataclass(frozen=True)
class MultimodalPrompt:
    """A chat prompt with images, as one vision engine prepared it (:meth:`Engine.multimodal_prompt`).

    ``prompt_ids`` are the ids the engine will run, each image's placeholder expanded into its image
    tokens: the context check and ``usage.prompt_tokens`` count them. ``images`` are the request's images
    in prompt order (RGB, already within the limits); ``inputs`` is the engine's own processed form
    (pixel values and their sizes for transformers, multimodal data for vLLM, ...), opaque to the OpenAI
    layer. One prompt is shared by the ``n`` choices of a request: engines must not mutate it.
    """

    prompt_ids: Sequence[int]
    images: tuple[Any, ...]  # PIL.Image.Image; Any so that this module does not import Pillow
    inputs: Any = None
    #: How many of ``prompt_ids`` stand for images (for the log and metrics; usage counts them all).
    image_tokens: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate (``n`` choices are ``n`` requests)."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    constraint: Constraint | None = None
    #: The prompt's images, when it has any (then ``prompt_ids`` is ``multimodal.prompt_ids``); only an
    #: engine whose :attr:`Engine.vision` is set is ever given one.
    multimodal: MultimodalPrompt | None = None
    #: The LoRA adapter to generate with (its files local); None: the base model. Only an engine whose
    #: :attr:`EngineCapabilities.adapters` is set is ever given one.
    adapter: AdapterRef | None = None


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and, when asked, the most likely alternatives (best first)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass
class GenerationChunk:
    """New tokens of one sequence.

    ``token_ids`` counts every generated token (an EOS that ended the sequence included, so usage is
    the tokenizer's true count); ``text`` is the decoded text they add (EOS and stop tokens add none;
    an incomplete UTF-8 sequence is held back until it completes); ``logprobs`` has one entry per token
    in ``token_ids`` when asked for; ``finish_reason`` is set on the last chunk only.
    """

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    #: On a sequence's first chunk, when the engine began its prefill (``time.time_ns()``), where the engine says
    #: (transformers, llama.cpp): the end of its wait in the queue, in its trace (:mod:`universal_predictors.tracing`).
    prefill_started_ns: int | None = None


#: Sampling defaults a model may publish, and their bounds: ``generation_config.json``'s ``temperature``, ``top_p``,
#: ``top_k`` (what ``vllm serve`` applies with its default ``generation_config="auto"``: vllm 0.32
#: vllm/config/model.py get_diff_sampling_param) or a GGUF's ``general.sampling.temp``/``top_p``/``top_k`` (what
#: llama-server applies: llama.cpp in llama-cpp-python 0.3.36, common/common.cpp, LLAMA_MODEL_META_KEY_SAMPLING_*).
#: Penalties, ``min_p`` and the rest have no request field here and are not applied.
SAMPLING_DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0),
                                                           "top_k": (0.0, 1e9)}  # fmt: skip


def sampling_defaults(published: Mapping[str, Any]) -> dict[str, float]:
    """The usable sampling defaults among ``published`` (names as in ``generation_config.json``): numbers in range
    only; anything else (a string, a bound exceeded) is ignored, as the request's own value would be refused."""
    out: dict[str, float] = {}
    for key, (low, high) in SAMPLING_DEFAULT_BOUNDS.items():
        value = published.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if low <= float(value) <= high:
            out[key] = float(value)
    return out


class Engine(ABC):
    """A loaded model that generates. Subclasses set ``backend``, ``EngineArgs``, ``capabilities``."""

    backend: ClassVar[Backend]
    #: Engine arguments (``--engine-arg k=v``), validated at start-up; unknown keys stop the process.
    EngineArgs: ClassVar[type[BaseModel]] = NoEngineArgs
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()

    def __init__(self, config: PredictorConfig, args: BaseModel) -> None:
        self.config = config
        self.args = args
        #: The most images one chat request may carry (the OpenAI layer's ``max_images`` engine arg, which
        #: enforces it), set by the task before :meth:`load` for an engine that sizes itself by it (vLLM's
        #: ``limit_mm_per_prompt``); None when not told.
        self.max_images: int | None = None
        #: The model's own sampling defaults (:func:`sampling_defaults`), applied where a request is silent; set by
        #: :meth:`load`.
        self.sampling_defaults: dict[str, float] = {}

    @classmethod
    def supports(cls, config: PredictorConfig) -> bool:
        """Whether ``auto`` may pick this engine for ``config`` (architecture, hardware)."""
        return True

    # -- lifecycle (blocking; called from a worker thread) --------------------------------------------

    @abstractmethod
    def load(self) -> None:
        """Load weights and tokenizer; afterwards every property below is usable."""

    @abstractmethod
    def unload(self) -> None:
        """Stop generating, drop the model, give memory back (``torch.cuda.empty_cache()`` on CUDA)."""

    # -- tokenizer ------------------------------------------------------------------------------------

    @property
    @abstractmethod
    def context_length(self) -> int:
        """The most tokens (prompt + output) one sequence may hold."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """How many token ids the model has (valid ids are ``0 .. vocab_size - 1``); prompts given as
        token ids are checked against it."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a sequence."""

    @abstractmethod
    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Text to ids; ``add_special_tokens`` adds BOS as the model expects (completions: True;
        a rendered chat template already contains its special tokens: False)."""

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Ids to text, special tokens skipped."""

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs."""
        return self.detokenize([token_id])

    def token_pieces(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's strings for ``token_ids`` (``/tokenize``'s ``token_strs``): the tokenizer's own
        pieces where it has them (``convert_ids_to_tokens``, as vLLM answers), else each token's text."""
        convert = getattr(getattr(self, "tokenizer", None), "convert_ids_to_tokens", None)
        if convert is not None:
            return [str(piece) for piece in convert(list(token_ids))]
        return [self.token_text(token_id) for token_id in token_ids]

    @property
    @abstractmethod
    def chat_template(self) -> str | None:
        """The model's Jinja chat template (tokenizer config or GGUF metadata), or None."""

    @property
    def special_tokens(self) -> dict[str, str]:
        """Names the chat template may use: ``bos_token``, ``eos_token``."""
        return {}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for ``messages``, the generation prompt appended unless ``add_generation_prompt`` is
        false; NoChatTemplate if the model has no template."""
        template = self.chat_template
        if not template:
            raise NoChatTemplate(f"the model {self.config.model_name!r} has no chat template")
        return render_chat_template(
            template, messages, tools, self.special_tokens, add_generation_prompt=add_generation_prompt
        )

    # -- images ---------------------------------------------------------------------------------------

    @property
    def vision(self) -> VisionSupport | None:
        """The loaded model's vision part; None for a text-only model (the default): chat requests with
        images then get :func:`no_vision` (400) before any image is fetched or decoded."""
        return None

    def multimodal_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        images: Sequence[Any],
    ) -> MultimodalPrompt:
        """The prompt for ``messages`` with the generation prompt appended, where a message's content may be
        a list of Hugging Face parts, ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, each image
        part standing for the next of ``images`` (PIL RGB images, in order). The engine renders its chat
        template with its image placeholders and prepares the images (blocking: called on a worker thread).
        NoChatTemplate without a template; ValueError for messages it cannot take (a 400). Only called when
        :attr:`vision` is set."""
        raise NoChatTemplate(f"the model {self.config.model_name!r} takes no images")

    # -- generation -----------------------------------------------------------------------------------

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the sequence's tokens. Must not block the event loop. Closing the iterator stops the
        sequence. Raises ValueError for a request the engine cannot take (it becomes a 400)."""

    def check_capacity(self, sequences: int = 1) -> None:
        """Raise ``errors.Unavailable`` (503 with Retry-After) when ``sequences`` more cannot be queued
        now, and :func:`beyond_capacity` (413) when they could never be, even on an idle engine.

        The OpenAI layer calls it while planning; an engine with a bounded queue must also check and
        count a sequence in ``generate`` before its first ``await`` (the OpenAI layer starts a stream's
        sequences, and sends the 200, only once each has passed that point), so concurrent requests get
        a real 503 rather than an error event after a 200. The default accepts everything (engines
        without a bounded queue). Such an engine also keeps ``metrics.QUEUE_DEPTH`` at the number of
        admitted sequences still waiting for the model."""
        return None

    def describe(self) -> dict[str, Any]:
        """Extra fields for ``/openai/v1/models`` (the OpenAI layer adds ``context_length``)."""
        return {}

    def load_adapter(self, adapter: AdapterRef) -> bool:
        """Make the LoRA ``adapter`` resident (blocking: run it off the event loop); False when it already was.
        An engine whose :attr:`EngineCapabilities.adapters` is set implements it; :class:`AdapterMismatch` when
        the adapter does not fit the base, ``errors.Unavailable`` when no room can be made now."""
        raise InvalidRequest(f"the {self.backend.value} backend does not serve LoRA adapters", param="model")

    def unload_adapter(self, name: str) -> bool:
        """Unload ``name`` if resident and unused; False otherwise."""
        return False

    def health(self) -> str | None:
        """None while the loaded engine can still generate; otherwise why it cannot (its engine process
        died, a sticky device error). Cheap and non-blocking: readiness and the predictor's health watch
        call it on the event loop, and a reason makes the predictor unready and exit."""
        return None


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 (byte-level BPE
    splits characters across tokens). Decodes only the last few tokens each step, not the sequence."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ids: list[int] = []
        self._prefix = 0  # start of the already-emitted context decoded alongside the new ids
        self._read = 0  # ids before this are emitted

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        before = self.engine.detokenize(self.ids[self._prefix : self._read])
        after = self.engine.detokenize(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet, or the rest of a character is still to come
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end), as decoded."""
        before = self.engine.detokenize(self.ids[self._prefix : self._read])
        after = self.engine.detokenize(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


def tokenizer_chat_template(tokenizer: Any) -> str | None:
    """A Hugging Face tokenizer's chat template (the default one when it names several), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def tokenizer_special_tokens(tokenizer: Any) -> dict[str, str]:
    """The BOS/EOS text a chat template may refer to, from a Hugging Face tokenizer."""
    return {"bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or ""}


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    special_tokens: Mapping[str, str],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render a Hugging Face-style chat template in a sandbox (as transformers does)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template rejected the messages: {exc}") from None
