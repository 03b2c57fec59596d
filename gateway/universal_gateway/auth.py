"""API keys: ``Authorization: Bearer KEY``, each key with an id, an owner, the models it may use and its limits.

Where keys come from (any together; each key's id must be unique across them):

- ``--api-keys-file FILE`` in either of two forms, told apart by what the file holds:
  - lines (the first form, still valid): ``SECRET`` or ``SECRET model-a,model-b``; ``#`` starts a comment. Such
    a key's id is ``key-`` and the first 12 hex digits of its secret's SHA-256 (what logs and metrics show);
  - YAML, a mapping with ``keys:`` (:class:`KeysFile`): ids, owners, models, limits, and the secret either as it is
    (``secret``) or hashed (``sha256``: what ``universal-runtime keys create`` writes, so a file at rest holds no
    usable secret).
  A mounted Secret works as such a file: the gateway re-reads the file when it changes (:meth:`ApiKeys.refresh`),
  keeping the keys it had when the new content is invalid (logged, and counted in
  ``universal_gateway_api_keys_reload_errors_total``).
- ``UNIVERSAL_RUNTIME_API_KEYS``: comma-separated secrets, every model, no limits.
- In a cluster, Secrets selected by label (:mod:`.key_secrets`), one key each.

No keys configured: the gateway is open. A secret is never logged; a key is looked up by its secret's SHA-256
(as GitHub and Stripe store tokens): the lookup's time depends on that digest, which tells a caller nothing about
the stored ones, and the digest found is compared again with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from universal_predictors.errors import APIError

KEYS_ENV = "UNIVERSAL_RUNTIME_API_KEYS"
#: A key id: what logs, metrics and the usage ledger show (a DNS label's characters, dots and underscores).
KEY_ID = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
#: The shortest secret a YAML entry may hold: shorter ones can be guessed.
MIN_SECRET = 16

logger = logging.getLogger(__name__)


class Unauthorized(APIError):
    status_code = 401
    error_type = "invalid_request_error"


class Forbidden(APIError):
    status_code = 403
    error_type = "invalid_request_error"


class KeysError(ValueError):
    """A keys source that cannot be read: the message names the source, the entry and what to change."""


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def derived_id(secret: str) -> str:
    """The id of a key given without one (a line of the first file form, the environment variable)."""
    return f"key-{hashlib.sha256(secret.encode()).hexdigest()[:12]}"


class Limits(BaseModel):
    """What a key may use per minute and at once; a field left out: no limit of that kind."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    requests_per_minute: PositiveInt | None = None
    input_tokens_per_minute: PositiveInt | None = None
    output_tokens_per_minute: PositiveInt | None = None
    concurrent_requests: PositiveInt | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in self.model_dump().values())

    def over(self, fallback: Limits) -> Limits:
        """These limits, each field not set taken from ``fallback``."""
        mine = self.model_dump(exclude_none=True)
        return Limits(**{**fallback.model_dump(exclude_none=True), **mine})


NO_LIMITS = Limits()


@dataclass(frozen=True)
class Key:
    """One API key, without its secret."""

    id: str
    digest: bytes = field(repr=False)
    owner: str = ""
    #: The models (and adapters, ``base:adapter``) it may use; None: every model.
    models: frozenset[str] | None = None
    #: Limits over all its requests.
    limits: Limits = NO_LIMITS
    #: Limits on its requests to one model (over the keys file's ``modelLimits`` default for that model).
    model_limits: Mapping[str, Limits] = field(default_factory=dict)
    #: May read every key's usage (``GET /v1/usage``).
    admin: bool = False
    #: Where it was read (a file, a Secret): for messages.
    source: str = ""

    def may_use(self, model: str | None, base: str | None = None) -> bool:
        """Whether it may use ``model``; ``base``: the model ``model`` is an adapter of (a key naming the base may
        use its adapters too, a key naming one adapter that adapter only)."""
        return (
            self.models is None or model is None or model in self.models or (base is not None and base in self.models)
        )


class KeyEntry(BaseModel):
    """One key of the YAML form."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    id: str = Field(pattern=KEY_ID)
    owner: str = ""
    secret: str | None = Field(default=None, min_length=MIN_SECRET)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    models: list[str] | None = None
    limits: Limits = NO_LIMITS
    model_limits: dict[str, Limits] = Field(default_factory=dict)
    admin: bool = False

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.secret is None) == (self.sha256 is None):
            raise ValueError("give the key's secret either as `secret` or hashed as `sha256`, not both or neither")
        return self

    def key(self, source: str) -> Key:
        hashed = bytes.fromhex(self.sha256) if self.sha256 else digest(self.secret or "")
        models = frozenset(self.models) if self.models is not None else None
        return Key(self.id, hashed, self.owner, models, self.limits, dict(self.model_limits), self.admin, source)


class KeysFile(BaseModel):
    """The YAML form of ``--api-keys-file``."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    keys: list[KeyEntry]
    #: The default limits of every key's requests to a model, per model (a key's own ``modelLimits`` win).
    model_limits: dict[str, Limits] = Field(default_factory=dict)


def _problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def parse_keys(text: str, source: str) -> tuple[list[Key], dict[str, Limits]]:
    """The keys a file holds, and its per-model default limits; :class:`KeysError` naming what is wrong."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        document = None
    if isinstance(document, dict) and "keys" in document:
        try:
            parsed = KeysFile.model_validate(document)
        except ValidationError as exc:
            raise KeysError(f"{source}: {_problem(exc)}") from None
        return [entry.key(source) for entry in parsed.keys], dict(parsed.model_limits)
    keys = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        secret, _, models = line.partition(" ")
        allowed = frozenset(m.strip() for m in models.split(",") if m.strip())
        keys.append(Key(derived_id(secret), digest(secret), models=allowed or None, source=f"{source}:{number}"))
    return keys, {}


def env_keys(value: str) -> list[Key]:
    return [Key(derived_id(s.strip()), digest(s.strip()), source=KEYS_ENV) for s in value.split(",") if s.strip()]


class ApiKeys:
    """The keys the gateway takes, from every source, and the per-model default limits."""

    def __init__(
        self,
        keys: Iterable[Key] = (),
        model_limits: Mapping[str, Limits] | None = None,
        *,
        file: Path | None = None,
        on_reload_error: Callable[[], None] | None = None,
    ) -> None:
        self._file = file
        self._file_seen: tuple[int, int, int] | None = None
        self._file_keys: list[Key] = []
        self._fixed = list(keys)
        self._secret_keys: list[Key] = []
        self.model_limits: dict[str, Limits] = dict(model_limits or {})
        self.on_reload_error = on_reload_error
        #: Keys required even while no source holds one: with Secrets as a source, a cluster with none (yet, or any
        #: more) must refuse every caller, not open the gateway.
        self.required = False
        #: Labelled Secrets skipped: no valid key in them (``universal_gateway_api_key_secrets_invalid``).
        self.invalid_secrets = 0
        self._by_digest: dict[bytes, Key] = {}
        #: Bumped whenever the keys change (what caches of per-key settings check).
        self.generation = 0
        self._index()

    @classmethod
    def of(cls, secrets: Mapping[str, frozenset[str] | None]) -> ApiKeys:
        """Keys from their secrets, each with the models it may use (tests, the first file form in memory)."""
        return cls(Key(derived_id(s), digest(s), models=m) for s, m in secrets.items())

    @classmethod
    def load(cls, file: Path | None = None, env: str | None = None) -> ApiKeys:
        """Keys from ``file`` (re-read by :meth:`refresh` when it changes) and the environment variable;
        :class:`KeysError` (or OSError) when the file cannot be read."""
        keys = cls(env_keys(env if env is not None else os.environ.get(KEYS_ENV, "")), file=file)
        if file is not None:
            keys._read_file()
        return keys

    @property
    def enabled(self) -> bool:
        return self.required or bool(self._by_digest)

    @property
    def keys(self) -> list[Key]:
        return list(self._by_digest.values())

    def _read_file(self) -> None:
        assert self._file is not None
        stat = self._file.stat()
        keys, model_limits = parse_keys(self._file.read_text(), str(self._file))
        previous = (self._file_keys, self.model_limits)
        self._file_keys, self.model_limits = keys, model_limits  # (_index bumps the generation)
        try:
            self._index()
        except KeysError:
            self._file_keys, self.model_limits = previous
            raise
        self._file_seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)

    def refresh(self) -> bool:
        """Re-read the keys file if it changed since it was read (a mounted Secret is replaced in place by the
        kubelet); True when the keys changed. An invalid new content keeps the keys there were, logged."""
        if self._file is None:
            return False
        try:
            stat = self._file.stat()
            if (stat.st_mtime_ns, stat.st_size, stat.st_ino) == self._file_seen:
                return False
            self._read_file()
        except (OSError, KeysError) as exc:
            logger.error("kept the API keys there were: %s", exc)
            if self.on_reload_error is not None:
                self.on_reload_error()
            return False
        logger.info("re-read the API keys file %s: %d keys", self._file, len(self._by_digest))
        return True

    def set_secret_keys(self, keys: list[Key]) -> None:
        """The keys read from Kubernetes Secrets (all of them, replacing those before); :class:`KeysError` for an
        id or secret another source has, the keys left as they were."""
        previous = self._secret_keys
        self._secret_keys = keys
        try:
            self._index()
        except KeysError:
            self._secret_keys = previous
            raise

    def _index(self) -> None:
        by_digest: dict[bytes, Key] = {}
        ids: dict[str, Key] = {}
        for key in [*self._fixed, *self._file_keys, *self._secret_keys]:
            if key.id in ids:
                raise KeysError(f"{key.source}: the key id {key.id!r} is taken by {ids[key.id].source}; ids are unique")
            if key.digest in by_digest:
                raise KeysError(f"{key.source}: the key {key.id!r} has the same secret as {by_digest[key.digest].id!r}")
            ids[key.id] = by_digest[key.digest] = key
        self._by_digest = by_digest
        self.generation += 1

    def authenticate(self, header: str | None) -> Key | None:
        """The caller's key (None: the gateway is open); 401 without a valid one."""
        if not self.enabled:
            return None
        scheme, _, token = (header or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer YOUR_KEY'.", code="missing_api_key")
        presented = digest(token)
        key = self._by_digest.get(presented)
        if key is None or not hmac.compare_digest(key.digest, presented):
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return key

    def authorize(self, header: str | None, model: str | None, base: str | None = None) -> Key | None:
        """The caller's key (None: the gateway is open); 401 without a valid key, 403 for a model it may not use.
        ``base``: the model ``model`` is an adapter of (see :meth:`Key.may_use`)."""
        return may_use(self.authenticate(header), model, base)

    def limits(self, key: Key | None, model: str) -> tuple[Limits, Limits]:
        """The limits over all of ``key``'s requests, and those on its requests to ``model``."""
        if key is None:
            return NO_LIMITS, self.model_limits.get(model, NO_LIMITS)
        default = self.model_limits.get(model, NO_LIMITS)
        return key.limits, key.model_limits.get(model, NO_LIMITS).over(default)


def may_use(key: Key | None, model: str | None, base: str | None = None) -> Key | None:
    """``key``, if it may use ``model`` (see :meth:`Key.may_use`); 403 if not."""
    if key is not None and not key.may_use(model, base):
        raise Forbidden(f"This API key may not use the model {model!r}.", param="model", code="model_not_allowed")
    return key


def allowed_models(key: Key | None) -> frozenset[str] | None:
    """The models a caller may see (None: all)."""
    return None if key is None else key.models


def describe(keys: ApiKeys) -> dict[str, Any]:
    """What is configured, without secrets (for the startup log)."""
    return {"keys": len(keys.keys), "limited": sum(1 for k in keys.keys if k.limits.any or k.model_limits)}
