#!/usr/bin/env bash
# A real cluster for the end-to-end suite (e2e/): kind with cert-manager, Istio, Knative Serving and KServe at the versions the
# README's support matrix names, the project's images built and loaded with `kind load`, and the chart
# installed with those images. Prints the KUBECONFIG to run the suite with (README, "Real clusters (kind)").
#
#   e2e/kind/up.sh
#   KUBECONFIG=<printed path> UNIVERSAL_RUNTIME_E2E=kubeconfig python -m pytest e2e
#   e2e/kind/down.sh
#
# Not run in CI: no kind node image can be fetched on the CI machines. Needs kind, kubectl, helm, docker (or
# podman) and the internet (charts, the KServe, Knative and Istio images, and the example model's hub).
#
# How the platform is installed follows KServe's own installer at the release installed, read from its source:
# KServe v0.16.0 hack/quick_install.sh (Gateway API CRDs, Istio from its Helm charts, cert-manager from
# jetstack's chart, the Knative Operator's chart plus a KnativeServing resource, then the kserve-crd and kserve
# charts from oci://ghcr.io/kserve/charts) and, for KServe 0.17 and later, v0.20.0
# hack/setup/infra/manage.kserve-helm.sh (the resource chart is named kserve-resources there).
set -euo pipefail
cd "$(dirname "$0")/../.."

# --- Versions and names (each overridable from the environment) --------------------------------------------
# KServe: the operator's default release (charts/universal-runtime/values.yaml operator.config.kserve.version).
KSERVE_VERSION="${KSERVE_VERSION:-0.16.0}"
# Knative Serving: the oldest our support matrix names (1.16: its defaults, activator timeout and field masks
# were read at knative-v1.16.0). KServe v0.16.0's installer pairs 1.15.2 with operator v1.15.7; its
# kserve-deps.env names Knative Operator v1.16.0, which installs Serving 1.16.
KNATIVE_OPERATOR_VERSION="${KNATIVE_OPERATOR_VERSION:-v1.16.0}"
KNATIVE_SERVING_VERSION="${KNATIVE_SERVING_VERSION:-1.16.0}"
# The rest as KServe v0.16.0 hack/quick_install.sh pins them.
ISTIO_VERSION="${ISTIO_VERSION:-1.27.1}"
CERT_MANAGER_VERSION="${CERT_MANAGER_VERSION:-v1.16.1}"
GATEWAY_API_VERSION="${GATEWAY_API_VERSION:-v1.2.1}"
CLUSTER_NAME="${CLUSTER_NAME:-universal-runtime}"
# Empty: the node image of the installed kind release (Kubernetes 1.28 or later is needed: the CRD's CEL rules).
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-}"
KUBECONFIG_OUT="${KUBECONFIG_OUT:-$PWD/.cache/kind/kubeconfig}"
# How the images get into the cluster: docker (docker build of the Dockerfile's targets from their public
# bases), ci (.ci/images.sh build: podman, offline, as root; loaded as archives), none (already in docker).
IMAGE_BUILD="${IMAGE_BUILD:-docker}"
# The image names the chart and the operator use by default (.ci/images.sh, charts/universal-runtime/values.yaml).
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
REGISTRY="${IMAGE_REGISTRY:-ghcr.io/universal-runtime}"
CONTROL_PLANE_IMAGE="$REGISTRY/universal-runtime:$VERSION"
PREDICTOR_CPU_IMAGE="$REGISTRY/predictor-cpu:$VERSION"
RELEASE_NAMESPACE="${RELEASE_NAMESPACE:-universal-runtime}"

say() { echo "kind-up: $*"; }
need() {
  command -v "$1" >/dev/null 2>&1 || {
    echo "kind-up: '$1' is not on the PATH: $2" >&2
    exit 1
  }
}

need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl"
need helm "install Helm 3 (https://helm.sh/docs/intro/install/); the platform and our chart are Helm charts"
case "$IMAGE_BUILD" in
  docker | none) need docker "install docker, or set IMAGE_BUILD=ci to build with podman" ;;
  ci) need podman "IMAGE_BUILD=ci builds with podman (.ci/images.sh installs it on Debian when run as root)" ;;
  *) echo "kind-up: IMAGE_BUILD must be docker, ci or none, not '$IMAGE_BUILD'" >&2 && exit 2 ;;
esac

mkdir -p "$(dirname "$KUBECONFIG_OUT")"
export KUBECONFIG="$KUBECONFIG_OUT"

# --- The cluster ------------------------------------------------------------------------------------------
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  say "cluster $CLUSTER_NAME exists; reusing it"
  kind export kubeconfig --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_OUT"
else
  node_image=()
  if [ -n "$KIND_NODE_IMAGE" ]; then
    node_image=(--image "$KIND_NODE_IMAGE")
  fi
  kind create cluster --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_OUT" "${node_image[@]}" --wait 120s
fi

# --- Images: built from the Dockerfile, loaded into the node (imagePullPolicy IfNotPresent finds them) --------
case "$IMAGE_BUILD" in
  docker)
    for target_image in "control-plane=$CONTROL_PLANE_IMAGE" "predictor-cpu=$PREDICTOR_CPU_IMAGE"; do
      say "docker build --target ${target_image%%=*}"
      docker build --target "${target_image%%=*}" --tag "${target_image#*=}" \
        --build-arg "VERSION=$VERSION" --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)" .
    done
    kind load docker-image --name "$CLUSTER_NAME" "$CONTROL_PLANE_IMAGE" "$PREDICTOR_CPU_IMAGE"
    ;;
  ci)
    IMAGE_REGISTRY="$REGISTRY" bash .ci/images.sh build
    archive="$(dirname "$KUBECONFIG_OUT")/images.tar"
    podman save --format docker-archive --multi-image-archive -o "$archive" "$CONTROL_PLANE_IMAGE" "$PREDICTOR_CPU_IMAGE"
    kind load image-archive --name "$CLUSTER_NAME" "$archive"
    rm -f "$archive"
    ;;
  none)
    kind load docker-image --name "$CLUSTER_NAME" "$CONTROL_PLANE_IMAGE" "$PREDICTOR_CPU_IMAGE"
    ;;
esac

# --- Gateway API CRDs and Istio (KServe v0.16.0 hack/quick_install.sh) --------------------------------------
# Istio, not Kourier: KServe's ingress reconciler writes an Istio VirtualService for every Knative-mode
# InferenceService unless its ingress config disables it, and every KServe installer defaults to Istio.
say "Gateway API $GATEWAY_API_VERSION, Istio $ISTIO_VERSION"
kubectl apply -f "https://github.com/kubernetes-sigs/gateway-api/releases/download/${GATEWAY_API_VERSION}/standard-install.yaml"
helm repo add istio https://istio-release.storage.googleapis.com/charts --force-update >/dev/null
helm upgrade --install istio-base istio/base -n istio-system --create-namespace --wait \
  --set defaultRevision=default --version "$ISTIO_VERSION"
helm upgrade --install istiod istio/istiod -n istio-system --wait --version "$ISTIO_VERSION" \
  --set proxy.autoInject=disabled
# No --wait: its LoadBalancer Service never gets an address on kind; the pod's readiness is what counts.
helm upgrade --install istio-ingressgateway istio/gateway -n istio-system --version "$ISTIO_VERSION"
kubectl rollout status deployment/istio-ingressgateway -n istio-system --timeout=600s

# --- cert-manager (KServe's webhooks take their certificates from it) ---------------------------------------
say "cert-manager $CERT_MANAGER_VERSION"
helm repo add jetstack https://charts.jetstack.io --force-update >/dev/null
# --wait (quick_install.sh has none): KServe's chart creates Certificates, which need cert-manager's webhook up.
helm upgrade --install cert-manager jetstack/cert-manager -n cert-manager --create-namespace --wait \
  --version "$CERT_MANAGER_VERSION" --set crds.enabled=true

# --- Knative Serving through the Knative Operator (KServe v0.16.0 hack/quick_install.sh) ---------------------
say "Knative Operator $KNATIVE_OPERATOR_VERSION, Knative Serving $KNATIVE_SERVING_VERSION"
helm upgrade --install knative-operator -n knative-serving --create-namespace --wait \
  "https://github.com/knative/operator/releases/download/knative-${KNATIVE_OPERATOR_VERSION}/knative-operator-${KNATIVE_OPERATOR_VERSION}.tgz"
# registries-skipping-tag-resolving: Knative resolves each revision's image tag to a digest through the
# registry (knative-v1.16.0 config/core/configmaps/deployment.yaml; default kind.local,ko.local,dev.local); the
# loaded images are in no registry, so their registry host is skipped (as KServe v0.20.0's installer
# templates skip nvcr.io and index.docker.io). Knative's other settings stay at their defaults: the operator's
# configuration describes a default install (operator.config.knative in the chart).
kubectl apply -f - <<EOF
apiVersion: operator.knative.dev/v1beta1
kind: KnativeServing
metadata:
  name: knative-serving
  namespace: knative-serving
spec:
  version: "${KNATIVE_SERVING_VERSION}"
  config:
    deployment:
      registries-skipping-tag-resolving: "kind.local,ko.local,dev.local,${REGISTRY%%/*}"
    domain:
      # As quick_install.sh: the default domain svc.cluster.local is not exposed on the ingress.
      example.com: ""
EOF
kubectl wait --for=condition=Ready KnativeServing/knative-serving -n knative-serving --timeout=600s

# --- KServe ------------------------------------------------------------------------------------------------
# The resource chart is "kserve" up to 0.16 (v0.16.0 hack/quick_install.sh) and "kserve-resources" from 0.17
# (v0.17.0-v0.20.0 hack/setup/infra/manage.kserve-helm.sh, RESOURCE_CHARTS).
IFS=. read -r kserve_major kserve_minor _ <<<"$KSERVE_VERSION"
kserve_chart=kserve
if [ "$kserve_major" -gt 0 ] || [ "$kserve_minor" -ge 17 ]; then
  kserve_chart=kserve-resources
fi
say "KServe $KSERVE_VERSION ($kserve_chart chart)"
helm upgrade --install kserve-crd oci://ghcr.io/kserve/charts/kserve-crd --version "v$KSERVE_VERSION" \
  -n kserve --create-namespace --wait
helm upgrade --install kserve "oci://ghcr.io/kserve/charts/$kserve_chart" --version "v$KSERVE_VERSION" \
  -n kserve --create-namespace --wait

# --- The Universal Runtime chart, on the loaded images -------------------------------------------------------
# gateway.standardMode: the suite's Standard-mode test needs the gateway to stop and wake idle models.
say "charts/universal-runtime ($CONTROL_PLANE_IMAGE, $PREDICTOR_CPU_IMAGE)"
helm upgrade --install universal-runtime charts/universal-runtime -n "$RELEASE_NAMESPACE" --create-namespace --wait \
  --set image.repository="${CONTROL_PLANE_IMAGE%:*}" --set image.tag="$VERSION" --set image.pullPolicy=IfNotPresent \
  --set operator.config.images.cpu="$PREDICTOR_CPU_IMAGE" --set operator.config.images.pullPolicy=IfNotPresent \
  --set-string operator.config.kserve.version="$KSERVE_VERSION" \
  --set gateway.standardMode=true --set gateway.replicas=1

say "ready. Run the end-to-end suite against it:"
echo
echo "  export KUBECONFIG=$KUBECONFIG_OUT"
echo "  UNIVERSAL_RUNTIME_E2E=kubeconfig .venv/bin/python -m pytest e2e"
echo
say "remove it with e2e/kind/down.sh"
