"""The Dockerfile's structure, for every target (the CUDA one cannot be built on CI machines: no CUDA base).

Parsed, not built: runs in the ordinary test run. Building and running the CPU targets is test_images.py's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
TARGETS = ("control-plane", "predictor-cpu", "predictor-cuda", "model")
#: Packages or programs that make a compiler toolchain (a final stage carries none).
COMPILERS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|cmake|ninja-build|python3-dev|nvcc|cuda-nvcc)\b")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [text for kw, text in self.instructions if kw == keyword]


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in _instructions(text):
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            current = Stage(name.strip(), base.strip())
            stages[current.name] = current
        elif current is None:
            if keyword == "ARG" and "=" in rest:
                key, _, value = rest.partition("=")
                global_args[key] = value
        else:
            current.instructions.append((keyword, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse(DOCKERFILE.read_text())


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [stages[name]]
    while out[-1].base in stages:
        out.append(stages[out[-1].base])
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_runs_as_uid_1000_with_oci_labels_and_no_compiler(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str
) -> None:
    _, stages = dockerfile
    assert target in stages
    lineage = chain(stages, target)
    assert lineage[0].all("USER")[-1:] == ["1000:1000"]
    labels = " ".join(label for stage in lineage for label in stage.all("LABEL"))
    for key in ("source", "version", "revision"):
        assert f"org.opencontainers.image.{key}=" in labels
    runs = [run for stage in lineage for run in stage.all("RUN")]
    assert [run for run in runs if COMPILERS.search(run)] == []


@pytest.mark.parametrize("target", ["control-plane", "predictor-cpu", "predictor-cuda"])
def test_python_targets_have_their_home_in_the_cache_volume(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str
) -> None:
    _, stages = dockerfile
    env = " ".join(e for stage in chain(stages, target) for e in stage.all("ENV"))
    assert "HOME=/cache" in env
    assert "PATH=/opt/venv/bin:" in env


def test_cuda_target_compiles_llama_cpp_in_a_devel_stage_and_ships_a_runtime_base(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    global_args, stages = dockerfile
    cuda = stages["predictor-cuda"]
    assert cuda.base == "${CUDA_BASE_IMAGE}"
    assert "-runtime-" in global_args["CUDA_BASE_IMAGE"]
    assert "-devel-" in global_args["CUDA_DEVEL_IMAGE"]
    builder = stages["predictor-cuda-venv"]
    assert builder.base == "${CUDA_DEVEL_IMAGE}"
    assert any("GGML_CUDA=on" in arg for arg in builder.all("ARG"))
    # vLLM and its CUDA torch come from the CUDA lock (tests/test_locks.py checks what it pins).
    assert any("requirements/image-predictor-cuda.txt" in run for run in builder.all("RUN"))
    assert any(copy.startswith("--from=predictor-cuda-venv /opt/venv") for copy in cuda.all("COPY"))


def test_public_bases_by_default_and_the_hub_token_only_as_a_build_secret(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    global_args, stages = dockerfile
    assert global_args["BASE_IMAGE"] == "docker.io/library/python:3.11-slim-bookworm"
    every_arg = [arg for stage in stages.values() for arg in stage.all("ARG")] + list(global_args)
    assert [arg for arg in every_arg if "TOKEN" in arg.upper()] == []
    fetch = " ".join(stages["model-fetch"].all("RUN"))
    assert "--mount=type=secret,id=hf_token" in fetch
    # The model image holds files only; the wheelhouse is a build context, never copied into an image.
    assert stages["model"].all("COPY") == ["--from=model-fetch /models /models"]
    copies = [copy for stage in stages.values() for copy in stage.all("COPY")]
    assert [copy for copy in copies if "wheelhouse" in copy] == []
