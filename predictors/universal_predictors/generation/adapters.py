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

import asyncio
import json
import logging
import re
import shutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from universal_predictors.generation.adapter_stores import (
    HF_TOKEN,
    CredentialsUnavailable,
    StoreSecret,
    download,
    is_remote,
    read_store_secret,
)

logger = logging.getLogger(__name__)

#: PEFT's files in an adapter folder (peft/utils/constants.py ``CONFIG_NAME``, ``SAFETENSORS_WEIGHTS_NAME``).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The adapter name PEFT's mixed-batch forward reads as "no adapter" for a row (peft/tuners/lora/model.py
#: ``_enable_peft_forward_hooks``: rows named ``__base__`` skip every LoRA delta).
BASE_ROW = "__base__"
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


def make_room(
    resident: Collection[str], users: Mapping[str, int], max_loras: int, free: Callable[[str], None], model: str
) -> None:
    """Free least recently used adapters (``resident``, live, in that order; ``free`` removes one from it) no
    sequence uses until fewer than ``max_loras`` remain; 503 ``adapters_busy`` when every one is in use. The
    engines' shared LRU rule."""
    from universal_predictors import metrics
    from universal_predictors.errors import Unavailable

    while len(resident) >= max_loras:
        idle = next((name for name in resident if users.get(name, 0) <= 0), None)
        if idle is None:
            raise Unavailable(
                f"all {max_loras} resident adapters (engine arg max_loras) are in use; retry when one finishes, or "
                "raise max_loras",
                code="adapters_busy",
                retry_after=1,
            )
        free(idle)
        metrics.ADAPTER_EVICTIONS.labels(model, idle).inc()


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
        match = LORA_KEY.match(key)
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


# -- the model's adapter list ----------------------------------------------------------------------------------

#: The separator between the base model's name and an adapter's in a request's ``model``
#: (``universal_operator.spec.ADAPTER_SEPARATOR``; the predictor does not import the operator).
SEPARATOR = ":"
_ADAPTER_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class AdapterState(StrEnum):
    """As ``universal_operator.spec.AdapterState`` spells them (the status reports these)."""

    PENDING = "Pending"
    DOWNLOADING = "Downloading"
    READY = "Ready"
    FAILED = "Failed"


@dataclass
class AdapterEntry:
    """One listed adapter and where it stands in this process."""

    name: str
    uri: str
    credentials: str | None = None  # the Secret its source's credentials come from (a cluster's)
    state: AdapterState = AdapterState.PENDING
    reason: str | None = None
    message: str | None = None
    path: Path | None = None  # its local folder, once fetched
    credentials_stamp: tuple[int, int] | None = None  # its Secret's copy as of the last download attempt

    def report(self, base: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "served_name": f"{base}{SEPARATOR}{self.name}", "state": self.state}
        if self.reason:
            out |= {"reason": self.reason, "message": self.message}
        return out


@dataclass(frozen=True)
class ListedAdapter:
    """One entry of the adapters file: where the adapter's files are, and the Secret that opens them."""

    uri: str
    credentials: str | None = None


def read_adapters_file(path: Path) -> dict[str, ListedAdapter]:
    """``{"adapters": [{"name": ..., "uri": ..., "credentials": SECRET?}]}`` (the operator's ConfigMap key, ``serve``'s
    file) by name; ValueError naming what is wrong. A missing file is an empty list (the volume may lag the pod)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text() or "{}")
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    items = data.get("adapters") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ValueError(f'{path}: expected {{"adapters": [{{"name": ..., "uri": ...}}]}}')
    adapters: dict[str, ListedAdapter] = {}
    for index, item in enumerate(items):
        name, uri = (item.get("name"), item.get("uri")) if isinstance(item, dict) else (None, None)
        if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"{path}: adapters[{index}].name must be a DNS label (got {name!r})")
        if not isinstance(uri, str) or not uri:
            raise ValueError(f"{path}: adapters[{index}].uri must be a non-empty string")
        if name in adapters:
            raise ValueError(f"{path}: adapter {name} appears more than once")
        credentials = item.get("credentials")
        if credentials is not None and (not isinstance(credentials, str) or not credentials):
            raise ValueError(f"{path}: adapters[{index}].credentials must be a Secret's name")
        adapters[name] = ListedAdapter(uri, credentials)
    return adapters


Fetch = Callable[[str, Path, StoreSecret | None], Path]


def fetch_adapter(uri: str, cache: Path, secret: StoreSecret | None = None) -> Path:
    """A local folder (or GGUF file) for ``uri``: a path (or file://) as it is; hf://ORG/REPO[:REV] from the hub
    (HF_TOKEN, HF_ENDPOINT honoured, as for the base model; a Secret's HF_TOKEN for this download only); s3://, gs://,
    http(s):// by KServe's storage code into ``cache`` (:mod:`.adapter_stores`). Other schemes: ValueError."""
    if uri.startswith("hf://"):
        from huggingface_hub import snapshot_download

        repo, _, revision = uri.removeprefix("hf://").partition(":")
        token = secret.text(HF_TOKEN) if secret is not None and HF_TOKEN in secret.data else None
        return Path(snapshot_download(repo_id=repo, revision=revision or None, cache_dir=cache / "hub", token=token))
    if is_remote(uri):
        target = cache / "download"
        if target.exists():  # a previous URI's files, or a failed attempt's
            shutil.rmtree(target)
        return download(uri, target, secret)
    scheme, sep, _ = uri.partition("://")
    if sep and scheme != "file":
        raise ValueError(f"{scheme}:// adapter sources are not fetched by the predictor (yet); use hf://, s3://, "
                         "gs://, https:// or a path")  # fmt: skip
    path = Path(uri.removeprefix("file://")).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return path


class AdapterCatalog:
    """The adapters a model lists (its ``--adapters-file``, re-read when it changes), fetched on first use.

    Names resolve as ``{base}:{adapter}``, and as ``{adapter}`` alone (what vLLM's clients send: vLLM serves a
    LoRA module under its bare name, ``vllm/entrypoints/openai/serving_models.py``) when that is not the base's
    own name."""

    def __init__(
        self,
        base: str,
        file: Path | None,
        cache: Path,
        credentials_dir: Path | None = None,
        fetch: Fetch = fetch_adapter,
    ) -> None:
        self.base = base
        self.file = file
        self.cache = cache
        self._fetch = fetch
        self._entries: dict[str, AdapterEntry] = {}
        self._stamp: tuple[int, int] | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        #: Where the copies of the adapters' credentials Secrets are (``--adapter-credentials-dir``); None: downloads
        #: use this process's environment, as ``serve``'s do.
        self.credentials_dir = credentials_dir
        self.error: str | None = None  # why the file could not be read (the last good list stays)
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the file when its mtime or size changed; True when the list changed."""
        if self.file is None:
            return False
        try:
            info = self.file.stat()
            stamp = (info.st_mtime_ns, info.st_size)
        except FileNotFoundError:
            stamp = (0, 0)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            listed = read_adapters_file(self.file)
        except (OSError, ValueError) as exc:
            self.error = str(exc)
            logger.error("the adapters file cannot be read, keeping the last list: %s", exc)
            return False
        self.error = None
        before = {name: ListedAdapter(e.uri, e.credentials) for name, e in self._entries.items()}
        for name, item in listed.items():
            entry = self._entries.get(name)
            if entry is None or (entry.uri, entry.credentials) != (item.uri, item.credentials):
                self._entries[name] = AdapterEntry(name, item.uri, item.credentials)
        for name in set(self._entries) - set(listed):
            del self._entries[name]
        return before != listed

    @property
    def names(self) -> list[str]:
        self.refresh()
        return sorted(self._entries)

    def entries(self) -> list[AdapterEntry]:
        self.refresh()
        return [self._entries[name] for name in sorted(self._entries)]

    def resolve(self, model: str | None) -> str | None:
        """The adapter ``model`` names, None for the base (or no model named); KeyError when it names neither."""
        if model is None or model == self.base:
            return None
        self.refresh()
        base, sep, adapter = model.rpartition(SEPARATOR)
        if sep and base == self.base and adapter in self._entries:
            return adapter
        if model in self._entries:
            return model
        raise KeyError(model)

    async def local(self, name: str) -> AdapterRef:
        """The adapter's local files (fetched once; a failure is remembered and raised again until the list
        changes): :class:`AdapterMismatch` or the fetch's error."""
        entry = self._entries[name]
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            retry = entry.state is AdapterState.FAILED and entry.reason in RETRIED_WITH_NEW_CREDENTIALS
            if retry and self._credentials_stamp(entry) != entry.credentials_stamp:  # copied or rotated since: again
                entry.state, entry.reason, entry.message, entry.path = AdapterState.PENDING, None, None, None
            if entry.state is AdapterState.FAILED:
                raise AdapterMismatch(entry.message or "failed")
            if entry.path is None:
                entry.state = AdapterState.DOWNLOADING
                entry.credentials_stamp = self._credentials_stamp(entry)
                try:
                    secret = self._secret(entry)
                    entry.path = await asyncio.to_thread(self._fetch, entry.uri, self.cache / name, secret)
                    await asyncio.to_thread(read_lora_or_gguf, entry.path)
                except Exception as exc:
                    self.fail(name, _failure_reason(exc), exc)
                    raise
                entry.state = AdapterState.READY
        return AdapterRef(name, entry.path)

    def _secret(self, entry: AdapterEntry) -> StoreSecret | None:
        """The copy of the adapter's credentials Secret; None when it names none (then: this process's
        environment). The files are read at each download, so a rotated Secret is used once the kubelet wrote it."""
        if entry.credentials is None:
            return None
        if self.credentials_dir is None:
            raise CredentialsUnavailable(
                f"the adapter names credentials Secret {entry.credentials!r}, but this predictor has no copies of "
                "Secrets (--adapter-credentials-dir)"
            )
        return read_store_secret(self.credentials_dir, entry.credentials)

    def _credentials_stamp(self, entry: AdapterEntry) -> tuple[int, int] | None:
        """When the adapter's copy of its Secret last changed (None: none named, or no copy)."""
        if entry.credentials is None or self.credentials_dir is None:
            return None
        try:
            info = (self.credentials_dir / f"{entry.credentials}.json").stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def fail(self, name: str, reason: str, error: BaseException) -> None:
        """Mark ``name`` Failed with ``reason`` (the base model serves on)."""
        entry = self._entries.get(name)
        if entry is not None:
            entry.state, entry.reason, entry.message = AdapterState.FAILED, reason, str(error).splitlines()[0]
            logger.warning("LoRA adapter %s failed (%s): %s", name, reason, entry.message)


#: The Failed reason of an adapter whose credentials Secret the predictor has no copy of.
CREDENTIALS_UNAVAILABLE = "CredentialsUnavailable"
#: Failures tried again on the next request once the copy of the adapter's Secret changed (it arrived, or was
#: rotated: the operator re-copies it, the kubelet rewrites the mounted file); the others wait for a new list.
RETRIED_WITH_NEW_CREDENTIALS = (CREDENTIALS_UNAVAILABLE, "DownloadFailed")


def _failure_reason(error: BaseException) -> str:
    if isinstance(error, AdapterMismatch):
        return "Mismatch"
    if isinstance(error, CredentialsUnavailable):
        return CREDENTIALS_UNAVAILABLE
    return "DownloadFailed"


def read_lora_or_gguf(folder: Path) -> None:
    """Check the fetched files are an adapter: a PEFT folder (:func:`read_lora`) or a GGUF LoRA (llama.cpp)."""
    if folder.is_file() and folder.suffix == ".gguf":
        return
    if folder.is_dir() and not (folder / ADAPTER_CONFIG).exists() and any(folder.glob("*.gguf")):
        return
    read_lora(folder)
