"""The OpenAI layer over any :class:`~universal_predictors.generation.engine.Engine`: chat and
completions for one served model, put together from engine-independent parts:

- :mod:`.planning`: an OpenAI request into engine requests (prompts, context check, ``n`` and seeds,
  the constraint ``response_format`` or a forced tool needs);
- :mod:`.streaming`: running the choices (stop strings via :mod:`.stops`), admission, SSE, cancellation
  when the client goes;
- :mod:`.responses`: the unary and streamed response bodies, usage and logprobs;
- :mod:`.responses_api`: OpenAI's Responses API as a chat, answered in its own shapes and events;
- :mod:`.messages_api`: Anthropic's Messages API, the same way;
- :mod:`.tools`: tool-call formats per model family, chosen from the chat template or an engine arg;
- :mod:`.images`: a chat request's ``image_url`` parts loaded within the limits, for a vision engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid

from fastapi import Request
from fastapi.responses import Response

from universal_predictors.config import IMAGES_HEADER, RESPONSES_STORED_HEADER
from universal_predictors.errors import APIError, InvalidRequest, Unavailable
from universal_predictors.generation import messages_api, responses_api
from universal_predictors.generation.adapters import SEPARATOR, AdapterCatalog, AdapterMismatch
from universal_predictors.generation.chat_images import ImageArgs, check_count, decode_budget, load_images
from universal_predictors.generation.engine import (
    Engine,
    GenerationRequest,
    MultimodalPrompt,
    SamplingParams,
    no_vision,
)
from universal_predictors.generation.messages_api import CountTokensRequest, MessagesRequest
from universal_predictors.generation.planning import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Plan,
    RequestPlanner,
    context_error,
)
from universal_predictors.generation.protocol import ChatCompletionRequest, CompletionRequest
from universal_predictors.generation.responses import ChatTools, chat_shape, completion_shape, respond
from universal_predictors.generation.responses_api import ResponsesRequest
from universal_predictors.generation.streaming import ChoiceRunner, ignore
from universal_predictors.generation.tools import ToolParser, choose_tool_parser

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "GenerationService"]

logger = logging.getLogger(__name__)


class GenerationService:
    """The OpenAI chat/completions behaviour of one served model.

    ``tool_call_parser`` names the model's tool-call format (an engine arg, already checked); without it
    the format is read from the chat template once the engine has loaded. ``image_args`` are the limits
    on chat images (engine args; the defaults when not given)."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        tool_call_parser: str | None = None,
        image_args: ImageArgs | None = None,
        adapters: AdapterCatalog | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.image_args = image_args or ImageArgs()
        self.decode_budget = decode_budget(self.image_args)
        self.planner = RequestPlanner(engine)
        self.runner = ChoiceRunner(engine, model_name)
        self._tool_call_parser = tool_call_parser
        self._tool_parser: ToolParser | None = None
        #: The model's LoRA adapters (``--adapters-file``); None: it has none.
        self.adapters = adapters

    @property
    def tool_parser(self) -> ToolParser:
        """The model's tool-call format (needs the loaded engine's chat template unless named)."""
        if self._tool_parser is None:
            template = self.engine.chat_template if self._tool_call_parser is None else None
            self._tool_parser, why = choose_tool_parser(self._tool_call_parser, template)
            logger.info("tool calls are parsed as %s: %s", self._tool_parser.name, why)
        return self._tool_parser

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        plan, tools = await self._plan_chat(body)
        plan = await self.adapted(plan, body.model)
        return counted(await respond(self.runner, request, body, plan, chat_shape(body, plan, tools)), body)

    async def responses(self, request: Request, body: ResponsesRequest) -> Response:
        """``POST /v1/responses``: the request as a chat (:mod:`.responses_api`), answered in Responses' shapes."""
        stored = request.headers.get(RESPONSES_STORED_HEADER) is not None  # the gateway keeps the conversation
        chat, origins = responses_api.chat_request(body, stored)
        try:
            plan, tools = await self._plan_chat(chat)
        except APIError as error:
            raise responses_api.renamed(error, origins) from None
        plan = await self.adapted(plan, body.model)
        return counted(await responses_api.respond(self.runner, request, body, chat, plan, tools), chat)

    async def messages(self, request: Request, body: MessagesRequest) -> Response:
        """``POST /v1/messages``: the request as a chat (:mod:`.messages_api`), answered in Anthropic's shapes."""
        chat, origins = messages_api.chat_request(body)
        try:
            plan, tools = await self._plan_chat(chat)
        except APIError as error:
            raise messages_api.renamed(error, origins) from None
        plan = await self.adapted(plan, body.model)
        return counted(await messages_api.respond(self.runner, request, body, chat, plan, tools), chat)

    async def adapted(self, plan: Plan, model: str | None) -> Plan:
        """``plan`` on the adapter ``model`` names (fetched and loaded first), or as it is for the base. An
        adapter that cannot be fetched or does not fit its base is Failed (its status says why) and a 400 naming
        it; the base serves on."""
        name = self.adapters.resolve(model) if self.adapters is not None else None
        if name is None or self.adapters is None:
            return plan
        try:
            adapter = await self.adapters.local(name)  # a failed download or check: Failed by the catalog, its reason
            try:
                await asyncio.to_thread(self.engine.load_adapter, adapter)
            except Unavailable:
                raise
            except Exception as exc:
                if not isinstance(exc, AdapterMismatch | FileNotFoundError | PermissionError | LookupError | OSError):
                    logger.exception("LoRA adapter %s failed to load", name)
                self.adapters.fail(name, "Mismatch" if isinstance(exc, AdapterMismatch) else "LoadFailed", exc)
                raise
        except Unavailable:
            raise
        except Exception:
            entry = next(e for e in self.adapters.entries() if e.name == name)
            raise InvalidRequest(
                f"The adapter {model!r} failed ({entry.reason}): {entry.message}. The base model "
                f"{self.model_name!r} still serves; fix the adapter's source and list it again.",
                param="model",
                code="adapter_failed",
            ) from None
        jobs = [(p, dataclasses.replace(job, adapter=adapter)) for p, job in plan.jobs]
        return dataclasses.replace(plan, jobs=jobs, model=f"{self.model_name}{SEPARATOR}{name}")

    async def count_message_tokens(self, body: CountTokensRequest) -> int:
        """``POST /v1/messages/count_tokens``: the input tokens the same ``/v1/messages`` request is billed."""
        chat, origins = messages_api.chat_request(body.as_messages())
        try:
            if chat.images():
                return len((await self._multimodal_prompt(chat)).prompt_ids)
            return len(await asyncio.to_thread(self.planner.chat_prompt, chat))
        except APIError as error:
            raise messages_api.renamed(error, origins) from None

    async def _plan_chat(self, body: ChatCompletionRequest) -> tuple[Plan, ChatTools]:
        constraint, _ = self.planner.chat_constraint(body)
        if constraint is not None:  # checked (and compiled, cached) off the event loop: planning then hits the cache
            await asyncio.to_thread(self.planner.check_constraint, constraint)
        multimodal = await self._multimodal_prompt(body) if body.images() else None
        plan, forced = await asyncio.to_thread(self.planner.plan_chat, body, multimodal)  # template, tokenizer
        return plan, ChatTools(body, forced, self.tool_parser)

    async def _multimodal_prompt(self, body: ChatCompletionRequest) -> MultimodalPrompt:
        """A 400 for a model without a vision part (before anything is fetched), then the images loaded
        within the limits and the engine's prompt made from them (its processor runs off the event loop)."""
        vision = self.engine.vision
        if vision is None:
            raise no_vision(self.model_name, body.images()[0][0])
        images = await load_images(check_count(body, self.image_args), self.image_args, vision.max_pixels,
                                   self.decode_budget)  # fmt: skip
        return await asyncio.to_thread(self.planner.multimodal_prompt, body, images)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        plan, echoes = await asyncio.to_thread(self._plan_completion, body)
        plan = await self.adapted(plan, body.model)
        return await respond(self.runner, request, body, plan, completion_shape(body, plan, echoes))

    def _plan_completion(self, body: CompletionRequest) -> tuple[Plan, list[str]]:
        """The plan and the echoed prompts: tokenizer work, for a worker thread."""
        plan = self.planner.plan_completion(body)
        return plan, [self.engine.detokenize(ids) if body.echo else "" for ids in plan.prompts]

    async def complete_text(self, prompt: str, max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS) -> str:
        """Greedy text for one prompt (KServe v1/v2 text in, text out)."""
        self.planner.check_prompt_chars(len(prompt), "the prompt")
        ids = await asyncio.to_thread(self.engine.tokenize, prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.engine.context_length:
            raise context_error(self.engine.context_length, len(ids), max_tokens)
        params = SamplingParams(max_tokens=min(max_tokens, self.engine.context_length - len(ids)), temperature=0.0)
        choice = await self.runner.run_choice(0, GenerationRequest(uuid.uuid4().hex, ids, params), [], ignore)
        return choice.text


def counted(response: Response, chat: ChatCompletionRequest) -> Response:
    """``response`` with the images its chat held in ``IMAGES_HEADER``, which the gateway's usage ledger counts (and
    takes out): OpenAI's ``usage`` has no place for them."""
    images = len(chat.images())
    if images:
        response.headers[IMAGES_HEADER] = str(images)
    return response
