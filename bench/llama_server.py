"""llama.cpp's own ``llama-server``, built from the vendored llama.cpp of the installed llama-cpp-python.

The anchor a user of a local runtime compares with (Ollama, LM Studio and KubeAI's Ollama engine serve
with it): the same llama.cpp source as our engine, so the comparison measures the serving layers, not
two llama.cpp versions. Nothing prebuilt is downloaded: pip fetches llama-cpp-python's sdist (the
package this project installs) and CMake builds only the ``llama-server`` target. The build is cached
per version under ``.cache/bench/`` (about 10 minutes on 2 cores the first time).

    .venv/bin/python bench/llama_server.py      # build (or find) it and print its path
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "bench"
#: llama-cpp-python's hashed entry of the dev lock, as ``make venv`` extracts it.
LLAMA_LOCK = Path(__file__).resolve().parents[1] / ".cache" / "wheels" / "llama-cpp-python.txt"


def sdist_requirement(version: str, lock: Path = LLAMA_LOCK) -> list[str]:
    """pip's arguments naming llama-cpp-python's sdist: the dev lock's hashed entry that ``make venv`` extracted
    (the same bytes the installed wheel was built from), or the version alone where there is none (a venv made
    otherwise). Always with ``--no-build-isolation``: pip prepares an sdist's metadata even to download it, and
    in an isolated environment with ``--no-binary :all:`` it would first build scikit-build-core and its own
    build tools from source, unpinned (3 and a half minutes on a fresh machine, against 3 seconds with the
    venv's locked build tools)."""
    if lock.exists() and f"llama-cpp-python=={version} " in lock.read_text():
        return ["--require-hashes", "-r", str(lock)]
    return [f"llama-cpp-python=={version}"]


def vendored_llama_cpp(cache: Path = CACHE) -> Path:
    """The llama.cpp source vendored in the installed llama-cpp-python's sdist (fetched once per version):
    ``llama-server``'s source here, and ``convert_hf_to_gguf.py`` with its ``gguf-py`` for the tests' models."""
    version = importlib.metadata.version("llama-cpp-python")
    source = cache / f"llama-server-{version}" / "src"
    if not (source / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 "--no-build-isolation", *sdist_requirement(version), "-d", tmp],
                check=True,
            )  # fmt: skip
            [sdist] = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as archive:
                archive.extractall(tmp, filter="data")
            [vendored] = Path(tmp).glob("*/vendor/llama.cpp")
            source.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(source, ignore_errors=True)
            shutil.move(str(vendored), source)
    return source


def build_llama_server(cache: Path = CACHE) -> Path:
    """The path of a ``llama-server`` built from the installed llama-cpp-python's vendored llama.cpp."""
    version = importlib.metadata.version("llama-cpp-python")
    root = cache / f"llama-server-{version}"
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} (the same toolchain llama-cpp-python built with)")
    source = vendored_llama_cpp(cache)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = root / "build"
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j"], check=True)
    if not binary.exists():
        raise RuntimeError(f"the build finished without {binary}")
    return binary


if __name__ == "__main__":
    print(build_llama_server())
