"""What ``backend: auto`` picks for generation, and how it finds out: a GPU is seen through NVML, never by
initialising CUDA (vLLM must still be free to fork its engine core), and only an engine that knows every
``--engine-arg`` key given is picked.

No GPU here: a stand-in for NVML's library (``libnvidia-ml.so.1``, the functions vLLM and the predictor call)
reports the GPUs, and torch is made to look like a CUDA build whose CUDA-initialising entry points raise.
Runs in .venv (vLLM absent: transformers) and in .venv-vllm through .ci/vllm.sh (vLLM on the "GPU").
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.predictors.harness import OFFLINE_ENV

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
#: Run in the unit tier (no vllm) and again in the vLLM tier (vllm installed): auto's choice differs.
pytestmark = pytest.mark.also_vllm

#: NVML as far as vLLM's platform check (nvmlInit, nvmlDeviceGetCount, nvmlShutdown) and ours use it.
FAKE_NVML = r"""
#include <stdio.h>
#include <stdlib.h>
static void note(const char *what) {
    const char *path = getenv("FAKE_NVML_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) { fprintf(f, "%s\n", what); fclose(f); }
}
static unsigned gpus(void) { const char *n = getenv("FAKE_NVML_GPUS"); return n ? (unsigned)atoi(n) : 0; }
int nvmlInit_v2(void) { note("nvmlInit"); return 0; }
int nvmlInit(void) { note("nvmlInit"); return 0; }
int nvmlInitWithFlags(unsigned flags) { (void)flags; note("nvmlInit"); return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *count) { *count = gpus(); note("nvmlDeviceGetCount"); return 0; }
int nvmlDeviceGetCount(unsigned *count) { *count = gpus(); note("nvmlDeviceGetCount"); return 0; }
const char *nvmlErrorString(int result) { (void)result; return "fake NVML"; }
"""

#: Resolve ``auto`` in a process where torch then looks like a CUDA build and every path that initialises CUDA
#: raises (torch 2.13 torch/cuda/__init__.py: is_available and device_count's fallback call
#: torch._C._cuda_getDeviceCount, i.e. cuInit; _lazy_init/init create the context).
RESOLVE = """
import importlib.util, json, sys
import torch

if importlib.util.find_spec("vllm"):
    # Imported while torch is still what it is (a CPU build): vLLM's CPU wheel cannot import as a CUDA one.
    import universal_predictors.generation.engines.vllm
    import vllm.model_executor.models

def initialises_cuda(*args, **kwargs):
    raise RuntimeError("CUDA was initialised")

torch.version.cuda = "12.8"
torch.cuda._is_compiled = lambda: True
torch._C._cuda_getDeviceCount = initialises_cuda
torch.cuda._lazy_init = initialises_cuda
torch.cuda.init = initialises_cuda

from universal_predictors.config import PredictorConfig
from universal_predictors.catalog import Task
from universal_predictors.devices import nvml_gpu_count
from universal_predictors.generation.engines import resolve_backend

source, engine_args = json.loads(sys.argv[1])
config = PredictorConfig(model_name="m", task=Task.GENERATE, source=source, engine_args=engine_args)
print("RESULT " + json.dumps([resolve_backend(config).value, nvml_gpu_count()]))
"""


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the stand-in ``libnvidia-ml.so.1``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        # Outside CI only: inside a tier this skip fails (tests/tiers.py), and `make test` installs a compiler.
        pytest.skip("a C compiler is needed to build the NVML stand-in")
    folder = tmp_path_factory.mktemp("fake-nvml")
    (folder / "nvml.c").write_text(FAKE_NVML)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "libnvidia-ml.so.1"), str(folder / "nvml.c")],
                   check=True, capture_output=True)  # fmt: skip
    return folder


def resolve(
    fake_nvml: Path, source: Path, engine_args: dict[str, str], gpus: int, tmp_path: Path, **env: str
) -> tuple[str, int, list[str]]:
    """The backend ``auto`` resolves to, the GPU count the predictor saw, and the NVML calls made."""
    log = tmp_path / "nvml.log"
    log.unlink(missing_ok=True)
    environment = {**os.environ, **OFFLINE_ENV, "FAKE_NVML_GPUS": str(gpus), "FAKE_NVML_LOG": str(log),
                   "LD_LIBRARY_PATH": f"{fake_nvml}:{os.environ.get('LD_LIBRARY_PATH', '')}", **env}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps([str(source), engine_args])],
                            capture_output=True, text=True, timeout=300, env=environment, check=False)  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0, result.stderr[-3000:]
    assert lines, result.stdout[-3000:]
    backend, count = json.loads(lines[0].removeprefix("RESULT "))
    calls = log.read_text().split() if log.exists() else []
    return backend, count, calls


def test_auto_counts_gpus_through_nvml_without_initialising_cuda(
    fake_nvml: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    backend, count, calls = resolve(fake_nvml, tiny_llama_dir, {}, 1, tmp_path)
    assert count == 1
    assert "nvmlDeviceGetCount" in calls  # the GPU was seen through NVML, and CUDA's init paths never ran
    assert backend == ("vllm" if VLLM_INSTALLED else "transformers")


def test_no_gpu_and_hidden_gpus_mean_transformers(fake_nvml: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert resolve(fake_nvml, tiny_llama_dir, {}, 0, tmp_path)[:2] == ("transformers", 0)
    # CUDA_VISIBLE_DEVICES empty hides every GPU from CUDA, so from vLLM too.
    assert resolve(fake_nvml, tiny_llama_dir, {}, 2, tmp_path, CUDA_VISIBLE_DEVICES="")[:2] == ("transformers", 0)
    assert resolve(fake_nvml, tiny_llama_dir, {}, 2, tmp_path, CUDA_VISIBLE_DEVICES="1")[1] == 1


def test_a_key_only_transformers_knows_makes_auto_pick_transformers_on_a_gpu(
    fake_nvml: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    assert resolve(fake_nvml, tiny_llama_dir, {"attn_implementation": "sdpa"}, 1, tmp_path)[0] == "transformers"


# vLLM's own keys steer auto only where vllm is installed: the vLLM tier's (skipped outside the tiers where vllm is
# missing; inside a tier a skip fails).
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM's own keys steer auto only where vllm is installed")
def test_a_key_only_vllm_knows_keeps_auto_on_vllm(fake_nvml: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert resolve(fake_nvml, tiny_llama_dir, {"gpu_memory_utilization": "0.8"}, 1, tmp_path)[0] == "vllm"
