"""The credentials of a model's LoRA adapters, delivered to its running predictors: one Secret of the model's,
``NAME-adapter-credentials``, holding a copy of each Secret that ``spec.adapters[].source.credentialsSecret`` names.

The predictor downloads an adapter while it runs, with KServe's storage code and the environment KServe's credential
builder would build from the adapter's Secret (``universal_predictors.generation.adapter_stores``), so it needs the
Secret's keys and its ``serving.kserve.io/*`` annotations (the S3 endpoint, region, https and SSL settings: KServe
v0.20.0 ``pkg/credentials/s3/s3_secret.go``, ``utils.go``). Why one aggregate Secret the operator writes, rather
than the referenced Secrets mounted as they are:

- a Secret volume per referenced Secret is part of the pod template: naming a new Secret would change the template,
  so Knative would cut a new revision (KServe's raw mode a new ReplicaSet) and the predictor would restart, the
  very thing adapters must not do (``reconcile/adapters.py``). The aggregate is one volume, present while
  ``spec.adapters`` is not empty (possibly with no data): a new Secret changes its data only, and the kubelet
  rewrites a mounted Secret in place like a ConfigMap (not with ``subPath``; Kubernetes v1.31
  ``pkg/volume/secret/secret.go`` SetUpAt writes through ``pkg/volume/util/atomic_writer.go``), at its next sync.
  Knative admits secret volumes with no feature flag (knative/serving knative-v1.23.0
  ``pkg/apis/serving/k8s_validation.go`` validateVolume);
- a Secret volume holds the data only: annotations never reach the files, and KServe reads S3 settings from them.

Each copy is the key ``<secret>.json``: ``{"data": {key: base64 value}, "annotations": {serving.kserve.io/*}}``.
Only what adapters reference is copied, and only into a Secret the model owns (garbage-collected with it). KServe's
own controller reads Secrets for the same reason (it builds the storage initializer's env from them:
``pkg/credentials/service_account_credentials.go``).

Rotation: the operator re-reads the referenced Secrets on every reconcile of the model, and so at least every repair
interval (``repairIntervalSeconds``, 60 s by default: the timer every model already has; a watch on Secrets would
need list and watch on every Secret of the namespace and hold them all in memory), and writes the aggregate only
when a copy drifted. A rotated key reaches the predictor after that interval plus the kubelet's sync (a minute or
so); the predictor tries a failed download again when the copy changes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from universal_operator.reconcile.labels import owned_metadata
from universal_operator.spec import UniversalModel

ADAPTER_CREDENTIALS_SUFFIX = "-adapter-credentials"
ADAPTER_CREDENTIALS_MOUNT_PATH = "/etc/universal-runtime/adapter-credentials"
ADAPTER_CREDENTIALS_VOLUME = "adapter-credentials"
#: The annotations KServe's credential builder reads (``constants.KServeAPIGroupName + "/..."``); no other
#: annotation of a Secret is copied (kubectl's last-applied-configuration would carry the whole Secret).
KSERVE_ANNOTATION_PREFIX = "serving.kserve.io/"


def adapter_credentials_secret_name(model: UniversalModel) -> str | None:
    """The model's aggregate Secret, or None when it lists no adapters."""
    return f"{model.metadata.name}{ADAPTER_CREDENTIALS_SUFFIX}" if model.spec.adapters else None


def adapter_credentials_dir(model: UniversalModel) -> str | None:
    """Where the predictor reads the copies (``--adapter-credentials-dir``), or None."""
    return ADAPTER_CREDENTIALS_MOUNT_PATH if model.spec.adapters else None


def referenced_secrets(model: UniversalModel) -> dict[str, list[str]]:
    """Each Secret the adapters name, with the adapters that name it (in spec order)."""
    found: dict[str, list[str]] = {}
    for adapter in model.spec.adapters:
        if adapter.source.credentials_secret:
            found.setdefault(adapter.source.credentials_secret, []).append(adapter.name)
    return found


def secret_copy(secret: Mapping[str, Any]) -> str:
    """What the predictor reads of a Secret: its data (base64, as the API gives it) and its KServe annotations."""
    annotations = (secret.get("metadata") or {}).get("annotations") or {}
    return json.dumps(
        {
            "data": dict(secret.get("data") or {}),
            "annotations": {k: v for k, v in annotations.items() if k.startswith(KSERVE_ANNOTATION_PREFIX)},
        },
        sort_keys=True,
    )


def desired_adapter_credentials_secret(
    model: UniversalModel, found: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, Any] | None:
    """The aggregate Secret for the referenced Secrets ``found`` (name -> the Secret as read, None when it does not
    exist: left out, the predictor then fails the adapters naming it); None when the model lists no adapters."""
    name = adapter_credentials_secret_name(model)
    if name is None:
        return None
    return copies_secret(owned_metadata(model, name), found)


def copies_secret(metadata: dict[str, Any], found: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """An aggregate Secret (``metadata``: its name, namespace, labels and owner) holding ``<secret>.json`` for each
    Secret of ``found`` that exists (:func:`secret_copy`). Also a pool's (``reconcile.pools``), for its members."""
    data = {
        f"{secret}.json": base64.b64encode(secret_copy(body).encode()).decode()
        for secret, body in sorted(found.items())
        if body is not None
    }
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "data": data}
