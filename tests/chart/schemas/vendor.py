"""Cut the published schemas the chart tests check against down to what they need, reproducibly.

    python tests/chart/schemas/vendor.py crd UPSTREAM_CRD.yaml VERSION > NAME.json
    python tests/chart/schemas/vendor.py openapi UPSTREAM_OPENAPI_V3.json COMPONENT... > NAME.json

``crd``: the ``openAPIV3Schema`` of one served version of a CustomResourceDefinition file. ``openapi``: the named
``components.schemas`` of a Kubernetes OpenAPI v3 document and every component they ``$ref``, transitively, under
the same ``#/components/schemas/...`` names so the references still resolve. Both drop ``description`` (prose, half
the bytes) and change nothing else. README.md names the upstream file, tag and commit of each output.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

_REF_PREFIX = "#/components/schemas/"


def without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # A property may itself be named "description" (a properties map's key): keep those.
        return {k: without_descriptions(v) for k, v in node.items() if k != "description" or isinstance(v, dict)}
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    return node


def crd_version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return dict(served["schema"]["openAPIV3Schema"])


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].removeprefix(_REF_PREFIX)} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node))
    return set()


def components_closure(document: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    wanted, pending = set(), list(roots)
    while pending:
        name = pending.pop()
        if name not in wanted:
            wanted.add(name)
            pending += sorted(_refs(schemas[name]))
    return {"components": {"schemas": {name: schemas[name] for name in sorted(wanted)}}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="source", required=True)
    crd = sub.add_parser("crd")
    crd.add_argument("file")
    crd.add_argument("version")
    openapi = sub.add_parser("openapi")
    openapi.add_argument("file")
    openapi.add_argument("components", nargs="+")
    args = parser.parse_args(argv)
    with open(args.file, encoding="utf-8") as handle:
        if args.source == "crd":
            out = crd_version_schema(yaml.safe_load(handle), args.version)
        else:
            out = components_closure(json.load(handle), args.components)
    json.dump(without_descriptions(out), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
