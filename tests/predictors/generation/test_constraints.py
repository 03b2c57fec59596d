"""The llguidance glue both engines share: which schemas are refused (and how), the closing of listed
properties, and the token masks, checked against the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from universal_predictors.generation import constraints
from universal_predictors.generation.engine import JSONSchemaConstraint


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
