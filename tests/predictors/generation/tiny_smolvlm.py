"""A tiny random SmolVLM (Idefics3: a SigLIP vision tower, a pixel-shuffle connector, a Llama) built on the
spot, and the GGUF pair llama.cpp serves it from: the text model and its multimodal projector (mmproj),
both written by the vendored llama.cpp's own ``convert_hf_to_gguf.py`` (``--mmproj`` for the projector).

Why Idefics3: of the families llama.cpp's converter writes a projector for, it is the one whose text side
is a plain Llama with causal attention and one position per token, the case the llama.cpp engine tests
token for token; its image tokens are wrapped in special tokens (``<fake_token_around_image>``,
``<global-img>``, ``<row_1_col_1>``) that llama.cpp looks up in the vocabulary, so the tokenizer has them.

Sizes: 32x32 tiles of 8x8 patches, scale factor 2, so one tile is 4 image tokens; the processor's longest
edge is 64, so an image is 2x2 tiles at most plus the overview (llama.cpp's Idefics3 preprocessing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.predictors.generation.tiny_llama import BOS, EOS, IM_START, corpus

IMAGE = "<image>"
FAKE_AROUND_IMAGE = "<fake_token_around_image>"
GLOBAL_IMAGE = "<global-img>"
ROW_COL = [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]
END_OF_UTTERANCE = "<end_of_utterance>"  # the Idefics3 processor adds it when missing
SPECIAL_TOKENS = [BOS, EOS, IM_START, IMAGE, FAKE_AROUND_IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE, *ROW_COL]

#: ChatML over Hugging Face content parts: text parts as they are, an image part as ``<image>`` (what the
#: Idefics3 processor expands); llama.cpp's path gives image parts as text parts holding its media marker.
#: No ``bos_token`` (SmolVLM's own template has none): llama-cpp-python's ``MTMDChatHandler``, the reference
#: the tests compare with, renders ``bos_token`` as the empty string (it detokenizes the control token).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TILE = 32
PATCH = 8
SCALE = 2
LONGEST_EDGE = 64


def train_tokenizer(vocab_size: int) -> Any:
    """tiny_llama's byte-level BPE, with the image tokens, and "\\n" and "\\n\\n" as tokens of their own
    (llama.cpp's Idefics3 layout puts them around the tiles)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # GPT-2's split regex keeps "\n\n" whole only before the end (or more whitespace): lines ending in it.
    lines = corpus() + ["A paragraph ends here.\n\n", "One line.\n", "Another paragraph.\n\n"] * 20
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A $B", special_tokens=[]
    )  # the chat template writes BOS itself: no BOS added on top (GGUF add_bos_token false)
    return tokenizer


def build_smolvlm(out: Path, seed: int = 0) -> Path:
    """Build and ``save_pretrained`` a random Idefics3 model + processor into ``out`` (returned)."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )

    raw = train_tokenizer(512)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=1024,
        add_bos_token=False,
        extra_special_tokens={"image_token": IMAGE},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    bos_id, eos_id, image_id = raw.token_to_id(BOS), raw.token_to_id(EOS), raw.token_to_id(IMAGE)
    text = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],  # the converter's text side: a plain Llama
        "vocab_size": raw.get_vocab_size(),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "tie_word_embeddings": False,
        "initializer_range": 0.08,
    }
    vision = {
        "model_type": "idefics3_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": TILE,
        "patch_size": PATCH,
        "layer_norm_eps": 1e-6,
        "initializer_range": 0.08,
    }
    config = Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=SCALE, image_token_id=image_id,
        tie_word_embeddings=False, pad_token_id=eos_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # random, larger than the default init: image tokens move the logits
            param.normal_(0.0, 0.08)
        model.lm_head.weight[eos_id].zero_()  # the random model never ends by itself (see tiny_llama)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    image_processor = Idefics3ImageProcessor(
        do_resize=True,
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=True,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(TILE // PATCH) ** 2 // SCALE**2,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out)
    # The converter reads the text side's architecture from text_config (transformers drops it on save).
    saved = json.loads((out / "config.json").read_text())
    saved["text_config"]["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return out


#: Run convert_hf_to_gguf.py with two changes, both about our trained tokenizer, which is GPT-2's kind
#: (byte-level BPE with GPT-2's split regex): its pre-tokenizer is unknown to the converter's checksum
#: table (it lists published models only), and its Llama class tries SentencePiece first (importing the
#: sentencepiece package, not installed here, before it looks for a tokenizer.model).
_CONVERT = """
import json, runpy, sys
source, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [source, source + "/gguf-py"]
from conversion.base import TextModel
from conversion.llama import LlamaModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
for args in runs:  # both files in one process: torch and transformers imported once
    sys.argv = [source + "/convert_hf_to_gguf.py", *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf_dir: Path, out_dir: Path, llama_cpp_source: Path) -> tuple[Path, Path]:
    """(text GGUF, projector GGUF), both F32, written by the vendored converter into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text, projector = out_dir / "tiny-smolvlm-f32.gguf", out_dir / "mmproj-tiny-smolvlm-f32.gguf"
    runs = [[str(hf_dir), "--outtype", "f32", "--outfile", str(target), *extra]
            for target, extra in ((text, []), (projector, ["--mmproj"]))]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(llama_cpp_source), json.dumps(runs)], capture_output=True, text=True
    )
    if result.returncode != 0 or not (text.exists() and projector.exists()):
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}")
    return text, projector
