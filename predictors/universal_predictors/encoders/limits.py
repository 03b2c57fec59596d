"""How long an input may be, and the one error for an input that is longer.

The limit counts tokens with the special tokens added. It is the smallest of:

- the position table: ``max_position_embeddings``, less the slots the RoBERTa family reserves before its
  first position. Those models number positions from ``padding_idx + 1`` (transformers'
  ``create_position_ids_from_input_ids``: ``cumsum(mask) * mask + padding_idx``, with ``padding_idx =
  config.pad_token_id``), so an input of ``n`` tokens reads position ``pad_token_id + n``, and the table of
  ``max_position_embeddings`` rows holds ``max_position_embeddings - pad_token_id - 1`` tokens: 512 for
  roberta-base's 514 rows and ``pad_token_id`` 1. Beyond it the embedding lookup fails (an index error on
  the CPU, a device-side assert that poisons the CUDA context on a GPU).
- the tokenizer's ``model_max_length`` where it is set (transformers writes ``int(1e30)`` for "unset");
- caps the model or the deployment declare: sentence-transformers' ``max_seq_length``, the
  ``max_input_tokens`` engine argument.

Counting tokens costs memory in proportion to the text (about 600 bytes a character for a whole-text
tokenisation: a 2 MiB input took 1.2 GB), so a text is first held to :data:`MAX_CHARS_PER_TOKEN` characters a
token of the limit (:func:`char_limit`): longer, it is refused unread, or cut to that many characters when the
request asks for truncation; within it, tokenizers cap what they hand back at one token over the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from universal_predictors.errors import InvalidRequest

#: Model types whose embeddings number positions from ``padding_idx + 1``, with ``padding_idx`` the
#: config's ``pad_token_id`` (transformers 5.24: their ``*Embeddings`` set ``self.padding_idx =
#: config.pad_token_id`` and call ``create_position_ids_from_input_ids``).
OFFSET_POSITION_TYPES = frozenset(
    {
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "camembert",
        "data2vec-text",
        "longformer",
        "xmod",
        "ibert",
        "esm",
        "luke",
        "markuplm",
        "lilt",
        "layoutlmv3",
    }
)
#: Model types of the same scheme whose ``padding_idx`` is fixed, whatever the config says
#: (``MPNetEmbeddings``: ``self.padding_idx = 1``).
FIXED_PADDING_IDX = {"mpnet": 1}
#: What a tokenizer's ``model_max_length`` above this means: no limit set (transformers uses ``int(1e30)``).
_UNSET_MAX_LENGTH = 10**9
#: The limit when neither the model nor its tokenizer says one (BERT's).
DEFAULT_LIMIT = 512

#: Characters read per token of the limit. A token covers at least one character; this many covers every word a
#: WordPiece vocabulary splits (``max_input_chars_per_word`` is 100: longer words are one ``[UNK]``) and the
#: whitespace around it, several times over for ordinary text (4-5 characters a token).
MAX_CHARS_PER_TOKEN = 64

#: What to do about a text over the limit where the request can ask for truncation.
TRUNCATE_REMEDY = 'Shorten it, or send "truncate": true to cut it to the limit.'
#: What to do where it cannot (KServe v1/v2 instances).
SHORTEN_REMEDY = "Shorten it."


def position_limit(model_config: Any) -> int | None:
    """The most tokens the model's position table holds, or None when it has no absolute table."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    model_type = getattr(model_config, "model_type", None)
    if model_type in FIXED_PADDING_IDX:
        positions -= FIXED_PADDING_IDX[model_type] + 1
    elif model_type in OFFSET_POSITION_TYPES:
        pad = getattr(model_config, "pad_token_id", None)
        positions -= (pad if isinstance(pad, int) and pad >= 0 else 1) + 1  # RobertaConfig's default is 1
    return positions


def input_limit(model_config: Any, tokenizer: Any, *caps: int | None) -> int:
    """The most tokens (special tokens included) one input may have; see the module docstring."""
    limits = [cap for cap in caps if cap is not None and cap > 0]
    positions = position_limit(model_config)
    if positions is not None:
        limits.append(positions)
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < _UNSET_MAX_LENGTH:
        limits.append(declared)
    return min(limits) if limits else DEFAULT_LIMIT


def context_length_exceeded(param: str, length: int, limit: int, remedy: str = TRUNCATE_REMEDY) -> InvalidRequest:
    """The 400 for an input longer than the model takes: names the input, its length, the limit, a remedy."""
    return InvalidRequest(
        f"{param} is {length} tokens long, over this model's limit of {limit} tokens. {remedy}",
        param=param,
        code="context_length_exceeded",
    )


def char_limit(tokens: int) -> int:
    """The most characters of one text read for an input limit of ``tokens`` tokens."""
    return tokens * MAX_CHARS_PER_TOKEN


def text_too_long(param: str, chars: int, limit: int, remedy: str = TRUNCATE_REMEDY) -> InvalidRequest:
    """The 400 for a text refused before tokenising: more characters than ``limit`` tokens can hold."""
    return InvalidRequest(
        f"{param} is {chars} characters long, more than this model's limit of {limit} tokens can hold (at most "
        f"{char_limit(limit)} characters, {MAX_CHARS_PER_TOKEN} a token, are read). {remedy}",
        param=param,
        code="context_length_exceeded",
    )


def check_chars(texts: Sequence[str], limit: int, param: str, remedy: str = TRUNCATE_REMEDY) -> None:
    """:func:`text_too_long` for the first of ``texts`` over :func:`char_limit`, named ``param[i]``."""
    most = char_limit(limit)
    for index, text in enumerate(texts):
        if len(text) > most:
            raise text_too_long(f"{param}[{index}]", len(text), limit, remedy)


def check_lengths(lengths: Sequence[int], limit: int, param: str, remedy: str = TRUNCATE_REMEDY) -> None:
    """:func:`context_length_exceeded` for the first of ``lengths`` over ``limit``, named ``param[i]``."""
    for index, length in enumerate(lengths):
        if length > limit:
            raise context_length_exceeded(f"{param}[{index}]", length, limit, remedy)
