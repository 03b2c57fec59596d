"""``task: classify``: ``POST /v1/classify`` over a transformers sequence-classification model.

Loading, the input limit, tokenisation and micro-batching are
:class:`~universal_predictors.encoders.texts.TextsPredictor`'s, shared with NER.

Scores follow the model's ``problem_type`` the way transformers' text-classification pipeline reads
it: ``multi_label_classification`` (or a single output) -> sigmoid per label, ``regression`` -> the
raw value, anything else -> softmax over the labels. ``--engine-arg score_function=...`` overrides it.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from universal_predictors.catalog import Task
from universal_predictors.encoders.texts import TextsEngineArgs, TextsPredictor, TextsRequest

ScoreFunction = Literal["softmax", "sigmoid", "none"]


def score_function(problem_type: str | None, num_labels: int) -> ScoreFunction:
    """What turns logits into scores, read from the model's configuration as transformers does."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def apply_score_function(logits: np.ndarray, function: ScoreFunction) -> np.ndarray:
    values: np.ndarray = logits.astype(np.float64)
    if function == "softmax":
        shifted = np.exp(values - values.max())
        values = shifted / shifted.sum()
    elif function == "sigmoid":
        values = 1.0 / (1.0 + np.exp(-values))
    return values


class ClassifyEngineArgs(TextsEngineArgs):
    """Engine arguments of the classify predictor."""

    score_function: Literal["auto", "softmax", "sigmoid", "none"] = "auto"


class ClassifyRequest(TextsRequest):
    top_k: int | None = Field(default=None, ge=1, description="How many labels all_scores lists (default all).")
    threshold: float | None = Field(
        default=None, ge=0, le=1, description="Labels scoring at least this are listed in labels."
    )


class ClassifyPredictor(TextsPredictor):
    """One sequence classifier; texts from concurrent requests share forward passes."""

    task = Task.CLASSIFY
    EngineArgs = ClassifyEngineArgs

    def auto_model_class(self) -> Any:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification

    def after_load(self) -> None:
        chosen = self.engine_args.score_function
        problem_type = getattr(self.model.config, "problem_type", None)
        self.function: ScoreFunction = chosen if chosen != "auto" else score_function(problem_type, len(self.labels))
        self.problem_type = problem_type

    def card(self) -> dict[str, Any]:
        return {"labels": self.labels, "problem_type": self.problem_type, "score_function": self.function}

    def result(self, logits: np.ndarray, top_k: int | None, threshold: float | None) -> dict[str, Any]:
        """One text's answer: the best label, all (or top_k) scores sorted, the labels over threshold."""
        scores = apply_score_function(logits, self.function)
        order = np.argsort(-scores, kind="stable")  # ties keep the model's label order
        best = int(order[0])
        if threshold is None and self.function == "sigmoid":
            threshold = 0.5
        chosen = (
            [self.labels[best]]
            if threshold is None
            else [self.labels[int(i)] for i in order if float(scores[int(i)]) >= threshold]
        )
        listed = order if top_k is None else order[:top_k]
        return {
            "label": self.labels[best],
            "score": float(scores[best]),
            "labels": chosen,
            "all_scores": [{"label": self.labels[int(i)], "score": float(scores[int(i)])} for i in listed],
        }

    async def infer(self, instances: list[Any]) -> list[Any]:
        self.require_ready()
        items = await self.encode(self.strings(instances), truncate=False, field="instances")
        return [self.result(logits, None, None) for logits in await self.run(items)]

    async def classify_request(self, body: ClassifyRequest, request: Request) -> Response:
        items = await self.encode(body.text_list(), body.truncate)
        outputs = await self.run(items)
        entries = [self.result(logits, body.top_k, body.threshold) for logits in outputs]
        return self.list_response(items, entries, body.truncate)
