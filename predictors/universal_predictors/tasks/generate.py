"""``task: generate``: OpenAI chat/completions (and KServe v1/v2 text in, text out) over one engine.

The backend (``auto`` resolved in :mod:`universal_predictors.generation.engines`) picks the engine; the
engine's own ``EngineArgs`` validate ``--engine-arg`` keys at start-up.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from universal_predictors.base import StartupError, UniversalPredictor, parse_engine_args
from universal_predictors.catalog import Backend, Route, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.devices import allocated_gpus, gpu_unusable_reason
from universal_predictors.errors import InvalidRequest, ModelNotFound
from universal_predictors.generation.adapters import SEPARATOR, AdapterCatalog
from universal_predictors.generation.chat_images import IMAGE_ARG_KEYS, ImageArgs
from universal_predictors.generation.engines import EngineUnavailable, engine_class, resolve_backend
from universal_predictors.generation.messages_api import CountTokensRequest, MessagesRequest
from universal_predictors.generation.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from universal_predictors.generation.responses_api import ResponsesRequest
from universal_predictors.generation.service import COMPLETIONS_DEFAULT_MAX_TOKENS, GenerationService
from universal_predictors.generation.tools import TOOL_CALL_PARSER_ARG, tool_parser_named


class _DeferredArgs(BaseModel):
    """Accepts anything: the chosen engine's own model validates the keys in ``__init__``."""

    model_config = ConfigDict(extra="allow")


#: The OpenAI layer's engine args, the same on every backend: the tool-call format and the chat-image limits.
LAYER_ARG_KEYS = frozenset({TOOL_CALL_PARSER_ARG, *IMAGE_ARG_KEYS})


def _without_layer_args(config: PredictorConfig) -> tuple[Callable[[Backend], dict[str, str]], PredictorConfig]:
    """``tool_call_parser`` and the image limits are the OpenAI layer's engine args, not an engine's: the
    config without them (for the backend choice and the engine's own args), and the values they give a
    backend."""

    def values(backend: Backend) -> dict[str, str]:
        return {k: v for k, v in config.engine_args_for(backend).items() if k in LAYER_ARG_KEYS}

    stripped = config.model_copy(
        update={
            "engine_args": {k: v for k, v in config.engine_args.items() if k not in LAYER_ARG_KEYS},
            "engine_arg_defaults": {
                b: {k: v for k, v in args.items() if k not in LAYER_ARG_KEYS}
                for b, args in config.engine_arg_defaults.items()
            },
        }
    )
    return values, stripped


class GeneratePredictor(UniversalPredictor):
    """One text-generation model behind the OpenAI chat/completions API."""

    task = Task.GENERATE
    EngineArgs = _DeferredArgs

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__(config)
        layer_args, config = _without_layer_args(config)
        self.backend = resolve_backend(config)
        layer = layer_args(self.backend)
        parser = layer.pop(TOOL_CALL_PARSER_ARG, None)
        if parser is not None:
            try:
                tool_parser_named(parser)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        # The GPU check first: it reads NVML and the builds' files only, while importing an engine may already
        # need the device (vLLM's CUDA build does), which would hide the reason behind a traceback.
        unusable = gpu_unusable_reason(self.backend, allocated_gpus())
        if unusable is not None:
            raise StartupError(unusable)
        try:
            cls = engine_class(self.backend)
        except EngineUnavailable as exc:
            raise StartupError(str(exc)) from None
        args = parse_engine_args(
            cls.EngineArgs,
            config.engine_args_for(self.backend),
            f"the {self.backend.value} backend of task {self.task.value}",
        )
        image_args = parse_engine_args(ImageArgs, layer, f"the chat images of task {self.task.value}")
        self.engine_impl = cls(config, args)
        self.engine_impl.max_images = image_args.max_images
        self.adapters: AdapterCatalog | None = None
        if config.adapters_file:
            if not cls.capabilities.adapters:
                raise StartupError(f"the {self.backend.value} backend does not serve LoRA adapters (--adapters-file)")
            cache = Path(tempfile.gettempdir()) / "universal-runtime-adapters" / config.model_name
            credentials = Path(config.adapter_credentials_dir) if config.adapter_credentials_dir else None
            self.adapters = AdapterCatalog(config.model_name, Path(config.adapters_file), cache, credentials)
        self.service = GenerationService(self.engine_impl, config.model_name, parser, image_args, self.adapters)

    def load(self) -> bool:
        self.engine_impl.load()
        _ = self.service.tool_parser  # chosen (and logged) now that the chat template is known
        return True

    def unload(self) -> None:
        self.engine_impl.unload()

    def health(self) -> str | None:
        return self.engine_impl.health()

    def check_model(self, requested: str | None) -> None:
        """404 unless the body names this model, one of its adapters (``model:adapter``, or the adapter's bare
        name as vLLM's clients send it), or nothing."""
        if requested is None or requested == self.name:
            return
        if self.adapters is not None:
            try:
                self.adapters.resolve(requested)
                return
            except KeyError:
                pass
        adapters = [f"{self.name}{SEPARATOR}{a}" for a in self.adapters.names] if self.adapters is not None else []
        raise ModelNotFound(requested, self.name, adapters)

    def model_cards(self) -> list[dict[str, Any]]:
        """The base's card, then one per listed adapter: ``parent`` is the base (vLLM's LoRA entries in
        ``/v1/models`` have it too, ``vllm/entrypoints/openai/serving_models.py``), ``adapter`` its state."""
        cards = [self.model_card()]
        if self.adapters is not None:
            base = cards[0]
            for entry in self.adapters.entries():
                report = entry.report(self.name)
                cards.append({"id": report.pop("served_name"), "object": "model", "created": base["created"],
                              "owned_by": base["owned_by"], "parent": self.name, "root": entry.uri,
                              "task": base["task"], "backend": base["backend"], "ready": base["ready"],
                              "adapter": report})  # fmt: skip
        return cards

    def describe(self) -> dict[str, Any]:
        if not self.ready:
            return {}
        return {
            "context_length": self.engine_impl.context_length,
            "max_model_len": self.engine_impl.context_length,
            "vision": self.engine_impl.vision is not None,
            # The model's own defaults, used where a request leaves temperature or top_p out (top_k always).
            "sampling_defaults": dict(self.engine_impl.sampling_defaults),
            **self.engine_impl.describe(),
        }

    async def infer(self, instances: list[Any]) -> list[Any]:
        """Each instance is a prompt string, or ``{"prompt": ..., "max_tokens": ...}``; greedy text back."""
        outputs = []
        for index, item in enumerate(instances):
            if isinstance(item, dict):
                prompt, max_tokens = item.get("prompt"), item.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
            else:
                prompt, max_tokens = item, COMPLETIONS_DEFAULT_MAX_TOKENS
            if not isinstance(prompt, str) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise InvalidRequest(
                    f'instances[{index}]: expected a prompt string or {{"prompt": str, "max_tokens": int >= 1}}',
                    param=f"instances[{index}]",
                )
            outputs.append(self.service.complete_text(prompt, max_tokens))
        return list(await asyncio.gather(*outputs))

    def _precheck(self, check: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """``check`` (counts and sizes on the raw JSON) once the body names this model and it is loaded."""

        def precheck(data: dict[str, Any]) -> None:
            model = data.get("model")
            self.check_model(model if isinstance(model, str) else None)
            self.require_ready()
            check(data)

        return precheck

    def precheck(self, route: Route) -> Callable[[dict[str, Any]], None] | None:
        planner = self.service.planner
        if route.handler == "tokenize":  # a chat or a prompt, bounded as chat and completions bound them
            return self._precheck(
                lambda data: planner.precheck_chat(data) if "messages" in data else planner.precheck_completion(data)
            )
        if route.handler == "detokenize":
            return self._precheck(lambda data: None)
        if route.handler == "responses":
            return self._precheck(planner.precheck_responses)
        if route.handler in ("messages", "count_message_tokens"):
            return self._precheck(planner.precheck_messages)
        return self._precheck(
            planner.precheck_chat if route.handler == "chat_completions" else planner.precheck_completion
        )

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self.service.chat(request, body)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self.service.completions(request, body)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        return await self.service.responses(request, body)

    async def messages(self, body: MessagesRequest, request: Request) -> Response:
        return await self.service.messages(request, body)

    async def count_message_tokens(self, body: CountTokensRequest, request: Request) -> Response:
        """Anthropic's answer: ``{"input_tokens": N}``."""
        return JSONResponse({"input_tokens": await self.service.count_message_tokens(body)})

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        """vLLM's ``/tokenize`` answer: ``count``, ``max_model_len``, ``tokens`` and, when asked, ``token_strs``."""
        planner, engine = self.service.planner, self.engine_impl
        tokens = await asyncio.to_thread(planner.tokenize, body)
        payload: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.context_length, "tokens": tokens}
        payload["token_strs"] = engine.token_pieces(tokens) if body.return_token_strs else None
        return JSONResponse(payload)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        """vLLM's ``/detokenize`` answer: the ``prompt`` the ids spell (special tokens skipped)."""
        return JSONResponse({"prompt": await asyncio.to_thread(self.service.planner.detokenize, body)})
