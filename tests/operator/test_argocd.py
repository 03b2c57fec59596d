"""The Argo CD health check for UniversalModel (examples/argocd/argocd-cm-health.yaml), run as Argo CD
runs it (Lua 5.1; Argo CD embeds gopher-lua) against the statuses the operator itself writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51 as lua51
import pytest
import yaml

from tests.factories import model
from tests.operator.test_kserve_status_documents import CASES as KSERVE_DOCUMENTS
from tests.operator.test_kserve_status_documents import the_model
from tests.operator.test_status_from_inference_service import CASES, QWEN, child
from universal_operator.config import OperatorConfig
from universal_operator.reconcile.status import status_for_invalid_spec, status_from_inference_service
from universal_operator.spec import GROUP, KIND, Phase, SpecError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "argocd"
HEALTH_KEY = f"resource.customizations.health.{GROUP}_{KIND}"
#: What each phase the operator reports means to someone looking at an Argo CD Application.
HEALTH = {
    Phase.READY: "Healthy",
    Phase.IDLE: "Healthy",  # scaled to zero is the normal resting state, not a fault
    Phase.PENDING: "Progressing",
    Phase.LOADING: "Progressing",
    Phase.FAILED: "Degraded",
}


def health(obj: dict[str, Any]) -> dict[str, str]:
    config = yaml.safe_load((EXAMPLES / "argocd-cm-health.yaml").read_text())
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    check = lua.execute(f"return function(obj)\n{config['data'][HEALTH_KEY]}\nend")
    result = check(lua.table_from(obj, recursive=True))
    return {"status": result["status"], "message": result["message"]}


def universal_model(status: dict[str, Any] | None, generation: int = 3) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": KIND,
        "metadata": {"name": "qwen-chat", "namespace": "models", "generation": generation},
        "spec": {"task": "generate"},
    }
    if status is not None:
        obj["status"] = status
    return obj


@pytest.mark.parametrize("child_status", [None, *[case[0] for case in CASES.values()]], ids=["no child", *CASES])
def test_every_status_the_operator_writes_maps_to_the_health_its_phase_means(child_status: str | None) -> None:
    status = status_from_inference_service(None if child_status is None else child(child_status), model(QWEN))
    assert health(universal_model(status)) == {"status": HEALTH[Phase(status["phase"])], "message": status["message"]}


@pytest.mark.parametrize(("version", "knative", "child", "expected_yaml"), KSERVE_DOCUMENTS)
def test_the_status_of_every_kserve_release_document_maps_to_the_health_its_phase_means(
    version: str, knative: bool, child: dict[str, Any], expected_yaml: str
) -> None:
    config = OperatorConfig.model_validate({"kserve": {"version": version}})
    status = status_from_inference_service(child, the_model(knative), config=config)
    assert health(universal_model(status)) == {"status": HEALTH[Phase(status["phase"])], "message": status["message"]}


def test_an_invalid_spec_is_degraded_with_the_operators_message() -> None:
    body = universal_model(None)
    status = status_for_invalid_spec(body, SpecError("spec.resources.profile", "no profile 'h100'"))
    result = health(universal_model(status))
    assert result["status"] == "Degraded"
    assert "spec.resources.profile" in result["message"]


def test_a_model_the_operator_has_not_reported_on_yet_is_progressing() -> None:
    assert health(universal_model(None))["status"] == "Progressing"


def test_a_spec_change_the_operator_has_not_observed_yet_is_progressing_not_the_old_health() -> None:
    ready = status_from_inference_service(child(CASES[next(iter(CASES))][0]), model(QWEN))
    ready.update(phase="Ready", message="Serving.")
    assert health(universal_model(ready, generation=3))["status"] == "Healthy"
    result = health(universal_model(ready, generation=4))  # edited in Git, synced, not yet reconciled
    assert result == {"status": "Progressing", "message": "Waiting for the operator to observe generation 4."}


def test_the_application_example_syncs_a_folder_with_pruning_and_self_heal() -> None:
    app = yaml.safe_load((EXAMPLES / "application.yaml").read_text())
    assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
    assert app["spec"]["syncPolicy"]["automated"] == {"prune": True, "selfHeal": True}
    assert app["spec"]["source"]["path"]
