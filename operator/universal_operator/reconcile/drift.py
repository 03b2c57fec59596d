"""Drift: does the live child still carry everything the operator set in it?

The InferenceService and the model's ServiceAccount are compared with what the operator renders: what
KServe, the API server or another writer added is theirs, not drift.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from universal_operator.kserve import DISABLE_LOCAL_MODEL_ANNOTATION

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("0.001"), "k": Decimal(10**3),
    "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}  # fmt: skip


def quantity_value(value: Any) -> Decimal | None:
    """A Kubernetes quantity's value, or None if ``value`` is not one."""
    match = _QUANTITY.fullmatch(str(value))
    if not match:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
        return Decimal(number) * _SUFFIX[suffix]
    except (InvalidOperation, KeyError):
        return None


def _same_scalar(want: Any, have: Any, quantities: bool) -> bool:
    if want == have:
        return True
    # The API server canonicalises quantities ("1024Mi" comes back as "1Gi"); compare those by value.
    if quantities and isinstance(want, str | int) and isinstance(have, str | int):
        a, b = quantity_value(want), quantity_value(have)
        return a is not None and a == b
    return False


#: The lists the operator writes that Kubernetes merges by key (x-kubernetes-list-map-keys, patchMergeKey in
#: k8s.io/api core/v1 and meta/v1 types.go; KServe v0.16.0 config/crd/full/serving.kserve.io_inferenceservices.yaml
#: marks a container's env, ports and volumeMounts the same way). An item is found by its key, and items
#: another writer added (a webhook's env entry, a second owner reference) are theirs, not drift. Other lists
#: (args, command, tolerations) are atomic: they compare whole, item by item.
LIST_MAP_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "protocol"),
    "ownerReferences": ("uid",),
    "secrets": ("name",),
    "imagePullSecrets": ("name",),
}


def is_subset(want: Any, have: Any, *, quantities: bool = False, field: str | None = None) -> bool:
    """Whether ``have`` contains everything in ``want``.

    Maps compare by key; lists named in :data:`LIST_MAP_KEYS` by their items' keys (extra items in
    ``have`` are fine); other lists item by item with equal lengths. Scalars compare exactly, except
    under ``resources`` maps, where quantities compare by value. ``field`` is the name the value sits under.
    """
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and is_subset(v, have[k], quantities=quantities or k in ("requests", "limits"), field=k)
            for k, v in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        keys = LIST_MAP_KEYS.get(field or "")
        if keys and all(isinstance(w, dict) for w in want):
            by_key = {tuple(h.get(k) for k in keys): h for h in have if isinstance(h, dict)}
            return all(
                (match := by_key.get(tuple(w.get(k) for k in keys))) is not None
                and is_subset(w, match, quantities=quantities)
                for w in want
            )
        return len(want) == len(have) and all(
            is_subset(w, h, quantities=quantities) for w, h in zip(want, have, strict=True)
        )
    return _same_scalar(want, have, quantities)


#: Annotations the operator sets and later removes: their presence where the render has none is drift too (the
#: LocalModelCache opt-out, lifted once the cache holds the model: see :mod:`.cache`).
REMOVABLE_ANNOTATIONS = (DISABLE_LOCAL_MODEL_ANNOTATION,)


def child_drifted(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """Whether the live InferenceService lost something the operator set (or is gone), or keeps an annotation the
    operator no longer sets (:data:`REMOVABLE_ANNOTATIONS`)."""
    if actual is not None:
        wanted = (desired.get("metadata") or {}).get("annotations") or {}
        present = (actual.get("metadata") or {}).get("annotations") or {}
        if any(key in present and key not in wanted for key in REMOVABLE_ANNOTATIONS):
            return True
    if actual is None or actual.get("metadata", {}).get("deletionTimestamp"):
        return True
    want_meta = desired["metadata"]
    have_meta = actual.get("metadata", {})
    return not (
        is_subset(want_meta.get("labels", {}), have_meta.get("labels", {}))
        and is_subset(want_meta.get("annotations", {}), have_meta.get("annotations", {}))
        and is_subset(
            want_meta.get("ownerReferences", []), have_meta.get("ownerReferences", []), field="ownerReferences"
        )
        and is_subset(desired["spec"], actual.get("spec", {}))
    )


def data_drifted(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """Whether the live ConfigMap's (or Secret's) data differs from the operator's, or it lost the labels or owner it
    set. No data and empty data are the same (the API server leaves an empty ``data`` out)."""
    if actual is None or actual.get("metadata", {}).get("deletionTimestamp"):
        return True
    want_meta, have_meta = desired["metadata"], actual.get("metadata", {})
    return not (
        (actual.get("data") or {}) == desired["data"]
        and is_subset(want_meta["labels"], have_meta.get("labels") or {})
        and is_subset(want_meta["ownerReferences"], have_meta.get("ownerReferences") or [], field="ownerReferences")
    )


def service_account_drifted(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """Whether the live ServiceAccount lost something the operator set (or is gone)."""
    if actual is None or actual.get("metadata", {}).get("deletionTimestamp"):
        return True
    want_meta, have_meta = desired["metadata"], actual.get("metadata", {})
    return not (
        is_subset(want_meta["labels"], have_meta.get("labels") or {})
        and is_subset(want_meta["ownerReferences"], have_meta.get("ownerReferences") or [], field="ownerReferences")
        and is_subset(desired["secrets"], actual.get("secrets") or [], field="secrets")
        and actual.get("automountServiceAccountToken") == desired["automountServiceAccountToken"]
    )
