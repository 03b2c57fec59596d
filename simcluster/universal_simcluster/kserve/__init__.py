"""KServe stand-ins: the status-only controller (:mod:`.standin`) and the process runner (:mod:`.processes`)."""

from lightkube.generic_resource import create_namespaced_resource

#: KServe's InferenceService as the stand-ins read and write it: group serving.kserve.io, version v1beta1, plural
#: inferenceservices (KServe v0.20.0 pkg/apis/serving/v1beta1/inference_service.go, its kubebuilder markers, and
#: config/crd). Spelled here, not imported from the operator (see admission's KServe names).
InferenceService = create_namespaced_resource("serving.kserve.io", "v1beta1", "InferenceService", "inferenceservices")
