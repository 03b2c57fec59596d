"""Constrained decoding with llguidance (JSON schemas; regexes, choice lists and Lark/GBNF grammars), shared by the
transformers and llama.cpp engines.

A schema is compiled to an llguidance grammar once (cached by its grammar-relevant JSON, within a byte
budget: :class:`GrammarCache`) and checked: a schema that
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

Bounds, checked in Python (linear in the schema) before llguidance sees the schema: llguidance compiles a
``$ref`` chain by native recursion, and 4,000 ``$defs`` each referring to the previous overflow the stack
(SIGSEGV: the whole predictor dies). :data:`MAX_SCHEMA_DEPTH` bounds the deepest path through the schema,
``$ref`` followed, and :data:`MAX_SCHEMA_BYTES` its size without annotations. At the depth bound every
chain shape compiles within a 1 MiB thread stack (measured ~4-8 KiB per level; 512 KiB is not enough),
and Python's threads and the main thread get 8 MiB: pinned by ``tests/security/test_predictor_schemas.py``.
llguidance itself then runs in a compiler process (:mod:`universal_predictors.generation.schema_compiler`), so a
shape these bounds miss costs a 400, not the predictor.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from numpy.typing import NDArray

from universal_predictors.generation import schema_compiler
from universal_predictors.generation.engine import Constraint, GrammarConstraint, JSONSchemaConstraint

if TYPE_CHECKING:
    pass  # a TypedDict of the stubs only

#: ``response_format: json_object``: any JSON object.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}

#: The deepest path through a schema, counting every object on it (a sub-schema, or a ``properties``/``$defs``
#: map) and following ``$ref``: a ``$ref`` cycle counts all its members once. 128 is serde_json's own
#: nesting limit inside llguidance, so only ``$ref`` chains meet this bound first.
MAX_SCHEMA_DEPTH = 128
#: The most bytes of a schema's JSON once its annotations are stripped (:func:`grammar_relevant`), and of a regex,
#: choice list (as JSON) or grammar.
MAX_SCHEMA_BYTES = 256 * 1024
#: What the compiled grammars may hold in memory at most (keys and grammars, as Python sizes them).
GRAMMAR_CACHE_BYTES = 32 * 2**20
#: Keywords that describe a schema without constraining its values: stripped before compiling and
#: before keying the cache, so 8 MiB of ``description`` neither reach llguidance nor stay in memory.
ANNOTATIONS = frozenset({"description", "title", "examples", "$comment", "deprecated", "readOnly", "writeOnly"})

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")


class UnsupportedSchema(ValueError):
    """The schema cannot be enforced exactly; the message names the keyword (or the problem)."""

    def __init__(self, message: str, keywords: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keywords = tuple(keywords)


def schema_of(constraint: JSONSchemaConstraint) -> Mapping[str, Any]:
    return constraint.schema if constraint.schema is not None else ANY_OBJECT


class UnsupportedGrammar(ValueError):
    """A regex, choice list or grammar that cannot be enforced; the message names the problem."""


def grammar_for(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; UnsupportedSchema (UnsupportedGrammar for a regex, choice or
    grammar) when it cannot be enforced."""
    if isinstance(constraint, GrammarConstraint):
        return _compile_grammar(constraint)
    return _compile_checked(schema_of(constraint))


def check_schema(schema: Mapping[str, Any]) -> None:
    """Raise UnsupportedSchema when ``schema`` cannot be enforced (cheap, cached: for request checks)."""
    _compile_checked(schema)


def check_constraint(constraint: Constraint) -> None:
    """Raise UnsupportedSchema or UnsupportedGrammar when ``constraint`` cannot be enforced (cached)."""
    if isinstance(constraint, GrammarConstraint):
        _compile_grammar(constraint)
    elif constraint.schema is not None:
        _compile_checked(constraint.schema)


#: How each grammar kind is named in a refusal.
_GRAMMAR_WHAT = {"regex": "the regular expression", "choice": "the choice list", "grammar": "the grammar"}


def _compile_grammar(constraint: GrammarConstraint) -> str:
    """A regex, choice list or Lark/GBNF grammar compiled in the compiler process as vLLM's guidance backend
    compiles it (``llguidance.grammar_from``), bounded and cached like a schema. Every warning is an error, as for
    schemas: a grammar naming special tokens (``<|im_end|>``) cannot be checked without the model's tokenizer, and
    is refused rather than left to fail mid-generation."""
    what = _GRAMMAR_WHAT[constraint.kind]
    source = constraint.source()
    size = len(source.encode())
    if size > MAX_SCHEMA_BYTES:
        raise UnsupportedGrammar(f"{what} is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
    key = f"{constraint.kind}\0{source}"  # a schema's key is JSON: never starts with a kind's name
    grammar = grammar_cache.get(key)
    if grammar is not None:
        return grammar
    refused = refusals.get(key)
    if refused is not None:
        raise UnsupportedGrammar(refused)
    try:
        grammar, messages = schema_compiler.compiler.compile(source, kind=constraint.kind)
    except schema_compiler.CompilerFailed as exc:
        reason = f"{what} is too complex to compile: {exc}"
        refusals.put(key, reason)
        raise UnsupportedGrammar(reason) from None
    if grammar is None:
        raise UnsupportedGrammar(f"{what} cannot be enforced: {grammar_problem(messages, constraint.kind)}")
    grammar_cache.put(key, grammar)
    return grammar


_POSITION = re.compile(r"^at \d+\(\d+\): ")


def grammar_problem(messages: Sequence[str], kind: str) -> str:
    """llguidance's messages in one line each: the headline and its ``error:`` line, without the excerpt of the
    wrapper grammar it builds around a regex or choice list (whose positions mean nothing to the caller)."""
    out = []
    for message in messages:
        if "no tokenizer" in message and "special" in message:
            out.append(
                "it names special tokens (such as <|im_end|>), which are not supported in grammars; "
                "match text only, and let the model end the sequence"
            )
            continue
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        if not lines:
            continue
        head = _POSITION.sub("", lines[0]) if kind != "grammar" else lines[0]
        detail = next((line for line in lines[1:] if line.startswith("error:")), "")
        out.append(f"{head} {detail}".strip()[:400])
    return "; ".join(out) or "unknown error"


class GrammarCache:
    """Compiled grammars by the grammar-relevant JSON of their schema, least recently used dropped first,
    bounded by the bytes it holds rather than by entries (90 schemas with 8 MiB descriptions held 1.5 GB
    in an LRU of 512 entries keyed by the whole schema). Thread-safe: the event loop's worker threads
    check schemas, engine threads compile them for matchers."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, grammar: str) -> None:
        size = sys.getsizeof(key) + sys.getsizeof(grammar)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (grammar, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


grammar_cache = GrammarCache(GRAMMAR_CACHE_BYTES)
#: Why each schema the compiler process failed on was refused, by the same key: refused again at once, without
#: losing another compiler process to it.
refusals = GrammarCache(schema_compiler.REFUSALS_BYTES)


def grammar_relevant(schema: Any) -> Any:
    """``schema`` without :data:`ANNOTATIONS` wherever a schema stands (not inside ``enum``, ``const`` or
    a ``properties`` map, where such a name is data): the same grammar, from less text."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: grammar_relevant(s) for name, s in value.items()}
        elif key in _SUBSCHEMA_KEYS and isinstance(value, Mapping):
            out[key] = grammar_relevant(value)
        elif key in _SUBSCHEMA_KEYS and isinstance(value, list):
            out[key] = [grammar_relevant(s) for s in value]
        else:
            out[key] = value
    return out


def _compile_checked(schema: Mapping[str, Any]) -> str:
    try:
        key = json.dumps(grammar_relevant(schema), separators=(",", ":"))
    except RecursionError:
        raise UnsupportedSchema("the JSON schema nests too deeply") from None
    grammar = grammar_cache.get(key)
    if grammar is None:
        try:
            grammar = _compile(key)
        except RecursionError:
            raise UnsupportedSchema("the JSON schema nests too deeply") from None
        grammar_cache.put(key, grammar)
    return grammar


def matcher_failure(made: llguidance.LLMatcher) -> ValueError:
    """What a matcher that failed mid-generation (a grammar too complex for llguidance's parser limits)
    becomes: a ValueError, which the OpenAI layer answers with a 400 naming the constraint's field."""
    first = (made.get_error() or "unknown error").strip().splitlines()[0]
    return ValueError(f"constrained decoding cannot follow this schema or grammar: {first}")


# Keywords whose value is a schema, a list of schemas, or a name -> schema mapping.
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMAS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMA_KEYS = frozenset({*_SUBSCHEMA, *_SUBSCHEMAS, "allOf"})


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


def _children(node: Mapping[str, Any] | list[Any]) -> list[Any]:
    """The objects directly inside ``node`` (through lists: a list is not a level of its own)."""
    out: list[Any] = []
    pending: list[Any] = list(node.values()) if isinstance(node, Mapping) else list(node)
    while pending:
        item = pending.pop()
        if isinstance(item, Mapping):
            out.append(item)
        elif isinstance(item, list):
            pending.extend(item)
    return out


def schema_depth(root: Mapping[str, Any]) -> int:
    """The number of objects on the deepest path through ``root``, following local ``$ref``s, with a
    ``$ref`` cycle's members counted once each (an upper bound on any path llguidance's recursion can
    take). Linear: Tarjan's strongly connected components, iterative, and the longest path over them."""
    edges: dict[int, list[Mapping[str, Any]]] = {}
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    depth: dict[int, int] = {}  # per component root, then per node once its component is done
    on_stack: set[int] = set()
    stack: list[Mapping[str, Any]] = []

    def successors(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        out = _children(node)
        ref = node.get("$ref")
        target = _resolve(root, ref) if isinstance(ref, str) else None
        if isinstance(target, Mapping):
            out.append(target)
        return out

    work: list[tuple[Mapping[str, Any], int]] = [(root, 0)]
    while work:
        node, position = work.pop()
        key = id(node)
        if position == 0:
            index[key] = low[key] = len(index)
            stack.append(node)
            on_stack.add(key)
            edges[key] = successors(node)
        nexts = edges[key]
        while position < len(nexts):
            child = nexts[position]
            position += 1
            if id(child) not in index:
                work.append((node, position))
                work.append((child, 0))
                break
            if id(child) in on_stack:
                low[key] = min(low[key], index[id(child)])
        else:
            if low[key] == index[key]:  # a component: pop it, its depth = its size + the deepest below
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(id(member))
                    members.append(id(member))
                    if member is node:
                        break
                inside = set(members)
                below = max((depth[id(c)] for m in members for c in edges[m] if id(c) not in inside), default=0)
                for m in members:
                    depth[m] = len(members) + below
            if work:
                parent = work[-1][0]
                low[id(parent)] = min(low[id(parent)], low[key])
    return depth[id(root)]


def check_bounds(schema: Mapping[str, Any], size: int) -> None:
    """UnsupportedSchema when the schema (``size`` bytes of JSON) is over :data:`MAX_SCHEMA_BYTES` or
    nests deeper than :data:`MAX_SCHEMA_DEPTH`: checked before llguidance, whose recursion it bounds."""
    if size > MAX_SCHEMA_BYTES:
        raise UnsupportedSchema(
            f"the JSON schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted. Send a smaller schema "
            "(descriptions, titles and examples count too)"
        )
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise UnsupportedSchema(
            f"the JSON schema nests {depth} levels deep, counting each '$ref' it follows; at most "
            f"{MAX_SCHEMA_DEPTH} are accepted. Flatten the schema or shorten its '$ref' chains",
            keywords=["$ref"],
        )


def _check_finite(root: Mapping[str, Any]) -> None:
    """UnsupportedSchema when ``$ref`` makes the schema describe only infinitely deep values.

    ``{"$ref": "#"}``, a required property whose schema is the whole schema again, or two ``$defs``
    referring to each other: no finite JSON matches, and constrained decoding would run out of parser
    items or of allowed tokens mid-generation. A least fixed point decides which sub-schemas a finite value
    can satisfy; recursion through something optional (a property not required, an array that may be
    empty, another ``anyOf`` branch) is fine. Linear in the schema (a quadratic fixed point took 29 s,
    on the event loop, for 6,000 chained ``$defs``).
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
    # Horn satisfiability, linear: a node is finite once each of its requirements is met, a requirement
    # being a group of alternatives of which one finite member suffices (anyOf/oneOf: the branches; every
    # other requirement: one sub-schema). Each node and requirement is visited a bounded number of times.
    waiting: dict[int, int] = {}  # node -> requirements not met yet
    watchers: dict[int, list[tuple[int, list[bool]]]] = {}  # member -> (node, its group's met flag)
    finite: set[int] = set()
    ready: list[int] = []

    for key, node in nodes.items():
        groups: list[list[Any]] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            groups.append([_resolve(root, ref)])
        if isinstance(node.get("allOf"), list):
            groups += [[s] for s in node["allOf"]]
        for keyword in ("anyOf", "oneOf"):
            if isinstance(node.get(keyword), list) and node[keyword]:
                groups.append(list(node[keyword]))
        properties, required = node.get("properties"), node.get("required")
        if isinstance(properties, Mapping) and isinstance(required, list):
            groups += [[properties.get(name)] for name in required if isinstance(name, str)]
        min_items = node.get("minItems")
        need = min_items if isinstance(min_items, int) and min_items > 0 else 0
        if need:
            groups.append([node.get("items")])
            prefix = node.get("prefixItems")
            if isinstance(prefix, list):
                groups += [[s] for s in prefix[:need]]
        # A group with a member that is not an object (absent, true, a dangling $ref) is met already.
        pending = [g for g in groups if all(isinstance(m, Mapping) for m in g)]
        waiting[key] = len(pending)
        for group in pending:
            met = [False]
            for member in group:
                watchers.setdefault(id(member), []).append((key, met))
        if not pending:
            ready.append(key)
    while ready:
        key = ready.pop()
        finite.add(key)
        for node_key, met in watchers.pop(key, ()):
            if not met[0]:
                met[0] = True
                waiting[node_key] -= 1
                if waiting[node_key] == 0:
                    ready.append(node_key)

    def ok(node: Any) -> bool:
        return not isinstance(node, Mapping) or id(node) in finite

    if id(root) not in finite:
        looping = next((r for r in refs if not ok(_resolve(root, r))), refs[0])
        raise UnsupportedSchema(
            f"the JSON schema only describes infinitely deep values: '$ref' {looping!r} refers back to itself "
            "without an optional step (a property that is not required, an array that may be empty, or another "
            "anyOf branch)",
            keywords=["$ref"],
        )


def _compile(schema_json: str) -> str:
    schema = json.loads(schema_json)
    if not isinstance(schema, dict):
        raise UnsupportedSchema("the JSON schema is not a JSON object")
    check_bounds(schema, len(schema_json.encode()))
    _check_finite(schema)
    refused = refusals.get(schema_json)
    if refused is not None:
        raise UnsupportedSchema(refused)
    try:
        # In the compiler process (schema_compiler): a native crash there costs this schema, not the model.
        grammar, messages = schema_compiler.compiler.compile(json.dumps(closed_objects(schema)))
    except schema_compiler.CompilerFailed as exc:
        reason = f"the JSON schema is too complex to compile: {exc}"
        refusals.put(schema_json, reason)
        raise UnsupportedSchema(reason) from None
    # Every warning is an error here: a warning means part of the schema would not be enforced.
    if grammar is None:
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
