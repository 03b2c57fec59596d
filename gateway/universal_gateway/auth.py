"""Optional API keys: ``Authorization: Bearer KEY``, each key optionally limited to some models.

Keys come from a file (one per line: ``KEY`` or ``KEY model-a,model-b``; ``#`` starts a comment; a
mounted Secret works as such a file) and/or an environment variable (comma-separated keys, all models).
No keys configured: the gateway is open. Keys are never logged.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from universal_predictors.errors import APIError

KEYS_ENV = "UNIVERSAL_RUNTIME_API_KEYS"


class Unauthorized(APIError):
    status_code = 401
    error_type = "invalid_request_error"


class Forbidden(APIError):
    status_code = 403
    error_type = "invalid_request_error"


@dataclass
class ApiKeys:
    """Key -> allowed models (None: every model)."""

    keys: dict[str, frozenset[str] | None] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @classmethod
    def load(cls, file: Path | None = None, env: str | None = None) -> ApiKeys:
        keys: dict[str, frozenset[str] | None] = {}
        if file is not None:
            for raw in file.read_text().splitlines():
                line = raw.split("#", 1)[0].strip()
                if not line:
                    continue
                key, _, models = line.partition(" ")
                allowed = frozenset(m.strip() for m in models.split(",") if m.strip())
                keys[key] = allowed or None
        for key in (env if env is not None else os.environ.get(KEYS_ENV, "")).split(","):
            if key.strip():
                keys[key.strip()] = None
        return cls(keys)

    def authorize(self, header: str | None, model: str | None, base: str | None = None) -> frozenset[str] | None:
        """The models this caller may use (None: all); 401 without a valid key, 403 for another model. ``base``:
        the model ``model`` is an adapter of: a key naming the base may use its adapters too, a key naming one
        adapter (``qwen:support``) that adapter only."""
        if not self.keys:
            return None
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("Missing API key: send 'Authorization: Bearer YOUR_KEY'.", code="missing_api_key")
        allowed: frozenset[str] | None = None
        found = False
        for key, models in self.keys.items():
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                allowed, found = models, True
        if not found:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        if model is not None and allowed is not None and model not in allowed and (base is None or base not in allowed):
            raise Forbidden(f"This API key may not use the model {model!r}.", param="model", code="model_not_allowed")
        return allowed
