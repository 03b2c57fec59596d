#!/usr/bin/env bash
# `make test` after the venv exists: the checks and the three test tiers, with the independent slow steps
# overlapped. While lint, types, layering, the drift checks and the unit tier (pytest, about half of CI)
# run in the foreground, one background step prepares the later tiers: the vLLM tier's virtualenv
# (.ci/vllm.sh install), then the image tier's images (.ci/images.sh build). One after the other, not at
# once: both build the project from this tree (pip's in-tree build: build/, *.egg-info) and both run pip;
# together they take about 17 minutes, well inside pytest's 31. Then the vLLM tier's tests and the image
# tier's tests run, one after the other (both load the CPUs).
#
# A background step writes its log under $LOGS, printed whole (between markers) once it ends; a background
# step that fails fails CI with its exit status, like a foreground one. If CI stops early, a background
# step still running is stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
MAKE="${MAKE:-make}"
LOGS=.cache/ci-logs
mkdir -p "$LOGS"

declare -A PIDS=()
started=$SECONDS

background() {  # background NAME COMMAND...: start COMMAND with its output in $LOGS/NAME.log
  local name="$1"
  shift
  # Its own session (setsid), so that stopping it stops its children too (pip, podman). At the lowest CPU
  # and I/O priority: it takes what the unit tier leaves, so the tests' timing is what it was alone (the
  # llama.cpp admission tests, whose decode threads spin, time out on a CPU shared at equal priority).
  setsid --wait nice -n 19 ionice -t -c 2 -n 7 "$@" >"$LOGS/$name.log" 2>&1 &
  PIDS[$name]=$!
  echo "ci: started $name in the background (pid ${PIDS[$name]}, log $LOGS/$name.log)"
}

finish() {  # finish NAME: wait for a background step, print its log, fail with its status
  local name="$1" status=0
  wait "${PIDS[$name]}" || status=$?
  unset "PIDS[$name]"
  echo "ci: ---- $name (background) log ----"
  cat "$LOGS/$name.log"
  echo "ci: ---- end of $name log: exit status $status at $((SECONDS - started)) s ----"
  if [ "$status" -ne 0 ]; then
    echo "ci: background step $name failed (exit status $status)" >&2
    exit "$status"
  fi
}

stop_background() {
  local name
  for name in "${!PIDS[@]}"; do
    echo "ci: stopping background step $name" >&2
    kill -- "-${PIDS[$name]}" 2>/dev/null || true
  done
}
trap stop_background EXIT

background prepare env VENV="$VENV" bash -c 'set -euo pipefail
  echo "ci: vllm-install ..."; bash .ci/vllm.sh install
  echo "ci: images-build ..."; bash .ci/images.sh build'

"$MAKE" --no-print-directory VENV="$VENV" lint typecheck layering crd-check unit
echo "ci: checks and unit tier done at $((SECONDS - started)) s"

finish prepare
bash .ci/vllm.sh test
echo "ci: vLLM tier done at $((SECONDS - started)) s"

VENV="$VENV" bash .ci/images.sh test
echo "ci: image tier done at $((SECONDS - started)) s"
