"""The handlers' logic called as plain functions, with a recording stand-in for the two API writes.

The Kubernetes boundary is replaced here (the operator tests run against the emulator); the spec
parsing, rendering, drift and status logic under test are the real ones.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import Status

from tests.conftest import load_manifest
from universal_operator.config import OperatorConfig
from universal_operator.handlers import OperatorState, mirror_child_event, reconcile_model
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.status import status_from_inference_service
from universal_operator.spec import parse_model
from universal_simcluster.kserve.standin import ready_status


class RecordingApi:
    """Records the operator's writes; answers like an API server would (stamping generation)."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.statuses: list[tuple[str, str, dict[str, Any]]] = []
        self.apply_error: ApiError | None = None
        self.existing: dict[tuple[str, str], dict[str, Any]] = {}
        self.accounts: dict[tuple[str, str], dict[str, Any]] = {}
        self.account_error: ApiError | None = None
        self.config_maps: dict[tuple[str, str], dict[str, Any]] = {}

    async def get_service_account(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.accounts.get((namespace, name))

    async def apply_service_account(self, desired: dict[str, Any]) -> dict[str, Any]:
        if self.account_error is not None:
            raise self.account_error
        self.applied.append(desired)
        meta = desired["metadata"]
        self.accounts[(meta["namespace"], meta["name"])] = copy.deepcopy(desired)
        return desired

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.config_maps.get((namespace, name))

    async def apply_config_map(self, desired: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(desired)
        meta = desired["metadata"]
        self.config_maps[(meta["namespace"], meta["name"])] = copy.deepcopy(desired)
        return desired

    async def apply_inference_service(self, desired: dict[str, Any]) -> dict[str, Any]:
        if self.apply_error is not None:
            raise self.apply_error
        self.applied.append(desired)
        stored = copy.deepcopy(desired)
        stored["metadata"]["generation"] = len(self.applied)
        stored["metadata"]["uid"] = "child-uid"
        return stored

    async def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.existing.get((namespace, name))

    async def patch_model_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append((namespace, name, status))

    async def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
async def events() -> AsyncIterator[asyncio.Queue[posting.K8sEvent]]:
    """Capture what kopf.info/kopf.warn would post as Events (kopf's posting context, as in an operator)."""
    queue: asyncio.Queue[posting.K8sEvent] = asyncio.Queue()
    loop_token = posting.event_queue_loop_var.set(asyncio.get_running_loop())
    queue_token = posting.event_queue_var.set(queue)
    settings = kopf.OperatorSettings()
    settings_token = posting.settings_var.set(settings)
    yield queue
    posting.settings_var.reset(settings_token)
    posting.event_queue_var.reset(queue_token)
    posting.event_queue_loop_var.reset(loop_token)


def _drain(queue: asyncio.Queue[posting.K8sEvent]) -> list[posting.K8sEvent]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _model(name: str = "minilm", **spec_changes: Any) -> dict[str, Any]:
    body = load_manifest("cluster/minilm-embed.yaml")
    body["metadata"].update(name=name, namespace="default", uid="model-uid", generation=1)
    body["spec"].update(spec_changes)
    return body


@pytest.fixture
def api() -> RecordingApi:
    return RecordingApi()


@pytest.fixture
def state(api: RecordingApi) -> OperatorState:
    return OperatorState(config=OperatorConfig(), api=api)  # type: ignore[arg-type]


async def test_new_model_applies_child_once_writes_pending_and_posts_an_event(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    body = _model()
    await reconcile_model(state, body, {}, reason="created")

    assert api.applied == [desired_inference_service(parse_model(body), state.config)]
    [(namespace, name, status)] = api.statuses
    assert (namespace, name, status["phase"]) == ("default", "minilm", "Pending")
    [event] = _drain(events)
    assert (event.type, event.reason) == ("Normal", "InferenceServiceApplied")


async def test_unchanged_model_with_matching_child_writes_nothing(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    body = _model()
    child = await api.apply_inference_service(desired_inference_service(parse_model(body), state.config))
    api.applied.clear()
    body["status"] = status_from_inference_service(child, parse_model(body))

    await reconcile_model(state, body, {("default", "minilm"): [child]}, reason="drift check")

    assert api.applied == []
    assert api.statuses == []
    assert _drain(events) == []


async def test_drifted_child_is_reapplied(state: OperatorState, api: RecordingApi) -> None:
    body = _model()
    child = desired_inference_service(parse_model(body), state.config)
    child["spec"]["predictor"]["maxReplicas"] = 7

    await reconcile_model(state, body, {("default", "minilm"): [child]}, reason="drift check")

    assert len(api.applied) == 1
    assert api.applied[0]["spec"]["predictor"]["maxReplicas"] == 1


async def test_invalid_spec_reports_once_and_applies_nothing(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    body = _model(resources={"profile": "gpu-h100", "gpus": 1})

    await reconcile_model(state, body, {}, reason="created")
    await reconcile_model(state, body, {}, reason="drift check")

    assert api.applied == []
    [(_, _, status)] = api.statuses
    spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False"
    assert "spec.resources.profile" in spec_valid["message"]
    [event] = _drain(events)
    assert (event.type, event.reason) == ("Warning", "InvalidSpec")
    assert "gpu-h100" in event.message


async def test_schema_violation_names_the_field(state: OperatorState, api: RecordingApi) -> None:
    body = _model(scaling={"minReplicas": 3, "maxReplicas": 1})

    await reconcile_model(state, body, {}, reason="created")

    [(_, _, status)] = api.statuses
    assert "scaling" in status["message"]
    assert "minReplicas" in status["message"]
    assert api.applied == []


@pytest.mark.parametrize("code", [409, 429, 500, 503])
async def test_transient_api_errors_retry_through_kopf(state: OperatorState, api: RecordingApi, code: int) -> None:
    api.apply_error = ApiError(status=Status(code=code, message="try again"))

    with pytest.raises(kopf.TemporaryError):
        await reconcile_model(state, _model(), {}, reason="created")
    assert api.statuses == []


async def test_child_rejected_by_the_api_server_is_an_invalid_spec(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    api.apply_error = ApiError(status=Status(code=422, message="admission webhook denied the request"))

    await reconcile_model(state, _model(), {}, reason="created")

    [(_, _, status)] = api.statuses
    assert status["phase"] == "Failed"
    assert "admission webhook denied" in status["message"]
    assert [e.reason for e in _drain(events)] == ["InvalidSpec"]


async def test_child_event_mirrors_ready_status_into_parent(state: OperatorState, api: RecordingApi) -> None:
    body = _model()
    child = desired_inference_service(parse_model(body), state.config)
    child["metadata"]["generation"] = 1
    child["status"] = ready_status(child)

    await mirror_child_event(state, "MODIFIED", child, {("default", "minilm"): [body]})

    [(_, _, status)] = api.statuses
    assert status["phase"] == "Ready"
    assert status["address"] == "http://minilm-predictor.default.svc.cluster.local"


async def test_child_deleted_event_recreates_it(state: OperatorState, api: RecordingApi) -> None:
    body = _model()
    child = desired_inference_service(parse_model(body), state.config)

    await mirror_child_event(state, "DELETED", child, {("default", "minilm"): [body]})

    assert len(api.applied) == 1


async def test_child_of_another_owner_is_ignored(state: OperatorState, api: RecordingApi) -> None:
    body = _model()
    child = desired_inference_service(parse_model(body), state.config)
    child["metadata"]["ownerReferences"][0]["uid"] = "someone-else"

    await mirror_child_event(state, "DELETED", child, {("default", "minilm"): [body]})
    await mirror_child_event(state, "MODIFIED", child, {("default", "minilm"): [body]})

    assert api.applied == []
    assert api.statuses == []


async def test_stale_child_event_does_not_override_a_newer_applied_generation(
    state: OperatorState, api: RecordingApi
) -> None:
    body = _model()
    model = parse_model(body)
    old = desired_inference_service(model, state.config)
    old["metadata"]["generation"] = 1
    old["status"] = ready_status(old)
    state.latest_child[("default", "minilm")] = {**copy.deepcopy(old), "metadata": {**old["metadata"], "generation": 2}}
    del state.latest_child[("default", "minilm")]["status"]

    await mirror_child_event(state, "MODIFIED", old, {("default", "minilm"): [body]})

    [(_, _, status)] = api.statuses
    assert status["phase"] == "Ready"  # the event itself is the freshest view of what KServe reported


async def test_an_existing_inference_service_of_someone_else_is_never_taken_over(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    api.existing[("default", "minilm")] = {"metadata": {"name": "minilm", "namespace": "default"}, "spec": {}}

    await reconcile_model(state, _model(), {}, reason="created")

    assert api.applied == []
    [(_, _, status)] = api.statuses
    assert status["phase"] == "Failed"
    assert "already exists" in status["message"]
    assert "metadata.name" in status["message"]
    assert [e.reason for e in _drain(events)] == ["InvalidSpec"]


async def test_an_existing_child_of_this_model_is_adopted_without_a_write_when_unchanged(
    state: OperatorState, api: RecordingApi
) -> None:
    body = _model()
    child = desired_inference_service(parse_model(body), state.config)
    api.existing[("default", "minilm")] = child
    body["status"] = status_from_inference_service(child, parse_model(body))

    await reconcile_model(state, body, {}, reason="operator start")

    assert api.applied == []


FORBIDDEN = (
    'inferenceservices.serving.kserve.io "minilm" is forbidden: User "system:serviceaccount:ur:operator" cannot '
    'patch resource "inferenceservices" in API group "serving.kserve.io" in the namespace "default"'
)


async def test_a_403_is_rbac_not_a_spec_error_it_names_the_permission_and_retries_with_back_off(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    api.apply_error = ApiError(status=Status(code=403, reason="Forbidden", message=FORBIDDEN))

    delays: list[float] = []
    for retry in range(3):
        with pytest.raises(kopf.TemporaryError) as retried:
            await reconcile_model(state, _model(), {}, reason="created", retry=retry)
        delays.append(retried.value.delay or 0.0)

    assert 0 < delays[0] < delays[1] < delays[2]  # backs off
    [(_, _, status)] = api.statuses  # one status write for three refusals
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SpecValid"]["status"] == "True"
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "Forbidden")
    assert status["phase"] == "Pending"
    assert 'cannot patch resource "inferenceservices"' in status["message"]
    assert "grant the operator's service account" in status["message"]
    assert [(e.type, e.reason) for e in _drain(events)] == [("Warning", "Forbidden")]


async def test_a_403_reading_an_existing_child_is_rbac_too(state: OperatorState, api: RecordingApi) -> None:
    async def refuse(namespace: str, name: str) -> dict[str, Any] | None:
        raise ApiError(status=Status(code=403, reason="Forbidden", message="cannot get inferenceservices"))

    api.get_inference_service = refuse  # type: ignore[method-assign]
    with pytest.raises(kopf.TemporaryError):
        await reconcile_model(state, _model(), {}, reason="created")
    [(_, _, status)] = api.statuses
    assert next(c for c in status["conditions"] if c["type"] == "SpecValid")["status"] == "True"
    assert "cannot get inferenceservices" in status["message"]


# KServe's validator (controller-runtime's admission.Denied) answers 403, Knative's 400; the API server words both
# as ToStatusErr does (k8s.io/apiserver pkg/admission/plugin/webhook/errors/statuserror.go).
@pytest.mark.parametrize("code", [400, 403, 422])
async def test_a_webhook_denial_stays_a_spec_error(state: OperatorState, api: RecordingApi, code: int) -> None:
    denial = 'admission webhook "inferenceservice.kserve-webhook-server.validator" denied the request: bad'
    api.apply_error = ApiError(status=Status(code=code, reason="Forbidden" if code == 403 else None, message=denial))

    await reconcile_model(state, _model(), {}, reason="created")

    [(_, _, status)] = api.statuses
    assert next(c for c in status["conditions"] if c["type"] == "SpecValid")["status"] == "False"
    assert "denied the request" in status["message"]


# --------------------------------------------------------------------------------------------------
# Credentials: the model's own ServiceAccount, applied before the InferenceService


def _private_model() -> dict[str, Any]:
    return _model(source={"uri": "hf://org/private-model", "credentialsSecret": "hub-token"})


async def test_a_model_with_credentials_gets_its_service_account_before_its_inference_service(
    state: OperatorState, api: RecordingApi
) -> None:
    await reconcile_model(state, _private_model(), {}, reason="created")

    [account, child] = api.applied
    assert (account["kind"], account["metadata"]["name"]) == ("ServiceAccount", "minilm-storage")
    assert account["secrets"] == [{"name": "hub-token"}]
    assert account["metadata"]["ownerReferences"][0]["uid"] == "model-uid"
    assert child["kind"] == "InferenceService"
    assert child["spec"]["predictor"]["serviceAccountName"] == "minilm-storage"


async def test_an_intact_service_account_is_not_rewritten_a_changed_one_is_repaired(
    state: OperatorState, api: RecordingApi
) -> None:
    body = _private_model()
    await reconcile_model(state, body, {}, reason="created")
    child = api.applied[-1]
    api.applied.clear()
    # Another writer added a secret of its own: still everything we want, nothing to write.
    api.accounts[("default", "minilm-storage")]["secrets"].append({"name": "someone-elses"})
    await reconcile_model(state, body, {("default", "minilm"): [child]}, reason="drift check")
    assert api.applied == []

    api.accounts[("default", "minilm-storage")]["secrets"] = [{"name": "someone-elses"}]
    await reconcile_model(state, body, {("default", "minilm"): [child]}, reason="drift check")
    [repaired] = api.applied
    assert repaired["secrets"] == [{"name": "hub-token"}]


async def test_a_service_account_of_someone_else_is_never_taken_over(
    state: OperatorState, api: RecordingApi, events: asyncio.Queue[posting.K8sEvent]
) -> None:
    api.accounts[("default", "minilm-storage")] = {"metadata": {"name": "minilm-storage", "namespace": "default"}}

    await reconcile_model(state, _private_model(), {}, reason="created")

    assert api.applied == []
    [(_, _, status)] = api.statuses
    assert "spec.source.credentialsSecret" in status["message"]
    assert "already exists" in status["message"]
    assert [e.reason for e in _drain(events)] == ["InvalidSpec"]


async def test_a_403_on_the_service_account_is_rbac_and_no_inference_service_is_applied(
    state: OperatorState, api: RecordingApi
) -> None:
    message = 'serviceaccounts "minilm-storage" is forbidden: User "op" cannot patch resource "serviceaccounts"'
    api.account_error = ApiError(status=Status(code=403, reason="Forbidden", message=message))

    with pytest.raises(kopf.TemporaryError):
        await reconcile_model(state, _private_model(), {}, reason="created")

    assert api.applied == []
    [(_, _, status)] = api.statuses
    assert 'cannot patch resource "serviceaccounts"' in status["message"]
    assert next(c for c in status["conditions"] if c["type"] == "SpecValid")["status"] == "True"
