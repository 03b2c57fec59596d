"""Rows as a client sends them to the float matrix a detector sees.

Two row shapes:

- numeric rows: ``[[1.0, 2.5, 3], ...]``, every row the same length;
- object rows with a schema: ``schema={"amount": "numeric", "country": "categorical"}`` and rows
  ``[{"amount": 12.5, "country": "DE"}, ...]``. Numeric fields become one column each; a categorical
  field becomes one 0/1 column per category seen at fit time (in sorted order). A category not seen at
  fit time encodes as all zeros in its block (the row looks like none of the known categories) and is
  reported back as a warning, never an error. Keys a row has beyond the schema are ignored.

Every failure is an :class:`InvalidRequest` naming the row and column or field (``data[3][1]``,
``data[3].country``), so a client can find the bad value in a large batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from universal_predictors.errors import InvalidRequest, RequestTooLarge

FieldKind = Literal["numeric", "categorical"]

#: How many unseen-category warnings one response carries at most (the count is always exact).
MAX_WARNINGS = 100


def _number(value: Any, where: str) -> float:
    # bool is an int subclass in Python, but JSON true/false in a numeric column is a client mistake.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{where}: expected a number, got {_describe(value)}", param=where, code="invalid_value")
    try:
        number = float(value)
    except OverflowError:  # a JSON integer with hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequest(f"{where}: expected a finite number, got {value!r}", param=where, code="invalid_value")
    return number


def _category(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    raise InvalidRequest(
        f"{where}: expected a category (a string, integer or boolean), got {_describe(value)}",
        param=where,
        code="invalid_value",
    )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


@dataclass
class EncodeResult:
    """A matrix plus the unseen categories met while encoding it."""

    matrix: np.ndarray
    unseen: list[dict[str, Any]] = field(default_factory=list)
    unseen_count: int = 0


@dataclass(frozen=True)
class FeatureSpace:
    """What a detector was fitted on: plain columns, or a schema with the categories seen at fit."""

    n_columns: int
    schema: tuple[tuple[str, FieldKind], ...] | None = None
    categories: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        """Input features a client sends per row (fields for schema rows, columns for numeric rows)."""
        return len(self.schema) if self.schema is not None else self.n_columns

    @property
    def n_encoded(self) -> int:
        """Columns after one-hot encoding."""
        if self.schema is None:
            return self.n_columns
        return sum(1 if kind == "numeric" else len(self.categories[name]) for name, kind in self.schema)

    def numeric_columns(self) -> list[int]:
        """Indices of encoded columns that are numeric (the robust scaler touches only these)."""
        if self.schema is None:
            return list(range(self.n_columns))
        out: list[int] = []
        col = 0
        for name, kind in self.schema:
            if kind == "numeric":
                out.append(col)
                col += 1
            else:
                col += len(self.categories[name])
        return out

    def schema_json(self) -> dict[str, str] | None:
        return None if self.schema is None else dict(self.schema)

    def to_json(self) -> dict[str, Any]:
        return {
            "n_columns": self.n_columns,
            "schema": None if self.schema is None else [[name, kind] for name, kind in self.schema],
            "categories": {name: list(values) for name, values in self.categories.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FeatureSpace:
        raw_schema = data.get("schema")
        schema: tuple[tuple[str, FieldKind], ...] | None = None
        if raw_schema is not None:
            items: list[tuple[str, FieldKind]] = []
            for name, kind in raw_schema:
                if kind not in ("numeric", "categorical") or not isinstance(name, str):
                    raise ValueError(f"bad schema entry {name!r}: {kind!r}")
                items.append((name, "numeric" if kind == "numeric" else "categorical"))
            schema = tuple(items)
        categories = {str(k): tuple(str(v) for v in values) for k, values in dict(data.get("categories", {})).items()}
        space = cls(n_columns=int(data["n_columns"]), schema=schema, categories=categories)
        if schema is not None and any(kind == "categorical" and name not in categories for name, kind in schema):
            raise ValueError("a categorical field has no categories")
        return space

    # -- building and encoding -------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls, rows: Sequence[Any], schema: Mapping[str, FieldKind] | None, *, max_categories: int, max_features: int
    ) -> tuple[FeatureSpace, np.ndarray]:
        """Learn the feature space from training rows and encode them."""
        if schema is None:
            first = rows[0]
            if isinstance(first, dict):
                raise InvalidRequest(
                    'schema: required when rows are objects (e.g. {"amount": "numeric", "country": "categorical"})',
                    param="schema",
                )
            if not isinstance(first, list):
                raise InvalidRequest(f"data[0]: expected a list of numbers, got {_describe(first)}", param="data[0]")
            if not first:
                raise InvalidRequest("data[0]: a row needs at least one feature", param="data[0]")
            space = cls(n_columns=len(first))
            return space, space.encode(rows).matrix
        if not schema:
            raise InvalidRequest("schema: needs at least one field", param="schema")
        seen: dict[str, set[str]] = {name: set() for name, kind in schema.items() if kind == "categorical"}
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise InvalidRequest(f"data[{index}]: with a schema, each row is an object", param=f"data[{index}]")
            for name in seen:
                if name not in row:
                    raise InvalidRequest(
                        f"data[{index}].{name}: missing (the schema lists it)", param=f"data[{index}].{name}"
                    )
                seen[name].add(_category(row[name], f"data[{index}].{name}"))
        for name, values in seen.items():
            if len(values) > max_categories:
                raise RequestTooLarge(
                    f"schema.{name}: {len(values)} distinct categories; the limit is {max_categories} "
                    "(engine arg max_categories)"
                )
        space = cls(
            n_columns=0,
            schema=tuple(schema.items()),
            categories={name: tuple(sorted(values)) for name, values in seen.items()},
        )
        space = cls(n_columns=space.n_encoded, schema=space.schema, categories=space.categories)
        if space.n_encoded > max_features:
            raise RequestTooLarge(
                f"schema: {space.n_encoded} features after one-hot encoding the categories; the limit is "
                f"{max_features} (engine arg max_features)"
            )
        return space, space.encode(rows).matrix

    def encode(self, rows: Sequence[Any]) -> EncodeResult:
        """Rows to a float64 matrix of ``n_encoded`` columns; 400 naming the first bad value."""
        if self.schema is None:
            return EncodeResult(self._encode_numeric(rows))
        return self._encode_objects(rows)

    def _encode_numeric(self, rows: Sequence[Any]) -> np.ndarray:
        out = np.empty((len(rows), self.n_columns), dtype=np.float64)
        for index, row in enumerate(rows):
            if not isinstance(row, list):
                what = "an object (this detector was fitted on numeric rows, without a schema)"
                raise InvalidRequest(
                    f"data[{index}]: expected a list of {self.n_columns} numbers, got "
                    f"{what if isinstance(row, dict) else _describe(row)}",
                    param=f"data[{index}]",
                )
            if len(row) != self.n_columns:
                raise InvalidRequest(
                    f"data[{index}]: expected {self.n_columns} features, got {len(row)}",
                    param=f"data[{index}]",
                    code="feature_count_mismatch",
                )
            # type() rather than isinstance(): bool is an int subclass, and numpy would also parse "1.5".
            try:
                if not all(type(value) is float or type(value) is int for value in row):
                    raise TypeError
                out[index] = row
            except (TypeError, OverflowError):
                for column, value in enumerate(row):
                    out[index, column] = _number(value, f"data[{index}][{column}]")
        bad = np.argwhere(~np.isfinite(out))
        if len(bad):
            index, column = (int(i) for i in bad[0])
            _number(rows[index][column], f"data[{index}][{column}]")
        return out

    def _encode_objects(self, rows: Sequence[Any]) -> EncodeResult:
        assert self.schema is not None
        out = np.zeros((len(rows), self.n_encoded), dtype=np.float64)
        lookup = {name: {value: i for i, value in enumerate(values)} for name, values in self.categories.items()}
        result = EncodeResult(out)
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise InvalidRequest(
                    f"data[{index}]: expected an object with the fields {', '.join(n for n, _ in self.schema)} "
                    f"(this detector was fitted with a schema), got {_describe(row)}",
                    param=f"data[{index}]",
                )
            column = 0
            for name, kind in self.schema:
                where = f"data[{index}].{name}"
                if name not in row:
                    raise InvalidRequest(f"{where}: missing (the detector's schema lists it)", param=where)
                if kind == "numeric":
                    out[index, column] = _number(row[name], where)
                    column += 1
                    continue
                value = _category(row[name], where)
                position = lookup[name].get(value)
                if position is None:
                    result.unseen_count += 1
                    if len(result.unseen) < MAX_WARNINGS:
                        result.unseen.append({"index": index, "field": name, "value": value})
                else:
                    out[index, column + position] = 1.0
                column += len(lookup[name])
        return result
