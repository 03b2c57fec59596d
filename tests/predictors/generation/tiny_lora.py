"""Random LoRA adapters for the tiny test models, built offline with PEFT (the layout every engine reads:
``adapter_config.json`` + ``adapter_model.safetensors``)."""

from __future__ import annotations

from pathlib import Path


def build_lora(
    base: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
) -> Path:
    """A LoRA adapter of ``base`` with random A and B matrices (PEFT's ``init_lora_weights=False``: both random,
    so the adapter changes what the model says, unlike a freshly initialised one whose B is zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False, task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(out))
    return out


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """PEFT's own reference: the base with the adapter merged into its weights (``merge_and_unload``), greedy
    decoding with transformers' ``generate`` (no EOS stop: exactly ``max_tokens``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.train(False)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]
