"""Tiny LayoutLMv3 models (question answering, token classification, sequence classification), built offline.

No model hub is reachable: the tokenizer is LayoutLMv3's byte-level BPE over a vocabulary of RoBERTa's
special tokens and the 256 byte symbols (no merges: every character is a token), the image processor
resizes to 64x64 (four 16-pixel patches a side) with ``apply_ocr=False``, and the weights are random with
a fixed seed (a wide init, so labels and answers differ from word to word). Saved with ``save_pretrained``
as a checkpoint directory the predictor loads like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from tokenizers import pre_tokenizers
from transformers import (
    LayoutLMv3Config,
    LayoutLMv3ForQuestionAnswering,
    LayoutLMv3ForSequenceClassification,
    LayoutLMv3ForTokenClassification,
    LayoutLMv3ImageProcessor,
    LayoutLMv3Processor,
    LayoutLMv3Tokenizer,
)

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
FIELD_LABELS = ["O", "B-INVOICE", "I-INVOICE", "B-TOTAL", "I-TOTAL", "B-DATE", "I-DATE"]
PAGE_LABELS = ["invoice", "letter", "form"]
IMAGE_SIZE = 64
POSITIONS = 514  # 512 tokens after RoBERTa's pad offset

Head = Literal["qa", "extract", "classify"]


def vocabulary() -> dict[str, int]:
    symbols = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    return {symbol: i for i, symbol in enumerate(symbols)}


def build_processor(directory: Path) -> LayoutLMv3Processor:
    tokenizer = LayoutLMv3Tokenizer(vocab=vocabulary(), merges=[], model_max_length=POSITIONS - 2)
    images = LayoutLMv3ImageProcessor(apply_ocr=False, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LayoutLMv3Processor(image_processor=images, tokenizer=tokenizer)
    processor.save_pretrained(directory)
    return processor


def build_layoutlm(directory: Path, head: Head, *, seed: int = 0) -> Path:
    """A random-weight LayoutLMv3 with the ``head`` the document routes name, and its processor."""
    labels = {"qa": ["start", "end"], "extract": FIELD_LABELS, "classify": PAGE_LABELS}[head]
    config = LayoutLMv3Config(
        vocab_size=len(vocabulary()),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=POSITIONS,
        coordinate_size=6,  # 4 coordinates x 6 + 2 sizes x 4 = hidden_size
        shape_size=4,
        input_size=IMAGE_SIZE,
        patch_size=16,
        initializer_range=0.5,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    classes = {"qa": LayoutLMv3ForQuestionAnswering, "extract": LayoutLMv3ForTokenClassification,
               "classify": LayoutLMv3ForSequenceClassification}  # fmt: skip
    torch.manual_seed(seed)
    model = classes[head](config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_processor(directory)
    return directory
