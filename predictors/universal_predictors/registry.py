"""Which predictor class serves which task: one line per task, imported only when chosen."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from universal_predictors.config import Task

if TYPE_CHECKING:
    from universal_predictors.base import UniversalPredictor

PREDICTORS: dict[Task, str] = {
    Task.GENERATE: "universal_predictors.tasks.generate:GeneratePredictor",
    Task.EMBED: "universal_predictors.tasks.embed:EmbedPredictor",
    Task.RERANK: "universal_predictors.tasks.rerank:RerankPredictor",
    Task.CLASSIFY: "universal_predictors.tasks.classify:ClassifyPredictor",
    Task.NER: "universal_predictors.tasks.ner:NerPredictor",
    Task.OCR: "universal_predictors.tasks.ocr:OcrPredictor",
    Task.ANOMALY: "universal_predictors.tasks.anomaly:AnomalyPredictor",
}


#: The pip extra that brings each task's engines.
EXTRAS: dict[Task, str] = {
    Task.GENERATE: "generate",
    Task.EMBED: "transformers",
    Task.RERANK: "transformers",
    Task.CLASSIFY: "transformers",
    Task.NER: "transformers",
    Task.OCR: "ocr",
    Task.ANOMALY: "anomaly",
}


def predictor_class(task: Task) -> type[UniversalPredictor]:
    """The class serving ``task`` (ImportError names the missing extra)."""
    module_name, _, class_name = PREDICTORS[task].partition(":")
    module = importlib.import_module(module_name)
    cls: type[UniversalPredictor] = getattr(module, class_name)
    return cls
