"""Judging a spec: what only the operator can tell about a valid UniversalModel before rendering it.

The CRD's schema and CEL rules refuse what the API server can judge at admission; these checks need the
operator's configuration (its profiles, the Knative features the cluster enables) and raise a SpecError
that names the field and says what to do.
"""

from __future__ import annotations

from universal_operator.config import OperatorConfig, Profile
from universal_operator.predictor import compile_cache_claim
from universal_operator.spec import ScalingMode, SpecError, UniversalModel

#: Knative config-features flags (knative serving knative-v1.16.0 pkg/apis/config/features.go), all
#: Disabled on a default install; pkg/apis/serving/fieldmask.go drops the fields they guard.
FEATURE_SECURITY_CONTEXT = "kubernetes.podspec-securitycontext"
FEATURE_NODE_SELECTOR = "kubernetes.podspec-nodeselector"
FEATURE_TOLERATIONS = "kubernetes.podspec-tolerations"
FEATURE_RUNTIME_CLASS = "kubernetes.podspec-runtimeclassname"
FEATURE_PVC = "kubernetes.podspec-persistent-volume-claim"
FEATURE_PVC_WRITE = "kubernetes.podspec-persistent-volume-write"
FEATURE_FIELD_REF = "kubernetes.podspec-fieldref"
#: The longest DNS label (RFC 1123); KServe builds host names from the object's name and namespace.
DNS_LABEL_MAX = 63


def check_servable(model: UniversalModel, config: OperatorConfig) -> Profile | None:
    """What only the operator can judge: the profile exists, the source can be fetched in a cluster.

    Returns the model's profile (None where neither the spec nor the configuration names one): the one
    lookup a render makes, handed on to what depends on the profile.
    """
    spec = model.spec
    if spec.resources.profile is not None and spec.resources.profile not in config.profiles:
        known = ", ".join(sorted(config.profiles)) or "none are configured"
        raise SpecError(
            "spec.resources.profile",
            f"profile {spec.resources.profile!r} is not in the operator's configuration ({known})",
        )
    profile = config.profile(spec.resources.profile)
    source = spec.source
    if source.scheme == "file" or (source.scheme is None and not source.uri.startswith("/")):
        raise SpecError(
            "spec.source.uri",
            f"{source.uri!r} is a path on a workstation; in a cluster use hf://, s3://, gs://, pvc:// or https://, "
            "or an absolute path baked into spec.image",
        )
    for key, value in spec.engine_args.items():
        if isinstance(value, dict | list):
            raise SpecError(f"spec.engineArgs.{key}", "must be a string, number or boolean")
    check_host_names(model)
    check_knative_features(model, config, profile)
    return profile


def check_host_names(model: UniversalModel) -> None:
    """Standard mode: the host labels KServe builds from name and namespace must fit one DNS label.

    KServe's raw-deployment reconciler names the predictor's host ``{name}-predictor-{namespace}`` (and the
    top-level one ``{name}-{namespace}``) with its default domainTemplate, and fails the reconcile when a
    label exceeds 63 characters (KServe v0.14.1-v0.16.0 pkg/controller/v1beta1/inferenceservice/reconcilers/
    raw/raw_kube_reconciler.go createRawURL, reconcilers/ingress/domain.go GenerateDomainName). In Knative
    mode hosts come from Knative's template ``{service}.{namespace}.{domain}``: separate labels.
    """
    if model.spec.scaling.mode is not ScalingMode.STANDARD:
        return
    name, namespace = model.metadata.name, model.metadata.namespace
    label = f"{name}-predictor-{namespace}"
    if len(label) > DNS_LABEL_MAX:
        room = DNS_LABEL_MAX - len("-predictor-")
        raise SpecError(
            "metadata.name",
            f"name {name!r} ({len(name)} characters) and namespace {namespace!r} ({len(namespace)} characters) "
            f"make KServe's host label {label!r} {len(label)} characters long, over the {DNS_LABEL_MAX} a DNS "
            f"label allows: in Standard mode name and namespace together may have at most {room} characters; "
            "use a shorter name",
        )


def knative_features_needed(
    model: UniversalModel, config: OperatorConfig, profile: Profile | None
) -> dict[str, list[str]]:
    """Knative mode: the config-features flags each part of the spec needs, by the spec field that needs them.

    knative serving knative-v1.16.0 pkg/apis/serving/fieldmask.go (PodSpecMask, VolumeSourceMask,
    EnvVarSourceMask) and k8s_validation.go (validatePersistentVolumeClaims: a writable claim also needs
    persistent-volume-write). Pod-level securityContext is not listed: it is rendered only when enabled.
    """
    spec = model.spec
    if spec.scaling.mode is not ScalingMode.KNATIVE:
        return {}
    needed: dict[str, list[str]] = {}
    if profile is not None:
        where = f"spec.resources.profile {spec.resources.profile or config.default_profile!r}"
        if profile.node_selector:
            needed.setdefault(where, []).append(FEATURE_NODE_SELECTOR)
        if profile.tolerations:
            needed.setdefault(where, []).append(FEATURE_TOLERATIONS)
        if profile.runtime_class_name:
            needed.setdefault(where, []).append(FEATURE_RUNTIME_CLASS)
    if compile_cache_claim(model, profile) is not None:
        where = f"spec.resources.profile {spec.resources.profile or config.default_profile!r} (compileCacheClaim)"
        needed.setdefault(where, []).extend([FEATURE_PVC, FEATURE_PVC_WRITE])
        if config.pod_security.fs_group is not None:
            # As spec.state: vLLM and Triton write their caches there as the predictor's user, which only the
            # pod's fsGroup lets them (a claim's root is the volume's owner's, usually root).
            needed[where].append(FEATURE_SECURITY_CONTEXT)
    if spec.state is not None:
        needed["spec.state"] = [FEATURE_PVC, FEATURE_PVC_WRITE]
        if config.pod_security.fs_group is not None:
            # The claim is writable by the predictor's user only through the pod's fsGroup.
            needed["spec.state"].append(FEATURE_SECURITY_CONTEXT)
    for var in spec.env:
        if var.value_from is not None and var.value_from.field_ref is not None:
            needed.setdefault(f"spec.env[{var.name}]", []).append(FEATURE_FIELD_REF)
    return needed


def check_knative_features(model: UniversalModel, config: OperatorConfig, profile: Profile | None) -> None:
    """Refuse, naming the flags, a Knative-mode spec the cluster's Knative would not admit."""
    enabled = set(config.knative.features)
    missing = {
        where: [flag for flag in flags if flag not in enabled]
        for where, flags in knative_features_needed(model, config, profile).items()
    }
    missing = {where: flags for where, flags in missing.items() if flags}
    if not missing:
        return
    flags = sorted({flag for needed in missing.values() for flag in needed})
    parts = "; ".join(f"{where} needs {', '.join(needed)}" for where, needed in missing.items())
    raise SpecError(
        next(iter(missing)).split(" ")[0].split("[")[0],
        f"Knative admits this only with config-features flags it has disabled ({parts}): set "
        f"{', '.join(f'{flag}: enabled' for flag in flags)} in the knative-serving/config-features ConfigMap and "
        "list them under the operator's knative.features, or use scaling.mode Standard",
    )
