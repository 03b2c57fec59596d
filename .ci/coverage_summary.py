"""The unit tier's coverage, per package: combines the data files the tests' processes wrote (the pytest process
and every process it started, pyproject.toml's [tool.coverage.run]) and prints one line per package and a total.

Not a gate: a number for the README's status table (`make coverage`). Usage: python .ci/coverage_summary.py
(COVERAGE_FILE names the data file, as for `coverage run`).
"""

from __future__ import annotations

import collections
import sys

import coverage


def main() -> int:
    cov = coverage.Coverage()
    cov.combine(keep=False)
    cov.save()
    data = cov.get_data()
    statements: collections.Counter[str] = collections.Counter()
    missed: collections.Counter[str] = collections.Counter()
    for path in sorted(data.measured_files()):
        parts = path.split("/")
        package = next((p for p in parts if p.startswith("universal_")), None)
        if package is None:
            continue
        _, lines, _, missing, _ = cov.analysis2(path)
        statements[package] += len(lines)
        missed[package] += len(missing)
    if not statements:
        print("coverage: no data (was the unit tier run under `coverage run`?)", file=sys.stderr)
        return 1
    print("coverage (unit tier, the processes the tests start included): statements, missed, covered")
    for package in sorted(statements):
        total, miss = statements[package], missed[package]
        print(f"coverage: {package:24} {total:6} {miss:6} {100 * (total - miss) / total:5.1f}%")
    total, miss = sum(statements.values()), sum(missed.values())
    print(f"coverage: {'total':24} {total:6} {miss:6} {100 * (total - miss) / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
