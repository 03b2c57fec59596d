"""``status.adapters``: each listed LoRA adapter as its predictor last reported it (``predictorReport.adapters``, which
the gateway writes from the predictor's ``/openai/v1/models``), Pending until then; and the gateway's reading of the
predictor's cards."""

from __future__ import annotations

from typing import Any

from tests.factories import manifest
from universal_gateway.predictor_report import adapter_report
from universal_operator.reconcile.status import status_from_inference_service
from universal_operator.spec import parse_model

TUNED = """
metadata: {name: qwen-chat, generation: 2}
spec:
  task: generate
  source: {uri: hf://Qwen/Qwen2.5-0.5B-Instruct}
  adapters:
  - {name: support, source: {uri: hf://acme/support-lora}}
  - {name: legal, source: {uri: s3://adapters/legal}}
"""


def model_with(status: dict[str, Any] | None = None, text: str = TUNED) -> Any:
    body = manifest(text)
    if status is not None:
        body["status"] = status
    return parse_model(body)


def test_listed_adapters_are_pending_until_the_predictor_reports_them() -> None:
    status = status_from_inference_service(None, model_with())
    assert status["adapters"] == [
        {"name": "support", "servedName": "qwen-chat:support", "state": "Pending"},
        {"name": "legal", "servedName": "qwen-chat:legal", "state": "Pending"},
    ]


def test_the_predictors_report_gives_each_adapter_its_state_and_reason() -> None:
    report = {"adapters": [
        {"name": "support", "state": "Ready"},
        {"name": "legal", "state": "Failed", "reason": "Mismatch", "message": "q_proj: 256 -> 256 features"},
        {"name": "removed", "state": "Ready"},  # no longer listed: not shown
    ]}  # fmt: skip
    status = status_from_inference_service(None, model_with({"predictorReport": report}))
    assert status["adapters"] == [
        {"name": "support", "servedName": "qwen-chat:support", "state": "Ready"},
        {"name": "legal", "servedName": "qwen-chat:legal", "state": "Failed", "reason": "Mismatch",
         "message": "q_proj: 256 -> 256 features"},
    ]  # fmt: skip


def test_a_model_without_adapters_has_no_adapters_status_and_an_emptied_list_clears_it() -> None:
    plain = TUNED.replace("  adapters:\n  - {name: support, source: {uri: hf://acme/support-lora}}\n"
                          "  - {name: legal, source: {uri: s3://adapters/legal}}\n", "")  # fmt: skip
    assert "adapters" not in status_from_inference_service(None, model_with(text=plain))
    shown = {"adapters": [{"name": "support", "servedName": "qwen-chat:support", "state": "Ready"}]}
    assert status_from_inference_service(None, model_with(shown, text=plain))["adapters"] == []


def test_the_gateway_reads_adapter_states_from_the_predictors_cards() -> None:
    cards = [
        {"id": "qwen-chat", "backend": "transformers"},
        {"id": "qwen-chat:support", "parent": "qwen-chat", "adapter": {"name": "support", "state": "Ready"}},
        {"id": "qwen-chat:legal", "parent": "qwen-chat",
         "adapter": {"name": "legal", "state": "Failed", "reason": "Mismatch", "message": "m"}},
    ]  # fmt: skip
    assert adapter_report(cards) == [
        {"name": "legal", "state": "Failed", "reason": "Mismatch", "message": "m"},
        {"name": "support", "state": "Ready"},
    ]
