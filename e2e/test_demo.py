"""`make demo` as a new user runs it: ``python -m e2e.simulated_cluster --once`` applies every ``examples/cluster/``
manifest with the real kubectl to the real operator (a process) over the simulated cluster, and prints `kubectl get
um` with every model Ready (the GPU example too: the simulated cluster has the Knative flags its profile needs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_make_demo_applies_every_cluster_example_and_each_becomes_ready() -> None:
    names = sorted(
        doc["metadata"]["name"]
        for path in (ROOT / "examples" / "cluster").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == "UniversalModel"
    )
    done = subprocess.run(
        [sys.executable, "-m", "e2e.simulated_cluster", "--once"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout[done.stdout.index("NAME ") :].splitlines()
    assert table[0].split()[:6] == ["NAME", "TASK", "BACKEND", "SERVED", "PHASE", "STEP"]
    rows = {line.split()[0]: line.split() for line in table[1:] if line.strip()}
    assert sorted(rows) == names
    assert {name: row[4] for name, row in rows.items()} == dict.fromkeys(names, "Ready"), done.stdout
    assert "not every model became Ready" not in done.stderr
