"""LayoutLMv3: text, 2-D positions (our OCR words on the 0-1000 grid) and image patches, with one of three heads.

The processor is the checkpoint's own (``LayoutLMv3Processor``) with ``apply_ocr=False``: the words and
boxes are this project's OCR engines' (or the request's), never a second OCR stack. Heads, from the
config's ``architectures``: ``LayoutLMv3ForQuestionAnswering`` (extractive QA over the page's words),
``LayoutLMv3ForTokenClassification`` (a label per word, grouped into fields by the B-/I- scheme of
``id2label``), ``LayoutLMv3ForSequenceClassification`` (a class for the page).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from universal_predictors.devices import detect_device, dtype_for, release_memory
from universal_predictors.document.family import DocumentModel, Head, PageJob
from universal_predictors.document.words import PageWords

HEADS = {
    "LayoutLMv3ForQuestionAnswering": Head.QA,
    "LayoutLMv3ForTokenClassification": Head.EXTRACT,
    "LayoutLMv3ForSequenceClassification": Head.CLASSIFY,
}
#: The longest answer (in tokens) question answering considers, as transformers' QA pipelines default to.
MAX_ANSWER_TOKENS = 15


def softmax(values: np.ndarray) -> np.ndarray:
    shifted = np.exp(values - values.max(axis=-1, keepdims=True))
    out: np.ndarray = shifted / shifted.sum(axis=-1, keepdims=True)
    return out


def entity_of(label: str) -> tuple[str | None, str | None]:
    """``B-TOTAL`` -> ("B", "TOTAL"); ``O`` -> (None, None); a label without a prefix is its own entity."""
    if label.upper() == "O":
        return None, None
    if len(label) > 2 and label[1] in "-_" and label[0].upper() in "BIES":
        return label[0].upper(), label[2:]
    return None, label


def group_fields(labels: Sequence[str], scores: Sequence[float]) -> list[tuple[str, list[int], float]]:
    """Consecutive words of one entity as a field: (name, word indices, mean score).

    ``B-X`` starts a field, ``I-X`` continues an ``X`` field (or starts one after anything else), an
    unprefixed label continues a run of the same label; ``O`` ends the field."""
    fields: list[tuple[str, list[int], list[float]]] = []
    current: str | None = None
    for i, (label, score) in enumerate(zip(labels, scores, strict=True)):
        prefix, name = entity_of(label)
        if name is None:
            current = None
            continue
        if prefix in ("B", "S") or name != current:
            fields.append((name, [i], [score]))
        else:
            fields[-1][1].append(i)
            fields[-1][2].append(score)
        current = None if prefix in ("E", "S") else name
    return [(name, words, float(np.mean(s))) for name, words, s in fields]


@dataclass
class Encoded:
    """One page's model inputs (batch of one, unpadded) and the token -> word map."""

    features: dict[str, Any]
    word_ids: list[int | None]
    sequence_ids: list[int | None]
    truncated: bool

    @property
    def tokens(self) -> int:
        return len(self.word_ids)


class LayoutLMv3Model(DocumentModel):
    family: ClassVar[str] = "layoutlmv3"
    needs_words: ClassVar[bool] = True

    @classmethod
    def heads(cls) -> dict[str, Head]:
        return dict(HEADS)

    @classmethod
    def head_of(cls, architectures: Sequence[str]) -> Head | None:
        for name in architectures:
            if name in HEADS:
                return HEADS[name]
        return None

    def load(self, device: str, dtype: str) -> None:
        import torch
        import transformers
        from transformers import AutoProcessor

        classes = {Head.QA: transformers.LayoutLMv3ForQuestionAnswering,
                   Head.EXTRACT: transformers.LayoutLMv3ForTokenClassification,
                   Head.CLASSIFY: transformers.LayoutLMv3ForSequenceClassification}  # fmt: skip
        self.device = detect_device(device)
        self.processor = AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            self.source, apply_ocr=False, local_files_only=True
        )
        model_class: Any = classes[self.head]
        model = model_class.from_pretrained(self.source, local_files_only=True, dtype=dtype_for(self.device, dtype))
        self.model = model.to(self.device).eval()
        self._torch = torch
        config = self.model.config
        tokenizer = self.processor.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 1
        # RoBERTa-style positions start after pad_token_id: that many rows of the table are never used.
        limit = int(config.max_position_embeddings) - int(config.pad_token_id or 0) - 1
        model_max = getattr(tokenizer, "model_max_length", None)
        if isinstance(model_max, int) and 0 < model_max < limit:
            limit = model_max
        self.max_tokens = limit
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        multi = getattr(config, "problem_type", None) == "multi_label_classification"
        self.score_function = "sigmoid" if multi else "softmax"

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_input_tokens": self.max_tokens}
        if self.head is Head.EXTRACT:
            out["fields"] = self.field_names()
        elif self.head is Head.CLASSIFY:
            out["labels"] = self.labels
        return out

    def close(self) -> None:
        for attribute in ("model", "processor"):
            if hasattr(self, attribute):
                delattr(self, attribute)
        release_memory(getattr(self, "device", "cpu"))

    # -- worker thread ---------------------------------------------------------------------------------

    def encode(self, job: PageJob) -> Encoded:
        assert job.words is not None
        words = job.words.words
        boxes = [list(box) for box in job.words.normalised]
        common: dict[str, Any] = {"boxes": boxes, "return_tensors": "pt", "truncation": True}
        if self.head is Head.QA:
            inputs = self.processor(job.image, job.question, words, truncation="only_second",
                                    boxes=boxes, return_tensors="pt", max_length=self.max_tokens)  # fmt: skip
            full = self.processor.tokenizer(job.question, words, boxes=boxes)
        else:
            inputs = self.processor(job.image, words, max_length=self.max_tokens, **common)
            full = self.processor.tokenizer(words, boxes=boxes)
        features = {key: value for key, value in inputs.items()}
        return Encoded(
            features=features,
            word_ids=list(inputs.word_ids(0)),
            sequence_ids=list(inputs.sequence_ids(0)),
            truncated=len(full["input_ids"]) > int(features["input_ids"].shape[1]),
        )

    def cost(self, encoded: Encoded) -> int:
        return encoded.tokens

    # -- engine thread ---------------------------------------------------------------------------------

    def forward(self, batch: Sequence[Encoded]) -> list[Any]:
        torch = self._torch
        longest = max(item.tokens for item in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        bbox = torch.zeros((len(batch), longest, 4), dtype=torch.long)
        for row, item in enumerate(batch):
            n = item.tokens
            ids[row, :n] = item.features["input_ids"][0]
            mask[row, :n] = item.features["attention_mask"][0]
            bbox[row, :n] = item.features["bbox"][0]
        pixels = torch.cat([item.features["pixel_values"] for item in batch])
        inputs = {"input_ids": ids, "attention_mask": mask, "bbox": bbox, "pixel_values": pixels.to(self.model.dtype)}
        with torch.inference_mode():
            out = self.model(**{key: value.to(self.device) for key, value in inputs.items()})
        if self.head is Head.QA:
            start = out.start_logits.float().cpu().numpy()
            end = out.end_logits.float().cpu().numpy()
            return [(start[row, : item.tokens], end[row, : item.tokens]) for row, item in enumerate(batch)]
        logits = out.logits.float().cpu().numpy()
        if self.head is Head.CLASSIFY:
            return [logits[row] for row in range(len(batch))]
        return [logits[row, : item.tokens] for row, item in enumerate(batch)]

    # -- answers -----------------------------------------------------------------------------------------

    def qa(self, encoded: Encoded, output: Any, words: PageWords | None) -> dict[str, Any]:
        start_logits, end_logits = (np.asarray(v, dtype=np.float64) for v in output)
        context = np.array([s == 1 and w is not None for s, w in zip(encoded.sequence_ids, encoded.word_ids,
                                                                       strict=True)])  # fmt: skip
        if not context.any():
            return {"answer": None, "score": 0.0, "start": None, "end": None, "words": []}
        start_p = softmax(np.where(context, start_logits, -np.inf))
        end_p = softmax(np.where(context, end_logits, -np.inf))
        scores = np.triu(np.outer(start_p, end_p))
        scores = np.tril(scores, MAX_ANSWER_TOKENS - 1)
        s, e = np.unravel_index(int(np.argmax(scores)), scores.shape)
        first, last = encoded.word_ids[int(s)], encoded.word_ids[int(e)]
        assert first is not None
        assert last is not None
        assert words is not None
        indices = list(range(first, last + 1))
        return {
            "answer": " ".join(words.words[i] for i in indices),
            "score": float(scores[s, e]),
            "start": first,
            "end": last,
            "words": indices,
        }

    def field_names(self) -> list[str]:
        names: list[str] = []
        for label in self.labels:
            _, name = entity_of(label)
            if name is not None and name not in names:
                names.append(name)
        return names

    def word_labels(self, encoded: Encoded, output: Any) -> tuple[list[str], list[float]]:
        """Each word's label and score, from its first token (the token LayoutLM labels a word by)."""
        probabilities = softmax(np.asarray(output, dtype=np.float64))
        first: dict[int, int] = {}
        for token, word in enumerate(encoded.word_ids):
            if word is not None and word not in first:
                first[word] = token
        labels, scores = [], []
        for word in sorted(first):
            row = probabilities[first[word]]
            best = int(np.argmax(row))
            labels.append(self.labels[best])
            scores.append(float(row[best]))
        return labels, scores

    def extract(self, encoded: Encoded, output: Any, words: PageWords | None) -> list[dict[str, Any]]:
        assert words is not None
        labels, scores = self.word_labels(encoded, output)
        return [
            {"name": name, "text": " ".join(words.words[i] for i in indices), "score": score, "words": indices}
            for name, indices, score in group_fields(labels, scores)
        ]

    def classify(self, encoded: Encoded, output: Any) -> list[tuple[str, float]]:
        logits = np.asarray(output, dtype=np.float64)
        scores = softmax(logits) if self.score_function == "softmax" else 1.0 / (1.0 + np.exp(-logits))
        order = np.argsort(-scores, kind="stable")
        return [(self.labels[int(i)], float(scores[int(i)])) for i in order]
