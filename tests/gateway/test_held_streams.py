"""A streaming request held while its model wakes, through a real nginx whose read timeout (1 s here; ingress-nginx's
default is 60 s) is far shorter than the wake: the gateway sends the answer's head at once and an SSE comment
(``: waking model``) every ``--wake-keepalive`` seconds, so the proxy keeps the connection, then the model's own
stream. A wake that fails ends the stream with an OpenAI-shaped error event. Real processes: nginx, the gateway
in this process, the tiny Llama's predictor, the real `openai` client."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from tests.predictors.generation.tiny_llama import build_llama
from tests.predictors.harness import OFFLINE_ENV, free_port
from universal_gateway.app import Gateway, GatewayLimits
from universal_gateway.local import LocalSupervisor
from universal_gateway.manifests import load_manifests

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
KEEPALIVE_S = 0.3


def manifest(folder: Path, source: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chat.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {name: chat}\n"
        f'spec: {{task: generate, backend: transformers, servedName: tiny-chat, source: {{uri: "{source}"}}}}\n'
    )


@contextlib.contextmanager
def nginx_in_front(upstream_port: int, work: Path) -> Iterator[str]:
    """nginx proxying to the gateway with a 1 s read timeout and no buffering (as the chart's ingress asks)."""
    port = free_port()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "nginx.conf").write_text(f"""
daemon off; pid {work}/nginx.pid; error_log {work}/logs/error.log;
events {{}}
http {{
  access_log off; client_body_temp_path {work}/body; proxy_temp_path {work}/proxy;
  fastcgi_temp_path {work}/fcgi; uwsgi_temp_path {work}/uwsgi; scgi_temp_path {work}/scgi;
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://127.0.0.1:{upstream_port}; proxy_http_version 1.1; proxy_buffering off;
      proxy_read_timeout 1s;
    }}
  }}
}}
""")
    process = subprocess.Popen([NGINX, "-p", str(work), "-c", str(work / "nginx.conf")])
    try:
        for _ in range(100):
            with contextlib.suppress(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            subprocess.run(["sleep", "0.05"], check=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("held") / "llama")


@contextlib.asynccontextmanager
async def gateway(folder: Path, state: Path) -> AsyncIterator[str]:
    # No standby: the wake takes seconds (torch and transformers imported afresh), many read timeouts long.
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=state, env=OFFLINE_ENV, standby=False)
    limits = GatewayLimits(wake_keepalive_s=KEEPALIVE_S)
    async with Gateway(supervisor, limits=limits).serving() as url:
        yield url


async def test_a_held_stream_outlives_the_proxy_read_timeout_and_gets_the_answer(llama: Path, tmp_path: Path) -> None:
    manifest(tmp_path / "manifests", str(llama))
    async with gateway(tmp_path / "manifests", tmp_path / "state") as url:
        with nginx_in_front(int(url.rsplit(":", 1)[1]), tmp_path / "nginx") as proxied:
            # The raw stream first: comments while it wakes, then the model's chunks.
            body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "stream": True}  # fmt: skip
            lines: list[str] = []
            async with (
                httpx.AsyncClient(base_url=proxied, timeout=300) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                lines = [line async for line in response.aiter_lines() if line]
            comments = [line for line in lines if line.startswith(": waking model")]
            data = [line for line in lines if line.startswith("data: ")]
            assert len(comments) >= 2, lines[:5]  # the wake took several read timeouts: nginx kept it open
            # Each names the wake's step once the supervisor knows it: the process starting, then the model loading.
            assert set(comments) <= {": waking model", ": waking model (starting)", ": waking model (loading)"}
            assert any(comment.endswith("(loading)") for comment in comments), comments
            assert data[-1] == "data: [DONE]"
            assert lines.index(comments[-1]) < lines.index(data[0])

            # One wake, its steps timed: the process starting, the model loading.
            async with httpx.AsyncClient() as plain:
                metrics = (await plain.get(f"{url}/metrics")).text
            assert 'universal_gateway_wakes_total{model="tiny-chat"} 1.0' in metrics
            for step in ("Starting", "Loading"):
                assert f'universal_gateway_wake_step_seconds_count{{model="tiny-chat",step="{step}"}} 1.0' in metrics

            # Awake now, and through the real client: an ordinary stream.
            client = AsyncOpenAI(base_url=f"{proxied}/v1", api_key="x", max_retries=0)
            stream = await client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
            chunks = [c async for c in stream]
            assert chunks


async def test_a_wake_that_fails_ends_the_held_stream_with_an_error_event(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    manifest(tmp_path / "manifests", str(broken))
    async with gateway(tmp_path / "manifests", tmp_path / "state") as url:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with (
            httpx.AsyncClient(base_url=url, timeout=300) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
    errors = [line for line in lines if line.startswith("data: {")]
    assert len(errors) == 1, lines
    assert '"error"' in errors[0]
    assert "model_failed" in errors[0] or "not available" in errors[0]
