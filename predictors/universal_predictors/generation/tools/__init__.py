"""Tool calling: the formats model families write (one :class:`ToolParser` each, in :data:`TOOL_PARSERS`)
and which one a model gets: ``--engine-arg tool_call_parser=NAME`` when given, else the first whose
markers its chat template uses, else Hermes.

Adding a format: a module that defines its parser (a :class:`~.calls.JSONCallFormat` when its calls are
JSON objects) and one entry below.
"""

from __future__ import annotations

from universal_predictors.generation.tools.base import ParsedToolCalls, ToolCallStreamer, ToolParser
from universal_predictors.generation.tools.hermes import HERMES
from universal_predictors.generation.tools.llama3 import LLAMA3_JSON
from universal_predictors.generation.tools.mistral import MISTRAL

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "TOOL_CALL_PARSER_ARG",
    "TOOL_PARSERS",
    "ParsedToolCalls",
    "ToolCallStreamer",
    "ToolParser",
    "choose_tool_parser",
    "tool_parser_named",
]

#: The engine arg that names a model's tool-call format.
TOOL_CALL_PARSER_ARG = "tool_call_parser"

#: Every format, in the order chat templates are checked against their markers.
TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (MISTRAL, HERMES, LLAMA3_JSON)}

#: For a template with none of the markers (or none at all): what the predictor has always parsed.
DEFAULT_TOOL_PARSER = HERMES.name


def tool_parser_named(name: str) -> ToolParser:
    """The parser ``name`` selects; ValueError naming the known ones for any other name."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(
            f"engine arg {TOOL_CALL_PARSER_ARG!r}: no tool-call parser {name!r} (known: {known})"
        ) from None


def choose_tool_parser(name: str | None, chat_template: str | None) -> tuple[ToolParser, str]:
    """The parser for a model, and why (for the log): the engine arg wins over the chat template."""
    if name is not None:
        return tool_parser_named(name), f"engine arg {TOOL_CALL_PARSER_ARG}"
    for parser in TOOL_PARSERS.values():
        if chat_template and parser.detects(chat_template):
            return parser, "its chat template's markers"
    return TOOL_PARSERS[DEFAULT_TOOL_PARSER], "the default (no known markers in the chat template)"
