"""What the Responses and Messages APIs share as translations to and from a chat request: the chat's field names in
its errors mapped back to the caller's (``messages[i]`` to the item or turn it came from), the chat request validated
with that mapping, and server-sent events named by an ``event:`` line (both APIs name theirs)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from universal_predictors.errors import APIError, InvalidRequest
from universal_predictors.generation.protocol import ChatCompletionRequest


def rename_param(
    error: APIError,
    names: Mapping[str, str],
    origins: list[str] | None,
    *,
    suffixes: Mapping[str, str] | None = None,
    words: Mapping[str, str] | None = None,
) -> APIError:
    """``error`` naming the caller's field instead of the chat's: its ``param`` and its message's leading field go
    through ``names`` (the chat field -> the API's), ``messages[i]`` becomes ``origins[i]`` (where that chat message
    came from), a trailing ``suffixes`` key is replaced, and ``words`` are replaced in the message's text."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    name, _, index = head.partition("[")
    if name not in names:
        return error
    param = names[name] + (f"[{index}" if index else "")
    if name == "messages" and index and origins is not None:
        position = index.rstrip("]")
        if position.isdigit() and int(position) < len(origins):
            param = origins[int(position)]
    param += dot + rest
    for suffix, replacement in (suffixes or {}).items():
        if param.endswith(suffix):
            param = param.removesuffix(suffix) + replacement
    message = error.message
    if message.startswith(f"{error.param}:"):
        message = param + message[len(error.param) :]
    for word, replacement in (words or {}).items():
        message = message.replace(word, replacement)
    error.param, error.message = param, message
    return error


def validated_chat(chat: dict[str, Any], rename: Callable[[APIError], APIError]) -> ChatCompletionRequest:
    """``chat`` as a validated chat request; its first validation error a 400 named by ``rename``."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        raise rename(InvalidRequest(f"{where}: {first['msg']}", param=where)) from None


def first_error(exc: ValidationError) -> str:
    """A nested model's first validation error as ``where: what``, for a validator re-raising it."""
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def named_event(event: dict[str, Any]) -> str:
    """One server-sent event named by an ``event:`` line (its ``type``), as OpenAI's Responses and Anthropic's
    Messages streams send them."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
