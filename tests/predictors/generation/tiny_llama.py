"""Tiny generation models built on the spot (no model hub is reachable): a random-weight Llama with a
byte-level BPE tokenizer trained here on a small corpus and a tools-capable chat template, saved with
``save_pretrained``; the same weights and tokenizer written to GGUF for llama.cpp.

Head size 64 (hidden 128, 2 heads, 1 KV head) so vLLM's CPU attention accepts it. The EOS row of the
output projection is zeroed, so the random model (almost) never ends on its own: lengths in tests are
decided by ``max_tokens``, stop strings and constraints, not by chance.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS = "<|begin_of_text|>"
EOS = "<|im_end|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START]

#: ChatML with tools: the tool list goes into a system turn, calls are ``<tool_call>{json}</tool_call>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    'You may call tools. Answer with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus() -> list[str]:
    """A small, varied English-and-JSON corpus, enough for a few hundred merges."""
    cities = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Dakar", "Hanoi"]
    things = ["weather", "river", "market", "museum", "garden", "station", "bridge", "library"]
    lines = []
    for i, city in enumerate(cities):
        for j, thing in enumerate(things):
            n = (i * 7 + j * 13) % 100
            lines.append(f"The {thing} in {city} is open from {n} to {n + 8}, said the guide.")
            lines.append(json.dumps({"city": city, "thing": thing, "count": n, "open": n % 2 == 0}))
            lines.append(f"User asked: what is the {thing} like in {city}? Assistant: it is calm and old.")
    lines += [
        "Hello, how are you today? I am fine, thank you for asking.",
        "Once upon a time there was a small model that learned to count: one, two, three, four, five.",
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024 3.14 -7 true false null",
        "Unicode: café, naïve, Zürich, São Paulo, 東京, emoji 🙂 and more.",
    ]
    return lines


def train_tokenizer(vocab_size: int, extra_special: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) trained on :func:`corpus`, BOS added by the post-processor;
    ``extra_special`` are more special tokens (a vision model's image placeholder), after the usual ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a built model; the defaults are the test model."""

    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    layers: int = 2
    intermediate: int = 256
    vocab_size: int = 512
    context: int = 512
    seed: int = 0


def text_model(shape: Any, extra_special: tuple[str, ...] = ()) -> tuple[Any, Any, Any]:
    """The trained tokenizer (raw and wrapped) and the ``LlamaConfig`` of a tiny Llama of ``shape`` (any object
    with :class:`LlamaShape`'s text fields): the tiny Llama itself, and the text model of the vision-language
    models built on it (``extra_special``: their image tokens)."""
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    raw = train_tokenizer(shape.vocab_size, extra_special)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=EOS, model_max_length=shape.context
    )
    bos_id, eos_id = raw.token_to_id(BOS), raw.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=raw.get_vocab_size(),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        initializer_range=0.08,  # larger than usual: peaked logits, so greedy choices are not near-ties
    )
    return raw, tokenizer, config


def build_llama(out: Path, shape: LlamaShape = LlamaShape(), *, chat_template: bool = True) -> Path:
    """Build and ``save_pretrained`` a random Llama + tokenizer into ``out`` (returned)."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    raw, tokenizer, config = text_model(shape)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    bos_id, eos_id = raw.token_to_id(BOS), raw.token_to_id(EOS)
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[eos_id].zero_()  # see the module docstring
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out)
    return out


def without_chat_template(src: Path, out: Path) -> Path:
    """A copy of a built model whose tokenizer carries no chat template."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2))
    return out


def _permute(weights: Any, n_head: int) -> Any:
    """HF's q/k rows (rotary halves) into GGUF's interleaved rotary layout (as convert_hf_to_gguf does)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(hf_dir: Path, out: Path, *, sampling: dict[str, float] | None = None) -> Path:
    """The model in ``hf_dir`` (from :func:`build_llama`) as an F32 GGUF file at ``out``."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    template_file = hf_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else None
    tensors = load_file(str(hf_dir / "model.safetensors"))

    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-llama")
    for key, value in (sampling or {}).items():  # general.sampling.* (llama.cpp src/llama-arch.cpp)
        if key == "top_k":
            writer.add_int32(f"general.sampling.{key}", int(value))
        else:
            writer.add_float32(f"general.sampling.{key}", float(value))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's GPT-2 split regex, as ByteLevel(use_regex=True); "default" differs
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    if template:
        writer.add_chat_template(template)

    def put(name: str, key: str) -> None:
        writer.add_tensor(name, tensors[key].astype("float32"))

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}"
        put(f"blk.{i}.attn_norm.weight", f"{hf}.input_layernorm.weight")
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(tensors[f"{hf}.self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(tensors[f"{hf}.self_attn.k_proj.weight"], kv_heads))
        put(f"blk.{i}.attn_v.weight", f"{hf}.self_attn.v_proj.weight")
        put(f"blk.{i}.attn_output.weight", f"{hf}.self_attn.o_proj.weight")
        put(f"blk.{i}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight")
        put(f"blk.{i}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight")
        put(f"blk.{i}.ffn_up.weight", f"{hf}.mlp.up_proj.weight")
        put(f"blk.{i}.ffn_down.weight", f"{hf}.mlp.down_proj.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
