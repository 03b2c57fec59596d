"""Speech to text in a cluster, as a user applies it: the example manifest (``examples/cluster/whisper-tiny.yaml``)
applied with the real ``kubectl``, reconciled by the real operator (embedded) against the API emulator, its
InferenceService's predictor run as a real process by the KServe stand-in
(:mod:`universal_simcluster.kserve.processes`: its storage initializer's "hub" hands it the tests' tiny Whisper), the
cluster gateway (``KubernetesBackends``) with an API key, and the real ``openai`` SDK: multipart uploads routed by
their ``model`` field, a key refused, and the model scaled to zero after its idle window (the stand-in's clock) and
woken by the next upload, which answers as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from lightkube import AsyncClient
from openai import AsyncOpenAI

from tests.clock import SteppedClock
from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually, load_manifest
from tests.predictors.speech_samples import espeak, wav_bytes
from tests.predictors.tiny_whisper import build_tiny_whisper
from universal_gateway.app import Gateway
from universal_gateway.auth import ApiKeys
from universal_gateway.cluster import KubernetesBackends
from universal_operator.config import parse_config
from universal_simcluster import admission
from universal_simcluster.apiserver import serve_emulator
from universal_simcluster.kserve.processes import kserve_processes

NS = "default"
KEY = "sk-speech-team"


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks audio.translations deprecated
async def test_the_example_transcribes_through_the_cluster_gateway_scales_to_zero_and_wakes_on_an_upload(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = load_manifest("cluster/whisper-tiny.yaml")
    name, source = manifest["metadata"]["name"], manifest["spec"]["source"]["uri"]
    manifest["spec"]["scaling"]["idleTimeout"] = "30s"
    whisper = build_tiny_whisper(tmp_path / "whisper")
    clock = SteppedClock()
    async with serve_emulator(tmp_path, crds=[crd], admission=admission.Cluster()) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))
        client = AsyncClient()
        try:
            async with (
                kserve_processes(client, tmp_path / "kserve", sources={source: str(whisper)}, clock=clock.monotonic,
                                 grace_period=5) as kserve,
                embedded_operator(parse_config(TEST_OPERATOR_CONFIG)),
                Gateway(KubernetesBackends([NS], reap_interval=0.2), keys=ApiKeys.of({KEY: None})).serving() as url,
            ):  # fmt: skip
                path = tmp_path / "whisper-tiny.yaml"
                path.write_text(yaml.safe_dump(manifest))
                applied = await served.kubectl("apply", "--validate=false", "-f", str(path))
                assert applied.returncode == 0, applied.stderr

                def phase() -> str | None:
                    model = served.emulator.get_object("universalmodels", NS, name) or {}
                    return (model.get("status") or {}).get("phase")

                await eventually(lambda: phase() == "Ready", within=300)
                sdk = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
                clip = wav_bytes(espeak("call me back tomorrow"))

                async def transcribe() -> dict[str, Any]:
                    answer = await sdk.audio.transcriptions.create(model=name, file=("note.wav", clip), language="en",
                                                                   response_format="verbose_json")  # fmt: skip
                    return answer.model_dump()

                first = await transcribe()
                assert first["segments"], first
                assert first["duration"] == pytest.approx(len(clip[44:]) / 2 / 16_000, abs=0.01)
                translated = await sdk.audio.translations.create(model=name, file=("note.wav", clip))
                assert isinstance(translated.text, str)
                wrong = AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await wrong.audio.transcriptions.create(model=name, file=("note.wav", clip))
                await wrong.close()
                async with httpx.AsyncClient(timeout=60) as http:
                    models = (await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})).json()
                assert {m["id"]: m.get("task") for m in models["data"]}[name] == "transcribe"

                # Idle past its window: scaled to zero; the next upload wakes it and answers as the first did.
                pid = kserve.pid(NS, name)
                assert pid is not None
                clock.advance(31)
                await eventually(lambda: kserve.pid(NS, name) is None, within=60)
                # (Gone once its grace period ends: until then the gateway's kept-alive connection, which the
                # stand-in relays byte by byte, still reaches it; a Knative ingress routes each request.)
                await eventually(lambda: not Path(f"/proc/{pid}").exists(), within=30)
                woken = await transcribe()
                assert kserve.pid(NS, name) not in (None, pid)
                assert [s["tokens"] for s in woken["segments"]] == [s["tokens"] for s in first["segments"]]
                await sdk.close()
        finally:
            await client.close()
