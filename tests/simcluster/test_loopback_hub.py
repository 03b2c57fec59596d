"""The loopback hub as the pinned ``huggingface_hub`` client sees it: each answer becomes what the client makes of
huggingface.co's (its errors by ``X-Error-Code``, revisions, listings, resumed downloads)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get

from universal_simcluster.hub import LoopbackHub, Repository

TOKEN = "hf_loopback_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackHub]:
    main, v2 = tmp_path_factory.mktemp("main"), tmp_path_factory.mktemp("v2")
    (main / "config.json").write_text('{"v": 1}')
    (main / "weights").mkdir()
    (main / "weights" / "model-q4.gguf").write_bytes(b"q4" * 100)
    (main / "weights" / "model-q8.gguf").write_bytes(b"q8" * 100)
    (main / "mmproj-f16.gguf").write_bytes(b"projector")
    (v2 / "config.json").write_text('{"v": 2}')
    repos = [Repository("acme/model", {"main": main, "v2": v2}), Repository("acme/gated", {"main": v2}, token=TOKEN)]
    with LoopbackHub(repos) as running:
        yield running


def test_a_branch_and_its_commit_id_give_the_same_snapshot_and_patterns_pick_files(
    hub: LoopbackHub, tmp_path: Path
) -> None:
    commit = hub.repositories["acme/model"].commit_of("v2")
    by_branch = Path(snapshot_download("acme/model", revision="v2", cache_dir=tmp_path, endpoint=hub.endpoint))
    assert by_branch.name == commit
    assert (by_branch / "config.json").read_text() == '{"v": 2}'
    by_commit = snapshot_download("acme/model", revision=commit, cache_dir=tmp_path / "other", endpoint=hub.endpoint)
    assert (Path(by_commit) / "config.json").read_text() == '{"v": 2}'
    picked = Path(
        snapshot_download(
            "acme/model", allow_patterns=["*q4.gguf", "mmproj-*.gguf"], cache_dir=tmp_path, endpoint=hub.endpoint
        )
    )
    assert sorted(p.relative_to(picked).as_posix() for p in picked.rglob("*") if p.is_file()) == [
        "mmproj-f16.gguf",
        "weights/model-q4.gguf",
    ]


def test_model_info_lists_the_revisions_files_as_siblings(hub: LoopbackHub) -> None:
    info = HfApi(endpoint=hub.endpoint).model_info("acme/model", revision="main")
    assert info.sha == hub.repositories["acme/model"].commit_of("main")
    assert sorted(s.rfilename for s in info.siblings or []) == [
        "config.json",
        "mmproj-f16.gguf",
        "weights/model-q4.gguf",
        "weights/model-q8.gguf",
    ]
    top = HfApi(endpoint=hub.endpoint).list_repo_tree("acme/model")
    assert sorted(entry.path for entry in top) == ["config.json", "mmproj-f16.gguf", "weights"]


def test_refusals_become_the_clients_own_errors(hub: LoopbackHub, tmp_path: Path) -> None:
    def fetch(repo: str, **options: object) -> str:
        return snapshot_download(repo, cache_dir=tmp_path, endpoint=hub.endpoint, **options)  # type: ignore[arg-type]

    with pytest.raises(RevisionNotFoundError):
        fetch("acme/model", revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError) as missing:
        fetch("acme/nothing")
    assert not isinstance(missing.value, GatedRepoError)
    with pytest.raises(GatedRepoError) as anonymous:
        fetch("acme/gated", token=False)  # not even a token from the environment
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as wrong:
        fetch("acme/gated", token="hf_someone_else")
    assert wrong.value.response.status_code == 403
    assert (Path(fetch("acme/gated", token=TOKEN)) / "config.json").read_text() == '{"v": 2}'
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("acme/model", "absent.bin", cache_dir=tmp_path, endpoint=hub.endpoint)


def test_a_download_resumes_with_a_range_request(hub: LoopbackHub) -> None:
    url = f"{hub.endpoint}/acme/model/resolve/main/weights/model-q8.gguf"
    out = io.BytesIO(b"q8q8")  # four bytes already there
    out.seek(4)
    http_get(url, out, resume_size=4, expected_size=200)
    assert out.getvalue() == b"q8" * 100
    assert hub.partial == [("/acme/model/resolve/main/weights/model-q8.gguf", "bytes=4-")]  # not sent again whole
