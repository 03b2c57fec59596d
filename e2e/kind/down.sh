#!/usr/bin/env bash
# Removes the kind cluster e2e/kind/up.sh made, and the kubeconfig it wrote (README, "Real clusters (kind)").
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER_NAME="${CLUSTER_NAME:-universal-runtime}"
KUBECONFIG_OUT="${KUBECONFIG_OUT:-$PWD/.cache/kind/kubeconfig}"

command -v kind >/dev/null 2>&1 || {
  echo "kind-down: 'kind' is not on the PATH (install kind to remove the cluster)" >&2
  exit 1
}
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  kind delete cluster --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_OUT"
else
  echo "kind-down: no kind cluster named $CLUSTER_NAME"
fi
rm -f "$KUBECONFIG_OUT"
