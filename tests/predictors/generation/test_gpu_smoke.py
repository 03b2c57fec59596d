"""``bench/gpu_smoke.py --dry-run``: the GPU smoke run's steps on tiny models on the CPU, so that the script a
GPU machine runs in one go is known to work end to end before it gets there (issue 16)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.predictors.harness import OFFLINE_ENV

ROOT = Path(__file__).resolve().parents[3]


def test_the_dry_run_passes_every_step_and_reports_the_oom_as_503(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="the llama.cpp step needs llama-cpp-python")
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), "--dry-run", "--work", str(tmp_path / "work"),
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **OFFLINE_ENV}, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert not [name for name, facts in report.items() if "error" in facts]
    assert report["environment"]["cuda available"] is False
    assert report["generate: transformers (auto, HF directory)"]["card"]["backend"] == "transformers"
    assert report["generate: llama.cpp (auto, GGUF)"]["card"]["backend"] == "llamacpp"
    for step in ("generate: transformers (auto, HF directory)", "generate: llama.cpp (auto, GGUF)"):
        assert report[step]["tokens/s c=1"] > 0
        assert report[step]["tokens/s c=8"] > 0
    assert report["embed (auto)"]["device"] == "cpu"
    speech = report["transcribe (auto)"]
    assert (speech["transformers device"], speech["transformers dtype"]) == ("cpu", "torch.float32")
    assert speech["transformers real time x (150 s, long-form)"] > 0
    assert speech["faster-whisper device, compute type"] == "cpu, int8"
    assert speech["faster-whisper real time x (150 s)"] > 0
    assert report["out of memory (transformers)"]["under pressure"] == ["503 out_of_memory Retry-After=1"]
    assert report["out of memory (transformers)"]["afterwards"] == ["200"]


def test_the_carried_sdist_keeps_the_build_files_and_drops_tests_docs_and_models(tmp_path: Path) -> None:
    from bench.gpu_smoke import trim_sdist

    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    top = "llama_cpp_python-0.3.36"
    names = [f"{top}/CMakeLists.txt", f"{top}/vendor/llama.cpp/ggml/src/ggml-cuda/x.cu",
             f"{top}/vendor/llama.cpp/models/ggml-vocab-llama.gguf", f"{top}/tests/test_llama.py",
             f"{top}/docs/index.md"]  # fmt: skip
    with tarfile.open(sdist, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    with tarfile.open(trim_sdist(sdist, tmp_path / "trimmed.tar.gz")) as tar:
        kept = tar.getnames()
    assert kept == names[:2]
