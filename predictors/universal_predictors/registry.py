"""Which predictor class serves which task, and the pip extra that brings its engine: read from the
catalog (:mod:`universal_predictors.catalog`), each class imported only when its task is chosen."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from universal_predictors.catalog import CATALOG, Task

if TYPE_CHECKING:
    from universal_predictors.base import UniversalPredictor

#: ``module:Class`` of each task's predictor.
PREDICTORS: dict[Task, str] = {Task(entry.name): entry.predictor for entry in CATALOG.tasks}

#: The pip extra that brings each task's engines.
EXTRAS: dict[Task, str] = {Task(entry.name): entry.extra for entry in CATALOG.tasks}


def predictor_class(task: Task) -> type[UniversalPredictor]:
    """The class serving ``task`` (ImportError names the missing extra)."""
    module_name, _, class_name = PREDICTORS[task].partition(":")
    module = importlib.import_module(module_name)
    cls: type[UniversalPredictor] = getattr(module, class_name)
    return cls
