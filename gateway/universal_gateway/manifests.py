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
    """Files named directly, plus every manifest file inside named folders (sorted, not recursive; hidden names
    skipped: a mounted ConfigMap's ``..data`` link and ``..<timestamp>`` folders, an editor's swap files)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(
                p for p in path.iterdir()
                if p.suffix in MANIFEST_SUFFIXES and not p.name.startswith(".") and p.is_file()
            )  # fmt: skip
        elif path.exists():
            files.append(path)
        else:
            raise ManifestError(f"{path}: no such file or folder")
    return files


def load_manifests(paths: list[Path], *, allow_empty: bool = False) -> list[Manifest]:
    """All UniversalModels under ``paths``; served names must be unique; none is an error unless ``allow_empty``
    (a pool's members folder, which may start empty and fill while it runs)."""
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
    if not manifests and not allow_empty:
        raise ManifestError(f"no UniversalModel manifests found in {', '.join(str(p) for p in paths)}")
    return manifests


def files_signature(paths: list[Path]) -> tuple[tuple[str, int, int, int], ...]:
    """What changes when a manifest under ``paths`` is added, removed or rewritten: each file's name, inode, mtime
    and size, through symlinks (a mounted ConfigMap's files are links into ``..data``, which the kubelet swaps
    atomically: the link stays, its target is a new file). Cheap: one ``stat`` per file."""
    try:
        files = manifest_files(paths)
    except ManifestError:  # a named folder went away: it holds no members now
        files = [p for p in paths if p.exists()]
    signature = []
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            continue
        signature.append((str(file), stat.st_ino, stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


@dataclass(frozen=True)
class MemberChanges:
    """What a new reading of the manifests changes, by served name."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    #: Changed beyond ``spec.adapters``: the member restarts.
    changed: tuple[str, ...] = ()
    #: Only ``spec.adapters`` changed: its running predictor re-reads them.
    adapters: tuple[str, ...] = ()
    #: The same model, from another file or document: nothing to restart.
    moved: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.adapters or self.moved)


def member_changes(old: dict[str, Manifest], new: dict[str, Manifest]) -> MemberChanges:
    """The difference between two readings of the members, each by served name."""

    def without_adapters(manifest: Manifest) -> UniversalModel:
        model = manifest.model
        return model.model_copy(update={"spec": model.spec.model_copy(update={"adapters": []})})

    changed, adapters, moved = [], [], []
    for name in sorted(old.keys() & new.keys()):
        before, after = old[name], new[name]
        if without_adapters(before) != without_adapters(after):
            changed.append(name)
        elif before.model.spec.adapters != after.model.spec.adapters:
            adapters.append(name)
        elif (before.path, before.document) != (after.path, after.document):
            moved.append(name)
    return MemberChanges(
        added=tuple(sorted(new.keys() - old.keys())), removed=tuple(sorted(old.keys() - new.keys())),
        changed=tuple(changed), adapters=tuple(adapters), moved=tuple(moved),
    )  # fmt: skip
