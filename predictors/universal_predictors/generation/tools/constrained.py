"""Tool calls under a constraint (``tool_choice`` required or a named function): the output's shape is
the one the constraint imposes, whatever the model family, so one parser and streamer serve them all.

A named function's output is its bare arguments object; ``required`` outputs one
``{"name", "arguments"}`` object (the constraint may put the name after the arguments).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from universal_predictors.generation.tools.base import ParsedToolCalls
from universal_predictors.generation.tools.calls import (
    WAIT,
    ArgumentsStream,
    call_head,
    json_value_end,
    loose_call,
    split_call,
    streamable_call_name,
    tool_call,
)

_HEAD = call_head(("arguments",))


def parse_constrained(text: str, forced: str | None, call_id: Callable[[], str]) -> ParsedToolCalls:
    stripped = text.strip()
    if forced is not None:
        try:
            value = json.loads(stripped)
        except ValueError:
            value = None
        calls = [tool_call(forced, stripped, call_id())] if isinstance(value, dict) else []  # as generated
    else:
        split = split_call(stripped, _HEAD) or loose_call(stripped, ("arguments",))
        calls = [tool_call(*split, call_id())] if split is not None else []
    return ParsedToolCalls(None, calls) if calls else ParsedToolCalls(text, [])


class ConstrainedCallStreamer:
    """Streams the one call a constraint makes the model write (see the module's docstring)."""

    def __init__(self, forced: str | None, known: frozenset[str], call_id: Callable[[], str]) -> None:
        self.forced, self.known, self.call_id = forced, known, call_id
        self.text = ""
        self.pos = 0
        self.args_start = 0
        self.mode = "args" if forced is not None else "call"
        self.args = ArgumentsStream()

    @property
    def calls(self) -> int:
        return self.args.calls

    def push(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        while True:
            rest = self.text[self.pos :]
            if self.mode == "args":  # a named function's bare arguments
                if self.calls == 0:
                    if not rest.strip():
                        return out
                    assert self.forced is not None
                    out.append(self.args.start(self.forced, self.call_id()))
                    self.pos += len(rest) - len(rest.lstrip())
                    continue
                out += self.args.piece(rest)
                self.pos = len(self.text)
                return out
            if self.mode == "call":  # the head of the call object
                head = _HEAD.match(rest)
                if head is None or not rest[head.end() :]:
                    return out
                # The name comes first or is the only tool's; else it follows the arguments: wait for it.
                only = next(iter(self.known)) if len(self.known) == 1 else None
                name = streamable_call_name(rest, head, only, self.known)
                if name is WAIT:
                    return out
                if name is None:
                    self.mode = "whole"  # not a call we can stream: decided at the end
                    return out
                out.append(self.args.start(name, self.call_id()))
                self.pos += head.end()
                self.args_start = self.pos
                self.mode = "call_args"
                continue
            if self.mode == "call_args":
                end = json_value_end(self.text[self.args_start :])
                if end is None:
                    out += self.args.piece(rest)
                    self.pos = len(self.text)
                    return out
                out += self.args.piece(self.text[self.pos : self.args_start + end])
                self.pos = self.args_start + end
                self.mode = "done"
            return out  # "done": the object's closing syntax; "whole": decided at the end

    def finish(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        if self.calls:
            return []
        if message.get("tool_calls"):
            return [{"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}]
        return [{"content": self.text}] if self.text else []
