"""The ``predictor-cuda`` image, built in the image tier from the Debian base and the CUDA lock's PyPI wheels
(issue 24 items 8, 9, 13, 16, 18). No GPU is reachable here, so this proves what can be proven without one:

* every engine imports, with the CUDA builds the lock pins (torch and vLLM for CUDA 13, Triton, FlashInfer,
  the headless OpenCV only: item 9's clash of two cv2 packages would fail the imports);
* what vLLM's first kernel needs at run time is there (item 8): Triton's CUDA driver stub compiles with the
  image's C compiler and Python headers, exactly as Triton builds it at the first kernel, and the image's nvcc
  compiles a kernel with its host compiler;
* the start-up check refuses a GPU it cannot reach with one line naming the runtime class, not a traceback
  (items 16 and 18), for each engine and an encoder task;
* the environment the NVIDIA container runtime reads (item 13): the CUDA the image needs (``cuda>=13.0``:
  the runtime refuses an older driver by name), the driver capabilities, and no ``NVIDIA_VISIBLE_DEVICES``.

CI builds it with ``LLAMA_CPP_CUDA_ARCHITECTURES=none`` (llama.cpp's CPU wheel: compiling ggml-cuda takes about
25 minutes an architecture on CI's two cores), which the image's label records and the llama.cpp case reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap

import pytest

from universal_simcluster.podman import podman_sync

IMAGE = os.environ.get("UNIVERSAL_RUNTIME_PREDICTOR_CUDA_IMAGE", "ghcr.io/universal-runtime/predictor-cuda:0.1.0")
GPUS_ENV = "UNIVERSAL_RUNTIME_GPUS"


def _skip_reason() -> str | None:
    if os.environ.get("UNIVERSAL_RUNTIME_IMAGE_TESTS") != "1":
        return "the image tier runs from .ci/images.sh (make test-images), which sets UNIVERSAL_RUNTIME_IMAGE_TESTS=1"
    if shutil.which("podman") is None:
        return "podman is not installed (make images installs it)"
    if podman_sync("image", "exists", IMAGE, check=False).returncode:
        return f"image not built: {IMAGE} (make images)"
    return None


_reason = _skip_reason()
pytestmark = [pytest.mark.image, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


def in_image(*command: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``command`` in the image as its own user, read-only but for /cache and /tmp, fresh world-writable
    directories as the kubelet makes a pod's emptyDirs; no GPU."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tmp:
        for directory in (cache, tmp):
            os.chmod(directory, 0o777)  # an emptyDir is world-writable
        args = ["run", "--rm", "--read-only", "--read-only-tmpfs=false", "--volume", f"{cache}:/cache",
                "--volume", f"{tmp}:/tmp"]  # fmt: skip
        for key, value in (env or {}).items():
            args += ["--env", f"{key}={value}"]
        result = podman_sync(*args, IMAGE, *command, check=False)
    return result.returncode, result.stdout, _without_podman_noise(result.stderr)


def _without_podman_noise(stderr: str) -> str:
    """podman's complaint that it cannot register the image's HEALTHCHECK with systemd (none runs here)."""
    return "\n".join(line for line in stderr.splitlines() if "unable to get systemd connection" not in line)


def labels() -> dict[str, str]:
    return dict(json.loads(podman_sync("image", "inspect", IMAGE).stdout)[0]["Config"]["Labels"])


def test_every_engine_imports_with_the_cuda_builds_the_lock_pins() -> None:
    probe = textwrap.dedent(
        """
        import json, importlib.metadata as md
        import cv2, flashinfer, llama_cpp, onnxruntime, pyod, rapidocr_onnxruntime, torch, transformers, triton
        import av, ctranslate2, faster_whisper, vllm, universal_predictors
        names = [d.metadata["Name"].lower() for d in md.distributions()]
        print(json.dumps({
            "torch_cuda": torch.version.cuda, "vllm": vllm.__version__, "triton": triton.__version__,
            "llama_offload": llama_cpp.llama_supports_gpu_offload(),
            "opencv": sorted(n for n in names if "opencv" in n),
            "ctranslate2": ctranslate2.__version__, "faster_whisper": faster_whisper.__version__,
            "ctranslate2_cuda_devices": ctranslate2.get_cuda_device_count(),
        }))
        """
    )
    code, out, err = in_image("python", "-c", probe)
    assert code == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    assert found["torch_cuda"].startswith("13.")
    assert found["vllm"] == "0.32.0"
    assert found["triton"] == "3.7.1"
    assert found["opencv"] == ["opencv-python-headless"]  # item 9: one cv2, the one without X11 and GL
    # Speech to text (issue 30): the lock's faster-whisper and CTranslate2 (whose Linux wheel carries its CUDA
    # kernels), asking for a device without failing where there is none.
    assert (found["ctranslate2"], found["faster_whisper"]) == ("4.8.5", "1.2.1")
    assert found["ctranslate2_cuda_devices"] == 0


def test_triton_builds_its_driver_stub_and_nvcc_compiles_a_kernel_in_the_image() -> None:
    # Triton 3.7.1 builds backends/nvidia/driver.c into cuda_utils at its first kernel with runtime/build.py's
    # _build: $CC or gcc, Python.h from sysconfig, its bundled cuda.h. Here the same call, minus -lcuda (the
    # driver library is mounted only on GPU nodes; an unresolved symbol is fine in a shared object).
    probe = textwrap.dedent(
        """
        import os, pathlib, tempfile
        import triton
        from triton.runtime.build import _build
        nvidia = pathlib.Path(triton.__file__).parent / "backends" / "nvidia"
        work = tempfile.mkdtemp()
        so = _build("cuda_utils", str(nvidia / "driver.c"), work, [], [str(nvidia / "include")], [], [])
        print("stub", os.path.getsize(so))
        """
    )
    code, out, err = in_image("python", "-c", probe)
    assert code == 0, err
    assert out.split()[-2] == "stub"
    # Compiled and linked (nvcc links CUDA's static runtime from its profile's lib64): what a JIT extension does.
    kernel = "__global__ void twice(float *x) { x[threadIdx.x] *= 2.0f; } int main() { return 0; }"
    script = f"echo '{kernel}' >/tmp/k.cu && \"$CUDA_HOME/bin/nvcc\" -arch=sm_80 /tmp/k.cu -o /tmp/k && echo built"
    code, out, err = in_image("sh", "-c", script)
    assert code == 0, err
    assert out.strip().endswith("built")


@pytest.mark.parametrize(
    ("task", "backend"),
    [
        ("generate", "vllm"),
        ("generate", "transformers"),
        ("embed", "transformers"),
        ("generate", "llamacpp"),
        ("transcribe", "transformers"),
        ("transcribe", "faster-whisper"),
    ],
)
def test_a_gpu_pod_without_the_nvidia_runtime_is_refused_in_one_line(task: str, backend: str) -> None:
    # Before: vLLM's check looked at the torch build only and the engine died later with a traceback; the
    # encoder tasks silently ran on the CPU.
    code, out, err = in_image(
        "python", "-m", "universal_predictors", "--model_name=m", f"--task={task}", f"--backend={backend}",
        "--source=/mnt/models", env={GPUS_ENV: "1"},
    )  # fmt: skip
    assert code == 2, out + err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("universal_predictors: error:")]
    assert f"{GPUS_ENV}=1" in line
    if backend == "llamacpp" and labels()["dev.universal-runtime.llama-cpp.cuda-architectures"] == "none":
        assert "built without GPU offload" in line  # CI's build: llama.cpp's CPU wheel, and it says so
    else:
        assert "no NVIDIA driver" in line
        assert "runtimeClassName" in line


def test_vllm_without_a_gpu_is_refused_in_one_line() -> None:
    # vLLM's CUDA build reads its engine arguments' defaults at import, which needs a device: before, a model
    # naming backend vllm without spec.resources.gpus crash-looped with "Failed to infer device type".
    code, out, err = in_image(
        "python", "-m", "universal_predictors", "--model_name=m", "--task=generate", "--backend=vllm",
        "--source=/mnt/models",
    )  # fmt: skip
    assert code == 2, out + err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("universal_predictors: error:")]
    assert "the vllm backend could not start" in line
    assert "spec.resources.gpus" in line


def test_the_image_tells_the_nvidia_runtime_what_it_needs_and_sees_no_gpu_by_default() -> None:
    env = dict(
        item.split("=", 1) for item in json.loads(podman_sync("image", "inspect", IMAGE).stdout)[0]["Config"]["Env"]
    )
    assert env["NVIDIA_REQUIRE_CUDA"] == "cuda>=13.0"  # torch 2.13 / vLLM 0.32: driver 580+
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # the device plugin says which GPUs a container gets
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    code, out, err = in_image("sh", "-c", '"$CUDA_HOME/bin/nvcc" --version && ls "$CUDA_HOME/lib/libcudart.so.13"')
    assert code == 0, err
    assert "release 13." in out
