"""Pure reconcile logic: UniversalModel -> InferenceService, InferenceService status -> UniversalModel status.

Nothing here talks to Kubernetes. The handlers feed these functions plain dicts and write the results. One
module per step, each importing only modules listed below it (the "Reconcile layers" import-linter contract):

- :mod:`.status`: the UniversalModel's status from its InferenceService, or for a spec or a request refused.
- :mod:`.render`: the InferenceService that serves a model (``desired_inference_service``).
- :mod:`.checks`: what only the operator can judge about a spec (``check_servable``).
- :mod:`.service_account`: the per-model ServiceAccount that hands storage credentials to KServe.
- :mod:`.cache`: the KServe LocalModelCache of a model's source, and what its status says (``spec.cache``).
- :mod:`.labels`: the labels, served-name annotation and owner reference that mark a child as a model's.
- :mod:`.drift`: whether a live child still carries everything the operator set.

What the gateway and the simulated cluster share with the render lives outside this package: the predictor's
command line in :mod:`universal_operator.predictor`, reading a UniversalModel in :mod:`universal_operator.spec`.
"""
