"""The Dockerfile's structure, for every target.

Parsed, not built: runs in the ordinary test run. Building and running the targets is the image tier's job
(test_images.py, test_cuda_image.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
TARGETS = ("control-plane", "predictor-cpu", "predictor-cuda", "model")
#: Packages or programs that make a compiler toolchain (a final stage carries none, but for these).
COMPILERS = re.compile(
    r"(?<![\w.-])(build-essential|gcc|g\+\+|clang|cmake|ninja-build|python3-dev|nvcc|cuda-nvcc)(?![\w.-])"
)
#: predictor-cuda's C/C++ compiler, on purpose (issue 24 item 8): Triton compiles its CUDA driver stub with gcc
#: and Python.h at the first kernel, and nvcc (from the lock's wheels) needs g++ as its host compiler.
ALLOWED_COMPILERS = {"predictor-cuda": {"gcc", "g++"}}


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
    found = {match for run in runs for match in COMPILERS.findall(run)}
    assert found == ALLOWED_COMPILERS.get(target, set())


@pytest.mark.parametrize("target", ["control-plane", "predictor-cpu", "predictor-cuda"])
def test_python_targets_have_their_home_in_the_cache_volume(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str
) -> None:
    _, stages = dockerfile
    env = " ".join(e for stage in chain(stages, target) for e in stage.all("ENV"))
    assert "HOME=/cache" in env
    assert "PATH=/opt/venv/bin:" in env


def test_cuda_target_is_the_debian_base_with_the_cuda_lock_and_llama_cpp_compiled_for_every_named_gpu(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    global_args, stages = dockerfile
    # Item 13/18: no NVIDIA base image (CUDA 12.8 under torch and vLLM built for CUDA 13): the CPU targets' base,
    # CUDA from the lock's wheels, and the driver the image needs said to the NVIDIA container runtime.
    assert not [arg for arg in global_args if arg.startswith("CUDA_")]
    cuda = stages["predictor-cuda"]
    assert cuda.base == "runtime"
    env = " ".join(cuda.all("ENV"))
    assert 'NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in env
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    install = " ".join(cuda.all("RUN"))
    assert "requirements/image-predictor-cuda.txt --without llama-cpp-python" in install
    assert "--require-hashes" in install
    assert "libpython3.11-dev" in install  # item 8: Python.h for Triton's stub
    # Item 12: llama.cpp for T4 (75) through Blackwell (120), not the build machine's CPU.
    builder = stages["predictor-cuda-llama"]
    [archs] = [arg for arg in builder.all("ARG") if arg.startswith("LLAMA_CPP_CUDA_ARCHITECTURES=")]
    listed = archs.split("=", 1)[1].strip('"').split(";")
    assert {"75-real", "80-real", "86-real", "89-real", "90-real", "100-real", "120-real"} <= set(listed)
    build = " ".join(builder.all("RUN"))
    assert "-DGGML_CUDA=on" in build
    assert "-DGGML_NATIVE=OFF" in build
    assert "requirements/image-predictor-cuda.txt" not in build or "image-predictor-cuda.txt --only" in build
    assert "--from=predictor-cuda-llama /llama-site/ /opt/venv/lib/python3.11/site-packages/" in cuda.all("COPY")


def test_public_bases_by_default_and_the_hub_token_only_as_a_build_secret(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    global_args, stages = dockerfile
    assert global_args["BASE_IMAGE"] == "docker.io/library/python:3.11-slim-bookworm"
    every_arg = [arg for stage in stages.values() for arg in stage.all("ARG")] + list(global_args)
    assert [arg for arg in every_arg if "TOKEN" in arg.split("=", 1)[0].upper()] == []  # names, not values
    fetch = " ".join(stages["model-fetch"].all("RUN"))
    assert "--mount=type=secret,id=hf_token" in fetch
    # The model image holds files only; the wheelhouse is a build context, never copied into an image.
    assert stages["model"].all("COPY") == ["--from=model-fetch /models /models"]
    copies = [copy for stage in stages.values() for copy in stage.all("COPY")]
    assert [copy for copy in copies if "wheelhouse" in copy] == []
