"""Split a hashed lock (requirements/*.txt from uv) around some packages: print their blocks only (``--only``)
or the lock without them (``--without``). A block is the ``name==version`` line and the indented lines that
follow it (its hashes and ``# via`` comments).

The CUDA image compiles llama-cpp-python with the lock's CUDA compiler wheels only, then installs the wheel
it built and every other pin straight from the lock: pip's ``--require-hashes`` takes a whole file, so the
lock is split here."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def pattern(names: list[str]) -> str:
    """A regular expression matching ``names`` (``*`` in a name: any characters but ``=``, as in ``nvidia-*``)."""
    return "|".join(re.escape(name).replace(r"\*", "[^=]*") for name in names)


def split(text: str, names: list[str]) -> tuple[str, str]:
    """(the packages' blocks, the rest) of ``text``."""
    wanted = re.compile(rf"^({pattern(names)})==", re.IGNORECASE)
    inside = False
    block: list[str] = []
    rest: list[str] = []
    for line in text.splitlines(keepends=True):
        if line[:1].strip():  # a line at column 0 starts a block (or is a top comment)
            inside = bool(wanted.match(line))
        (block if inside else rest).append(line)
    return "".join(block), "".join(rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lock_part", description=__doc__.splitlines()[0])
    parser.add_argument("lock", type=Path)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--only", metavar="NAME", nargs="+", help="a package name; * matches any characters")
    group.add_argument("--without", metavar="NAME", nargs="+", help="a package name; * matches any characters")
    ns = parser.parse_args(argv)
    names = ns.only or ns.without
    block, rest = split(ns.lock.read_text(), names)
    missing = [name for name in names if not re.search(rf"^({pattern([name])})==", block, re.IGNORECASE | re.M)]
    if missing:
        print(f"lock_part: {ns.lock} pins no {', '.join(missing)}", file=sys.stderr)
        return 1
    sys.stdout.write(block if ns.only else rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
