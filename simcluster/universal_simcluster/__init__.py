"""The simulated cluster: what the tests and ``make demo`` run in place of a Kubernetes cluster with KServe.

* :mod:`universal_simcluster.apiserver`: an in-process Kubernetes API emulator (kmock underneath) that the real
  kopf operator, lightkube and ``kubectl`` talk to; :mod:`universal_simcluster.apiserver.rbac` authorizes each
  request as the API server's RBAC would.
* :mod:`universal_simcluster.admission`: the admission a cluster applies to InferenceService writes (KServe's
  webhooks, Knative's revision validation, pod validation).
* :mod:`universal_simcluster.kserve`: KServe stand-ins: :mod:`~universal_simcluster.kserve.standin` writes the
  status KServe's controller would; :mod:`~universal_simcluster.kserve.processes` runs each InferenceService's
  predictor as a local process (or a podman container, :mod:`universal_simcluster.podman`) behind a Knative
  activator, with KServe's storage-initializer code (:mod:`~universal_simcluster.kserve.storage_initializer`).

Each behaviour a stand-in imitates is taken from the upstream source at a named release and cites it beside the
code. Nothing here is part of the product: the control-plane and predictor images do not carry this package, and
no product package imports it (import-linter holds that).
"""
