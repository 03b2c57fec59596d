"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``), the shape most model
families share, and what differs between them as data: the marker that opens the calls, whether the
calls form a list, what separates two calls, and the key the arguments go under.

One :class:`JSONCallFormat` parses a whole output (the unary response) and streams one as it is generated
(:class:`JSONCallStreamer`), from the same syntax, so that the streamed pieces assemble to the unary call:
the arguments are sent as the model wrote them, never re-serialised.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from universal_predictors.generation.tools.base import ParsedToolCalls

_STRING = r'"((?:[^"\\]|\\.)*)"'
#: After a call's arguments object: the name, when it comes after them, and the object's ``}``.
_TAIL = rf'\s*(?:,\s*"name"\s*:\s*{_STRING}\s*)?\}}'
NAME_AFTER = re.compile(rf'\s*,\s*"name"\s*:\s*{_STRING}')


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    """One entry of an assistant message's ``tool_calls``."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def call_head(argument_keys: tuple[str, ...]) -> re.Pattern[str]:
    """The head of a call object up to where its arguments start: ``{"name": ..., "arguments": `` or
    ``{"arguments": `` with the name after them (as a constraint may order it); an optional leading
    ``"type": "function"`` (some Llama outputs carry it)."""
    keys = "|".join(re.escape(k) for k in argument_keys)
    return re.compile(
        rf'\s*\{{\s*(?:"type"\s*:\s*"function"\s*,\s*)?(?:"name"\s*:\s*{_STRING}\s*,\s*)?"(?:{keys})"\s*:\s*'
    )


def json_value_end(text: str) -> int | None:
    """Where the JSON object/array starting ``text`` ends (exclusive), or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def unquote(raw: str) -> str | None:
    with contextlib.suppress(ValueError):
        value = json.loads(f'"{raw}"')
        return value if isinstance(value, str) else None
    return None


#: :func:`streamable_call_name`'s answer while the text so far cannot tell the call's name yet.
WAIT = "\x00wait"


def streamable_call_name(rest: str, head: re.Match[str], default: str | None, known: frozenset[str]) -> str | None:
    """The name of the call whose head ``head`` matched at the start of ``rest``, if it can be streamed.

    The name comes from the head, else from ``default`` (the only tool), else it follows the arguments
    object, and then is known only once that object has closed: :data:`WAIT` until then. ``None``: not a
    call that can be streamed (no arguments object, or a tool the request did not offer).
    """
    name = unquote(head.group(1)) if head.group(1) is not None else default
    if name is None and rest[head.end()] == "{":  # the name follows the arguments
        end = json_value_end(rest[head.end() :])
        after = NAME_AFTER.match(rest, head.end() + end) if end is not None else None
        if after is None:
            return WAIT
        name = unquote(after.group(1))
    if rest[head.end()] != "{" or name not in known:
        return None
    return name


def split_call(fragment: str, head: re.Pattern[str]) -> tuple[str, str] | None:
    """A call object's name and its arguments as the model wrote them (so a streamed call and a unary
    one carry the same text), or None when ``fragment`` is not such an object."""
    match = head.match(fragment)
    if match is None:
        return None
    rest = fragment[match.end() :]
    end = json_value_end(rest) if rest[:1] == "{" else None
    tail = re.compile(_TAIL + r"\s*").fullmatch(rest[end:]) if end is not None else None
    if end is None or tail is None or (match.group(1) is None) == (tail.group(1) is None):
        return None  # not a call, or the name missing or given twice
    name = unquote(match.group(1) or tail.group(1))
    try:
        args = json.loads(rest[:end])
    except ValueError:
        return None
    return (name, rest[:end]) if name is not None and isinstance(args, dict) else None


def loose_call(fragment: str, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """A call object in any other valid JSON spelling (arguments given as a JSON string, say)."""
    try:
        value = json.loads(fragment)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in argument_keys:
        if key in value:
            args = value[key]
            return value["name"], args if isinstance(args, str) else json.dumps(args)
    return None


@dataclass(frozen=True)
class JSONCallFormat:
    """A tool-call syntax of JSON call objects; implements :class:`~.base.ToolParser`."""

    name: str
    #: Strings in a chat template that show the model was trained on this format.
    template_markers: tuple[str, ...]
    #: What opens the calls in the output (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``).
    open: str
    #: Between the end of one call object and the start of the next (a regex).
    separator: str
    #: The calls are a JSON list after the marker (``[{...}, {...}]``).
    listed: bool = False
    #: The keys a call's arguments may go under.
    argument_keys: tuple[str, ...] = ("arguments",)
    #: The output may start with the calls without the marker (a tokenizer that drops special tokens
    #: drops the marker too); ``stream_bare`` streams them, otherwise they are judged at the end.
    bare: bool = True
    stream_bare: bool = True
    call_id: Callable[[], str] = openai_call_id
    head: re.Pattern[str] = field(init=False, repr=False, compare=False)
    between: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "head", call_head(self.argument_keys))
        object.__setattr__(self, "between", re.compile(_TAIL + self.separator + r"\s*"))

    @property
    def bare_start(self) -> str:
        return "[" if self.listed else "{"

    def detects(self, chat_template: str) -> bool:
        return any(marker in chat_template for marker in self.template_markers)

    def calls_start(self, text: str) -> tuple[int, int] | None:
        """Where the content before the calls ends and where the first call object starts."""
        at = text.find(self.open)
        if at >= 0:
            start = at + len(self.open)
            if self.listed:
                listed = re.compile(r"\s*\[").match(text, start)
                start = listed.end() if listed is not None else start
            return at, start
        body = len(text) - len(text.lstrip())
        if self.bare and text[body : body + 1] == self.bare_start:
            return 0, body + (1 if self.listed else 0)
        return None

    def parse(self, text: str) -> ParsedToolCalls:
        start = self.calls_start(text)
        if start is None:
            return ParsedToolCalls(text, [])
        content_end, pos = start
        calls = []
        while True:
            pos += len(text[pos:]) - len(text[pos:].lstrip())
            end = json_value_end(text[pos:]) if text[pos : pos + 1] == "{" else None
            if end is None:
                break
            fragment = text[pos : pos + end]
            split = split_call(fragment, self.head) or loose_call(fragment, self.argument_keys)
            if split is not None:
                calls.append(tool_call(*split, self.call_id()))
            after = re.compile(r"\s*" + self.separator + r"\s*").match(text, pos + end)
            if after is None:
                break
            pos = after.end()
        if not calls:
            return ParsedToolCalls(text, [])
        return ParsedToolCalls(text[:content_end].strip() or None, calls)

    def streamer(self, known: frozenset[str]) -> JSONCallStreamer:
        return JSONCallStreamer(self, known)


def args_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


def start_delta(index: int, name: str, call_id: str) -> dict[str, Any]:
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]
    }


class ArgumentsStream:
    """The arguments of the call being streamed: pieces as generated, whitespace held until something
    follows it (so the pieces end where the arguments object ends)."""

    def __init__(self) -> None:
        self.calls = 0  # tool calls started
        self.pending_ws = ""

    def start(self, name: str, call_id: str) -> dict[str, Any]:
        self.calls += 1
        self.pending_ws = ""
        return start_delta(self.calls - 1, name, call_id)

    def piece(self, text: str) -> list[dict[str, Any]]:
        text = self.pending_ws + text
        stripped = text.rstrip()
        self.pending_ws = text[len(stripped) :]
        return [args_delta(self.calls - 1, stripped)] if stripped else []


class CallObjectStream:
    """What both streamers (:class:`JSONCallStreamer`, :class:`~.constrained.ConstrainedCallStreamer`) keep of
    one choice's output, and the states of one call object they share: ``call``, waiting for the object's head
    until the call's name is known, then ``call_args``, its arguments object streamed as generated until it
    closes. What comes before and after a call object is each streamer's own."""

    def __init__(
        self,
        mode: str,
        head: re.Pattern[str],
        known: frozenset[str],
        call_id: Callable[[], str],
        *,
        default: str | None,
        after_args: str,
    ) -> None:
        self.head, self.known, self.call_id = head, known, call_id
        self.default = default  # the call's name when the head has none and it cannot follow the arguments
        self.after_args = after_args  # the state once a call's arguments object has closed
        self.text = ""  # everything generated so far
        self.pos = 0  # text before this is handled (emitted or deliberately dropped)
        self.mode = mode
        self.args = ArgumentsStream()
        self.args_start = 0  # where the current call's arguments object starts in ``text``

    @property
    def calls(self) -> int:
        return self.args.calls

    def step_call(self, out: list[dict[str, Any]]) -> bool:
        """One step in the ``call`` or ``call_args`` state, its deltas appended to ``out``: True to step again,
        False to wait for more text (or, once the state is ``whole``, for the end)."""
        rest = self.text[self.pos :]
        if self.mode == "call":  # waiting for the head of a call object
            head = self.head.match(rest)
            if head is None or not rest[head.end() :]:
                return False
            name = streamable_call_name(rest, head, self.default, self.known)
            if name is WAIT:
                return False
            if name is None:
                self.mode = "whole"  # not a call we can stream: decided at the end
                return False
            out.append(self.args.start(name, self.call_id()))
            self.pos += head.end()
            self.args_start = self.pos
            self.mode = "call_args"
            return True
        # "call_args": the arguments object of a call, until it closes
        end = json_value_end(self.text[self.args_start :])
        if end is None:
            out += self.args.piece(rest)
            self.pos = len(self.text)
            return False
        out += self.args.piece(self.text[self.pos : self.args_start + end])
        self.pos = self.args_start + end
        self.mode = self.after_args
        return True


class JSONCallStreamer(CallObjectStream):
    """Turns one choice's streamed text into chat deltas under ``tool_choice: auto``: content while the
    output cannot (yet) be a tool call, then OpenAI-style ``tool_calls`` deltas (a first one with index,
    id, type and name; then pieces of ``arguments`` as they are generated). What cannot be streamed
    safely (a call whose name is unknown or comes too late, a bare object the format does not stream) is
    judged at the end, from the unary parse."""

    def __init__(self, syntax: JSONCallFormat, known: frozenset[str]) -> None:
        super().__init__("undecided", syntax.head, known, syntax.call_id, default=None, after_args="between")
        self.syntax = syntax
        self.content_end = 0  # text before this was sent as content

    def push(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        syntax = self.syntax
        while True:
            rest = self.text[self.pos :]
            if self.mode == "undecided":
                body = rest.lstrip()
                if not body or (len(body) < len(syntax.open) and syntax.open.startswith(body)):
                    return out  # could still become a tool call: hold it
                if body.startswith(syntax.open):
                    self._open(len(rest) - len(body))
                    continue
                if syntax.bare and body.startswith(syntax.bare_start):
                    if not syntax.stream_bare:
                        self.mode = "whole"  # maybe a whole-output call object: only the end can tell
                        return out
                    self.pos += len(rest) - len(body) + (1 if syntax.listed else 0)
                    self.mode = "call"
                    continue
                self.mode = "content"
                continue
            if self.mode == "content":  # plain text; the calls' marker may still follow it
                at = rest.find(syntax.open)
                if at >= 0:
                    self._content(out, rest[:at])
                    self._open(0)
                    continue
                keep = next((n for n in range(min(len(syntax.open) - 1, len(rest)), 0, -1)
                             if rest.endswith(syntax.open[:n])), 0)  # fmt: skip
                self._content(out, rest[: len(rest) - keep])
                return out
            if self.mode == "list":  # after the marker of a listed format: its "["
                body = rest.lstrip()
                if not body:
                    return out
                self.pos += len(rest) - len(body) + (1 if body.startswith("[") else 0)
                self.mode = "call"
                continue
            if self.mode in ("call", "call_args"):  # a call object's head, then its arguments
                if self.step_call(out):
                    continue
                return out
            if self.mode == "between":  # the call object's end, and the separator before another call
                after = syntax.between.match(self.text, self.pos)
                if after is None or after.end() == len(self.text):
                    return out  # the next call (if any) has not started yet
                self.pos = after.end()
                self.mode = "call"
                continue
            return out  # "whole": everything waits for the end

    def _open(self, marker_at: int) -> None:
        """The calls' marker starts ``marker_at`` characters after ``pos``: skip it."""
        self.pos += marker_at + len(self.syntax.open)
        self.mode = "list" if self.syntax.listed else "call"

    def _content(self, out: list[dict[str, Any]], text: str) -> None:
        if text:
            out.append({"content": text})
        self.pos += len(text)
        self.content_end = self.pos

    def finish(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The last deltas, given the unary message for the whole text."""
        if self.calls:
            return []  # the calls were streamed; what is left is their closing syntax
        if message.get("tool_calls"):  # a call only the whole output could reveal
            return [{"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}]
        rest = self.text[self.content_end :]
        return [{"content": rest}] if rest else []
