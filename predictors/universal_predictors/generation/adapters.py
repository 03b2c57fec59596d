"""LoRA adapters: what a request names, and the checks that an adapter fits its base model before an engine
touches it.

An adapter is served as the model ``{base}:{adapter}`` (``universal_operator.spec.ADAPTER_SEPARATOR``). Its files
are a PEFT adapter folder: ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``target_modules``) and
``adapter_model.safetensors`` (for each adapted module ``<module>.lora_A.weight`` of shape [r, in_features] and
``<module>.lora_B.weight`` of shape [out_features, r], PEFT's layout: ``peft/tuners/lora/layer.py`` at 0.21).
A mismatch with the base (a module it lacks, other dimensions, another rank than the config says) is an
:class:`AdapterMismatch` naming the first difference: the base model keeps serving, and the adapter is Failed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: PEFT's files in an adapter folder (peft/utils/constants.py ``CONFIG_NAME``, ``SAFETENSORS_WEIGHTS_NAME``).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The adapter name PEFT's mixed-batch forward reads as "no adapter" for a row (peft/tuners/lora/model.py
#: ``_enable_peft_forward_hooks``: rows named ``__base__`` skip every LoRA delta).
BASE_ROW = "__base__"
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterMismatch(ValueError):
    """The adapter cannot apply to this base model; the message names what differs."""


@dataclass(frozen=True)
class AdapterRef:
    """An adapter a request uses: its name and its local folder (downloaded already)."""

    name: str
    path: Path


@dataclass(frozen=True)
class LoraShape:
    """What an adapter folder says about itself, read without torch: rank, target modules, and for each adapted
    module its (in_features, out_features)."""

    rank: int
    target_modules: tuple[str, ...]
    modules: dict[str, tuple[int, int]]
    base_model: str | None


def read_lora(folder: Path) -> LoraShape:
    """The adapter's config and the shapes of its tensors (safetensors' header: nothing is loaded)."""
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise AdapterMismatch(f"no {ADAPTER_CONFIG} in the adapter's folder (a PEFT LoRA adapter has one)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterMismatch(f"{ADAPTER_CONFIG} is not readable JSON: {exc}") from None
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterMismatch(f"peft_type is {config.get('peft_type')!r}: only LoRA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterMismatch(f"{ADAPTER_CONFIG} has no valid rank r (got {rank!r})")
    targets = config.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(str(t) for t in targets)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterMismatch(f"no {ADAPTER_WEIGHTS} in the adapter's folder")
    shapes = _safetensors_shapes(weights)
    parts: dict[str, dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        match = _LORA_KEY.match(key)
        if match is not None:
            parts.setdefault(match["module"], {})[match["part"]] = shape
    modules: dict[str, tuple[int, int]] = {}
    for module, pair in sorted(parts.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            raise AdapterMismatch(f"{module}: lora_A and lora_B must both be matrices")
        if a[0] != rank or b[1] != rank:
            raise AdapterMismatch(f"{module}: its LoRA matrices have rank {a[0]}, the config says r={rank}")
        modules[module] = (a[1], b[0])
    if not modules:
        raise AdapterMismatch(f"{ADAPTER_WEIGHTS} holds no LoRA matrices (lora_A/lora_B weights)")
    base = config.get("base_model_name_or_path")
    return LoraShape(rank, targets, modules, str(base) if base else None)


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's JSON header (8-byte little-endian length, then JSON)."""
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if not 0 < length <= 100_000_000:
            raise AdapterMismatch(f"{path.name} is not a safetensors file")
        header: dict[str, Any] = json.loads(handle.read(length))
    return {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_fits(shape: LoraShape, linear_shapes: dict[str, tuple[int, int]]) -> None:
    """:class:`AdapterMismatch` unless every adapted module is a linear layer of the base with the adapter's
    (in_features, out_features). ``linear_shapes``: the base's linear layers by module path."""
    for module, (fan_in, fan_out) in shape.modules.items():
        found = linear_shapes.get(module)
        if found is None:
            raise AdapterMismatch(
                f"the adapter adapts {module!r}, which this base model does not have as a linear layer "
                f"(target_modules {list(shape.target_modules)}; adapter trained on {shape.base_model or 'unknown'})"
            )
        if found != (fan_in, fan_out):
            raise AdapterMismatch(
                f"{module}: the adapter expects {fan_in} -> {fan_out} features, the base model has "
                f"{found[0]} -> {found[1]} (adapter trained on {shape.base_model or 'another base model'})"
            )
