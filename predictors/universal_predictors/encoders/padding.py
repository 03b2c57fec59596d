"""Padded model inputs for a batch of token-id sequences of different lengths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def pad_batch(
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    device: str,
    *,
    left: bool = False,
    token_types: Sequence[Sequence[int]] | None = None,
    with_token_types: bool = False,
) -> dict[str, Any]:
    """``input_ids`` and ``attention_mask`` (1 on real tokens) as ``[rows, longest]`` tensors on ``device``.

    Padding goes right, or left when ``left`` (decoder-style tokenizers). ``token_type_ids`` is added when
    ``with_token_types`` (the tokenizer lists it among its model inputs): ``token_types`` per row, zeros
    where none are given. The pad id is the tokenizer's: RoBERTa-family models read positions from
    where ``input_ids`` differ from it, so any other id would shift them.
    """
    import torch

    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    types = torch.zeros((len(sequences), width), dtype=torch.long) if with_token_types else None
    for row, seq in enumerate(sequences):
        start = width - len(seq) if left else 0
        ids[row, start : start + len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, start : start + len(seq)] = 1
        if types is not None and token_types is not None:
            types[row, start : start + len(seq)] = torch.tensor(list(token_types[row]), dtype=torch.long)
    features: dict[str, Any] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if types is not None:
        features["token_type_ids"] = types.to(device)
    return features
