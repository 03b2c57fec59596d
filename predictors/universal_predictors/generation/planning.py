"""Turning an OpenAI request into engine requests: capability checks, prompts (chat templates, token-id
prompts), the context check, sampling parameters per choice (``n``, per-choice seeds), and the constraint
``response_format``, a forced tool choice or ``structured_outputs`` needs. Every refusal happens here, before any
generation starts."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from universal_predictors.errors import InvalidRequest
from universal_predictors.generation.engine import (
    Constraint,
    Engine,
    GenerationRequest,
    GrammarConstraint,
    JSONSchemaConstraint,
    MultimodalPrompt,
    NoChatTemplate,
    SamplingParams,
    no_vision,
)
from universal_predictors.generation.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Message,
    NamedToolChoice,
    SamplingFields,
    TokenizeRequest,
    Tool,
)

#: ``max_tokens`` when a completions request names none (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: The most top-logprob entries one request may ask for: choices x tokens (``max_tokens``, clipped to the
#: context) x ``top_logprobs``. Each entry is ~30-50 bytes of JSON and more as Python objects: a 152-byte
#: body of ``n=16, max_tokens=1000, top_logprobs=20`` made responses of 9 MiB and left GBs of RSS behind.
#: 65,536 is ``top_logprobs=20`` over 3,276 tokens of one choice (or 16 choices of 204 tokens): a few MiB.
MAX_LOGPROB_ENTRIES = 65_536
#: Characters one token can stand for at most, for the size check before tokenizing: a prompt of more than
#: ``context_length`` x this many characters cannot fit, whatever the tokenizer (vocabularies' longest
#: tokens are runs of 16-128 spaces or symbols; this leaves twice the longest). A 15 MiB prompt took the
#: tokenizer 20 s on the event loop to reach the same 400.
MAX_CHARS_PER_TOKEN = 256


@dataclass(frozen=True)
class _MessagesAndTools:
    """A request's ``messages`` and ``tools``: what :meth:`RequestPlanner.chat_messages` reads of any request."""

    messages: Sequence[Message]
    tools: Sequence[Tool] | None


@dataclass
class Plan:
    """A validated request, ready to run: one entry per choice."""

    prompts: list[list[int]]  # per prompt
    jobs: list[tuple[int, GenerationRequest]]  # (prompt index, request) per choice
    stops: list[str]
    prompt_tokens: int
    #: The model name the answer carries: the request's adapter (``base:adapter``); None: the base's name.
    model: str | None = None


def context_error(context: int, prompt: int, requested: int | None) -> InvalidRequest:
    asked = f" and {requested} tokens requested for the completion" if requested else ""
    return InvalidRequest(
        f"This model's maximum context length is {context} tokens. However, the prompt is {prompt} tokens{asked}; "
        f"at least one token must remain for the completion. Shorten the prompt.",
        param="messages",
        code="context_length_exceeded",
    )


def tool_constraint(body: ChatCompletionRequest) -> tuple[JSONSchemaConstraint | None, str | None]:
    """The constraint a forced tool choice needs, and the forced function's name (named choice)."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None, None
    if not body.tools:
        raise InvalidRequest("tool_choice: needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        for tool in body.tools:
            if tool.function.name == choice.function.name:
                return JSONSchemaConstraint(tool.function.parameters, param="tools"), tool.function.name
        raise InvalidRequest(f"tool_choice: no tool named {choice.function.name!r}", param="tool_choice")
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": t.function.parameters,
            },
            "required": ["name", "arguments"],
        }
        for t in body.tools
    ]
    return JSONSchemaConstraint(options[0] if len(options) == 1 else {"anyOf": options}, param="tools"), None


@contextlib.contextmanager
def _template_errors() -> Iterator[None]:
    """A chat template's refusals as 400s."""
    try:
        yield
    except NoChatTemplate as exc:
        raise InvalidRequest(
            f"{exc}; use /v1/completions with a prompt instead", param="messages", code="chat_template_missing"
        ) from None
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="messages") from None


class RequestPlanner:
    """Validates chat and completions requests against one engine and plans their choices."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _check_capabilities(self, body: SamplingFields, logprobs: int | None) -> None:
        caps = self.engine.capabilities
        backend = self.engine.backend.value
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) and not caps.penalties:
                raise InvalidRequest(f"{name}: the {backend} backend does not support penalties", param=name)
        if logprobs is not None:
            if not caps.logprobs:
                raise InvalidRequest(f"logprobs: the {backend} backend does not return logprobs", param="logprobs")
            if logprobs > caps.max_top_logprobs:
                raise InvalidRequest(
                    f"top_logprobs: at most {caps.max_top_logprobs} on the {backend} backend", param="top_logprobs"
                )

    def _params(
        self, body: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None, choice: int
    ) -> SamplingParams:
        context = self.engine.context_length
        if prompt_len >= context:
            raise context_error(context, prompt_len, max_tokens)
        remaining = context - prompt_len
        seed = body.seed + choice if body.seed is not None else None
        # Where the request is silent, the model's own defaults (Engine.sampling_defaults), then OpenAI's.
        defaults = self.engine.sampling_defaults
        return SamplingParams(
            max_tokens=min(max_tokens, remaining) if max_tokens is not None else remaining,
            temperature=defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
            top_p=defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
            top_k=int(defaults.get("top_k", 0)) if body.top_k is None else max(body.top_k, 0),
            seed=seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
        )

    def _plan(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        constraint: Constraint | None,
        multimodal: MultimodalPrompt | None = None,
    ) -> Plan:
        if constraint is not None and not self.engine.capabilities.constraints:
            raise InvalidRequest(
                f"{constraint.param}: the {self.engine.backend.value} backend cannot constrain output",
                param=constraint.param,
            )
        if constraint is not None:
            self.check_constraint(constraint)
        jobs = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                params = self._params(body, len(ids), max_tokens, logprobs, i)
                jobs.append((p, GenerationRequest(uuid.uuid4().hex, ids, params, constraint, multimodal)))
        if logprobs:
            self._check_logprob_entries(body, [job.params.max_tokens for _, job in jobs], logprobs)
        self.engine.check_capacity(len(jobs))  # overload: a 503 before any stream starts
        return Plan(prompts, jobs, body.stops(), sum(len(ids) for ids in prompts))

    @staticmethod
    def _check_logprob_entries(body: SamplingFields, max_tokens: list[int], top: int) -> None:
        """400 when the choices' tokens x ``top`` exceed :data:`MAX_LOGPROB_ENTRIES`, before generating."""
        entries = sum(max_tokens) * top
        if entries <= MAX_LOGPROB_ENTRIES:
            return
        param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise InvalidRequest(
            f"{param}: n x max_tokens x {param} is {entries} logprob entries ({len(max_tokens)} choices of up to "
            f"{max(max_tokens)} tokens, max_tokens clipped to the context, x {top}); at most {MAX_LOGPROB_ENTRIES} "
            f"are returned for one request. Lower max_tokens, n or {param}.",
            param=param,
            code="too_many_logprobs",
        )

    # -- counts and sizes on the raw JSON, before model validation and the tokenizer ----------------------

    def check_prompt_chars(self, chars: int, what: str, param: str = "prompt") -> None:
        """400 ``context_length_exceeded`` when ``chars`` characters cannot fit the context."""
        context = self.engine.context_length
        if chars > context * MAX_CHARS_PER_TOKEN:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens, at most {context * MAX_CHARS_PER_TOKEN} "
                f"characters ({MAX_CHARS_PER_TOKEN} per token at most); {what} is {chars} characters. "
                "Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def precheck_chat(self, data: dict[str, Any]) -> None:
        """Refuse by count and size before validation: more messages than the context has tokens (every
        chat template spends at least one token on a message), or more text than it could hold."""
        messages = data.get("messages")
        if not isinstance(messages, list):
            return
        context = self.engine.context_length
        if len(messages) > context:
            raise InvalidRequest(
                f"messages: {len(messages)} messages; this model's maximum context length is {context} tokens and "
                "every message takes at least one. Send fewer messages.",
                param="messages",
                code="context_length_exceeded",
            )
        chars = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        self.check_prompt_chars(chars, "the messages' text", param="messages")

    def precheck_responses(self, data: dict[str, Any]) -> None:
        """:meth:`precheck_chat` for a Responses request: its ``input`` items and their text (and ``instructions``)."""
        items = data.get("input")
        if isinstance(items, str):
            self.check_prompt_chars(len(items), "the input", param="input")
            return
        if not isinstance(items, list):
            return
        context = self.engine.context_length
        if len(items) > context:
            raise InvalidRequest(
                f"input: {len(items)} items; this model's maximum context length is {context} tokens and every item "
                "takes at least one. Send fewer items.",
                param="input",
                code="context_length_exceeded",
            )
        instructions = data.get("instructions")
        chars = len(instructions) if isinstance(instructions, str) else 0
        for item in items:
            if not isinstance(item, dict):
                continue
            for key in ("content", "output", "arguments"):
                value = item.get(key)
                if isinstance(value, str):
                    chars += len(value)
                elif isinstance(value, list):
                    chars += sum(len(p.get("text") or "") for p in value if isinstance(p, dict) and
                                 isinstance(p.get("text"), str))  # fmt: skip
        self.check_prompt_chars(chars, "the input's text", param="input")

    def precheck_messages(self, data: dict[str, Any]) -> None:
        """:meth:`precheck_chat` for an Anthropic Messages request: its turns, their text blocks and ``system``."""
        turns = data.get("messages")
        if not isinstance(turns, list):
            return
        context = self.engine.context_length
        if len(turns) > context:
            raise InvalidRequest(
                f"messages: {len(turns)} messages; this model's maximum context length is {context} tokens and every "
                "message takes at least one. Send fewer messages.",
                param="messages",
                code="context_length_exceeded",
            )
        system = data.get("system")
        chars = len(system) if isinstance(system, str) else 0
        for turn in turns:
            content = turn.get("content") if isinstance(turn, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for block in content:
                    if isinstance(block, dict):
                        text = block.get("text") if block.get("type") == "text" else block.get("content")
                        chars += len(text) if isinstance(text, str) else 0
        self.check_prompt_chars(chars, "the messages' text", param="messages")

    def precheck_completion(self, data: dict[str, Any]) -> None:
        """Refuse by count and size before validation and the tokenizer: more prompts x ``n`` than the
        engine ever admits (413), token ids or text beyond the context (400)."""
        prompt = data.get("prompt")
        n = data.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16 else 1
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "the prompt")
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            self.engine.check_capacity(len(prompt) * n)
            self.check_prompt_chars(max(len(p) if isinstance(p, str) else 0 for p in prompt), "the longest prompt")
        elif isinstance(prompt, list) and len(prompt) >= self.engine.context_length:
            max_tokens = data.get("max_tokens")
            raise context_error(
                self.engine.context_length, len(prompt), max_tokens if isinstance(max_tokens, int) else None
            )

    def check_constraint(self, constraint: Constraint) -> None:
        """A 400 naming the field when no engine could enforce the schema or grammar exactly: one verdict on
        every engine (vLLM's own backend would silently ignore what it lacks). Linear in the schema and cached,
        but a large schema costs milliseconds: the service calls it on a worker thread first."""
        if isinstance(constraint, JSONSchemaConstraint) and constraint.schema is None:
            return
        if not self.engine.capabilities.constraints:
            raise InvalidRequest(
                f"{constraint.param}: the {self.engine.backend.value} backend cannot constrain output",
                param=constraint.param,
            )
        from universal_predictors.generation.constraints import check_constraint

        try:
            check_constraint(constraint)
        except ValueError as exc:
            raise InvalidRequest(f"{constraint.param}: {exc}", param=constraint.param) from None

    @staticmethod
    def structured_constraint(body: SamplingFields) -> Constraint | None:
        """The constraint of ``structured_outputs`` (or a legacy ``guided_*`` field), if the request has one."""
        so = body.structured_outputs
        if so is None:
            return None
        param = body.structured_param()
        kind = so.kind
        if kind == "json":
            assert isinstance(so.json_schema, dict)  # a string was parsed by the model
            return JSONSchemaConstraint(so.json_schema, param=param)
        if kind == "json_object":
            return JSONSchemaConstraint(None, param=param)
        if kind == "choice":
            assert so.choice is not None
            return GrammarConstraint("choice", choices=tuple(so.choice), param=param)
        if kind == "regex":
            assert so.regex is not None
            return GrammarConstraint("regex", text=so.regex, param=param)
        assert so.grammar is not None
        return GrammarConstraint("grammar", text=so.grammar, param=param)

    @staticmethod
    def chat_constraint(body: ChatCompletionRequest) -> tuple[Constraint | None, str | None]:
        """The constraint of a chat request (a forced tool, else ``response_format``, else ``structured_outputs``)
        and the forced function's name when ``tool_choice`` names one. Two of them at once is a 400: which one
        would win is not something a caller should have to guess."""
        constraint: Constraint | None
        constraint, forced = tool_constraint(body)
        structured = RequestPlanner.structured_constraint(body)
        formatted = body.response_format is not None and body.response_format.type != "text"
        if structured is not None and (constraint is not None or formatted):
            other = "tool_choice" if constraint is not None else "response_format"
            raise InvalidRequest(
                f"{structured.param}: cannot be combined with {other}; give one constraint on the output",
                param=structured.param,
            )
        if constraint is None and body.response_format is not None:
            if body.response_format.type == "json_object":
                constraint = JSONSchemaConstraint(None)
            elif body.response_format.type == "json_schema":
                assert body.response_format.json_schema is not None
                constraint = JSONSchemaConstraint(body.response_format.json_schema.schema_ or {"type": "object"})
        return constraint or structured, forced

    @staticmethod
    def chat_messages(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools as a chat template takes them; a message with images has its content as
        Hugging Face parts (``{"type": "image"}`` for each image, see ``Message.parts``)."""
        return RequestPlanner.template_messages(body.messages, body.tools)

    @staticmethod
    def template_messages(
        request_messages: Sequence[Message], request_tools: Sequence[Tool] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """:meth:`chat_messages` of any request's ``messages`` and ``tools``."""
        body = _MessagesAndTools(request_messages, request_tools)
        messages = []
        for m in body.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.parts()}
            if m.name:
                message["name"] = m.name
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            messages.append(message)
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        return messages, tools

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt ids of a chat without images, as :meth:`plan_chat` bills them (tokenizer work: a worker
        thread's)."""
        return self._chat_prompt(body)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages, tools = self.chat_messages(body)
        with _template_errors():
            text = self.engine.apply_chat_template(messages, tools)
        return self.engine.tokenize(text, add_special_tokens=False)

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        """``/tokenize``'s token ids: the prompt's, or the chat's as the chat template renders it (see
        :class:`TokenizeRequest`). Images are not counted here: a chat with images is a 400."""
        if body.prompt is not None:
            self.check_prompt_chars(len(body.prompt), "the prompt")
            return self.engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        assert body.messages is not None
        for m, message in enumerate(body.messages):
            for i, _ in message.images():
                raise InvalidRequest(
                    f"messages[{m}].content[{i}]: /tokenize counts text only; send the chat without its images "
                    "(an image's tokens depend on the model's processor and the image's size)",
                    param=f"messages[{m}].content[{i}]",
                )
        messages, tools = self.template_messages(body.messages, body.tools)
        with _template_errors():
            text = self.engine.apply_chat_template(
                messages,
                tools,
                add_generation_prompt=not body.continue_final_message and body.add_generation_prompt is not False,
            )
        if body.continue_final_message:
            final = body.messages[-1].content
            if not isinstance(final, str) or not final or text.rfind(final) < 0:
                raise InvalidRequest(
                    "continue_final_message: the last message needs text content the chat template keeps",
                    param="continue_final_message",
                )
            text = text[: text.rfind(final) + len(final)]  # the last message left open, as vLLM cuts it
        return self.engine.tokenize(text, add_special_tokens=bool(body.add_special_tokens))

    def detokenize(self, body: DetokenizeRequest) -> str:
        vocab = self.engine.vocab_size
        for index, token in enumerate(body.tokens):
            if token >= vocab:
                raise InvalidRequest(
                    f"tokens[{index}]: {token} is outside the vocabulary (0..{vocab - 1})", param=f"tokens[{index}]"
                )
        return self.engine.detokenize(body.tokens)

    def multimodal_prompt(self, body: ChatCompletionRequest, images: list[Any]) -> MultimodalPrompt:
        """The engine's prompt for a chat request with images (already loaded, in prompt order). Blocking:
        the engine's processor runs here; call it on a worker thread."""
        messages, tools = self.chat_messages(body)
        with _template_errors():
            return self.engine.multimodal_prompt(messages, tools, images)

    def plan_chat(
        self, body: ChatCompletionRequest, multimodal: MultimodalPrompt | None = None
    ) -> tuple[Plan, str | None]:
        """The plan, and the forced function's name when ``tool_choice`` names one. A request with images
        needs their ``multimodal`` prompt (:meth:`multimodal_prompt`); without it, it is refused."""
        if multimodal is None and body.images():
            raise no_vision(self.engine.config.model_name, body.images()[0][0])
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self._check_capabilities(body, logprobs)
        constraint, forced = self.chat_constraint(body)
        ids = list(multimodal.prompt_ids) if multimodal is not None else self._chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return self._plan(body, [ids], max_tokens, logprobs, constraint, multimodal), forced

    def plan_completion(self, body: CompletionRequest) -> Plan:
        self._check_capabilities(body, body.logprobs)
        if body.suffix:
            raise InvalidRequest("suffix: not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest("best_of: only best_of == n is supported", param="best_of")
        if isinstance(body.prompt, str):
            prompts = [self.engine.tokenize(body.prompt, add_special_tokens=True)]
        elif body.prompt and isinstance(body.prompt[0], int):
            prompts = [[int(t) for t in body.prompt]]
        else:
            prompts = [self.engine.tokenize(str(p), add_special_tokens=True) for p in body.prompt]
        if any(not ids for ids in prompts):
            raise InvalidRequest("prompt: must not be empty", param="prompt")
        vocab = self.engine.vocab_size
        if any(t < 0 or t >= vocab for ids in prompts for t in ids):
            raise InvalidRequest(f"prompt: a token id is outside the vocabulary (0..{vocab - 1})", param="prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return self._plan(body, prompts, max_tokens, body.logprobs, self.structured_constraint(body))
