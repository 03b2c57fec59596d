"""How the operator marks what it creates: who manages a child and for which model (labels), the
served name (an annotation), whether KServe may publish its route, and the owner reference that lets
garbage collection delete it with its model.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from universal_operator.config import OperatorConfig
from universal_operator.spec import GROUP, KIND, ScalingMode, UniversalModel

MANAGED_BY = "universal-runtime"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MODEL = f"{GROUP}/model"
LABEL_TASK = f"{GROUP}/task"
LABEL_SERVED_NAME = f"{GROUP}/served-name"
ANNOTATION_SERVED_NAME = f"{GROUP}/served-name"
#: Labels that make KServe keep a model's route inside the cluster, one per mode: Knative mode reads Knative's
#: (KServe v0.14.1-v0.16.0 reconcilers/ingress/ingress_reconciler.go), Standard mode KServe's own
#: (reconcilers/ingress/kube_ingress_reconciler.go, httproute_reconciler.go at v0.16.0).
LABEL_KNATIVE_VISIBILITY = "networking.knative.dev/visibility"
LABEL_KSERVE_VISIBILITY = "networking.kserve.io/visibility"
CLUSTER_LOCAL = "cluster-local"
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def labels_for(model: UniversalModel) -> dict[str, str]:
    """Labels on the child (and its pods): who manages it, which model, which task, which served name."""
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: MANAGED_BY,
        LABEL_NAME: model.metadata.name,
        LABEL_COMPONENT: "predictor",
        LABEL_MODEL: model.metadata.name,
        LABEL_TASK: model.spec.task.value,
    }
    served = model.served_name
    labels[LABEL_SERVED_NAME] = served if len(served) <= 63 and _LABEL_VALUE.fullmatch(served) else _label_safe(served)
    return labels


def visibility_labels(model: UniversalModel, config: OperatorConfig) -> dict[str, str]:
    """Keep the model's own route inside the cluster unless the operator is told to expose models.

    The gateway is the front door (API keys, one address); a model KServe publishes on its own ingress host
    would be reachable around it.
    """
    if config.expose_models:
        return {}
    knative = model.spec.scaling.mode is ScalingMode.KNATIVE
    return {LABEL_KNATIVE_VISIBILITY if knative else LABEL_KSERVE_VISIBILITY: CLUSTER_LOCAL}


def _label_safe(text: str) -> str:
    """A label value standing for ``text`` (which has characters or length labels forbid)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:54].strip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


def owner_reference(model: UniversalModel) -> dict[str, Any]:
    """The controller reference that lets garbage collection delete the child with its parent."""
    return {
        "apiVersion": model.api_version,
        "kind": KIND,
        "name": model.metadata.name,
        "uid": model.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_metadata(model: UniversalModel, name: str) -> dict[str, Any]:
    """The metadata of a namespaced helper object the model owns (its ServiceAccount, its adapters ConfigMap):
    in the model's namespace, labelled as ours, garbage-collected with it."""
    return {
        "name": name,
        "namespace": model.metadata.namespace,
        "labels": {
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_PART_OF: MANAGED_BY,
            LABEL_NAME: model.metadata.name,
            LABEL_MODEL: model.metadata.name,
        },
        "ownerReferences": [owner_reference(model)],
    }


def owned_by(child: dict[str, Any], model: UniversalModel) -> bool:
    """Whether ``child`` names ``model`` as its controller."""
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == model.metadata.uid and ref.get("controller") for ref in refs)
