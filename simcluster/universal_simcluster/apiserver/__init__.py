"""An in-process Kubernetes API emulator for operator tests and the simulated cluster.

It subclasses :class:`kmock.KubernetesEmulator` and replaces its object store
semantics with a much closer imitation of a real API server, so that the real
kopf operator, the lightkube client and the real ``kubectl`` can run against it.
The concerns live in their own modules:

* :mod:`.storage`: every write stamps ``metadata.resourceVersion`` (one global
  counter); an append-only event log per resource makes
  ``watch?resourceVersion=N`` resume exactly after ``N``; lists report the
  current global version;
* :mod:`.emulator`: request dispatch and the object lifecycle. Creates stamp
  ``uid``, ``creationTimestamp`` and ``generation``; the generation grows
  whenever anything outside ``metadata``/``status`` changes (and when a
  graceful deletion starts, as in Kubernetes); stale ``resourceVersion`` in a
  merge patch / PUT / apply body answers 409; the ``status`` subresource is
  isolated from the main resource both ways; background garbage collection via
  ``ownerReferences``; fault injection and write accounting
  (:mod:`.accounting`) for tests and benchmarks;
* :mod:`.patch`: merge, strategic-merge and JSON patches (a failed ``test``
  answers 422) and server-side apply (a documented subset);
* :mod:`.schemas`: a custom resource's structural schema on every write (defaults, pruning of unknown fields,
  OpenAPI validation and ``x-kubernetes-validations`` CEL rules, 422 Invalid naming the field), as
  apiextensions-apiserver applies it;
* :mod:`.selectors`: label & field selectors;
* :mod:`.tables`: server-side ``Table`` rendering for ``kubectl get``;
* :mod:`.watch`: watch streams; ``sendInitialEvents=true`` ends the initial
  batch with a bookmark;
* :mod:`.registration`: built-in kinds, CRDs, KServe's InferenceService;
* :mod:`.server`: the emulator served on a loopback port with a kubeconfig
  and a ``kubectl`` runner; :mod:`.rbac`: the same emulator authorizing each
  request against Roles and ClusterRoles.

Deliberate simplifications (documented once, here):

* Server-side apply merges maps recursively; lists merge as their schema
  says (structured-merge-diff): ``x-kubernetes-list-type: map`` lists by
  their ``x-kubernetes-list-map-keys`` and ``set`` lists by value (read from
  a CRD's ``openAPIV3Schema``; for every object ``metadata.ownerReferences``
  by uid and ``metadata.finalizers`` as a set, k8s.io/apimachinery
  meta/v1 types.go; a ServiceAccount's ``secrets`` by name, core/v1
  types.go patchMergeKey), every other list is atomic and replaced (the
  apiextensions default for CRDs: "Defaults to atomic for arrays"; KServe's
  InferenceService CRD leaves ``predictor.containers`` unannotated, so it
  is atomic). Ownership is tracked per object, per field manager and per
  subresource as a set of paths (map leaves, list-map items by key, set
  values); ``metadata.managedFields`` is not rendered. Conflicts are only
  detected between apply managers, and only writes by apply own fields: an
  item another writer added by a patch is nobody's, so an applier never
  removes it (unless it sits inside an item the applier stops applying).
* Strategic merge patches are treated as JSON merge patches (``$``-directives
  are dropped).
* ``propagationPolicy: Foreground`` behaves as ``Background``; ``Orphan``
  skips the garbage collection. GC runs synchronously within the request that
  finally deleted the owner.
* Namespaces are not required to exist for namespaced objects; no schema
  validation, no defaulting, no admission except for InferenceServices, which
  pass through :mod:`universal_simcluster.admission` (KServe's webhooks, Knative's
  revision validation, pod validation) when ``admission`` is set;
  ``limit``/``continue`` are ignored
  (every list is a single page); PUT without ``metadata.resourceVersion`` is
  accepted as an unconditional update.
* Requests to registered resources are served by this class directly; kmock's
  ``<<`` reactions still work for all other URLs (discovery, custom endpoints).
  Seeding via ``emulator.objects[...] = ...`` bypasses stamping and watches.
"""

from universal_simcluster.apiserver.accounting import WRITE_METHODS, Access, FaultRule, WriteKey, WriteRecord, rbac_verb
from universal_simcluster.apiserver.clock import rfc3339
from universal_simcluster.apiserver.emulator import HARNESS_HEADER, KubeEmulator
from universal_simcluster.apiserver.errors import ApiError, status_body
from universal_simcluster.apiserver.patch import apply_merge, merge_patch, schema_list_types
from universal_simcluster.apiserver.registration import (
    register_builtins,
    register_crd,
    register_inference_services,
    register_local_model_caches,
)
from universal_simcluster.apiserver.resources import ALL_VERBS, JSON, ListType, PrinterColumn, ResourceSpec
from universal_simcluster.apiserver.selectors import parse_field_selector, parse_label_selector
from universal_simcluster.apiserver.server import ServedEmulator, serve_emulator, write_kubeconfig
from universal_simcluster.apiserver.tables import human_duration, jsonpath
from universal_simcluster.apiserver.wire import parse_api_path

__all__ = [
    "ALL_VERBS",
    "HARNESS_HEADER",
    "JSON",
    "WRITE_METHODS",
    "Access",
    "ApiError",
    "FaultRule",
    "KubeEmulator",
    "ListType",
    "PrinterColumn",
    "ResourceSpec",
    "ServedEmulator",
    "WriteKey",
    "WriteRecord",
    "apply_merge",
    "human_duration",
    "jsonpath",
    "merge_patch",
    "parse_api_path",
    "parse_field_selector",
    "parse_label_selector",
    "rbac_verb",
    "register_builtins",
    "register_crd",
    "register_inference_services",
    "register_local_model_caches",
    "rfc3339",
    "schema_list_types",
    "serve_emulator",
    "status_body",
    "write_kubeconfig",
]
