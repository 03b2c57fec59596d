"""What the emulator serves: the built-in kinds kopf and kubectl need, CRDs, and KServe's InferenceService."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import kmock

from universal_simcluster.apiserver.emulator import KubeEmulator
from universal_simcluster.apiserver.resources import ALL_VERBS, ListType, Path_, ResourceSpec


def register_crd(emulator: KubeEmulator, crd: Mapping[str, Any]) -> None:
    """Serve a custom resource from an ``apiextensions.k8s.io/v1`` CRD dict.

    The CRD object itself is also stored (with a watch event) when ``customresourcedefinitions``
    is served (see :func:`register_builtins`), as kopf and kubectl may look at it.
    """
    emulator._register_crd_object(crd)
    crd_res = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    crd_spec = emulator._specs.get(crd_res)
    name = (crd.get("metadata") or {}).get("name")
    if crd_spec is not None and name and emulator._current(crd_res, None, name) is None:
        emulator._create(crd_spec, None, copy.deepcopy(dict(crd)))


_BUILTINS: dict[str, tuple[str, bool, bool]] = {
    # resource: (kind, namespaced, status subresource)
    "v1/namespaces": ("Namespace", False, True),
    "v1/events": ("Event", True, False),
    "events.k8s.io/v1/events": ("Event", True, False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, True),
    "v1/configmaps": ("ConfigMap", True, False),
    "v1/secrets": ("Secret", True, False),
    "v1/serviceaccounts": ("ServiceAccount", True, False),
    "v1/services": ("Service", True, True),
    "v1/pods": ("Pod", True, True),
    "discovery.k8s.io/v1/endpointslices": ("EndpointSlice", True, False),
}


#: Lists of the built-in kinds that merge by key under server-side apply (k8s.io/api core/v1 types.go:
#: ServiceAccount.secrets ``patchMergeKey=name``; imagePullSecrets is atomic).
_BUILTIN_LIST_TYPES: dict[str, dict[Path_, ListType]] = {
    "v1/serviceaccounts": {("secrets",): ("map", ("name",))},
}


def register_builtins(emulator: KubeEmulator, *, default_namespace: bool = True) -> None:
    """Serve what kopf and kubectl need: namespaces, both events APIs, CRDs (+ a few common kinds).

    Discovery details (short names, verbs) come from kmock's bundled K3s discovery data.
    """
    bundled = kmock.ResourcesArray()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # kmock uses importlib.resources.read_binary
        bundled.load_bundled()
    for name, (kind, namespaced, status) in _BUILTINS.items():
        res = kmock.resource(name)
        info: kmock.ResourceInfo | None = None
        if res in bundled:  # keep only the subresources we emulate
            known = bundled[res]
            info = kmock.ResourceInfo(
                namespaced=namespaced,
                kind=kind,
                singular=known.singular,
                verbs=set(known.verbs) or set(ALL_VERBS),
                shortnames=set(known.shortnames),
                categories=set(known.categories),
                subresources={"status"} if status else set(),
            )
        group, version, plural = name.rsplit("/", 2) if name.count("/") == 2 else ("", *name.split("/"))
        emulator.register_resource(
            ResourceSpec(
                group=group,
                version=version,
                plural=plural,
                kind=kind,
                namespaced=namespaced,
                status_subresource=status,
                list_types=_BUILTIN_LIST_TYPES.get(name, {}),
            ),
            info,
        )
    if default_namespace:
        emulator._create(emulator.resolve("namespaces"), None, {"metadata": {"name": "default"}})


def register_inference_services(emulator: KubeEmulator) -> None:
    """Serve KServe's ``serving.kserve.io/v1beta1`` InferenceService (shortname ``isvc``)."""
    register_crd(
        emulator,
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "inferenceservices.serving.kserve.io"},
            "spec": {
                "group": "serving.kserve.io",
                "scope": "Namespaced",
                "names": {
                    "plural": "inferenceservices",
                    "singular": "inferenceservice",
                    "kind": "InferenceService",
                    "listKind": "InferenceServiceList",
                    "shortNames": ["isvc"],
                },
                "versions": [
                    {
                        "name": "v1beta1",
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "additionalPrinterColumns": [
                            {"name": "URL", "type": "string", "jsonPath": ".status.url"},
                            {
                                "name": "Ready",
                                "type": "string",
                                "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
                            },
                            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                        ],
                    }
                ],
            },
        },
    )


#: KServe's LocalModel kinds, all cluster-scoped at v1alpha1: (kind, plural, status subresource). KServe v0.14.1-v0.20.0
#: config/crd/full/serving.kserve.io_localmodelcaches.yaml, _localmodelnodegroups.yaml, _localmodelnodes.yaml
#: (``scope: Cluster``; the cache and the node have ``subresources: status``, the node group none).
LOCAL_MODEL_KINDS = (
    ("LocalModelCache", "localmodelcaches", True),
    ("LocalModelNodeGroup", "localmodelnodegroups", False),
    ("LocalModelNode", "localmodelnodes", True),
)


def register_local_model_caches(emulator: KubeEmulator) -> None:
    """Serve KServe's LocalModelCache, LocalModelNodeGroup and LocalModelNode (``serving.kserve.io/v1alpha1``)."""
    for kind, plural, status in LOCAL_MODEL_KINDS:
        version: dict[str, Any] = {"name": "v1alpha1", "served": True, "storage": True}
        if status:
            version["subresources"] = {"status": {}}
        register_crd(
            emulator,
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.serving.kserve.io"},
                "spec": {
                    "group": "serving.kserve.io",
                    "scope": "Cluster",
                    "names": {"plural": plural, "singular": plural[:-1], "kind": kind, "listKind": f"{kind}List"},
                    "versions": [version],
                },
            },
        )
