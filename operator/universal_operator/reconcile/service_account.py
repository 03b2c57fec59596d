"""Credentials for KServe's storage initializer: a ServiceAccount per model that lists
spec.source.credentialsSecret (see :func:`desired_service_account` for why a ServiceAccount).
"""

from __future__ import annotations

from typing import Any

from universal_operator.config import OperatorConfig
from universal_operator.reconcile.labels import owned_metadata
from universal_operator.spec import UniversalModel

#: The per-model ServiceAccount that hands spec.source.credentialsSecret to KServe's storage initializer.
STORAGE_ACCOUNT_SUFFIX = "-storage"
SERVICE_ACCOUNT_API_VERSION = "v1"


def storage_account_name(model: UniversalModel) -> str | None:
    """The name of the model's own ServiceAccount, or None when it names no credentials secret."""
    if not model.spec.source.credentials_secret:
        return None
    return f"{model.metadata.name}{STORAGE_ACCOUNT_SUFFIX}"


def desired_service_account(model: UniversalModel) -> dict[str, Any] | None:
    """The ServiceAccount whose ``secrets`` hand spec.source.credentialsSecret to KServe's storage initializer.

    Why a ServiceAccount: the initializer's env is built by KServe's pod webhook, never copied from
    ``kserve-container``. For a custom container (ours) its credentials come from the secrets listed on the
    pod's ServiceAccount (KServe v0.14.1 to v0.20.0 pkg/credentials/service_account_credentials.go,
    CreateSecretVolumeAndEnv -> mountSecretCredential; storage_initializer_injector.go). The other
    mechanisms do not fit: ``storage.key``/``storage.parameters`` exist only for ``predictor.model``
    (CustomPredictor.GetStorageSpec returns nil) and read one shared ``storage-config`` Secret; the
    secret-name annotation's key is a per-install setting (``storageSecretNameAnnotation``: the kustomize
    install says ``serving.kserve.io/storageSecretName``, the Helm chart ``serving.kserve.io/secretName``).

    Owned by the model (garbage-collected with it), applied before the InferenceService. The token is not
    mounted: the predictor never calls the API. It replaces OperatorConfig.serviceAccountName for this
    model only (reading that account to copy its imagePullSecrets or IRSA annotation would need RBAC on
    every ServiceAccount); a model that needs the configured account instead lists the secret in that
    account's ``secrets`` and leaves credentialsSecret empty.
    """
    name = storage_account_name(model)
    if name is None:
        return None
    return {
        "apiVersion": SERVICE_ACCOUNT_API_VERSION,
        "kind": "ServiceAccount",
        "metadata": owned_metadata(model, name),
        "secrets": [{"name": model.spec.source.credentials_secret}],
        "automountServiceAccountToken": False,
    }


def predictor_service_account(model: UniversalModel, config: OperatorConfig) -> str | None:
    """The predictor pods' ServiceAccount: the model's own when it has credentials, else the configured one."""
    return storage_account_name(model) or config.service_account_name
