"""Mistral (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct, Mistral Nemo; the ``[TOOL_CALLS]`` JSON list)::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": ..., "arguments": ...}]

The marker is a special token: a tokenizer that drops special tokens from the text leaves the bare list,
which counts too. Mistral's templates accept only 9-character alphanumeric tool call ids back, so the
calls get such ids.
"""

from __future__ import annotations

import secrets
import string

from universal_predictors.generation.tools.calls import JSONCallFormat

_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


MISTRAL = JSONCallFormat(
    name="mistral",
    template_markers=("[TOOL_CALLS]",),
    open="[TOOL_CALLS]",
    separator=",",
    listed=True,
    call_id=mistral_call_id,
)
