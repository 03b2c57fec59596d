"""Donut run in-process the way its model cards and transformers' document pipeline run it: the reference
the predictor's Donut family is held to (tests) and measured against (bench/vision.py).

Written from the Donut recipe, not from the predictor's code: the processor's pixel values, the task
prompt tokenised without special tokens as ``decoder_input_ids``, ``generate`` up to the decoder's
positions with ``<unk>`` banned, then the decoded text cleaned (end, padding and the task start token
removed) and parsed with ``DonutProcessor.token2json``.

The scores, from ``generate``'s: the sequence's (every generated token's probability multiplied); each
top-level field's (its tokens' from ``<s_NAME>`` to ``</s_NAME>``, the last writing of a field counting);
each class's (the ``<NAME/>`` tokens' softmax probability at the step after ``<s_class>``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]
    sequence: str
    fields: dict[str, Any]
    score: float
    field_scores: dict[str, float]
    class_scores: dict[str, float]


class DonutReference:
    def __init__(self, path: Path, *, num_beams: int = 1, device: str = "cpu", dtype: Any = None) -> None:
        import torch
        from transformers import DonutProcessor, VisionEncoderDecoderModel

        self.processor = DonutProcessor.from_pretrained(path, local_files_only=True)
        self.dtype = dtype or torch.float32
        self.device = device
        model = VisionEncoderDecoderModel.from_pretrained(path, local_files_only=True, dtype=self.dtype)
        # transformers wraps `to` in a decorator whose stub takes the model as the first argument
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self.num_beams = num_beams

    def generate(self, images: list[Any], prompt: str) -> Any:
        """The raw ``generate`` output for a batch of pages sharing ``prompt``."""
        import torch

        tokenizer = self.processor.tokenizer
        pixel_values = self.processor(images, return_tensors="pt").pixel_values.to(self.device, self.dtype)
        prompt_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(self.device)
        extra: dict[str, Any] = {"early_stopping": True} if self.num_beams > 1 else {}
        with torch.inference_mode():
            return self.model.generate(
                pixel_values,
                decoder_input_ids=prompt_ids.repeat(len(images), 1),
                max_length=self.model.decoder.config.max_position_embeddings,
                num_beams=self.num_beams,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                use_cache=True,
                bad_words_ids=[[tokenizer.unk_token_id]],
                return_dict_in_generate=True,
                output_scores=True,
                **extra,
            ), prompt_ids.shape[1]

    def run(self, image: Any, prompt: str) -> Reference:
        """One page, alone."""
        import torch

        tokenizer = self.processor.tokenizer
        out, prompt_length = self.generate([image], prompt)
        with torch.inference_mode():
            steps = self.model.compute_transition_scores(
                out.sequences, out.scores, out.beam_indices if self.num_beams > 1 else None,
                normalize_logits=self.num_beams == 1,
            )[0].tolist()  # fmt: skip
        row = out.sequences[0].tolist()
        generated = row[prompt_length:]
        if tokenizer.eos_token_id in generated:
            generated = generated[: generated.index(tokenizer.eos_token_id) + 1]
        sequence = self.processor.batch_decode(out.sequences)[0]
        sequence = sequence.replace(tokenizer.eos_token, "").replace(tokenizer.pad_token, "")
        sequence = re.sub(r"<.*?>", "", sequence, count=1).strip()  # the task start token
        tokens = tokenizer.convert_ids_to_tokens(generated)
        field_scores: dict[str, float] = {}
        stack: list[tuple[str, int]] = []  # (field, where its start tag is)
        for position, token in enumerate(tokens):
            if token.startswith("<s_") and token.endswith(">"):
                stack.append((token[3:-1], position))
            elif token.startswith("</s_") and token.endswith(">") and stack:
                name, start = stack.pop()
                if not stack and name == token[4:-1]:
                    field_scores[name] = math.exp(sum(steps[start : position + 1]))
        class_scores: dict[str, float] = {}
        if "<s_class>" in tokens[:-1]:
            step = tokens.index("<s_class>") + 1
            row = int(out.beam_indices[0, step]) if self.num_beams > 1 else 0
            probabilities = torch.softmax(out.scores[step][row].float(), dim=-1)
            for token, token_id in tokenizer.get_added_vocab().items():
                if re.fullmatch(r"<[^/<>]+/>", token) and token != "<sep/>":
                    class_scores[token[1:-2]] = float(probabilities[token_id])
        return Reference(generated, sequence, self.processor.token2json(sequence),
                         math.exp(sum(steps[: len(generated)])), field_scores, class_scores)  # fmt: skip
