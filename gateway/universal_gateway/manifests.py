"""Reading UniversalModel manifests from files and folders, validated by the operator's own spec models.

An error names the file, the document (1-based, for multi-document YAML) and the field, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from universal_operator.spec import API_VERSION, KIND, UniversalModel

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


class ManifestError(Exception):
    """A manifest that cannot be served; the message is one line: file, document, field, what to do."""


@dataclass(frozen=True)
class Manifest:
    """One UniversalModel and where it came from (relative sources resolve against its folder)."""

    model: UniversalModel
    path: Path
    document: int

    @property
    def origin(self) -> str:
        return f"{self.path} (document {self.document})"


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-"))


def parse_documents(text: str, path: Path) -> list[Manifest]:
    """Every UniversalModel in one YAML text; other kinds are skipped, errors name the document."""
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ManifestError(f"{path}:{where} not valid YAML ({getattr(exc, 'problem', exc)})") from None
    manifests = []
    for number, doc in enumerate(documents, start=1):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(f"{path} (document {number}): expected a mapping, got {type(doc).__name__}")
        if doc.get("kind") != KIND:
            continue
        if doc.get("apiVersion") != API_VERSION:
            raise ManifestError(
                f"{path} (document {number}): apiVersion {doc.get('apiVersion')!r} is not {API_VERSION!r}"
            )
        doc.setdefault("metadata", {}).setdefault("namespace", "default")
        try:
            model = UniversalModel.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            message = str(first["msg"]).removeprefix("Value error, ")
            raise ManifestError(f"{path} (document {number}): {_field(tuple(first['loc']))}: {message}") from None
        manifests.append(Manifest(model=model, path=path, document=number))
    return manifests


def manifest_files(paths: list[Path]) -> list[Path]:
    """Files named directly, plus every manifest file inside named folders (sorted, not recursive)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in MANIFEST_SUFFIXES and p.is_file())
        elif path.exists():
            files.append(path)
        else:
            raise ManifestError(f"{path}: no such file or folder")
    return files


def load_manifests(paths: list[Path]) -> list[Manifest]:
    """All UniversalModels under ``paths``; served names must be unique."""
    manifests: list[Manifest] = []
    for file in manifest_files(paths):
        manifests += parse_documents(file.read_text(), file)
    seen: dict[str, Manifest] = {}
    for manifest in manifests:
        name = manifest.model.served_name
        if name in seen:
            raise ManifestError(
                f"{manifest.origin}: served name {name!r} is already used by {seen[name].origin}; "
                "give one of them another spec.servedName"
            )
        seen[name] = manifest
    if not manifests:
        raise ManifestError(f"no UniversalModel manifests found in {', '.join(str(p) for p in paths)}")
    return manifests
