"""JSON-schema constrained decoding over a tokenizer's vocabulary, for engines without their own.

lm-format-enforcer drives a character-level JSON-schema parser; this module builds its tokenizer data
from any ``decode(ids) -> str`` function (its own transformers integration does not import under
transformers 5), so the transformers engine can mask each sequence's logits to the tokens that keep
the output valid. Once the JSON value is complete only EOS is allowed, which ends the sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from universal_predictors.generation.engine import JSONSchemaConstraint


class JsonConstraintFactory:
    """Built once per tokenizer (a pass over the vocabulary); makes one enforcer per sequence."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        vocab_size: int,
        special_ids: Collection[int],
        eos_ids: Collection[int],
    ) -> None:
        self._decode = decode
        self._vocab_size = vocab_size
        self._special = set(special_ids)
        self.eos_ids = sorted(eos_ids)
        self._data: Any = None
        self.texts: dict[int, str] = {}
        self._syntax_cache: dict[State, list[int]] = {}
        self._lock = threading.Lock()

    def _tokenizer_data(self) -> Any:
        with self._lock:
            if self._data is None:
                from lmformatenforcer import TokenEnforcerTokenizerData  # type: ignore[import-untyped]  # no stubs

                regular = []
                for token_id in range(self._vocab_size):
                    if token_id in self._special:
                        continue
                    text = self._decode([token_id])
                    if not text or "\ufffd" in text or any(c < " " and c not in "\n\r" for c in text):
                        # A fragment of a multi-byte character (the parser works on whole characters), or a
                        # control character, which the parser would let into strings where JSON forbids it.
                        continue
                    self.texts[token_id] = text
                    # Byte-level BPE keeps the leading space in the token itself: a word start is a space.
                    regular.append((token_id, text, text.startswith(" ")))
                self._data = TokenEnforcerTokenizerData(
                    regular, lambda ids: self._decode(ids).rstrip("\ufffd"), self.eos_ids, False, self._vocab_size
                )
            return self._data

    def syntax_allowed(self, state: State) -> list[int]:
        """Tokens that keep the text valid JSON from ``state`` (EOS once a value is complete), cached."""
        cached = self._syntax_cache.get(state)
        if cached is None:
            if not state[0] and state[1] == _AFTER:
                cached = list(self.eos_ids)  # a complete object or array: end here, no trailing filler
            else:
                cached = [t for t, text in self.texts.items() if json_feed(state, text) is not None]
                if json_complete(state):
                    cached += self.eos_ids
            if len(self._syntax_cache) < 100_000:
                self._syntax_cache[state] = cached
        return cached

    def enforcer(self, constraint: JSONSchemaConstraint) -> JsonEnforcer:
        """A per-sequence filter; ValueError when the schema is one the parser cannot enforce."""
        from lmformatenforcer import JsonSchemaParser, TokenEnforcer

        data = self._tokenizer_data()
        if constraint.schema is None:
            return JsonEnforcer(self, None, INITIAL_OBJECT)
        try:
            parser = JsonSchemaParser(dict(constraint.schema))
        except Exception as exc:  # the parser raises plain exceptions for schema features it lacks
            raise ValueError(f"the JSON schema cannot be enforced: {exc}") from None
        root = INITIAL_OBJECT if constraint.schema.get("type") == "object" else INITIAL_VALUE
        return JsonEnforcer(self, TokenEnforcer(data, parser), root)


class JsonEnforcer:
    """Which tokens may come next for one sequence; :meth:`advance` with each token generated."""

    def __init__(self, factory: JsonConstraintFactory, schema_enforcer: Any, state: State) -> None:
        self._factory = factory
        self._schema = schema_enforcer
        self._state: State | None = state
        self._generated: list[int] = []

    def allowed(self) -> list[int]:
        if self._state is None:
            return list(self._factory.eos_ids)
        syntax = self._factory.syntax_allowed(self._state)
        if self._schema is None:
            return syntax
        # The schema enforcer keys its state on the token tuple; the first call's tuple is taken as the
        # prompt, so the generated tokens alone (possibly empty) are the whole sequence it sees.
        result = self._schema.get_allowed_tokens(list(self._generated))
        schema_ok = set(getattr(result, "allowed_tokens", result))
        both = [t for t in syntax if t in schema_ok]
        return both or syntax

    def advance(self, token_id: int) -> None:
        self._generated.append(token_id)
        text = self._factory.texts.get(token_id)
        self._state = None if text is None or self._state is None else json_feed(self._state, text)


# -- JSON syntax ------------------------------------------------------------------------------------
#
# lm-format-enforcer lets some tokens through that break JSON syntax (a trailing ",}" in free-form
# objects, a quote inside a merged token); every token it allows is therefore also checked against this
# small character-level JSON automaton, which alone enforces ``json_object``. A state is an immutable
# tuple ``(stack, mode, aux, spaces)``, so allowed-token sets are cached per state.

_WS = " \t\n\r"
_MAX_SPACES = 8  # consecutive whitespace characters: bounds how long a weak model can stall
(_ROOT, _VALUE, _KEY_OR_END, _KEY, _COLON, _VALUE_OR_END, _AFTER, _STRING, _ESCAPE, _HEX, _NUMBER, _LITERAL) = range(12)
# Number sub-states (aux): which characters may come next and whether the number may end here.
_NUM_NEXT = {
    "minus": ("digits0", None),
    "zero": (None, True),
    "int": (None, True),
    "dot": (None, False),
    "frac": (None, True),
    "e": (None, False),
    "esign": (None, False),
    "exp": (None, True),
}

State = tuple[str, int, Any, int]
INITIAL_OBJECT: State = ("", _ROOT, None, 0)
INITIAL_VALUE: State = ("", _VALUE, None, 0)


def _number_step(sub: str, ch: str) -> str | None:
    digit = ch.isdigit() and ch.isascii()
    if sub == "minus":
        return "zero" if ch == "0" else "int" if digit else None
    if sub == "int" and digit:
        return "int"
    if sub in ("zero", "int"):
        return "dot" if ch == "." else "e" if ch in "eE" else None
    if sub in ("dot", "frac"):
        return "frac" if digit else ("e" if sub == "frac" and ch in "eE" else None)
    if sub == "e":
        return "esign" if ch in "+-" else "exp" if digit else None
    if sub in ("esign", "exp"):
        return "exp" if digit else None
    return None


def _number_can_end(sub: str) -> bool:
    return sub in ("zero", "int", "frac", "exp")


def _start_value(stack: str, ch: str) -> State | None:
    if ch == "{":
        return (stack + "o", _KEY_OR_END, None, 0)
    if ch == "[":
        return (stack + "a", _VALUE_OR_END, None, 0)
    if ch == '"':
        return (stack, _STRING, False, 0)
    if ch == "-":
        return (stack, _NUMBER, "minus", 0)
    if ch.isdigit() and ch.isascii():
        return (stack, _NUMBER, "zero" if ch == "0" else "int", 0)
    for word in ("true", "false", "null"):
        if ch == word[0]:
            return (stack, _LITERAL, word[1:], 0)
    return None


def _after_value(stack: str, ch: str) -> State | None:
    if not stack:
        return None  # the value is complete; only whitespace may follow
    top = stack[-1]
    if ch == ",":
        return (stack, _KEY if top == "o" else _VALUE, None, 0)
    if (ch == "}" and top == "o") or (ch == "]" and top == "a"):
        return (stack[:-1], _AFTER, None, 0)
    return None


def json_step(state: State, ch: str) -> State | None:
    """The state after ``ch``, or None when ``ch`` cannot continue valid JSON."""
    stack, mode, aux, spaces = state
    if mode == _STRING:
        if ch == '"':
            return (stack, _COLON, None, 0) if aux else (stack, _AFTER, None, 0)
        if ch == "\\":
            return (stack, _ESCAPE, aux, 0)
        return None if ch < " " else state
    if mode == _ESCAPE:
        if ch == "u":
            return (stack, _HEX, (aux, 4), 0)
        return (stack, _STRING, aux, 0) if ch in '"\\/bfnrt' else None
    if mode == _HEX:
        key, left = aux
        if ch not in "0123456789abcdefABCDEF":
            return None
        return (stack, _STRING, key, 0) if left == 1 else (stack, _HEX, (key, left - 1), 0)
    if mode == _LITERAL:
        if ch != aux[0]:
            return None
        return (stack, _LITERAL, aux[1:], 0) if len(aux) > 1 else (stack, _AFTER, None, 0)
    if mode == _NUMBER:
        nxt = _number_step(aux, ch)
        if nxt is not None:
            return (stack, _NUMBER, nxt, 0)
        if not _number_can_end(aux):
            return None
        return json_step((stack, _AFTER, None, 0), ch)
    if ch in _WS:
        return (stack, mode, aux, spaces + 1) if spaces < _MAX_SPACES else None
    if mode == _ROOT:
        return (stack + "o", _KEY_OR_END, None, 0) if ch == "{" else None
    if mode == _VALUE:
        return _start_value(stack, ch)
    if mode == _VALUE_OR_END:
        return (stack[:-1], _AFTER, None, 0) if ch == "]" else _start_value(stack, ch)
    if mode == _KEY_OR_END:
        if ch == "}":
            return (stack[:-1], _AFTER, None, 0)
        return (stack, _STRING, True, 0) if ch == '"' else None
    if mode == _KEY:
        return (stack, _STRING, True, 0) if ch == '"' else None
    if mode == _COLON:
        return (stack, _VALUE, None, 0) if ch == ":" else None
    if mode == _AFTER:
        return _after_value(stack, ch)
    return None


def json_complete(state: State) -> bool:
    """Whether the text so far is one complete JSON value."""
    stack, mode, aux, _ = state
    if stack:
        return False
    return mode == _AFTER or (mode == _NUMBER and _number_can_end(aux))


def json_feed(state: State | None, text: str) -> State | None:
    for ch in text:
        if state is None:
            return None
        state = json_step(state, ch)
    return state
