"""What a tool-call format is to the OpenAI layer: the :class:`ToolParser` protocol.

Model families write tool calls differently (Hermes/Qwen ``<tool_call>`` blocks, Llama 3's bare JSON,
Mistral's ``[TOOL_CALLS]`` list). A parser turns a whole output into the assistant message's content and
``tool_calls`` (the unary response), and makes a streamer that turns the same output, as it is generated,
into chat deltas whose pieces assemble to those calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ParsedToolCalls:
    """A whole output split into the text before the calls (None when there is none) and the calls."""

    content: str | None
    calls: list[dict[str, Any]]  # OpenAI ``tool_calls`` entries: id, type, function {name, arguments}


class ToolCallStreamer(Protocol):
    """One choice's output as chat deltas while tools apply."""

    @property
    def calls(self) -> int:
        """How many tool calls have been streamed."""
        ...

    def push(self, text: str) -> list[dict[str, Any]]:
        """Deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) for the next generated text."""
        ...

    def finish(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The last deltas, given the unary assistant message for the whole output."""
        ...


class ToolParser(Protocol):
    """One model family's tool-call format under ``tool_choice: auto``."""

    @property
    def name(self) -> str:
        """The name ``--engine-arg tool_call_parser=NAME`` selects it by."""
        ...

    def detects(self, chat_template: str) -> bool:
        """Whether a chat template shows the model was trained to write this format."""
        ...

    def call_id(self) -> str:
        """A new tool call id as this family's chat template accepts it back."""
        ...

    def parse(self, text: str) -> ParsedToolCalls:
        """The calls in a whole output (none when it holds no call of this format)."""
        ...

    def streamer(self, known: frozenset[str]) -> ToolCallStreamer:
        """A streamer for one choice; ``known`` are the request's tool names (only those are streamed)."""
        ...
