"""JSON-schema constrained decoding with llguidance, shared by the transformers and llama.cpp engines.

A schema is compiled to an llguidance grammar once (cached by its JSON text) and checked: a schema that
llguidance cannot enforce completely (an unimplemented keyword such as ``not``, a look-around regex, an
unsatisfiable bound) is refused with :class:`UnsupportedSchema` before anything is generated, never
silently loosened. Each constrained sequence then gets one :class:`llguidance.LLMatcher`; per decoding
step the engine fills one bitmask row per constrained sequence (:func:`fill_masks`) and applies the
bitmask to the step's logits in one vectorised operation (:func:`apply_masks` for torch; the llama.cpp
engine does the same over numpy).

The JSON is compact (no free whitespace between tokens): a weak model given free whitespace can stall
in it until ``max_tokens`` (the vLLM engine asks its backend for the same). An object schema that lists
``properties`` without saying ``additionalProperties`` gets no other keys (OpenAI's strict structured
outputs, and vLLM's xgrammar default): otherwise a model may append invented keys until ``max_tokens``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from numpy.typing import NDArray

from universal_predictors.generation.engine import JSONSchemaConstraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

#: llguidance's JSON compile options: ``","`` and ``":"`` separators, no whitespace.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
#: ``response_format: json_object``: any JSON object.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")


class UnsupportedSchema(ValueError):
    """The schema cannot be enforced exactly; the message names the keyword (or the problem)."""

    def __init__(self, message: str, keywords: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keywords = tuple(keywords)


def schema_of(constraint: JSONSchemaConstraint) -> Mapping[str, Any]:
    return constraint.schema if constraint.schema is not None else ANY_OBJECT


def grammar_for(constraint: JSONSchemaConstraint) -> str:
    """The llguidance grammar of ``constraint``; UnsupportedSchema when it cannot be enforced."""
    return _compile_checked(schema_of(constraint))


def check_schema(schema: Mapping[str, Any]) -> None:
    """Raise UnsupportedSchema when ``schema`` cannot be enforced (cheap, cached: for request checks)."""
    _compile_checked(schema)


def _compile_checked(schema: Mapping[str, Any]) -> str:
    try:
        return _compile(json.dumps(schema))
    except RecursionError:
        raise UnsupportedSchema("the JSON schema nests too deeply") from None


def matcher_failure(made: llguidance.LLMatcher) -> ValueError:
    """What a matcher that failed mid-generation (a grammar too complex for llguidance's parser limits)
    becomes: a ValueError, which the OpenAI layer answers with a 400 naming the constraint's field."""
    first = (made.get_error() or "unknown error").strip().splitlines()[0]
    return ValueError(f"constrained decoding cannot follow this JSON schema: {first}")


# Keywords whose value is a schema, a list of schemas, or a name -> schema mapping.
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMAS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any, *, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties``
    and says nothing about other keys (not in ``allOf`` branches, whose properties add up)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, in_all_of=True) for s in out["allOf"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), Mapping) and not in_all_of and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _resolve(root: Mapping[str, Any], ref: str) -> Any:
    """The local ``$ref`` target (``#``, ``#/$defs/x``...), or None for one this check does not follow."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None  # a dangling pointer: llguidance names it
    return node


def _check_finite(root: Mapping[str, Any]) -> None:
    """UnsupportedSchema when ``$ref`` makes the schema describe only infinitely deep values.

    ``{"$ref": "#"}``, a required property whose schema is the whole schema again, or two ``$defs``
    referring to each other: no finite JSON matches, and constrained decoding would run out of parser
    items or of allowed tokens mid-generation. A least fixed point decides which sub-schemas a finite value
    can satisfy; recursion through something optional (a property not required, an array that may be
    empty, another ``anyOf`` branch) is fine.
    """
    nodes: dict[int, Mapping[str, Any]] = {}
    refs: list[str] = []

    stack: list[Any] = [root]
    while stack:  # iterative: a schema may nest as deep as the JSON parser allows
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, Mapping) and id(node) not in nodes:
            nodes[id(node)] = node
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            stack.extend(node.values())
    if not refs:
        return
    finite: set[int] = set()

    def ok(node: Any) -> bool:
        return not isinstance(node, Mapping) or id(node) in finite

    def satisfiable(node: Mapping[str, Any]) -> bool:
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref)
            if isinstance(target, Mapping) and not ok(target):
                return False
        if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(ok(s) for s in node[key]):
                return False
        properties = node.get("properties")
        required = node.get("required")
        if (
            isinstance(properties, Mapping)
            and isinstance(required, list)
            and not all(ok(properties.get(name)) for name in required if isinstance(name, str))
        ):
            return False
        min_items = node.get("minItems")
        need = min_items if isinstance(min_items, int) and min_items > 0 else 0
        if need and not ok(node.get("items")):
            return False
        prefix = node.get("prefixItems")
        return not (isinstance(prefix, list) and not all(ok(s) for s in prefix[:need]))

    changed = True
    while changed:  # each pass adds at least one node, so at most len(nodes) passes
        changed = False
        for key, node in nodes.items():
            if key not in finite and satisfiable(node):
                finite.add(key)
                changed = True
    if id(root) not in finite:
        looping = next((r for r in refs if not ok(_resolve(root, r))), refs[0])
        raise UnsupportedSchema(
            f"the JSON schema only describes infinitely deep values: '$ref' {looping!r} refers back to itself "
            "without an optional step (a property that is not required, an array that may be empty, or another "
            "anyOf branch)",
            keywords=["$ref"],
        )


@functools.lru_cache(maxsize=512)
def _compile(schema_json: str) -> str:
    schema = json.loads(schema_json)
    if not isinstance(schema, dict):
        raise UnsupportedSchema("the JSON schema is not a JSON object")
    _check_finite(schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS)
    # Without a tokenizer: the same verdict (grammar and regex checks do not depend on one) and cheaper.
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    # Every warning is an error here: a warning means part of the schema would not be enforced.
    if is_error or messages:
        raise _unsupported(messages)
    return grammar


def _unsupported(messages: Sequence[str]) -> UnsupportedSchema:
    keywords: list[str] = []
    for message in messages:
        found = _UNIMPLEMENTED.search(message)
        if found:
            keywords += [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
    if keywords:
        names = ", ".join(repr(k) for k in keywords)
        return UnsupportedSchema(
            f"the JSON schema uses {names}, which constrained decoding cannot enforce", keywords=keywords
        )
    detail = "; ".join(m.strip() for m in messages) or "unknown error"
    return UnsupportedSchema(f"the JSON schema cannot be enforced: {detail}")


# -- per-model and per-step glue ----------------------------------------------------------------------


def hf_tokenizer(tokenizer: Any, n_vocab: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (a pass over the vocabulary: build once per
    model). ``n_vocab`` is the logits width, which may exceed the tokenizer's vocabulary; every EOS id
    is one llguidance may end on."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=sorted(eos_ids))


def llamacpp_tokenizer(vocab: Any, n_vocab: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a llama.cpp vocabulary (``llama_vocab_p``; build once per model)."""
    import llguidance.llamacpp

    return llguidance.llamacpp.lltokenizer_from_vocab(vocab, n_vocab=n_vocab, eos_token=sorted(eos_ids))


def matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher for one sequence; RuntimeError if it cannot start (a checked grammar always can)."""
    made = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if made.is_error():
        raise RuntimeError(f"constrained decoding failed to start: {made.get_error()}")
    return made


def allocate_masks(rows: int, n_vocab: int) -> NDArray[np.int32]:
    """One bitmask row (32 tokens per int32) for each of ``rows`` sequences."""
    return np.full((rows, (n_vocab + 31) // 32), -1, dtype=np.int32)


def fill_masks(matchers: Sequence[llguidance.LLMatcher], masks: NDArray[np.int32]) -> NDArray[np.int32]:
    """Row ``i`` of ``masks`` := the tokens ``matchers[i]`` allows next; returns those rows."""
    import llguidance.numpy

    for row, m in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(m, masks, row)
    return masks[: len(matchers)]


def unpack_masks(masks: NDArray[np.int32], n_vocab: int) -> NDArray[np.bool_]:
    """Bitmask rows to booleans ``[rows, n_vocab]`` (True: allowed), vectorised."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :n_vocab].astype(bool)


def apply_masks(logits: Any, rows: Sequence[int], masks: NDArray[np.int32]) -> None:
    """Set the disallowed tokens of ``logits[rows[i]]`` to -inf (a torch tensor ``[batch, width]``)."""
    import torch

    width = logits.shape[-1]
    allowed = np.zeros((len(rows), width), dtype=bool)
    usable = min(width, masks.shape[1] * 32)
    allowed[:, :usable] = unpack_masks(masks, usable)
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    block = logits.index_select(0, index)
    block.masked_fill_(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
    logits.index_copy_(0, index, block)
