"""LoRA adapters for the llama.cpp engine: the GGUF file an adapter folder holds, and the check that it fits the
base model, read from both files' GGUF headers (the ``gguf`` package: nothing is loaded) before llama.cpp sees it.

A GGUF LoRA (``convert_lora_to_gguf.py`` of llama.cpp) says ``general.type = adapter``, ``adapter.type = lora``
and ``general.architecture``, and holds for each adapted base tensor ``<tensor>.lora_a`` (ggml shape
[in, r]) and ``<tensor>.lora_b`` ([r, out]). llama.cpp refuses an adapter whose architecture or shapes differ
from the base's with one line in its log and a NULL (``llama_adapter_lora_init_impl`` in src/llama-adapter.cpp
of the vendored llama.cpp): here the same rules raise an :class:`AdapterMismatch` that names the tensor and the
numbers, which is what the adapter's status shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from universal_predictors.generation.adapters import AdapterMismatch

#: Suffixes of a LoRA's tensor pair (llama.cpp src/llama-adapter.cpp); ``*_norm.weight`` tensors are skipped there.
LORA_A, LORA_B = ".lora_a", ".lora_b"


def lora_file(path: Path) -> Path:
    """The GGUF LoRA an adapter's ``path`` names: the file itself, or the one ``*.gguf`` in the folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise AdapterMismatch(f"the adapter's path {str(path)!r} is neither a GGUF file nor a folder")
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise AdapterMismatch(f"the llama.cpp engine needs one GGUF LoRA (*.gguf) in the adapter's folder; found "
                              f"{names} (llama.cpp's convert_lora_to_gguf.py converts a PEFT adapter)")  # fmt: skip
    return found[0]


def gguf_header(path: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """A GGUF file's string metadata and its tensors' shapes (ggml order: ``ne[0]`` first)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError on a foreign file
        raise AdapterMismatch(f"{path.name} is not a readable GGUF file: {exc}") from None
    strings: dict[str, str] = {}
    for key, value in reader.fields.items():
        if value.types == [gguf.GGUFValueType.STRING]:
            strings[key] = str(value.contents())
    return strings, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def check_lora_fits(path: Path, base_architecture: str, base_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """:class:`AdapterMismatch` naming the first difference unless ``path`` is a LoRA llama.cpp can apply to
    the base: an adapter of type lora, the base's architecture, a pair for each adapted tensor the base has,
    with the base's (in, out) features."""
    metadata, shapes = gguf_header(path)
    kind = (metadata.get("general.type"), metadata.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise AdapterMismatch(f"{path.name} is not a GGUF LoRA adapter (general.type {kind[0]!r}, adapter.type "
                              f"{kind[1]!r}; want 'adapter', 'lora')")  # fmt: skip
    architecture = metadata.get("general.architecture")
    if architecture != base_architecture:
        raise AdapterMismatch(
            f"the adapter is for architecture {architecture!r}, the base model is {base_architecture!r}"
        )
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        for part in (LORA_A, LORA_B):
            if name.endswith(part):
                pairs.setdefault(name[: -len(part)], {})[part] = shape
                break
        else:
            if not name.endswith("_norm.weight"):
                raise AdapterMismatch(f"{path.name}: tensor {name!r} is neither a lora_a nor a lora_b")
    if not pairs:
        raise AdapterMismatch(f"{path.name} holds no LoRA tensors (*.lora_a / *.lora_b)")
    for name, pair in pairs.items():
        a, b = pair.get(LORA_A), pair.get(LORA_B)
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            raise AdapterMismatch(f"{name}: lora_a and lora_b must both be matrices")
        base = base_shapes.get(name)
        if base is None:
            raise AdapterMismatch(f"the adapter adapts {name!r}, which this base model does not have")
        # The embedding's pair is stored the other way round (llama.cpp: llm_build_inp_embd).
        fan_in, fan_out, rank_a, rank_b = (b[1], a[1], a[0], b[0]) if name.endswith("token_embd.weight") else (
            a[0], b[1], a[1], b[0])  # fmt: skip
        if rank_a != rank_b:
            raise AdapterMismatch(f"{name}: lora_a has rank {rank_a}, lora_b {rank_b}")
        if (fan_in, fan_out) != tuple(base[:2]):
            raise AdapterMismatch(f"{name}: the adapter expects {fan_in} -> {fan_out} features, the base model has "
                                  f"{base[0]} -> {base[1]}")  # fmt: skip
