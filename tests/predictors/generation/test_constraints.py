"""The llguidance glue both engines share: which schemas are refused (and how), the closing of listed
properties, and the token masks, checked against the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from universal_predictors.generation import constraints
from universal_predictors.generation.engine import GrammarConstraint, JSONSchemaConstraint


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "not": {"required": ["a"]}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}, "not"),
    ],
)
def test_an_unimplemented_keyword_is_refused_by_name(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(constraints.UnsupportedSchema) as caught:
        constraints.grammar_for(JSONSchemaConstraint(schema))
    assert caught.value.keywords == (keyword,)
    assert f"'{keyword}'" in str(caught.value)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
        ({"$ref": "#/nowhere"}, "nowhere"),
    ],
)
def test_a_schema_that_cannot_be_enforced_is_refused_with_the_reason(schema: dict[str, Any], says: str) -> None:
    with pytest.raises(constraints.UnsupportedSchema, match=says):
        constraints.check_schema(schema)


def test_listed_properties_close_the_object_unless_the_schema_says_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "$defs": {"d": {"properties": {"y": {}}}},
        "anyOf": [{"properties": {"z": {}}, "additionalProperties": True}],
        "allOf": [{"properties": {"w": {}}}],
    }
    closed = constraints.closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in closed["allOf"][0]  # allOf branches add up: left open
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert constraints.closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any object


def test_the_mask_allows_exactly_the_tokens_that_keep_an_integer_within_its_bounds(hf_tokenizer: Any) -> None:
    n_vocab = len(hf_tokenizer) + 40  # logits wider than the tokenizer, as models often have
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    lltok = constraints.hf_tokenizer(hf_tokenizer, n_vocab, [eos])
    grammar = constraints.grammar_for(JSONSchemaConstraint({"type": "integer", "minimum": 3, "maximum": 7}))
    first = constraints.matcher(lltok, grammar)
    masks = constraints.allocate_masks(4, n_vocab)
    allowed = constraints.unpack_masks(constraints.fill_masks([first], masks), n_vocab)[0]
    assert sorted(hf_tokenizer.decode([t]) for t in allowed.nonzero()[0]) == ["3", "4", "5", "6", "7"]
    # After a digit the value is complete: only EOS may follow.
    assert first.consume_token(hf_tokenizer.convert_tokens_to_ids("5"))
    assert first.is_stopped()
    after = constraints.unpack_masks(constraints.fill_masks([first], masks), n_vocab)[0]
    assert after.nonzero()[0].tolist() == [eos]


def test_masks_apply_to_the_constrained_rows_of_a_batch_only(hf_tokenizer: Any) -> None:
    n_vocab = len(hf_tokenizer)
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    lltok = constraints.hf_tokenizer(hf_tokenizer, n_vocab, [eos])
    digit = constraints.matcher(lltok, constraints.grammar_for(JSONSchemaConstraint({"enum": [4]})))
    anything = constraints.matcher(lltok, constraints.grammar_for(JSONSchemaConstraint(None)))
    masks = constraints.fill_masks([digit, anything], constraints.allocate_masks(8, n_vocab))
    logits = torch.randn(3, n_vocab + 7)  # row 1 is unconstrained; 7 columns beyond the vocabulary
    before = logits.clone()
    constraints.apply_masks(logits, [0, 2], masks)
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [hf_tokenizer.convert_tokens_to_ids("4")]
    object_starts = torch.isfinite(logits[2]).nonzero().flatten().tolist()
    assert object_starts
    assert all(hf_tokenizer.decode([t]).startswith("{") for t in object_starts)
    assert torch.isinf(logits[:, n_vocab:][[0, 2]]).all()


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (GrammarConstraint("regex", text="(?<=a)b"), "the regular expression cannot be enforced: invalid regex"),
        (GrammarConstraint("grammar", text="start: a\na: b"), "the grammar cannot be enforced: at 2(4): unknown name"),
        (GrammarConstraint("grammar", text="root ::= [a-"), "the grammar cannot be enforced"),
        (GrammarConstraint("grammar", text='start: "x" <|eot_id|>'), "names special tokens"),
        (GrammarConstraint("regex", text="a" * (constraints.MAX_SCHEMA_BYTES + 1)), "bytes; at most 262144"),
        (GrammarConstraint("choice", choices=("b" * constraints.MAX_SCHEMA_BYTES,)), "the choice list is"),
    ],
    ids=["look-behind", "unknown-rule", "bad-gbnf", "special-token", "long-regex", "long-choices"],
)
def test_a_grammar_llguidance_cannot_enforce_is_refused_saying_why(constraint: GrammarConstraint, says: str) -> None:
    with pytest.raises(constraints.UnsupportedGrammar) as caught:
        constraints.check_constraint(constraint)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)  # one line: llguidance's excerpt of its wrapper grammar is left out


def test_grammars_compile_once_and_mask_tokens_to_their_language(hf_tokenizer: Any) -> None:
    regex = GrammarConstraint("regex", text=r"[0-9]{2}-(yes|no)")
    grammar = constraints.grammar_for(regex)
    assert constraints.grammar_for(regex) is grammar  # cached by kind and source
    lltok = constraints.hf_tokenizer(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id])
    matcher = constraints.matcher(lltok, grammar)
    for token in hf_tokenizer.encode("42-yes", add_special_tokens=False):
        masks = constraints.fill_masks([matcher], constraints.allocate_masks(1, len(hf_tokenizer)))
        allowed = constraints.unpack_masks(masks, len(hf_tokenizer))[0]
        assert allowed[token]
        assert not any(allowed[t] for t in hf_tokenizer.encode("z", add_special_tokens=False))
        assert matcher.consume_token(token)
    masks = constraints.fill_masks([matcher], constraints.allocate_masks(1, len(hf_tokenizer)))
    allowed = constraints.unpack_masks(masks, len(hf_tokenizer))[0]
    assert allowed.nonzero()[0].tolist() == [hf_tokenizer.eos_token_id]  # complete: only the end is left
