"""What a KServe release accepts and can do: the per-release facts rendering and status depend on.

Pure data and functions of ``OperatorConfig.kserve.release`` (a ``(major, minor, patch)`` tuple). Each fact
names the KServe source it was read from, at the tags it was checked against (v0.14.1, v0.15.0-v0.15.2,
v0.16.0, v0.17.0-v0.20.0).
"""

from __future__ import annotations

from universal_operator.spec import ScalingMode

Release = tuple[int, int, int]

#: The InferenceService the operator writes: KServe's API group (pkg/constants/constants.go KServeAPIGroupName),
#: the version every release checked serves it at (pkg/apis/serving/v1beta1) and the kind's names.
GROUP = "serving.kserve.io"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
#: KServe v0.16.0 pkg/constants/constants.go: DeploymentMode and StopAnnotationKey, each KServeAPIGroupName + "/...".
DEPLOYMENT_MODE_ANNOTATION = f"{GROUP}/deploymentMode"
STOP_ANNOTATION = f"{GROUP}/stop"

#: KServe's LocalModelCache (v0.14.1-v0.20.0 pkg/apis/serving/v1alpha1/local_model_cache_types.go: cluster-scoped,
#: served at v1alpha1) and what steers it on an InferenceService (v0.16.0 pkg/constants/constants.go: LocalModelLabel,
#: NodeGroupAnnotationKey, DisableLocalModelKey). See universal_operator.reconcile.cache.
CACHE_VERSION = "v1alpha1"
CACHE_KIND = "LocalModelCache"
CACHE_PLURAL = "localmodelcaches"
LOCAL_MODEL_LABEL = "internal.serving.kserve.io/localmodel"
NODE_GROUP_ANNOTATION = f"{GROUP}/nodegroup"
DISABLE_LOCAL_MODEL_ANNOTATION = f"{GROUP}/disable-localmodel"

#: The release that renamed the deployment modes Serverless -> Knative and RawDeployment -> Standard.
#: KServe v0.16.0 pkg/constants/constants.go (LegacyServerless, Knative, LegacyRawDeployment, Standard).
MODE_RENAME: Release = (0, 16, 0)

#: The first release honouring ``serving.kserve.io/stop``, per mode.
#: Serverless: KServe v0.15.1 pkg/controller/v1beta1/inferenceservice/components/predictor.go (the Knative branch
#: checks isvc.GetForceStopRuntime(); v0.15.0 has no StopAnnotationKey in pkg/constants/constants.go).
#: RawDeployment: KServe v0.16.0 pkg/controller/v1beta1/inferenceservice/reconcilers/deployment/
#: deployment_reconciler.go (checkDeploymentExist deletes the Deployment when stopped; v0.15.x's raw path never
#: reads the annotation).
STOP_SINCE: dict[ScalingMode, Release] = {
    ScalingMode.KNATIVE: (0, 15, 1),
    ScalingMode.STANDARD: (0, 16, 0),
}


def version_text(release: Release) -> str:
    return ".".join(str(part) for part in release)


#: The release whose validation webhook normalises the recorded mode (constants.ParseDeploymentMode, v0.19.0).
MODE_PARSED: Release = (0, 19, 0)
#: Every name of each mode, legacy first (KServe v0.16.0 pkg/constants/constants.go).
MODE_NAMES = {ScalingMode.KNATIVE: ("Serverless", "Knative"), ScalingMode.STANDARD: ("RawDeployment", "Standard")}


def deployment_mode(release: Release, mode: ScalingMode, recorded: str | None = None) -> str:
    """The ``serving.kserve.io/deploymentMode`` value ``release`` accepts for ``mode`` on an InferenceService whose
    ``status.deploymentMode`` is ``recorded`` (None: not created yet, or nothing recorded).

    Before 0.16 GetDeploymentMode knows only Serverless, RawDeployment and ModelMesh and turns anything else
    into the configured default (KServe v0.14.1/v0.15.2 pkg/controller/v1beta1/inferenceservice/utils/utils.go).
    From 0.16 it maps the legacy names to Knative/Standard for a new object and records the new name; but the
    recorded name comes first and is kept as it is, so an object made before 0.16 keeps ``Serverless`` or
    ``RawDeployment`` in its status after an upgrade (utils.go GetDeploymentMode, v0.16.0-v0.18.1). The validation
    webhook refuses any update whose annotation differs from the recorded name, compared verbatim until v0.18.1
    and after ParseDeploymentMode normalised the record from v0.19.0 (pkg/apis/serving/v1beta1/
    inference_service_validation.go validateDeploymentMode at each tag). So: the recorded name while the release
    compares verbatim, the release's own name otherwise.
    """
    if recorded in MODE_NAMES[mode] and release < MODE_PARSED and release >= (0, 15, 1):
        return str(recorded)
    if release >= MODE_RENAME:
        return MODE_NAMES[mode][1]
    return MODE_NAMES[mode][0]


def can_stop(release: Release, mode: ScalingMode) -> bool:
    """Whether ``release`` stops a ``mode`` InferenceService that carries ``serving.kserve.io/stop: "true"``."""
    return release >= STOP_SINCE[mode]


def stop_unsupported(release: Release, mode: ScalingMode) -> str | None:
    """Why the gateway cannot stop an idle model on ``release`` (None when it can)."""
    if can_stop(release, mode):
        return None
    return (
        f"KServe {version_text(release)} cannot stop a {mode.value}-mode InferenceService "
        f"({STOP_ANNOTATION} works in this mode from KServe {version_text(STOP_SINCE[mode])}): the model stays "
        f"running after idleTimeout. Upgrade KServe, or use scaling.mode Knative to scale to zero."
    )
