"""Every relative link in the repository's markdown resolves: the file exists, and so does the heading an anchor names.

A clone must explain itself, so a page that moves (``predictors/README.md`` became ``docs/tasks/``) must take
its links with it. Anchors are GitHub's: the heading's text, lower-cased, punctuation dropped, spaces as
hyphens, a repeated heading suffixed ``-1``, ``-2``. Links to the web are not fetched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from universal_predictors.catalog import Task

ROOT = Path(__file__).resolve().parent.parent
#: Folders whose markdown is not the project's: virtualenvs, caches, vendored sources.
SKIPPED_DIRS = {"node_modules", "__pycache__", "build", "dist"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    """The project's markdown: every ``*.md`` outside hidden folders (.venv, .cache, .git) and build output."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS]  # never walk a virtualenv
        files += [Path(folder) / name for name in names if name.endswith(".md")]
    return sorted(files)


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower-cased, punctuation dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not snake_case ones
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file defines: its headings' slugs (repeats numbered) and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match is None:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in ``path``'s prose, inline or reference-style."""
    found: list[tuple[int, str]] = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        found += [(number, target) for target in _INLINE_LINK.findall(line)]
        reference = _REFERENCE_LINK.match(line)
        if reference is not None:
            found.append((number, reference.group(1)))
    return found


def broken_links(path: Path) -> list[str]:
    """What is wrong with ``path``'s relative links, one line each (empty when every one resolves)."""
    problems: list[str] = []
    where = path.relative_to(ROOT)
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where}:{number}: {target}: no file {file_part!r} (looked for {resolved})")
            continue
        if anchor and resolved.is_file() and resolved.suffix == ".md" and anchor not in anchors(resolved):
            known = ", ".join(sorted(anchors(resolved)))
            problems.append(f"{where}:{number}: {target}: no heading with anchor #{anchor} in {file_part or where}"
                            f" (anchors there: {known})")  # fmt: skip
    return problems


def test_the_repository_has_its_documentation_and_a_page_per_task() -> None:
    names = {str(p.relative_to(ROOT)) for p in markdown_files()}
    expected = {"README.md", "docs/README.md", "docs/architecture.md", "predictors/README.md"}
    expected |= {f"docs/tasks/{task.value}.md" for task in Task}  # one page per task
    assert expected <= names, f"missing: {sorted(expected - names)}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Limits", "limits"),
        ("Engine arguments (`--engine-arg key=value`, `engineArgs` in the UniversalModel)",
         "engine-arguments---engine-arg-keyvalue-engineargs-in-the-universalmodel"),
        ("`GET /v1/anomaly/detectors` (and `GET /v1/anomaly/detectors/{name}` for one)",
         "get-v1anomalydetectors-and-get-v1anomalydetectorsname-for-one"),
        ("Idle time in Knative mode", "idle-time-in-knative-mode"),
        ("`max_batch_size` and [a link](x.md)", "max_batch_size-and-a-link"),
    ],
)  # fmt: skip
def test_anchors_are_githubs(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## Part\n\n## Part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#part-1) [here](#page) [web](https://example.com/x.md)\n"
        "`[in code](nowhere.md)`\n\n```\n[in a fence](nowhere.md)\n```\n\n"
        "[gone](missing.md) [no anchor](other.md#nope)\n[ref]: missing-too.md\n"
    )
    problems = broken_links(page)
    assert [p.split(": ")[1] for p in problems] == ["missing.md", "other.md#nope", "missing-too.md"]
