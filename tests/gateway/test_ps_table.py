"""``universal-runtime ps``'s table: a starting model's state names its step (issue 23, item 5)."""

from __future__ import annotations

from universal_gateway.cli import format_ps


def test_a_starting_models_state_names_its_step_and_others_do_not() -> None:
    table = format_ps(
        [
            {"id": "minilm", "task": "embed", "backend": "transformers", "state": "loading", "step": "Loading",
             "held": 3, "requests": 0},
            {"id": "qwen", "task": "generate", "backend": "llamacpp", "state": "ready", "held": 0, "requests": 7,
             "p50_ms": 41.6},
        ]
    )  # fmt: skip
    header, starting, ready = table.splitlines()
    assert header.split()[:5] == ["NAME", "TASK", "BACKEND", "STATE", "HELD"]
    assert starting.split()[:6] == ["minilm", "embed", "transformers", "loading", "(Loading)", "3"]
    assert ready.split()[:5] == ["qwen", "generate", "llamacpp", "ready", "0"]
    assert ready.rstrip().endswith("42ms")
