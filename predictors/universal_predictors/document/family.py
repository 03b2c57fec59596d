"""Document model families and their heads: which class loads a model, which routes its head serves.

A family is picked by the model's ``config.json`` ``model_type`` (:data:`FAMILIES`, import paths so
only the chosen family's code is imported); the head by the config's ``architectures`` (the family's
:meth:`DocumentModel.head_of`). A family that reads OCR words says so (``needs_words``); one that
reads pixels only (an OCR-free encoder-decoder) does not, and the predictor then runs no OCR.

Adding a family is a :class:`DocumentModel` subclass and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from universal_predictors.base import StartupError
from universal_predictors.document.words import PageWords


class Head(StrEnum):
    """What a model's head does, named by the route that serves it (``/v1/document/<head>``)."""

    QA = "qa"
    EXTRACT = "extract"
    CLASSIFY = "classify"


#: ``model_type`` -> ``module:Class`` of the family that serves it.
FAMILIES: dict[str, str] = {
    "layoutlmv3": "universal_predictors.document.layoutlm:LayoutLMv3Model",
    "vision-encoder-decoder": "universal_predictors.document.donut:DonutModel",
}


@dataclass(frozen=True)
class PageJob:
    """One page for a model: its image, its words (None for a family that reads pixels only), the question."""

    image: Image.Image
    words: PageWords | None
    question: str | None = None
    #: The route asked, for a model that serves several (a prompted decoder: Donut).
    head: Head | None = None


class DocumentModel(ABC):
    """One loaded document model. ``encode`` runs on a worker thread, ``forward`` on the engine thread
    (a micro-batch of encoded pages), ``qa``/``extract``/``classify`` turn one output into a response."""

    family: ClassVar[str]
    #: Whether the model reads OCR words and boxes (LayoutLM) or the pixels only.
    needs_words: ClassVar[bool] = True
    #: Whether the ``head`` engine argument chooses the head when ``architectures`` cannot tell (an
    #: encoder-decoder's task is in its prompt, not its class).
    head_from_args: ClassVar[bool] = False
    #: How long a batch waits for company by default (engine arg max_wait_ms): a decoder's batch is many
    #: forward passes, one per token, so waiting for a second page costs it relatively little.
    max_wait_ms: ClassVar[float] = 2.0

    def __init__(self, source: str, config: dict[str, Any], head: Head, options: Mapping[str, Any] | None = None
                 ) -> None:  # fmt: skip
        self.source = source
        self.config = config
        self.head = head
        #: The engine args a family reads itself (Donut's prompts and generation settings).
        self.options: dict[str, Any] = dict(options or {})

    def serves(self) -> tuple[Head, ...]:
        """The routes this model answers: its head's; a prompted decoder (Donut) answers several."""
        return (self.head,)

    @classmethod
    @abstractmethod
    def head_of(cls, architectures: Sequence[str]) -> Head | None:
        """The head the config's ``architectures`` name, or None when this family has no such head."""

    @classmethod
    @abstractmethod
    def heads(cls) -> dict[str, Head]:
        """Architecture names this family serves and their heads (for start-up errors)."""

    @abstractmethod
    def load(self, device: str, dtype: str) -> None: ...

    @abstractmethod
    def encode(self, job: PageJob) -> Any:
        """The model's inputs for one page (blocking: tokenisation, image preprocessing)."""

    @abstractmethod
    def cost(self, encoded: Any) -> int:
        """What one encoded page costs a batch (tokens)."""

    @abstractmethod
    def forward(self, batch: Sequence[Any]) -> list[Any]:
        """One forward pass over encoded pages (engine thread); one output per page."""

    def qa(self, encoded: Any, output: Any, words: PageWords | None) -> dict[str, Any]:
        raise NotImplementedError

    def extract(self, encoded: Any, output: Any, words: PageWords | None) -> list[dict[str, Any]]:
        """The fields found, in reading order: ``{"name", "text", "score", "words"}`` (word indices)."""
        raise NotImplementedError

    def field_names(self) -> list[str]:
        """The field names :meth:`extract` can return (what a schema may ask for)."""
        raise NotImplementedError

    def classify(self, encoded: Any, output: Any) -> list[tuple[str, float]]:
        """Every label with its score, best first."""
        raise NotImplementedError

    def structured(self, output: Any, schema: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The fields as nested JSON, for a family that writes them so (Donut); None for the others."""
        return None

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Give the model's memory back."""


def read_config(source: str) -> dict[str, Any]:
    path = Path(source) / "config.json"
    if not path.is_file():
        raise StartupError(f"source {source!r} has no config.json (a transformers model directory is needed)")
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StartupError(f"{path}: not readable JSON ({exc})") from None
    return config


def family_of(config: dict[str, Any], source: str) -> type[DocumentModel]:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise StartupError(
            f"source {source!r} is a {model_type!r} model; task document serves the families "
            f"{', '.join(sorted(FAMILIES))} (config.json model_type)"
        )
    module_name, _, class_name = FAMILIES[str(model_type)].partition(":")
    cls: type[DocumentModel] = getattr(importlib.import_module(module_name), class_name)
    return cls


def resolve(source: str, requested: Head | None = None, options: Mapping[str, Any] | None = None) -> DocumentModel:
    """The family and head of the model in ``source`` (not loaded yet); StartupError says what is missing.

    ``requested`` (the ``head`` engine argument) must agree with the head ``architectures`` names; it
    chooses the head only for a family whose architectures cannot tell (``head_from_args``). ``options``
    are the engine args a family reads itself (Donut's prompts and generation settings)."""
    config = read_config(source)
    cls = family_of(config, source)
    architectures = [str(a) for a in config.get("architectures") or []]
    head = cls.head_of(architectures)
    if head is not None and requested is not None and requested is not head:
        raise StartupError(
            f"source {source!r} is a {head.value} model ({', '.join(architectures)}); engine arg "
            f"head={requested.value} names another head"
        )
    if head is None and requested is not None and cls.head_from_args:
        head = requested
    if head is None:
        known = ", ".join(f"{name} ({h.value})" for name, h in cls.heads().items())
        raise StartupError(
            f"source {source!r}: config.json architectures {architectures or 'is missing'}; a {cls.family} "
            f"document model is one of {known}"
        )
    return cls(source, config, head, options)
