"""LoRA deltas for a batch whose rows use different adapters, two matrix products per layer.

Each resident adapter has a slot (1..``max_loras``; slot 0 is the base: zero matrices). For every adapted linear
layer the slots' matrices are stacked slot after slot, ``A`` as [slots * r, in] and ``B`` (its scaling folded in)
as [slots * r, out], ``r`` the largest rank resident (smaller ranks zero-padded: the padding adds nothing). A
forward hook on the layer adds, for the step's rows, ``((x @ A^T) * mask) @ B`` where ``mask`` keeps, for each row,
only its own slot's ``r`` columns: every row's ``(x @ A[slot]^T) @ B[slot]^T``, the same arithmetic as PEFT's
unmerged LoRA (``peft/tuners/lora/layer.py`` ``Linear.forward``, 0.21), in two dense products over the slots the
step uses, whatever the mix of adapters. PEFT's mixed batch (``_mixed_batch_forward``) loops over the batch's
adapters with a gather and a scatter each; gathering each row's matrices for two ``bmm`` (this module's first
form) copies every row's adapter at every step. vLLM's punica kernels (``vllm/lora/punica_wrapper``) do the
per-row products with CUDA kernels; this is the same sum in plain torch, on any device. Its cost grows with the
slots in use times ``r``, against the layer's own width: measured in ``bench/lora.py``.

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

    a: Any  # [(slots + 1) * rank, in]
    b: Any  # [(slots + 1) * rank, out], scaling folded in
    rank: int


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
                a=torch.zeros((self._slots * rank, linear.in_features), dtype=weight.dtype, device=weight.device),
                b=torch.zeros((self._slots * rank, linear.out_features), dtype=weight.dtype, device=weight.device),
                rank=rank,
            )
            self._layers[module] = layer
            self._hooks.append(linear.register_forward_hook(self._hook(layer)))
        elif rank > layer.rank:  # a larger rank than any before: pad every slot's block with zeros
            grow, old = rank - layer.rank, layer.rank
            a_old = layer.a.view(self._slots, old, -1)
            b_old = layer.b.view(self._slots, old, -1)
            layer.a = torch.cat([a_old, a_old.new_zeros((self._slots, grow, a_old.shape[2]))], dim=1).flatten(0, 1)
            layer.b = torch.cat([b_old, b_old.new_zeros((self._slots, grow, b_old.shape[2]))], dim=1).flatten(0, 1)
            layer.rank = rank
        block = slice(slot * layer.rank, (slot + 1) * layer.rank)
        layer.a[block].zero_()
        layer.b[block].zero_()
        layer.a[slot * layer.rank : slot * layer.rank + rank] = a.to(weight.device, weight.dtype)
        layer.b[slot * layer.rank : slot * layer.rank + rank] = b.T.to(weight.device, weight.dtype)

    def _clear(self, slot: int) -> None:
        for layer in self._layers.values():
            layer.a[slot * layer.rank : (slot + 1) * layer.rank].zero_()
            layer.b[slot * layer.rank : (slot + 1) * layer.rank].zero_()

    def _mask(self, rank: int, device: Any, dtype: Any) -> tuple[Any, int, int]:
        """The step's row mask over the slots in use ([rows, 1, (last - first) * rank]), and those slots' range."""
        key = (rank, device, dtype)
        cached = self._rows_on.get(key)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        assert self._rows is not None
        used = [s for s in self._rows if s]
        first, last = min(used), max(used) + 1
        mask = self._torch.zeros((len(self._rows), 1, (last - first) * rank), dtype=dtype)
        for row, slot in enumerate(self._rows):
            if slot:
                mask[row, 0, (slot - first) * rank : (slot - first + 1) * rank] = 1
        cached = self._rows_on[key] = (mask.to(device), first, last)
        return cached

    def _hook(self, layer: _Layer) -> Any:
        def add_delta(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
            if self._rows is None:
                return output
            x = inputs[0]
            if x.dtype != layer.a.dtype:
                x = x.to(layer.a.dtype)
            r = layer.rank
            if self._same is not None:  # every row on one adapter: two plain products, nothing masked
                block = slice(self._same * r, (self._same + 1) * r)
                delta = (x @ layer.a[block].T) @ layer.b[block]
                return output + delta.to(output.dtype)
            mask, first, last = self._mask(r, x.device, x.dtype)
            rows = x if x.dim() == 3 else x.unsqueeze(1)
            used = slice(first * r, last * r)
            delta = (rows @ layer.a[used].T).mul_(mask) @ layer.b[used]
            return output + delta.view_as(output).to(output.dtype)

        return add_delta
