"""Generate ``request_schemas.json``: the JSON Schemas of the request models the catalog's routes name.

``python -m universal_predictors.request_schemas [-o FILE | --check FILE]`` (``make crd`` runs it). This
imports every task module, so it needs the predictor extras; the result is data the control plane reads
(``universal_predictors.catalog.request_schemas``) without importing any of them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from universal_predictors.catalog import CATALOG, REQUEST_SCHEMAS_FILE, Catalog, RequestSchemas

_REF = "#/components/schemas/{model}"


def _import(path: str) -> type[BaseModel]:
    module_name, _, class_name = path.partition(":")
    model = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{path} is not a pydantic model")
    return model


def generate(catalog: Catalog = CATALOG) -> RequestSchemas:
    """The schemas of every request model in ``catalog``, as the predictors validate bodies."""
    paths = sorted({route.request for _, route in catalog.routes() if route.request})
    models = [_import(path) for path in paths]
    keys, document = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = document.get("$defs", {})
    requests = {
        path: keys[(model, "validation")]["$ref"].rsplit("/", 1)[-1] for path, model in zip(paths, models, strict=True)
    }
    return RequestSchemas(requests=requests, components=components)


def render(schemas: RequestSchemas) -> str:
    return json.dumps(schemas.model_dump(), indent=1, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m universal_predictors.request_schemas", description=__doc__)
    default = Path(__file__).with_name(REQUEST_SCHEMAS_FILE)
    parser.add_argument("-o", "--output", type=Path, default=None, help=f"write here (default {default})")
    parser.add_argument("--check", type=Path, default=None, help="exit 1 if this file differs from the generated")
    args = parser.parse_args(argv)
    text = render(generate())
    if args.check is not None:
        if args.check.read_text() != text:
            print(f"{args.check} is out of date; regenerate it with `make crd`", file=sys.stderr)
            return 1
        return 0
    (args.output or default).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
