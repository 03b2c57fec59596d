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
from universal_predictors.generation.tools.calls import CallObjectStream, call_head, loose_call, split_call, tool_call

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


class ConstrainedCallStreamer(CallObjectStream):
    """Streams the one call a constraint makes the model write (see the module's docstring)."""

    def __init__(self, forced: str | None, known: frozenset[str], call_id: Callable[[], str]) -> None:
        # The name comes first or is the only tool's; else it follows the arguments: wait for it.
        only = next(iter(known)) if len(known) == 1 else None
        mode = "args" if forced is not None else "call"
        super().__init__(mode, _HEAD, known, call_id, default=only, after_args="done")
        self.forced = forced

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
            if self.mode in ("call", "call_args") and self.step_call(out):  # the call object
                continue
            return out  # "done": the object's closing syntax; "whole": decided at the end

    def finish(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        if self.calls:
            return []
        if message.get("tool_calls"):
            return [{"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}]
        return [{"content": self.text}] if self.text else []
