"""Tiny BERTs for the classify and NER tests, built offline and saved with ``save_pretrained``.

No model hub is reachable, so the tokenizer is a hand-written WordPiece vocabulary (lower-casing,
accent-stripping BERT normaliser: offsets into the original text are then non-trivial) and the
weights are random with a fixed seed.

The token classifier is additionally *constructed*: every vocabulary entry's word embedding is
designed so that, at the classifier, the token's logits are close to a target row chosen here
(:data:`NER_TARGETS`); the encoder layer keeps small random weights, so context and position still
move the logits a little (a padding or position bug would show against an in-process reference),
while the label of a known token stays known.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    PreTrainedTokenizerFast,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [
    "john", "smith", "paris", "acme", "corp", "new", "york", "jose", "maria", "garcia", "lives", "in", "works",
    "at", "for", "the", "and", "visited", "said", "hello", "world", "good", "bad", "great", "terrible", "movie",
    "is", "was", "a", "very", "not", "this", "i", "love", "hate", "it", "buy", "now", "free", "money", "please",
    "help", "urgent", "question", "why", "what", "mr", "dr", "bank", "of", "london", "berlin", "gold",
]  # fmt: skip
PIECES = ["##son", "##berg", "##ville", "##ton", "##s", "##ing", "##ed"]
#: Single characters and their continuation forms, so any ASCII word tokenizes without [UNK].
CHARS = list(string.ascii_lowercase + string.digits + string.punctuation)

NER_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
CLASSIFY_LABELS = ["negative", "neutral", "positive"]
MULTI_LABELS = ["toxic", "spam", "urgent", "question"]
MAX_POSITIONS = 64
CALIBRATION_TEXTS = [
    "the bank of london", "dr garcia said hello", "new york was great", "mr smith lives in berlin",
    "free free free", "it was not very good", "i hate it", "what now", "help", "for the money",
]  # fmt: skip

#: The logits the token classifier is built to give a token (index into :data:`NER_LABELS`), before
#: the small contextual perturbation. Every other token gets a confident "O".
#: - ``john smith``: a clear two-token person; ``acme corp`` an organisation; ``paris`` a location.
#: - ``Johnson`` = ``john ##son``: the piece leans I-ORG, so ``simple`` splits the word into PER + ORG
#:   while the word-level strategies (``first``, ``max``, ``average``) keep one PER entity.
#: - ``Goldberg`` = ``gold ##berg``: a weak B-PER first piece and a confident B-ORG second piece, so
#:   ``first`` says PER while ``max`` and ``average`` say ORG.
NER_TARGETS: dict[str, list[float]] = {
    #           O     B-PER  I-PER  B-ORG  I-ORG  B-LOC  I-LOC
    "john":   [0.0,   5.0,   1.0,   0.0,   0.0,   0.0,   0.0],
    "smith":  [0.0,   1.0,   5.0,   0.0,   0.0,   0.0,   0.0],
    "jose":   [0.0,   4.5,   1.0,   0.0,   0.0,   0.0,   0.0],
    "garcia": [0.0,   1.0,   4.5,   0.0,   0.0,   0.0,   0.0],
    "##son":  [0.0,   0.0,   2.0,   0.0,   3.5,   0.0,   0.0],
    "gold":   [1.5,   2.5,   0.0,   1.0,   0.0,   0.0,   0.0],
    "##berg": [0.0,   0.0,   0.0,   6.0,   2.0,   0.0,   0.0],
    "acme":   [0.0,   0.0,   0.0,   5.0,   1.0,   0.0,   0.0],
    "corp":   [0.0,   0.0,   0.0,   1.0,   5.0,   0.0,   0.0],
    "paris":  [0.0,   0.0,   0.0,   0.0,   0.0,   5.0,   1.0],
    "london": [0.0,   0.0,   0.0,   0.0,   0.0,   5.0,   1.0],
    "berlin": [0.0,   0.0,   0.0,   0.0,   0.0,   5.0,   1.0],
}  # fmt: skip
NER_DEFAULT_TARGET = [5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]

_SCALE = 4.0  # classifier gain: logits = _SCALE * hidden[:num_labels]


#: RoBERTa's special tokens, in its order: ``<pad>`` is id 1, the id its position numbering starts after.
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def vocabulary(specials: list[str] = SPECIALS) -> list[str]:
    return specials + CHARS + ["##" + c for c in CHARS] + WORDS + PIECES


def build_tokenizer(
    directory: Path, *, roberta: bool = False, model_max_length: int | None = MAX_POSITIONS
) -> PreTrainedTokenizerFast:
    """The WordPiece tokenizer; ``roberta``: with RoBERTa's special tokens, templates and model inputs (no
    token types). ``model_max_length`` None leaves the limit unset, as many RoBERTa checkpoints do."""
    cls, pad, sep, unk, mask = ("<s>", "<pad>", "</s>", "<unk>", "<mask>") if roberta else (
        "[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]")  # fmt: skip
    vocab = {token: i for i, token in enumerate(vocabulary(ROBERTA_SPECIALS if roberta else SPECIALS))}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk, continuing_subword_prefix="##"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    extra: dict[str, Any] = {"model_max_length": model_max_length} if model_max_length is not None else {}
    if roberta:
        extra["model_input_names"] = ["input_ids", "attention_mask"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=unk,
        pad_token=pad,
        cls_token=cls,
        sep_token=sep,
        mask_token=mask,
        **extra,
    )
    tokenizer.save_pretrained(directory)
    return tokenizer


def _config(num_labels: int, labels: list[str], **extra: Any) -> BertConfig:
    return BertConfig(
        vocab_size=len(vocabulary()),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=MAX_POSITIONS,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        num_labels=num_labels,
        **extra,
    )


def build_sequence_classifier(directory: Path, *, multi_label: bool = False, seed: int = 0) -> Path:
    """A random-weight BERT sequence classifier: 3 sentiment labels (softmax) or 4 flags (sigmoid)."""
    labels = MULTI_LABELS if multi_label else CLASSIFY_LABELS
    problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    torch.manual_seed(seed)
    # The default init (std 0.02) gives every text the same scores; a wide init makes them differ.
    config = _config(len(labels), labels, problem_type=problem_type, initializer_range=0.5)
    model = BertForSequenceClassification(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    if multi_label:
        # Centre each label's logit on a small corpus so sigmoid scores fall on both sides of 0.5.
        with torch.no_grad():
            batch = tokenizer(CALIBRATION_TEXTS, padding=True, return_tensors="pt")
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            model.classifier.bias.sub_(logits.median(dim=0).values)
    model.save_pretrained(directory)
    return directory


def _design_embedding(target_logits: list[float], hidden: int) -> np.ndarray:
    """A vector v with LayerNorm(v) == v (mean 0, variance 1) and ``_SCALE * v[:L] == target_logits``."""
    head = np.asarray(target_logits, dtype=np.float64) / _SCALE
    head -= head.mean()  # softmax is shift-invariant: centre the head so the tail stays small
    rest = hidden - len(head)
    mean_fill = -head.sum() / rest
    pattern = np.array([1.0 if i % 2 == 0 else -1.0 for i in range(rest)])
    if rest % 2:
        pattern[-1] = 0.0  # keep the pattern's sum at zero
    remaining = hidden - (head**2).sum() - rest * mean_fill**2
    assert remaining > 0, "target logits too large for the hidden size"
    tail = mean_fill + np.sqrt(remaining / (pattern**2).sum()) * pattern
    return np.concatenate([head, tail])


def ner_targets(token: str) -> list[float]:
    return NER_TARGETS.get(token, NER_DEFAULT_TARGET)


def build_token_classifier(directory: Path, *, seed: int = 0, context_gain: float = 0.05) -> Path:
    """A BERT token classifier whose per-token logits are designed (see the module docstring)."""
    torch.manual_seed(seed)
    config = _config(len(NER_LABELS), NER_LABELS)
    model = BertForTokenClassification(config).eval()
    hidden = config.hidden_size
    with torch.no_grad():
        table = np.stack([_design_embedding(ner_targets(token), hidden) for token in vocabulary()])
        model.bert.embeddings.word_embeddings.weight.copy_(torch.from_numpy(table).float())
        # Residual branches stay random but small: context nudges the logits without flipping labels.
        for layer in model.bert.encoder.layer:
            layer.attention.output.dense.weight.mul_(context_gain)
            layer.attention.output.dense.bias.zero_()
            layer.output.dense.weight.mul_(context_gain)
            layer.output.dense.bias.zero_()
        head = torch.zeros(len(NER_LABELS), hidden)
        head[:, : len(NER_LABELS)] = torch.eye(len(NER_LABELS)) * _SCALE
        model.classifier.weight.copy_(head)
        model.classifier.bias.zero_()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    return directory


#: The limit-test models' families: BERT numbers positions from 0; RoBERTa from ``pad_token_id + 1``.
Family = Literal["bert", "roberta"]
#: What a limit-test model's head serves: an embedding model (no head), a sequence classifier (classify),
#: a one-logit sequence classifier (a rerank cross-encoder), a token classifier (NER).
Head = Literal["embed", "classify", "cross-encoder", "ner"]
#: The BERT limit-test tokenizer's ``model_max_length``: below the 64 positions, so it is what binds.
BERT_TOKENIZER_LIMIT = 48
#: The RoBERTa limit-test model's position table: 66 rows, of which pad id 1 + 1 go before the first position.
ROBERTA_POSITIONS = 66
#: The input limit each family's limit-test models have (special tokens included).
LIMITS: dict[str, int] = {"bert": BERT_TOKENIZER_LIMIT, "roberta": ROBERTA_POSITIONS - 2}


def build_limit_model(directory: Path, family: Family, head: Head, *, seed: int = 0) -> Path:
    """A random-weight encoder whose input limit comes from a different rule per family (:data:`LIMITS`):
    BERT with 64 positions and a tokenizer that says 48; RoBERTa with 66 positions, ``pad_token_id`` 1 and
    a tokenizer that says nothing, so only the position offset keeps an input inside the table."""
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        RobertaConfig,
    )

    roberta = family == "roberta"
    labels = {"embed": CLASSIFY_LABELS, "classify": CLASSIFY_LABELS, "cross-encoder": ["relevant"],
              "ner": NER_LABELS}[head]  # fmt: skip
    common: dict[str, Any] = {
        "vocab_size": len(vocabulary(ROBERTA_SPECIALS if roberta else SPECIALS)),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        "id2label": dict(enumerate(labels)),
        "label2id": {label: i for i, label in enumerate(labels)},
    }
    if roberta:
        config: Any = RobertaConfig(max_position_embeddings=ROBERTA_POSITIONS, pad_token_id=1, bos_token_id=0,
                                    eos_token_id=2, type_vocab_size=1, **common)  # fmt: skip
    else:
        config = BertConfig(max_position_embeddings=MAX_POSITIONS, **common)
    classifier = AutoModelForSequenceClassification
    auto = {"embed": AutoModel, "classify": classifier, "cross-encoder": classifier,
            "ner": AutoModelForTokenClassification}[head]  # fmt: skip
    torch.manual_seed(seed)
    model = auto.from_config(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_tokenizer(directory, roberta=roberta, model_max_length=None if roberta else BERT_TOKENIZER_LIMIT)
    return directory
