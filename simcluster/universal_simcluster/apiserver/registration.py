"""What the emulator serves: the built-in kinds kopf and kubectl need, CRDs, and KServe's InferenceService."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kmock
import yaml

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


#: KServe's own CRDs, vendored verbatim from kserve/kserve v0.20.0 (commit 1fb78105) ``config/crd/full/`` (the
#: InferenceService) and ``config/crd/full/localmodel/`` (see ``kserve/crds/README.md``; each file's git blob id is
#: checked against the tag's in ``tests/simcluster/test_kserve_crds.py``). ``full``, not ``minimal``: the default
#: ``kserve-crd`` chart installs the full schema, so an API server prunes and validates InferenceService writes
#: against it, and a rendered field KServe does not have is dropped, not stored.
KSERVE_CRDS = Path(__file__).resolve().parents[1] / "kserve" / "crds"


@functools.cache
def kserve_crd(plural: str) -> dict[str, Any]:
    """KServe's CRD for ``plural`` (``inferenceservices``, ``localmodelcaches``...), parsed once per process."""
    text = (KSERVE_CRDS / f"serving.kserve.io_{plural}.yaml").read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 0.4 s for the 1.9 MB InferenceService CRD
    crd: dict[str, Any] = yaml.load(text, Loader=loader)
    return crd


def register_inference_services(emulator: KubeEmulator) -> None:
    """Serve KServe's ``serving.kserve.io/v1beta1`` InferenceService (shortname ``isvc``) from its real CRD."""
    register_crd(emulator, copy.deepcopy(kserve_crd("inferenceservices")))


#: KServe's LocalModel kinds the stand-in serves, all cluster-scoped at v1alpha1.
LOCAL_MODEL_KINDS = ("localmodelcaches", "localmodelnodegroups", "localmodelnodes")


def register_local_model_caches(emulator: KubeEmulator) -> None:
    """Serve KServe's LocalModelCache, LocalModelNodeGroup and LocalModelNode (``serving.kserve.io/v1alpha1``)."""
    for plural in LOCAL_MODEL_KINDS:
        register_crd(emulator, copy.deepcopy(kserve_crd(plural)))
