"""OpenAI chat/completions request models. Every field is validated; unknown extension fields are
ignored (clients send vendor extensions), never rejected. Responses are plain dicts built in
:mod:`.service` in OpenAI's shapes (``chat.completion``, ``chat.completion.chunk``, ``text_completion``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

_IGNORE = ConfigDict(extra="ignore")

#: Seeds are signed 64-bit integers, as OpenAI's API takes them and every engine can (choice ``i`` uses
#: ``seed + i``; torch's generators take -2**63 .. 2**64 - 1, llama.cpp uses the low 32 bits).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _seed_range(value: int | None) -> int | None:
    if value is not None and not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"must be an integer from {SEED_MIN} to {SEED_MAX} (a signed 64-bit integer)")
    return value


class TextPart(BaseModel):
    model_config = _IGNORE

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _IGNORE

    #: A ``data:image/...;base64,...`` URL, or an ``http(s)`` URL from a host the engine arg
    #: ``image_url_hosts`` allows (:mod:`universal_predictors.image_inputs`).
    url: Annotated[str, Field(min_length=1)]
    #: OpenAI's resolution hint; accepted, and the model's processor decides the resolution.
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    """An image in a user message (OpenAI's ``image_url`` content part)."""

    model_config = _IGNORE

    type: Literal["image_url"]
    image_url: ImageURL


#: A content part: OpenAI's other user parts (``input_audio``, ``file``) are refused by name.
ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ImagesNotAccepted(ValueError):
    """Text was asked of a message that carries images: the caller must handle the images (a vision
    model) or refuse them, never drop them silently."""


class FunctionCall(BaseModel):
    model_config = _IGNORE

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _IGNORE

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = _IGNORE

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        # Named here: a union's own error would only say the content is not a string.
        if isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url"):
                    raise ValueError(
                        f"content[{index}]: a content part of type {kind!r} is not supported; "
                        "send text and image_url parts"
                    )
        return value

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role != "user" and self.images():
            # OpenAI takes image parts in user messages only (system, developer, assistant and tool content is
            # text); a prompt with an image elsewhere would be one this API cannot express.
            raise ValueError(f"image_url parts are only allowed in user messages, not in a {self.role} message")
        return self

    def images(self) -> list[tuple[int, ImagePart]]:
        """The image parts with their index in ``content``."""
        if not isinstance(self.content, list):
            return []
        return [(i, part) for i, part in enumerate(self.content) if isinstance(part, ImagePart)]

    def text(self) -> str:
        """The message's text; :class:`ImagesNotAccepted` if it has image parts (see :meth:`parts`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if self.images():
            raise ImagesNotAccepted("the message has image_url parts; only a vision-language model takes them")
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def parts(self) -> str | list[dict[str, str]]:
        """The content for a chat template: a string when it is text only, else the Hugging Face
        multimodal form, ``[{"type": "text", "text": ...}, {"type": "image"}, ...]`` in the client's order
        (each ``{"type": "image"}`` stands for the next image of the request)."""
        if not isinstance(self.content, list) or not self.images():
            return self.text()
        return [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
            for part in self.content
        ]


class FunctionDef(BaseModel):
    model_config = _IGNORE

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _IGNORE

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _IGNORE

    name: str


class NamedToolChoice(BaseModel):
    model_config = _IGNORE

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = _IGNORE

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _IGNORE

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self


class StreamOptions(BaseModel):
    model_config = _IGNORE

    include_usage: bool = False


Stop = str | Annotated[list[str], Field(max_length=16)] | None

#: The kinds of ``structured_outputs`` (vllm 0.32 ``sampling_params.py`` ``StructuredOutputsParams``): exactly one.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: vLLM's guided-decoding fields before ``structured_outputs`` replaced them (vLLM 0.32 ignores them, with a
#: warning: ``entrypoints/serve/engine/protocol.py`` ``_REMOVED_GUIDED_FIELDS``); honoured here, as their kind.
LEGACY_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` request field: the output must match one of a JSON schema (``json``), any JSON
    object (``json_object: true``), a regular expression (``regex``), one of ``choice``, or a Lark or GBNF
    ``grammar``. ``structural_tag`` and ``whitespace_pattern`` are refused by name (not enforced here);
    ``disable_any_whitespace`` is accepted: JSON under a constraint is always compact here."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in STRUCTURED_KINDS if getattr(self, "json_schema" if k == "json" else k) is not None]
        if len(given) != 1:
            listed = ", ".join(given) if given else "none"
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)} (given: {listed})")
        if self.structural_tag is not None:
            raise ValueError("structural_tag is not supported; use json, regex, choice or grammar")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported: JSON under a constraint is always compact")
        if self.json_object is False:
            raise ValueError("json_object must be true when given; leave structured_outputs out for free text")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar must not be empty")
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}") from None
            if not isinstance(self.json_schema, dict):
                raise ValueError("json must be a JSON schema object")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, "json_schema" if k == "json" else k) is not None)


class SamplingFields(BaseModel):
    """The fields chat and completions share."""

    model_config = _IGNORE

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    #: Sample among the k most likely tokens (vLLM's extension; 0 or -1: all); unset, the model's default.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stop: Stop = None
    seed: Annotated[int | None, AfterValidator(_seed_range)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    #: vLLM's old per-request backend choice: accepted and ignored (every engine uses llguidance).
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_structured(self) -> SamplingFields:
        legacy = [name for name in LEGACY_GUIDED if getattr(self, name) is not None]
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported: JSON under a constraint is always compact")
        if len(legacy) + (self.structured_outputs is not None) > 1:
            given = ", ".join(["structured_outputs"] * (self.structured_outputs is not None) + legacy)
            raise ValueError(f"give one structured output constraint, not several ({given})")
        if legacy:
            name = legacy[0]
            self.structured_outputs = StructuredOutputs.model_validate({LEGACY_GUIDED[name]: getattr(self, name)})
        return self

    def structured_param(self) -> str:
        """The field the structured output constraint came from, for error messages."""
        return next((name for name in LEGACY_GUIDED if getattr(self, name) is not None), "structured_outputs")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]

    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def images(self) -> list[tuple[str, ImagePart]]:
        """Every image part of the request in prompt order, with its field path
        (``messages[0].content[1].image_url``) for error messages."""
        return [
            (f"messages[{m}].content[{i}].image_url", part)
            for m, message in enumerate(self.messages)
            for i, part in message.images()
        ]


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=16)] | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's two shapes in one model (vllm 0.32 ``entrypoints/serve/tokenize/protocol.py``,
    ``TokenizeCompletionRequest`` and ``TokenizeChatRequest``): a ``prompt``, special tokens added by default, or
    chat ``messages`` (and ``tools``) rendered with the model's chat template, the generation prompt added and no
    extra special tokens by default; ``continue_final_message`` leaves the last message open instead."""

    model_config = _IGNORE

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_shape(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a chat), not both or neither")
        if self.prompt is not None and (self.tools or self.continue_final_message or self.add_generation_prompt):
            raise ValueError("tools, add_generation_prompt and continue_final_message go with messages, not prompt")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text (vLLM's ``DetokenizeRequest``)."""

    model_config = _IGNORE

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]
