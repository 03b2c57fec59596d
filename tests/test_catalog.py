"""The task catalog is the one place a task is written: what reads it agrees with it, and what is written
about tasks elsewhere (pyproject's extras, the README's table, the committed request schemas) matches it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from universal_predictors.catalog import (
    CATALOG,
    TASK_BACKENDS,
    Backend,
    Catalog,
    ModelFrom,
    Route,
    Task,
    TaskEntry,
    request_schemas,
)
from universal_predictors.config import FILE_PATTERN_TASKS, resolve_backend
from universal_predictors.registry import EXTRAS, PREDICTORS, predictor_class
from universal_predictors.request_schemas import generate, render

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS_FILE = ROOT / "predictors" / "universal_predictors" / "request_schemas.json"


def test_every_task_has_exactly_one_entry_in_order() -> None:
    assert CATALOG.names == [t.value for t in Task]
    assert dict(TASK_BACKENDS) == {Task(e.name): e.backends for e in CATALOG.tasks}


def test_the_registry_and_the_file_pattern_tasks_are_the_catalogs() -> None:
    assert {Task(e.name): e.predictor for e in CATALOG.tasks} == PREDICTORS
    assert {Task(e.name): e.extra for e in CATALOG.tasks} == EXTRAS
    assert FILE_PATTERN_TASKS == (Task.GENERATE, Task.EMBED)


@pytest.mark.parametrize("task", list(Task))
def test_each_predictor_class_serves_its_task(task: Task) -> None:
    assert predictor_class(task).task is task


@pytest.mark.parametrize(
    ("task", "source", "gpus", "expected"),
    [
        (Task.GENERATE, "/models/llama", 0, Backend.TRANSFORMERS),
        (Task.GENERATE, "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF", 0, Backend.LLAMACPP),
        (Task.GENERATE, "/models/llama", 1, Backend.AUTO),  # the predictor judges vLLM on the GPU
        (Task.EMBED, "/models/nomic.gguf", 1, Backend.LLAMACPP),
        (Task.EMBED, "/models/minilm", 1, Backend.TRANSFORMERS),
        (Task.OCR, "/models/ocr", 0, Backend.RAPIDOCR),
        (Task.ANOMALY, "./anomaly", 0, Backend.PYOD),
    ],
)
def test_auto_resolves_to_the_tasks_first_backend_unless_the_source_says_gguf(
    task: Task, source: str, gpus: int, expected: Backend
) -> None:
    assert resolve_backend(task, Backend.AUTO, source, None, gpus) is expected


def test_every_tasks_extra_is_declared_in_pyproject() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing = {e.name: e.extra for e in CATALOG.tasks if e.extra not in extras}
    assert missing == {}
    assert set(extras["all"][0].partition("[")[2].rstrip("]").split(",")) >= {e.extra for e in CATALOG.tasks}


def test_the_committed_request_schemas_are_the_generated_ones() -> None:
    assert SCHEMAS_FILE.read_text() == render(generate()), (
        "predictors/universal_predictors/request_schemas.json is out of date; regenerate it with `make crd`"
    )
    assert request_schemas() == generate()


def test_every_post_route_has_a_request_schema_naming_model() -> None:
    schemas = request_schemas()
    for _, route in CATALOG.routes():
        if route.method == "POST":
            schema = schemas.schema_of(route.request)
            assert schema is not None, route.path
            assert "model" in schema["properties"], route.path


# -- the README's task table ---------------------------------------------------------------------------------


def readme_task_table() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Tasks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {
        cells[0].strip("`"): cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)
    }


def _codes(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_readme_task_table_lists_every_task_as_the_catalog_has_it() -> None:
    table = readme_task_table()
    assert list(table) == CATALOG.names
    for entry in CATALOG.tasks:
        summary, backends, extra, routes = table[entry.name]
        assert summary == entry.summary, entry.name
        assert _codes(backends) == [b.value for b in entry.backends], entry.name
        assert _codes(extra) == [f"[{entry.extra}]"], entry.name
        assert _codes(routes) == [f"{r.method} /v1/{r.path}" for r in entry.routes], entry.name


# -- what the catalog refuses ---------------------------------------------------------------------------------


def _entry(name: str, path: str = "translate", **fields: object) -> TaskEntry:
    route = Route(
        method="POST",
        path=path,
        upstream=f"/v1/{path}",
        operation=path.replace("/", "_"),
        summary="x",
        handler="answer",
    )
    values: dict[str, object] = {
        "name": name, "summary": "x", "backends": (Backend.TRANSFORMERS,), "extra": "transformers",
        "predictor": "somewhere:Predictor", "routes": (route,), **fields,
    }  # fmt: skip
    return TaskEntry.model_validate(values)


def test_a_route_two_tasks_claim_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError, match="POST embeddings is served by both embed and translate"):
        CATALOG.with_task(_entry("translate", "embeddings"))


def test_a_task_listed_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match="a task is listed twice"):
        Catalog(tasks=(_entry("translate"), _entry("translate", "other")))


def test_auto_as_a_listed_backend_is_refused() -> None:
    with pytest.raises(ValidationError, match="auto is every task's"):
        _entry("translate", backends=(Backend.AUTO,))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "GET", "path": "a/{name}", "upstream": "/v1/a"}, "needs the same params"),
        ({"method": "GET", "path": "a", "upstream": "/v1/a"}, "GET/DELETE from the query"),
        ({"method": "POST", "path": "a", "upstream": "/v1/a", "model_from": (ModelFrom.QUERY,)}, "POST takes model"),
    ],
)
def test_a_route_whose_parts_disagree_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Route.model_validate({"operation": "op", "summary": "x", "handler": "op", **fields})


def test_the_docs_task_table_lists_every_task_as_the_catalog_has_it() -> None:
    """docs/README.md's table: each task in catalog order, its backends, and its page (which exists)."""
    text = (ROOT / "docs" / "README.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| `")]
    assert [_codes(row[0])[0] for row in rows] == CATALOG.names
    for entry, (_, backends, page) in zip(CATALOG.tasks, rows, strict=True):
        # The document row adds the OCR engines its words come from, after the backends.
        assert _codes(backends)[: len(entry.backends)] == [b.value for b in entry.backends], entry.name
        link = re.fullmatch(r"\[[^]]+\]\((tasks/[a-z]+\.md)\)", page)
        assert link is not None, (entry.name, page)
        assert (ROOT / "docs" / link.group(1)).is_file(), entry.name
