"""A model's LoRA adapters, delivered to its running predictors: a ConfigMap the predictor pods mount.

Why a ConfigMap volume: adding or removing an adapter must not roll the predictor (a restart reloads the base
model and drops every request in flight). A change to the InferenceService's pod template makes Knative cut a new
revision (and KServe's raw mode a new ReplicaSet); a ConfigMap's data is not in the template, and the kubelet
rewrites a mounted ConfigMap in place when it changes (not with ``subPath``; Kubernetes v1.31
``pkg/volume/configmap/configmap.go`` with ``pkg/volume/util/atomic_writer.go``), at its next pod sync: the
kubelet's ``syncFrequency`` defaults to 1 minute (``pkg/kubelet/apis/config/v1beta1/defaults.go``), so about a
minute; there the predictor re-reads it (``--adapters-file``). Knative accepts configMap
volumes with no feature flag (knative/serving knative-v1.23.0 ``pkg/apis/serving/k8s_validation.go``
validateVolume: only emptyDir, hostPath, CSI, ephemeral, image and PVC volumes are behind flags).

The volume exists while ``spec.adapters`` is not empty: the first adapter added to a model rolls it once (for
vLLM it must: ``enable_lora`` is set when its engine starts), later changes do not.
"""

from __future__ import annotations

import json
from typing import Any

from universal_operator.reconcile.labels import owned_metadata
from universal_operator.spec import UniversalModel

ADAPTERS_CONFIG_MAP_SUFFIX = "-adapters"
#: The ConfigMap's key, and the file name under the mount.
ADAPTERS_KEY = "adapters.json"
ADAPTERS_MOUNT_PATH = "/etc/universal-runtime/adapters"
ADAPTERS_VOLUME = "adapters"


def adapters_config_map_name(model: UniversalModel) -> str | None:
    """The model's adapters ConfigMap, or None when it lists no adapters."""
    return f"{model.metadata.name}{ADAPTERS_CONFIG_MAP_SUFFIX}" if model.spec.adapters else None


def adapters_file(model: UniversalModel) -> str | None:
    """Where the predictor reads the list (``--adapters-file``), or None."""
    return f"{ADAPTERS_MOUNT_PATH}/{ADAPTERS_KEY}" if model.spec.adapters else None


def adapters_json(model: UniversalModel) -> str:
    """The list as the predictor reads it (``universal_predictors.generation.adapters.read_adapters_file``): each
    adapter's URI and the Secret its credentials come from (copied into the model's own Secret, mounted at
    ``--adapter-credentials-dir``: :mod:`.adapter_credentials`)."""
    listed: list[dict[str, str]] = []
    for adapter in model.spec.adapters:
        item = {"name": adapter.name, "uri": adapter.source.storage_uri}
        if adapter.source.credentials_secret:
            item["credentials"] = adapter.source.credentials_secret
        listed.append(item)
    return json.dumps({"adapters": listed}, indent=1, sort_keys=True)


def desired_adapters_config_map(model: UniversalModel) -> dict[str, Any] | None:
    """The ConfigMap holding the model's adapter list, owned by the model (garbage-collected with it)."""
    name = adapters_config_map_name(model)
    if name is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owned_metadata(model, name),
        "data": {ADAPTERS_KEY: adapters_json(model)},
    }
