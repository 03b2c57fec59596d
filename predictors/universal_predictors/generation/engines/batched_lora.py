"""LoRA deltas for a batch whose rows use different adapters, two batched matrix products per layer.

Each resident adapter has a slot (1..``max_loras``; slot 0 is the base: zero matrices). For every adapted linear
layer the slots' matrices are stacked, ``A`` as [slots, r, in] and ``B`` (its scaling folded in) as
[slots, out, r], ``r`` the largest rank resident (smaller ranks zero-padded: the padding adds nothing). A forward
hook on the layer adds, for the step's rows, ``(x @ A[slot]^T) @ B[slot]^T`` with the rows' slots gathered in one
``index_select``: the same arithmetic as PEFT's unmerged LoRA (``peft/tuners/lora/layer.py`` ``Linear.forward``,
0.21), in two ``bmm`` whatever the mix of adapters, where PEFT's mixed batch (``_mixed_batch_forward``) loops over
the batch's adapters with a gather and a scatter each. vLLM's punica kernels (``vllm/lora/punica_wrapper``) do the
same per row with CUDA kernels; this is their shape in plain torch, on any device.

What an adapter may use: PEFT LoRA with ``bias: none``, no DoRA, no ``modules_to_save``, no ``fan_in_fan_out``, no
per-module ``alpha_pattern`` or ``rank_pattern``; ``use_rslora`` scales by ``alpha / sqrt(r)``. Anything else is
refused by name (:class:`AdapterMismatch`) before a layer is touched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from universal_predictors.generation.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_KEY, AdapterMismatch

#: Config keys an adapter may set only to their defaults (what this implementation does not do).
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "fan_in_fan_out": False,
    "alpha_pattern": {},
    "rank_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
    "use_qalora": False,
}


@dataclass
class _Layer:
    """One adapted linear layer's stacked matrices."""

    a: Any  # [slots + 1, rank, in]
    b: Any  # [slots + 1, out, rank], scaling folded in


def lora_matrices(folder: Path, torch: Any) -> tuple[dict[str, tuple[Any, Any]], int]:
    """The adapter's (A, B * scaling) per module path, and its rank; :class:`AdapterMismatch` for what this does not
    serve (see the module's docstring)."""
    from safetensors.torch import load_file

    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}, [], False):
            raise AdapterMismatch(f"{ADAPTER_CONFIG} sets {key}={value!r}, which this engine does not serve")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha") or config["r"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[str, dict[str, Any]] = {}
    for key, tensor in load_file(str(folder / ADAPTER_WEIGHTS)).items():
        match = LORA_KEY.match(key)
        if match is not None:
            parts.setdefault(match["module"], {})[match["part"]] = tensor
    return {module: (pair["A"], pair["B"] * scaling) for module, pair in parts.items()}, rank


class BatchedLora:
    """The resident adapters of one model and the hooks that apply them row by row (see the module's docstring)."""

    def __init__(self, model: Any, max_loras: int, torch: Any) -> None:
        self._torch = torch
        self._modules = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._slots = max_loras + 1
        self._free = list(range(max_loras, 0, -1))
        self.slot_of: dict[str, int] = {}
        self._layers: dict[str, _Layer] = {}
        self._hooks: list[Any] = []
        #: The current forward's slot per row, per device (None: every row is the base's: no delta at all).
        self._rows: list[int] | None = None
        self._rows_on: dict[Any, Any] = {}
        self._same: int | None = None  # the one slot every row is on, if so

    def add(self, name: str, matrices: dict[str, tuple[Any, Any]]) -> None:
        """Put ``name``'s matrices in a free slot (the caller keeps at most ``max_loras`` resident)."""
        slot = self._free.pop()
        try:
            for module, (a, b) in matrices.items():
                self._write(module, slot, a, b)
        except Exception:
            self._clear(slot)
            self._free.append(slot)
            raise
        self.slot_of[name] = slot

    def remove(self, name: str) -> None:
        slot = self.slot_of.pop(name)
        self._clear(slot)
        self._free.append(slot)

    def rows(self, slots: list[int] | None) -> None:
        """The next forward's slot per row (None, or all zero: the base for every row)."""
        self._rows = slots if slots and any(slots) else None
        self._rows_on = {}
        self._same = slots[0] if self._rows is not None and slots and len(set(slots)) == 1 else None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _write(self, module: str, slot: int, a: Any, b: Any) -> None:
        torch = self._torch
        linear = self._modules[module]
        weight = linear.weight
        layer = self._layers.get(module)
        rank = a.shape[0]
        if layer is None:
            layer = _Layer(
                a=torch.zeros((self._slots, rank, linear.in_features), dtype=weight.dtype, device=weight.device),
                b=torch.zeros((self._slots, linear.out_features, rank), dtype=weight.dtype, device=weight.device),
            )
            self._layers[module] = layer
            self._hooks.append(linear.register_forward_hook(self._hook(layer)))
        elif rank > layer.a.shape[1]:  # a larger rank than any before: pad every slot's matrices with zeros
            grow = rank - layer.a.shape[1]
            layer.a = torch.cat([layer.a, layer.a.new_zeros((self._slots, grow, layer.a.shape[2]))], dim=1)
            layer.b = torch.cat([layer.b, layer.b.new_zeros((self._slots, layer.b.shape[1], grow))], dim=2)
        layer.a[slot].zero_()
        layer.b[slot].zero_()
        layer.a[slot, :rank] = a.to(weight.device, weight.dtype)
        layer.b[slot, :, :rank] = b.to(weight.device, weight.dtype)

    def _clear(self, slot: int) -> None:
        for layer in self._layers.values():
            layer.a[slot].zero_()
            layer.b[slot].zero_()

    def _hook(self, layer: _Layer) -> Any:
        torch = self._torch

        def add_delta(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
            if self._rows is None:
                return output
            x = inputs[0].to(layer.a.dtype)
            if self._same is not None:  # every row on one adapter: two plain products, nothing gathered
                delta = (x @ layer.a[self._same].T) @ layer.b[self._same].T
                return output + delta.to(output.dtype)
            index = self._rows_on.get(x.device)
            if index is None:
                index = self._rows_on[x.device] = torch.tensor(self._rows, dtype=torch.long, device=x.device)
            rows = x if x.dim() == 3 else x.unsqueeze(1)
            a = layer.a.index_select(0, index)
            b = layer.b.index_select(0, index)
            delta = torch.bmm(torch.bmm(rows, a.transpose(1, 2)), b.transpose(1, 2))
            return output + delta.view_as(output).to(output.dtype)

        return add_delta
