"""The OCR-free family of the document task: Donut-style encoder-decoders (a Swin/DonutSwin image encoder,
an MBart/BART text decoder, a ``DonutProcessor``) run through transformers' ``generate``.

Each route is a task prompt the decoder continues: ``<s_docvqa><s_question>QUESTION</s_question><s_answer>``
for question answering, ``<s_cord-v2>`` (or the model's own start token) for extraction, ``<s_rvlcdip>`` for
classification. What the decoder writes is Donut's tag language (``<s_total>12.50</s_total>``), turned into
JSON by the processor's own ``token2json``, as the Donut model cards and transformers' document
question-answering pipeline do. Scores are probabilities read from ``generate``'s scores (with beams,
along the beam that won): an answer's is the sequence's (the product of every generated token's
probability); an extracted field's is the product of its own tokens' probabilities, from its
``<s_NAME>`` to its ``</s_NAME>`` (the probability the decoder wrote that field as it did, given what it
had written before); a classification lists every class the model knows (its ``<CLASS/>`` tokens) with
its probability at the step where the class is written, the one after ``<s_class>``.

Donut reads the page itself and returns no words or boxes: a Donut answer's ``words`` are empty.

Pages of concurrent requests share ``generate`` calls when their prompts have the same length (the
decoder's learned positions make padding change the result; extraction and classification prompts are
fixed per model, so those always batch).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from universal_predictors.base import StartupError
from universal_predictors.devices import detect_device, dtype_for, release_memory
from universal_predictors.document.family import DocumentModel, Head, PageJob
from universal_predictors.document.words import PageWords
from universal_predictors.errors import InvalidRequest

#: Encoder model types of the Donut family (``VisionEncoderDecoderConfig.encoder.model_type``).
DONUT_ENCODERS = frozenset({"donut-swin", "swin"})

#: The default task prompts, as the Donut model cards write them; ``{question}`` is the question.
QA_PROMPT = "<s_docvqa><s_question>{question}</s_question><s_answer>"
EXTRACT_PROMPT = "<s_cord-v2>"
CLASSIFY_PROMPT = "<s_rvlcdip>"

_TAG = re.compile(r"<[^<>]+>")
_FIELD_START = re.compile(r"^<s_(.+)>$")
_FIELD_END = re.compile(r"^</s_(.+)>$")
_CATEGORY = re.compile(r"^<([^/<>]+)/>$")  # a categorical value (``<letter/>``); ``<sep/>`` separates


def is_donut(source: str | Path) -> bool:
    """Whether ``source`` holds a Donut-style checkpoint: a vision-encoder-decoder over a (Donut)Swin encoder."""
    path = Path(source) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    encoder = config.get("encoder") if isinstance(config.get("encoder"), dict) else {}
    return config.get("model_type") == "vision-encoder-decoder" and encoder.get("model_type") in DONUT_ENCODERS


@dataclass(frozen=True)
class DonutJob:
    """One page, preprocessed, and the task prompt to continue (token ids)."""

    pixel_values: Any  # a (1, channels, height, width) tensor from the processor
    prompt_ids: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class DonutOutput:
    """What the decoder wrote for one page."""

    token_ids: list[int]  # generated after the prompt, the end-of-sequence token included when written
    sequence: str  # the decoded output with the task start token, end and padding tokens removed
    fields: dict[str, Any]  # token2json of the sequence
    score: float  # the probability of the generated tokens
    token_logprobs: list[float]  # each generated token's log-probability, in order
    classes: dict[str, float]  # the class tokens' probabilities at the step after <s_class>; {} when none


def tags(prompt: str) -> list[str]:
    return _TAG.findall(prompt)


class DonutEngine:
    """One Donut model and its processor on one device; :meth:`generate_batch` runs on the engine thread."""

    name = "donut"

    def __init__(
        self,
        source: str,
        *,
        device: str,
        dtype: Any,
        max_length: int | None = None,
        num_beams: int = 1,
        qa_prompt: str = QA_PROMPT,
        extract_prompt: str = EXTRACT_PROMPT,
        classify_prompt: str = CLASSIFY_PROMPT,
    ) -> None:
        from transformers import DonutProcessor, VisionEncoderDecoderModel

        self.processor = DonutProcessor.from_pretrained(source, local_files_only=True)
        model = VisionEncoderDecoderModel.from_pretrained(source, local_files_only=True, dtype=dtype)
        self.model: Any = model.to(device).eval()  # type: ignore[arg-type]  # transformers' to() stub
        self.device = device
        self.dtype = dtype
        tokenizer = self.processor.tokenizer
        self.tokenizer = tokenizer
        positions = int(getattr(self.model.config.decoder, "max_position_embeddings", 0) or 0)
        self.max_length = min(max_length, positions) if max_length and positions else (max_length or positions)
        if not self.max_length:
            raise ValueError(f"{source}: the decoder has no max_position_embeddings; set the engine arg max_length")
        self.num_beams = num_beams
        self.added_vocab: dict[str, int] = tokenizer.get_added_vocab()
        self.prompts = {"qa": qa_prompt, "extract": extract_prompt, "classify": classify_prompt}
        # A route the checkpoint was not fine-tuned for has task tokens its tokenizer lacks.
        self.missing: dict[str, list[str]] = {
            route: [tag for tag in tags(prompt.replace("{question}", "")) if tag not in self.added_vocab]
            for route, prompt in self.prompts.items()
        }
        task_starts = {tags(prompt)[0] for prompt in self.prompts.values() if tags(prompt)}
        starts = [(token, match.group(1)) for token in self.added_vocab if (match := _FIELD_START.match(token))]
        self.field_names = sorted(
            name for token, name in starts if token not in task_starts and f"</s_{name}>" in self.added_vocab
        )
        self.bad_words = [[tokenizer.unk_token_id]] if tokenizer.unk_token_id is not None else None
        self.added_by_id: dict[int, str] = {index: token for token, index in self.added_vocab.items()}
        #: The classes the model knows: its categorical tokens, by name (``<letter/>`` -> letter).
        self.class_ids: dict[str, int] = {
            match.group(1): index
            for token, index in self.added_vocab.items()
            if (match := _CATEGORY.match(token)) and match.group(1) != "sep"
        }
        self.class_start = self.added_vocab.get("<s_class>")

    # -- prompts -------------------------------------------------------------------------------------------------

    def routes(self) -> list[str]:
        """The routes this checkpoint answers (its tokenizer has their task tokens)."""
        return [route for route, missing in self.missing.items() if not missing]

    def prompt_ids(self, route: str, question: str | None = None) -> tuple[int, ...]:
        """The task prompt of ``route`` as token ids; a 400 when the model has no such task or the question
        carries the model's own tags."""
        missing = self.missing[route]
        if missing:
            arg = f"{route}_prompt"
            raise InvalidRequest(
                f"this Donut model has no {', '.join(missing)} token, so it was not fine-tuned for /v1/document/"
                f"{route}; it answers {', '.join('/v1/document/' + r for r in self.routes()) or 'no route'} "
                f"(set the engine arg {arg} to the task prompt it was trained with)",
                code="unsupported_route",
            )
        prompt = self.prompts[route]
        if "{question}" in prompt:
            if question is None or not question.strip():
                raise InvalidRequest("question: must not be empty", param="question")
            found = [
                tag for tag in tags(question) if tag in self.added_vocab or tag in self.tokenizer.all_special_tokens
            ]
            if found:
                raise InvalidRequest(
                    f"question: must not contain the model's own tags ({', '.join(found)})", param="question"
                )
            prompt = prompt.replace("{question}", question)
        ids = tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if len(ids) >= self.max_length:
            raise InvalidRequest(
                f"question: the task prompt is {len(ids)} tokens; this model generates at most {self.max_length} "
                "tokens in all (engine arg max_length), so shorten the question",
                param="question",
                code="context_length_exceeded",
            )
        return ids

    def encode(self, image: Any, route: str, question: str | None = None) -> DonutJob:
        """One page's pixels and prompt (blocking: a worker thread's job, not the engine thread's)."""
        pixel_values = self.processor(images=image.convert("RGB"), return_tensors="pt").pixel_values
        return DonutJob(pixel_values, self.prompt_ids(route, question))

    # -- generation ----------------------------------------------------------------------------------------------

    def generate_batch(self, jobs: Sequence[DonutJob]) -> list[DonutOutput]:
        """Every job's output, in order; jobs whose prompts have the same length share one ``generate``."""
        groups: dict[int, list[int]] = {}
        for index, job in enumerate(jobs):
            groups.setdefault(len(job.prompt_ids), []).append(index)
        results: list[DonutOutput | None] = [None] * len(jobs)
        for members in groups.values():
            outputs = self.generate([jobs[i] for i in members])
            for index, output in zip(members, outputs, strict=True):
                results[index] = output
        return [result for result in results if result is not None]

    def generate_kwargs(self) -> dict[str, Any]:
        """What ``generate`` is called with besides the inputs (the in-process reference uses the same)."""
        tokenizer = self.tokenizer
        kwargs: dict[str, Any] = {
            "max_length": self.max_length,
            "num_beams": self.num_beams,
            "do_sample": False,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "use_cache": True,
            "bad_words_ids": self.bad_words,
            "return_dict_in_generate": True,
            "output_scores": True,
        }
        if self.num_beams > 1:
            kwargs["early_stopping"] = True
        return kwargs

    def generate(self, jobs: Sequence[DonutJob]) -> list[DonutOutput]:
        import torch

        pixel_values = torch.cat([job.pixel_values for job in jobs])
        prompts = torch.tensor([list(job.prompt_ids) for job in jobs], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                pixel_values.to(self.device, self.dtype), decoder_input_ids=prompts, **self.generate_kwargs()
            )
            beams = out.beam_indices if self.num_beams > 1 else None
            transition = self.model.compute_transition_scores(
                out.sequences, out.scores, beams, normalize_logits=self.num_beams == 1
            )
            sequences = out.sequences.tolist()
            transition_rows = transition.float().cpu().tolist()
            prompt_length = prompts.shape[1]
            outputs = []
            for index, (row, logprobs) in enumerate(zip(sequences, transition_rows, strict=True)):
                generated = self.trimmed(row[prompt_length:])
                classes = self.class_scores(out, beams, index, generated)
                outputs.append(self.output(generated, row[:prompt_length], logprobs, classes))
        return outputs

    def trimmed(self, generated: list[int]) -> list[int]:
        """The generated tokens up to the end-of-sequence token (included), without the padding after it."""
        eos = self.tokenizer.eos_token_id
        return generated[: generated.index(eos) + 1] if eos in generated else generated

    def class_scores(self, out: Any, beams: Any, index: int, generated: list[int]) -> dict[str, float]:
        """Every class's probability at the step after ``<s_class>`` (the step that writes the class): the
        softmax of that step's scores (with beams, the winning beam's row; a row's beam score is a constant
        the softmax ignores). {} when the model has no classes or wrote no ``<s_class>``."""
        import torch

        if not self.class_ids or self.class_start not in generated:
            return {}
        step = generated.index(self.class_start) + 1
        if step >= len(generated) or step >= len(out.scores):
            return {}
        row = int(beams[index, step]) if beams is not None else index
        probs = torch.softmax(out.scores[step][row].float(), dim=-1)
        ids = list(self.class_ids.values())
        values = probs[torch.tensor(ids, device=probs.device)].cpu().tolist()
        return dict(zip(self.class_ids, values, strict=True))

    def output(self, generated: list[int], prompt: list[int], logprobs: list[float], classes: dict[str, float]
               ) -> DonutOutput:  # fmt: skip
        steps = logprobs[: len(generated)]
        sequence = self.clean(self.tokenizer.decode(prompt + generated))
        fields = self.processor.token2json(sequence)  # type: ignore[no-untyped-call]
        return DonutOutput(generated, sequence, fields, math.exp(sum(steps)), steps, classes)

    def field_scores(self, output: DonutOutput) -> dict[str, float]:
        """Each top-level field's probability: the product of its tokens' probabilities, ``<s_NAME>`` to
        ``</s_NAME>`` included (nested fields inside it count as its tokens). A field written twice is
        scored by its last writing, the one ``token2json`` keeps."""
        scores: dict[str, float] = {}
        depth, name, start = 0, "", 0
        for position, token_id in enumerate(output.token_ids):
            token = self.added_by_id.get(token_id, "")
            if match := _FIELD_START.match(token):
                if depth == 0:
                    name, start = match.group(1), position
                depth += 1
            elif match := _FIELD_END.match(token):
                depth = max(depth - 1, 0)
                if depth == 0 and match.group(1) == name:
                    scores[name] = math.exp(sum(output.token_logprobs[start : position + 1]))
                    name = ""
        return scores

    def clean(self, text: str) -> str:
        """The decoded text as Donut's own recipe cleans it: no end or padding tokens, no task start token."""
        tokenizer = self.tokenizer
        for token in (tokenizer.eos_token, tokenizer.pad_token):
            if token:
                text = text.replace(token, "")
        return re.sub(r"<.*?>", "", text, count=1).strip()

    def describe(self) -> dict[str, Any]:
        return {
            "family": "donut",
            "routes": self.routes(),
            "fields": self.field_names,
            "max_length": self.max_length,
            "num_beams": self.num_beams,
            "prompts": self.prompts,
            "boxes": False,
        }


# -- what a route answers ----------------------------------------------------------------------------------------


def leaf_text(value: Any) -> str | None:
    """A parsed field as one string: a leaf as it is, a list of leaves joined (Donut's ``<sep/>``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return " ".join(value)
    return json.dumps(value, ensure_ascii=False)


def answer_of(output: DonutOutput) -> str | None:
    """The answer of a question-answering prompt (``<s_answer>...</s_answer>``); None when none was written."""
    return leaf_text(output.fields.get("answer"))


def class_of(output: DonutOutput) -> str | None:
    """The class of a classification prompt (``<s_class><letter/></s_class>``); None when none was written."""
    return leaf_text(output.fields.get("class"))


def wanted_fields(schema: Mapping[str, Any], known: Sequence[str], path: str = "schema") -> dict[str, Any]:
    """The field tree a JSON schema asks for: {name: None (whole value) or a nested tree}.

    Every property must be a field the model writes (a ``<s_NAME>`` token of its tokenizer); a 400 names
    the unknown ones and lists the known."""
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{path}: must be a JSON schema object", param=path)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise InvalidRequest(f"{path}.type: the fields wanted are an object schema, not {kind!r}", param=f"{path}.type")
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        raise InvalidRequest(f"{path}.properties: name the fields wanted", param=f"{path}.properties")
    unknown = [name for name in properties if name not in known]
    if unknown:
        raise InvalidRequest(
            f"{path}.properties: {', '.join(repr(n) for n in unknown)} "
            f"{'is not a field' if len(unknown) == 1 else 'are not fields'} this model extracts; it writes "
            f"{', '.join(known) or 'no fields'}",
            param=f"{path}.properties.{unknown[0]}",
            code="unknown_field",
        )
    tree: dict[str, Any] = {}
    for name, sub in properties.items():
        if not isinstance(sub, Mapping):
            raise InvalidRequest(
                f"{path}.properties.{name}: must be a JSON schema object", param=f"{path}.properties.{name}"
            )
        nested = sub.get("items", sub) if sub.get("type") == "array" else sub
        tree[name] = (
            wanted_fields(nested, known, f"{path}.properties.{name}")
            if isinstance(nested, Mapping) and "properties" in nested
            else None
        )
    return tree


def select(fields: Any, tree: Mapping[str, Any]) -> Any:
    """Only the fields ``tree`` names (absent ones as None), lists of records filtered record by record."""
    if isinstance(fields, list):
        return [select(item, tree) for item in fields]
    if not isinstance(fields, Mapping):
        return {name: None for name in tree}
    out: dict[str, Any] = {}
    for name, sub in tree.items():
        value = fields.get(name)
        out[name] = select(value, sub) if sub is not None and value is not None else value
    return out


# -- the document task's family --------------------------------------------------------------------------------

#: The routes in the order a Donut checkpoint's head is named by (the first it serves).
_ROUTE_ORDER = ("qa", "extract", "classify")


class DonutModel(DocumentModel):
    """A Donut checkpoint as a document model: every route whose task tokens its tokenizer has, by prompt.

    Engine args (``--engine-arg``): ``max_length``, ``num_beams``, ``qa_prompt``, ``extract_prompt``,
    ``classify_prompt`` (see :class:`~universal_predictors.tasks.document.DocumentEngineArgs`)."""

    family: ClassVar[str] = "donut"
    needs_words: ClassVar[bool] = False
    max_wait_ms: ClassVar[float] = 50.0

    @classmethod
    def heads(cls) -> dict[str, Head]:
        return {"VisionEncoderDecoderModel": Head.EXTRACT}

    @classmethod
    def head_of(cls, architectures: Sequence[str]) -> Head | None:
        # The routes come from the tokenizer's task tokens once loaded (:meth:`serves`).
        return Head.EXTRACT if "VisionEncoderDecoderModel" in architectures or not architectures else None

    def __init__(
        self, source: str, config: dict[str, Any], head: Head, options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(source, config, head, options)
        encoder = (config.get("encoder") or {}).get("model_type")
        if encoder not in DONUT_ENCODERS:
            raise StartupError(
                f"source {source!r} is a vision-encoder-decoder with a {encoder!r} encoder; task document serves "
                f"the Donut-style ones ({', '.join(sorted(DONUT_ENCODERS))} encoders)"
            )

    def load(self, device: str, dtype: str) -> None:
        self.device = detect_device(device)
        options = self.options
        self.engine = DonutEngine(
            self.source,
            device=self.device,
            dtype=dtype_for(self.device, dtype),
            max_length=options.get("max_length"),
            num_beams=int(options.get("num_beams") or 1),
            qa_prompt=options.get("qa_prompt") or QA_PROMPT,
            extract_prompt=options.get("extract_prompt") or EXTRACT_PROMPT,
            classify_prompt=options.get("classify_prompt") or CLASSIFY_PROMPT,
        )
        served = self.serves()
        if not served:
            raise StartupError(
                f"source {self.source!r}: the tokenizer has none of the task tokens of the prompts "
                f"{self.engine.prompts}; set the engine args qa_prompt, extract_prompt or classify_prompt"
            )
        self.head = served[0]

    def serves(self) -> tuple[Head, ...]:
        if not hasattr(self, "engine"):
            return (self.head,)
        routes = set(self.engine.routes())
        return tuple(Head(route) for route in _ROUTE_ORDER if route in routes)

    def describe(self) -> dict[str, Any]:
        if not hasattr(self, "engine"):
            return {}
        card = self.engine.describe()
        del card["routes"]  # the predictor lists them, as paths
        return {**card, "fields": self.field_names()}

    def close(self) -> None:
        if hasattr(self, "engine"):
            del self.engine
        release_memory(getattr(self, "device", "cpu"))

    def encode(self, job: PageJob) -> DonutJob:
        head = job.head or self.head
        return self.engine.encode(job.image, head.value, job.question)

    def cost(self, encoded: DonutJob) -> int:
        return len(encoded.prompt_ids)

    def forward(self, batch: Sequence[DonutJob]) -> list[Any]:
        return list(self.engine.generate_batch(batch))

    def qa(self, encoded: DonutJob, output: DonutOutput, words: PageWords | None) -> dict[str, Any]:
        return {"answer": answer_of(output), "score": output.score, "words": []}

    def field_names(self) -> list[str]:
        # The question-answering and classification prompts' own tags are not fields of a page.
        structural = {"question", "answer"} | ({"class"} if Head.CLASSIFY in self.serves() else set())
        return [name for name in self.engine.field_names if name not in structural]

    def extract(self, encoded: DonutJob, output: DonutOutput, words: PageWords | None) -> list[dict[str, Any]]:
        # Each field its own probability (its tokens'); the sequence's for one with no span of its own.
        scores = self.engine.field_scores(output)
        return [
            {"name": name, "text": leaf_text(value), "score": scores.get(name, output.score), "words": []}
            for name, value in output.fields.items()
            if name in self.engine.field_names
        ]

    def structured(self, output: DonutOutput, schema: Mapping[str, Any] | None) -> dict[str, Any]:
        """The parsed JSON as Donut wrote it (nested records kept), only the schema's fields when one is given."""
        if schema is None:
            return output.fields
        selected: dict[str, Any] = select(output.fields, wanted_fields(schema, self.field_names()))
        return selected

    def classify(self, encoded: DonutJob, output: DonutOutput) -> list[tuple[str, float]]:
        # Every class the model knows, by its probability at the step that writes the class, best first
        # (greedy: the class written comes first; beam search writes the class of the winning beam, first too).
        label = class_of(output)
        if label is None or not output.classes:
            return [(label, output.score)] if label is not None else []
        ranked = sorted(output.classes.items(), key=lambda item: -item[1])
        written = [item for item in ranked if item[0] == label]
        return written + [item for item in ranked if item[0] != label]

    def generated_tokens(self, output: DonutOutput) -> int:
        return len(output.token_ids)
