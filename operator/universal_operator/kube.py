"""The operator's own Kubernetes calls (kopf has no public client): apply the children, patch the parent's status.

lightkube's async client speaks server-side apply natively, so the child is written with one field
manager and fields others own (KServe's defaults, the gateway's stop annotation) are left alone.
"""

from __future__ import annotations

from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.core_v1 import ConfigMap, Secret, ServiceAccount
from lightkube.types import PatchType

from universal_operator import kserve
from universal_operator.spec import GROUP, KIND, PLURAL, POOL_KIND, POOL_PLURAL, VERSION

FIELD_MANAGER = "universal-runtime-operator"

InferenceService = create_namespaced_resource(kserve.GROUP, kserve.VERSION, kserve.KIND, kserve.PLURAL)
UniversalModelResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)
UniversalModelPoolResource = create_namespaced_resource(GROUP, VERSION, POOL_KIND, POOL_PLURAL)
LocalModelCache = create_global_resource(kserve.GROUP, kserve.CACHE_VERSION, kserve.CACHE_KIND, kserve.CACHE_PLURAL)


def api_error_code(exc: ApiError) -> int:
    """The HTTP status of a failed API call (0 when the server did not say)."""
    code = getattr(exc.status, "code", None)
    if code is None and exc.response is not None:
        code = exc.response.status_code
    return int(code or 0)


def denied_by_webhook(exc: ApiError) -> bool:
    """Whether an admission webhook refused the write (a spec problem, whatever the status code).

    A validating webhook's denial reaches the client as ``admission webhook "NAME" denied the request: ...``
    (kubernetes/kubernetes staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/errors/statuserror.go,
    ToStatusErr). Its code is the webhook's own: KServe's controller-runtime validator answers 403
    (``admission.Denied``), Knative's 400, so a 403 alone does not tell RBAC from a refused spec.
    """
    message = str(getattr(exc.status, "message", "") or exc)
    return "admission webhook" in message and "denied the request" in message


class KubeApi:
    """The few writes the operator makes besides kopf's own bookkeeping."""

    def __init__(self, client: AsyncClient | None = None) -> None:
        self._client = client

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            # Reads $KUBECONFIG / ~/.kube/config, or the in-cluster service account.
            self._client = AsyncClient(field_manager=FIELD_MANAGER)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The InferenceService as stored, or None if there is none."""
        try:
            result: Any = await self.client.get(InferenceService, name, namespace=namespace)
        except ApiError as exc:
            if api_error_code(exc) == 404:
                return None
            raise
        return dict(result.to_dict())

    async def apply_inference_service(self, desired: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply the child; returns the object as the API server stored it."""
        obj = InferenceService.from_dict(desired)
        result = await self.client.apply(obj, field_manager=FIELD_MANAGER, force=True)
        return dict(result.to_dict())

    async def get_service_account(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ServiceAccount as stored, or None if there is none."""
        try:
            result: Any = await self.client.get(ServiceAccount, name, namespace=namespace)
        except ApiError as exc:
            if api_error_code(exc) == 404:
                return None
            raise
        return dict(result.to_dict())

    async def apply_service_account(self, desired: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply the model's ServiceAccount; returns it as the API server stored it."""
        obj = ServiceAccount.from_dict(desired)
        result: Any = await self.client.apply(obj, field_manager=FIELD_MANAGER, force=True)
        return dict(result.to_dict())

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ConfigMap as stored, or None if there is none."""
        try:
            result: Any = await self.client.get(ConfigMap, name, namespace=namespace)
        except ApiError as exc:
            if api_error_code(exc) == 404:
                return None
            raise
        return dict(result.to_dict())

    async def apply_config_map(self, desired: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply a ConfigMap of the model's (its adapter list); returns it as stored."""
        obj = ConfigMap.from_dict(desired)
        result: Any = await self.client.apply(obj, field_manager=FIELD_MANAGER, force=True)
        return dict(result.to_dict())

    async def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret as stored, or None if there is none (a Secret adapters name, or the model's own copy of them)."""
        try:
            result: Any = await self.client.get(Secret, name, namespace=namespace)
        except ApiError as exc:
            if api_error_code(exc) == 404:
                return None
            raise
        return dict(result.to_dict())

    async def apply_secret(self, desired: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply a Secret of the model's (its adapters' credentials); returns it as stored."""
        obj = Secret.from_dict(desired)
        result: Any = await self.client.apply(obj, field_manager=FIELD_MANAGER, force=True)
        return dict(result.to_dict())

    async def list_local_model_caches(self) -> list[dict[str, Any]]:
        """Every LocalModelCache in the cluster (they are cluster-scoped)."""
        items: Any = self.client.list(LocalModelCache)
        return [dict(item.to_dict()) async for item in items]

    async def apply_local_model_cache(self, desired: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply a LocalModelCache; returns it as the API server stored it."""
        obj = LocalModelCache.from_dict(desired)
        result: Any = await self.client.apply(obj, field_manager=FIELD_MANAGER, force=True)
        return dict(result.to_dict())

    async def delete_local_model_cache(self, name: str) -> None:
        await self.client.delete(LocalModelCache, name)

    async def patch_model_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the UniversalModel's status subresource (None values remove keys)."""
        await self.client.patch(
            UniversalModelResource.Status,
            name,
            {"status": status},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )

    async def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The UniversalModelPool as stored, or None if there is none (or its CRD is not installed: also a 404)."""
        try:
            result: Any = await self.client.get(UniversalModelPoolResource, name, namespace=namespace)
        except ApiError as exc:
            if api_error_code(exc) == 404:
                return None
            raise
        return dict(result.to_dict())

    async def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the UniversalModelPool's status subresource (None values remove keys)."""
        await self.client.patch(
            UniversalModelPoolResource.Status,
            name,
            {"status": status},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )
