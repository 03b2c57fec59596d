"""A tiny random-weight Whisper for the transcribe tests, built offline and saved with ``save_pretrained``.

No model hub is reachable, so the tokenizer is a byte-level BPE trained here on a few sentences, with
Whisper's special tokens after it in Whisper's order (``<|endoftext|>``, ``<|startoftranscript|>``, the
language tokens, the task tokens, ``<|notimestamps|>``) and the 1501 timestamp tokens ``<|0.00|>`` ..
``<|30.00|>`` last, as the real vocabulary has them (the tokenizer finds timestamps as the ids after its
last special token). The generation config carries what ``WhisperForConditionalGeneration.generate``
reads: the language and task token maps, the timestamp token, the suppressed tokens. Weights are random
with a fixed seed; the model's output is gibberish, but it is the same gibberish in-process and served,
which is what the tests compare.

:func:`build_tiny_ct2_whisper` converts such a model with CTranslate2's own converter, for the faster-whisper
backend (with Whisper's 448 decoder positions: faster-whisper decodes up to 448 tokens a window, as every real
Whisper has).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)

LANGUAGES = ["en", "de", "fr", "es"]
TASKS = ["translate", "transcribe"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world this is a test of speech recognition",
    "meeting notes voice memo call me back tomorrow",
    "one two three four five six seven eight nine ten",
]
MAX_TARGET_POSITIONS = 96

#: The shapes of the model :func:`build_tiny_whisper` writes: ``tiny`` (d_model 64, one layer each side: the tests'),
#: and ``base``, openai/whisper-base's (d_model 512, six layers each side, 8 heads, 74M parameters) with random
#: weights, for a benchmark whose engine compute should weigh as a real model's does.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 64, "layers": 1, "heads": 2, "ffn": 128},
    "base": {"d_model": 512, "layers": 6, "heads": 8, "ffn": 2048},
}


def build_tiny_whisper(path: Path, *, seed: int = 0, max_target_positions: int = MAX_TARGET_POSITIONS,
                       alignment_heads: bool = True, shape: str = "tiny") -> Path:  # fmt: skip
    """Write a tiny Whisper (model, tokenizer, feature extractor, generation config) to ``path`` (without
    ``alignment_heads`` in its generation config if told: no token timestamps, as some fine-tunes; ``shape``: one
    of :data:`SHAPES`)."""
    dims = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
    bpe.save_model(str(path))
    specials = [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *(f"<|{code}|>" for code in LANGUAGES),
        *(f"<|{task}|>" for task in TASKS),
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ]
    vocab = json.loads((path / "vocab.json").read_text())
    lines = (path / "merges.txt").read_text().splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#")]
    tokenizer = WhisperTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    ids: dict[str, int] = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in specials}  # type: ignore[arg-type]
    vocab_size = len(tokenizer)

    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=80,
        d_model=dims["d_model"],
        encoder_layers=dims["layers"],
        decoder_layers=dims["layers"],
        encoder_attention_heads=dims["heads"],
        decoder_attention_heads=dims["heads"],
        encoder_ffn_dim=dims["ffn"],
        decoder_ffn_dim=dims["ffn"],
        max_source_positions=1500,
        max_target_positions=max_target_positions,
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"],
    )
    model = WhisperForConditionalGeneration(config).eval()  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        max_length=max_target_positions,
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={task: ids[f"<|{task}|>"] for task in TASKS},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        begin_suppress_tokens=[ids["<|endoftext|>"]],
        suppress_tokens=[],
        max_initial_timestamp_index=50,
        return_timestamps=False,
    )
    if alignment_heads:
        # The decoder's heads whose cross-attention aligns tokens to audio (token timestamps): every head of the
        # last half of the layers, as CTranslate2's converter defaults to for a model without them.
        layers = dims["layers"]
        model.generation_config.alignment_heads = [
            [layer, head] for layer in range(layers // 2, layers) for head in range(dims["heads"])
        ]
    model.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=80)  # type: ignore[no-untyped-call]
    processor = WhisperProcessor(extractor, tokenizer)  # type: ignore[no-untyped-call]
    processor.save_pretrained(path)
    return path


def build_tiny_ct2_whisper(path: Path, *, seed: int = 0, shape: str = "tiny") -> Path:
    """A tiny Whisper built as :func:`build_tiny_whisper` does (under ``path/transformers``), converted with
    ``ctranslate2.converters.TransformersConverter`` to ``path/ctranslate2`` (``model.bin``, CTranslate2's
    ``config.json``, the vocabulary, and the tokenizer.json faster-whisper reads). Returns the converted folder."""
    import ctranslate2

    source = build_tiny_whisper(path / "transformers", seed=seed, max_target_positions=448, shape=shape)
    converter = ctranslate2.converters.TransformersConverter(str(source), copy_files=["tokenizer.json"])
    return Path(converter.convert(str(path / "ctranslate2"), force=True))
