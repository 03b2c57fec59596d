"""Images in chat on the llama.cpp engine: a GGUF model with its multimodal projector (``--source-projector-file``).

The tiny SmolVLM (tiny_smolvlm.py: random weights, converted by llama.cpp's own converter into a text GGUF and
an mmproj GGUF) is served by one predictor and run in-process by llama-cpp-python's own multimodal path
(``Llama`` with ``MTMDChatHandler``) on the same files: greedy token ids and prompt token counts (image tokens
as llama.cpp counts them) must agree, on images drawn with Pillow.
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("llama_cpp", reason="the llamacpp engine needs llama-cpp-python")

from tests.predictors.generation.tiny_smolvlm import PATCH, SCALE, TILE
from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

MODEL = "tiny-smolvlm"
PROJECTOR = "mmproj-*.gguf"
QUESTION = "What is in the picture?"
N = 10


def picture(kind: str) -> bytes:
    """A PNG drawn here: shapes and text on a background."""
    from PIL import Image, ImageDraw

    if kind == "red-box":
        image = Image.new("RGB", (56, 40), "white")
        draw = ImageDraw.Draw(image)
        draw.rectangle([4, 4, 30, 22], fill=(220, 30, 30))
        draw.text((6, 24), "Hi 42", fill=(20, 20, 200))
    else:
        image = Image.new("RGB", (40, 48), (10, 120, 40))
        draw = ImageDraw.Draw(image)
        draw.ellipse([6, 6, 34, 40], fill=(250, 220, 0))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def messages(png: bytes, question: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": question},
                                         {"type": "image_url", "image_url": {"url": data_url(png)}}]}]  # fmt: skip


@pytest.fixture(scope="module")
def predictor(tiny_smolvlm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name=MODEL, task=Task.GENERATE, backend=Backend.AUTO, source=str(tiny_smolvlm_gguf),
        source_projector_file=PROJECTOR, engine_args={"n_parallel": "2", "n_batch": "16"},
    )  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("llamacpp-vision")) as running:
        yield running


@pytest.fixture(scope="module")
def client(predictor: PredictorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=predictor.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_smolvlm_gguf: Path) -> Iterator[Any]:
    """llama-cpp-python's own multimodal chat on the same two files."""
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import MTMDChatHandler

    [text] = [p for p in tiny_smolvlm_gguf.glob("*.gguf") if not p.name.startswith("mmproj-")]
    [projector] = tiny_smolvlm_gguf.glob(PROJECTOR)
    handler = MTMDChatHandler(clip_model_path=str(projector), verbose=False)
    llm = Llama(model_path=str(text), chat_handler=handler, n_ctx=1024, verbose=False)
    yield llm
    llm.close()


def reference_run(llm: Any, png: bytes, n: int = N) -> tuple[list[str], int]:
    """(the first ``n`` greedy tokens, each as text, prompt tokens). It stops after ``n + 1`` tokens: the last
    one is sampled but never evaluated, so the evaluated ids (``input_ids``) hold the first ``n``."""
    result = llm.create_chat_completion(messages=messages(png), temperature=0.0, max_tokens=n + 1, repeat_penalty=1.0)
    prompt = result["usage"]["prompt_tokens"]
    ids = [int(t) for t in llm.input_ids[prompt : prompt + n]]
    # As the OpenAI logprobs write a token: its text, a partial UTF-8 sequence as U+FFFD.
    return [llm.detokenize([t]).decode("utf-8", errors="replace") for t in ids], prompt


def our_run(client: openai.OpenAI, png: bytes, n: int = N) -> tuple[list[str], Any]:
    response = client.chat.completions.create(model=MODEL, messages=messages(png), temperature=0, max_tokens=n,
                                              logprobs=True)  # type: ignore[arg-type]  # fmt: skip
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    return [t.token for t in content or []], response


def test_greedy_tokens_and_prompt_tokens_match_llama_cpp_pythons_own_multimodal_path(
    client: openai.OpenAI, reference: Any
) -> None:
    outputs = []
    for kind in ("red-box", "yellow-disc"):
        png = picture(kind)
        theirs, their_prompt = reference_run(reference, png)
        ours, response = our_run(client, png)
        assert ours == theirs, kind  # token by token
        assert response.usage is not None
        assert response.usage.prompt_tokens == their_prompt  # text + image tokens, as llama.cpp counts them
        assert response.usage.completion_tokens == N
        outputs.append(ours)
    assert outputs[0] != outputs[1]  # the image is read: another picture, other tokens


def test_image_chats_and_a_text_chat_running_together_each_give_their_solo_tokens(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pngs = [picture("red-box"), picture("yellow-disc")]
    text = [{"role": "user", "content": "Tell me about the market in Lima."}]

    def text_chat() -> str | None:
        response = client.chat.completions.create(model=MODEL, messages=text, temperature=0, max_tokens=24)  # type: ignore[arg-type]
        return response.choices[0].message.content

    solo = [our_run(client, png)[0] for png in pngs], text_chat()
    with ThreadPoolExecutor(3) as pool:  # two slots: one of the three waits, images and text interleave
        images = [pool.submit(our_run, client, png) for png in pngs]
        plain = pool.submit(text_chat)
        together = [f.result()[0] for f in images], plain.result()
    assert together == solo


def test_a_streamed_chat_with_an_image_gives_the_unary_tokens_and_usage(client: openai.OpenAI) -> None:
    png = picture("red-box")
    _, unary = our_run(client, png)
    stream = client.chat.completions.create(model=MODEL, messages=messages(png), temperature=0, max_tokens=N,
                                            stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens


def test_a_json_schema_response_with_an_image_is_valid_json_and_ends_with_stop(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
              "required": ["color", "n"], "additionalProperties": False}  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL, messages=messages(picture("red-box"), "Describe it as JSON."), max_tokens=120, temperature=0.7,
        seed=5, response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
    )  # type: ignore[call-overload]  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_a_forced_tool_call_with_an_image_gives_arguments_valid_against_the_tools_schema(client: openai.OpenAI) -> None:
    parameters = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8}},
                  "required": ["label"], "additionalProperties": False}  # fmt: skip
    tool = {"type": "function", "function": {"name": "tag_image", "parameters": parameters}}
    response = client.chat.completions.create(
        model=MODEL, messages=messages(picture("yellow-disc"), "Tag it."), tools=[tool], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "tag_image"}}, temperature=0.7, seed=1,
    )  # type: ignore[call-overload]  # fmt: skip
    [call] = response.choices[0].message.tool_calls or []
    assert call.function.name == "tag_image"
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_n_choices_share_one_image_prompt_and_each_reads_it(client: openai.OpenAI) -> None:
    png = picture("red-box")
    response = client.chat.completions.create(model=MODEL, messages=messages(png), temperature=0, max_tokens=N, n=2)  # type: ignore[arg-type]
    texts = [choice.message.content for choice in response.choices]
    assert texts == [our_run(client, png)[1].choices[0].message.content] * 2


def prompt_tokens_evaluated(predictor: PredictorProcess) -> float:
    text = httpx.get(f"{predictor.url}/metrics", timeout=10).text
    match = re.search(rf'^universal_predictor_prompt_tokens_total\{{model="{MODEL}"\}} ([0-9.e+]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_cached_prefix_is_reused_through_the_same_image_and_never_through_another(
    client: openai.OpenAI, predictor: PredictorProcess
) -> None:
    first, second = picture("red-box"), picture("yellow-disc")
    question = "Once more, what is in it?"  # a prompt no earlier test sent: no slot holds its image part yet
    ask = lambda png: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=messages(png, question), temperature=0, max_tokens=4
    )

    def evaluated(png: bytes) -> tuple[float, Any]:
        before = prompt_tokens_evaluated(predictor)
        response = ask(png)
        return prompt_tokens_evaluated(predictor) - before, response

    # Both pictures are 2x2 tiles and an overview of 4 tokens each (tiny_smolvlm): 20 image tokens.
    image_tokens = 5 * (TILE // PATCH) ** 2 // SCALE**2
    read_a, a = evaluated(first)
    assert read_a > image_tokens  # the image, and the text after it, read
    # The same image again: its slot holds the whole prompt, so only the last token is read again.
    read_again, again = evaluated(first)
    assert read_again == 1
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.usage.prompt_tokens == a.usage.prompt_tokens  # usage counts the whole prompt, cached or not
    # The same text with another image: that slot shares the text before the image, and nothing after.
    read_b, b = evaluated(second)
    assert read_b > image_tokens
    assert b.usage.prompt_tokens - read_b < a.usage.prompt_tokens - image_tokens
    assert b.choices[0].message.content != a.choices[0].message.content


def test_the_model_card_names_the_projector(predictor: PredictorProcess) -> None:
    [card] = httpx.get(f"{predictor.openai_url}/models", timeout=30).json()["data"]
    assert card["backend"] == "llamacpp"
    assert card["projector_file"].startswith("mmproj-")


def test_the_projector_pattern_picks_one_file_beside_the_model_and_never_the_model(tmp_path: Path) -> None:
    from universal_predictors.generation.engines.llamacpp import find_gguf
    from universal_predictors.generation.engines.llamacpp_vision import find_projector

    for name in ("model-Q8_0.gguf", "mmproj-model-f16.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    projector = find_projector(tmp_path, "mmproj-*.gguf")
    assert projector == tmp_path / "mmproj-model-f16.gguf"
    assert find_gguf(tmp_path, None, exclude=projector) == tmp_path / "model-Q8_0.gguf"  # the only other .gguf
    assert find_projector(tmp_path / "model-Q8_0.gguf", "mmproj-*") == projector  # beside a source file
    with pytest.raises(ValueError, match=r"'\*mmproj\*Q4\*' matches no file .*found: mmproj-model-f16.gguf, model-Q8"):
        find_projector(tmp_path, "*mmproj*Q4*")
    with pytest.raises(ValueError, match=r"'\*.gguf' matches 2 files .*exactly one"):
        find_projector(tmp_path, "*.gguf")
