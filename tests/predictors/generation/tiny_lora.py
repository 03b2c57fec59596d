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


#: Run the vendored llama.cpp's convert_lora_to_gguf.py on its own source (its ``conversion`` package and
#: ``gguf-py``), several adapters in one process: torch and transformers imported once.
_CONVERT_LORA = """
import json, runpy, sys
source, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [source, source + "/gguf-py"]
for args in runs:
    sys.argv = [source + "/convert_lora_to_gguf.py", *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def lora_to_gguf(base: Path, adapters: dict[Path, Path], llama_cpp_source: Path) -> None:
    """Each PEFT adapter folder (key) as an F32 GGUF LoRA (value), by llama.cpp's own converter; ``base`` is
    the Hugging Face folder of the base model (its config names the tensors)."""
    import json
    import subprocess
    import sys

    runs = [["--base", str(base), "--outtype", "f32", "--outfile", str(out), str(folder)]
            for folder, out in adapters.items()]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", _CONVERT_LORA, str(llama_cpp_source), json.dumps(runs)], capture_output=True, text=True
    )
    if result.returncode != 0 or not all(out.exists() for out in adapters.values()):
        raise RuntimeError(f"convert_lora_to_gguf.py failed:\n{result.stderr[-4000:]}")
