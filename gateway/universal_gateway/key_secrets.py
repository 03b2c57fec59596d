"""API keys from Kubernetes Secrets: one key per Secret carrying a label, in one namespace, reloaded as they change.

A platform team adds a key with ``kubectl create secret generic team-a-key --from-literal=secret=...`` and the label
``serving.universal-runtime.dev/api-key=true``; the gateway lists the labelled Secrets of its namespace, then watches
them, and hands every valid one to :meth:`ApiKeys.set_secret_keys`, so a key added, changed or deleted takes effect
without a restart. A Secret's ``data`` fields are those of one entry of the YAML keys file (:class:`KeyEntry`, so the
two forms cannot drift): ``secret`` or ``sha256``; optional ``id`` (default: the Secret's name), ``owner``, ``models``
(comma-separated or a YAML list), ``limits`` and ``modelLimits`` (YAML or JSON), ``admin``.

A Secret that holds no valid key is skipped (every other key keeps working): a log line naming the field, the gauge
``universal_gateway_api_key_secrets_invalid``, and a Warning Event on the Secret where the gateway may create Events.
A Secret whose id or secret another key already has (the keys file's, or an earlier Secret's by name) is skipped the
same way: the keys file wins (a changed file that clashes is refused by :meth:`ApiKeys.refresh` instead), then
the Secret whose name sorts first.

One namespace, not all: RBAC cannot grant reading only the Secrets that carry a label (a Role's rules name resources
and verbs; ``list`` and ``watch`` on ``secrets`` reach every Secret of the namespace), so the gateway reads Secrets in
its own release namespace alone, through a Role there, never a ClusterRole that would read every Secret of the
cluster.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

import yaml
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Event, Secret
from pydantic import ValidationError

from universal_gateway.auth import ApiKeys, Key, KeyEntry, KeysError
from universal_gateway.kube_watch import describe, expired, retry_delay
from universal_operator.spec import GROUP

logger = logging.getLogger(__name__)

#: The label that makes a Secret an API key (the project's labels are named under its API group).
LABEL = f"{GROUP}/api-key"
SELECTOR = f"{LABEL}=true"
#: The Warning Event's reason, and who reports it.
REASON = "InvalidApiKey"
COMPONENT = "universal-runtime-gateway"
#: A key Secret's data fields: one entry of the YAML keys file (camelCase, as there).
FIELDS = ("secret", "sha256", "id", "owner", "models", "limits", "modelLimits", "admin")

EVENTS_HINT = (
    "the gateway may not create Events in this namespace, so an invalid key Secret is reported in its log and the "
    "universal_gateway_api_key_secrets_invalid gauge only (the Helm chart's gateway.apiKeys.secrets Role grants it)"
)


def rbac_rules() -> list[dict[str, list[str]]]:
    """What reading keys from Secrets needs, in the Secrets' namespace only (a Role; the chart's
    ``gateway.apiKeys.secrets``): ``list`` and ``watch`` on Secrets (never ``get``: a list is how the gateway knows it
    has every key), and ``create`` on Events to report an invalid one on itself."""
    return [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]


class InvalidKeySecret(KeysError):
    """A labelled Secret that holds no valid key: which Secret, which ``data`` field, what to change."""

    def __init__(self, source: str, field: str, problem: str) -> None:
        super().__init__(f"{source}: data.{field}: {problem}")
        self.field = field
        self.problem = problem


def parse_selector(text: str) -> dict[str, str | None]:
    """``key=value`` and ``key`` (the label present) terms, comma-separated, as lightkube's label selector; ValueError
    for anything else (set-based terms are not needed to pick Secrets out)."""
    selector: dict[str, str | None] = {}
    for term in (t.strip() for t in text.split(",")):
        key, equals, value = term.partition("=")
        key, value = key.strip(), value.strip().removeprefix("=").strip()  # `==` means `=` in a selector
        if not key or key.endswith("!") or any(c in key + value for c in " ()!") or (equals and not value):
            raise ValueError(f"{text!r}: give label=value or label terms, comma-separated (e.g. {SELECTOR})")
        selector[key] = value if equals else None
    return selector


def _field_value(field: str, text: str) -> Any:
    """A ``data`` field's text as the YAML entry's value: lists and mappings parsed, the rest as written."""
    if field == "models":
        loaded = _yaml(field, text) if text.lstrip().startswith("[") or "\n" in text else None
        if isinstance(loaded, list):
            return loaded
        models = [m.strip() for m in text.replace("\n", ",").split(",") if m.strip()]
        if not models:
            raise ValueError("names no model: list at least one, or leave the field out for every model")
        return models
    if field in ("limits", "modelLimits", "model_limits"):
        return _yaml(field, text)
    return text


def _yaml(field: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML or JSON ({str(exc).splitlines()[0]})") from None


def key_from_secret(body: Mapping[str, Any]) -> Key:
    """The key one Secret holds; :class:`InvalidKeySecret` naming the field that is wrong."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name"))
    source = f"Secret {meta.get('namespace')}/{name}"
    # `data` only: the API server moves `stringData` into it on write and never returns it (k8s.io/api core/v1
    # types.go, Secret.StringData: "It is never output when reading from the API").
    entry: dict[str, Any] = {"id": name}
    for field, encoded in (body.get("data") or {}).items():
        try:
            text = base64.b64decode(encoded or "", validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise InvalidKeySecret(source, field, "not UTF-8 text") from None
        try:
            # Stripped: `kubectl create secret --from-file` keeps a file's final newline.
            entry[field] = _field_value(field, text.strip())
        except ValueError as exc:
            raise InvalidKeySecret(source, field, str(exc)) from None
    try:
        return KeyEntry.model_validate(entry).key(source)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        field = ".".join(loc) or "secret"
        problem = str(first["msg"]).removeprefix("Value error, ")
        if first["type"] == "extra_forbidden" and len(loc) == 1:
            problem = f"not a field of a key Secret (give {', '.join(FIELDS)})"
        if loc[:1] == ["id"] and "id" not in (body.get("data") or {}):
            problem = f"the Secret's name is not a valid key id ({problem}): give the key an `id` field"
        raise InvalidKeySecret(source, field, problem) from None


def admit(candidates: Mapping[str, Key], keys: ApiKeys) -> dict[str, str]:
    """Hand the Secrets' keys to ``keys``; those whose id or secret another key has are left out. Returns the Secrets
    left out (name -> why). ``candidates`` by Secret name: the first by name wins a tie."""
    ordered = sorted(candidates.items())
    try:
        keys.set_secret_keys([key for _, key in ordered])
        return {}
    except KeysError:
        pass
    accepted: list[Key] = []
    refused: dict[str, str] = {}
    for name, key in ordered:  # a clash is rare: find it one Secret at a time
        try:
            keys.set_secret_keys([*accepted, key])
        except KeysError as exc:
            refused[name] = str(exc)
            continue
        accepted.append(key)
    keys.set_secret_keys(accepted)
    return refused


class KeySecrets:
    """Keeps ``keys``' Secret-held keys those of the labelled Secrets in one namespace: list, then watch."""

    def __init__(
        self,
        keys: ApiKeys,
        *,
        namespace: str | None = None,
        selector: str = SELECTOR,
        client: AsyncClient | None = None,
        watch_timeout: int | None = None,
    ) -> None:
        self.keys = keys
        # Configured to take keys from Secrets: no Secret (yet, or left) means nobody gets in, not an open gateway.
        keys.required = True
        self._namespace = namespace
        self._selector: dict[str, Any] = dict(parse_selector(selector))  # lightkube's selector type
        self._client = client
        self._watch_timeout = watch_timeout
        self._bodies: dict[str, dict[str, Any]] = {}  # Secret name -> its object
        self._problems: dict[str, str] = {}  # Secret name -> why it is skipped (reported once per change)
        self._events = True  # False once the API server refused to take an Event (no RBAC for it)
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self.listed = False
        self.error: str | None = None

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(field_manager=COMPONENT)
        return self._client

    @property
    def namespace(self) -> str:
        """The namespace given, else the client's: in a pod, the ServiceAccount's own (lightkube's in-cluster config
        reads /var/run/secrets/kubernetes.io/serviceaccount/namespace), the release namespace."""
        return self._namespace or self.client.namespace

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="api-key-secrets")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.close()

    async def wait_synced(self, within: float = 30.0) -> None:
        await asyncio.wait_for(self._synced.wait(), within)

    def readiness(self) -> str | None:
        where = f"namespace {self.namespace!r}"
        if not self.listed:
            detail = f" (last error: {self.error})" if self.error else ""
            return f"API key Secrets in {where} are not listed yet{detail}; no key is accepted."
        if self.error is not None:
            return f"Watching API key Secrets in {where} fails ({self.error}); keys may be stale."
        return None

    async def _watch(self) -> None:
        """List, then watch from the list's resourceVersion; on any failure list again (as cluster.py's models)."""
        failures = 0
        while True:
            try:
                listing = self.client.list(Secret, namespace=self.namespace, labels=self._selector)
                items: list[Any] = [item async for item in listing]
                self._bodies = {body["metadata"]["name"]: body for body in (item.to_dict() for item in items)}
                await self._apply()
                self.listed, self.error, failures = True, None, 0
                self._synced.set()
                # An object whose label is taken off arrives as DELETED (the watch cache converts an object that stops
                # matching the selector: Kubernetes v1.31 storage/cacher/cache_watcher.go convertToWatchEvent).
                async for kind, obj in self.client.watch(
                    Secret,
                    namespace=self.namespace,
                    labels=self._selector,
                    resource_version=listing.resourceVersion,
                    server_timeout=self._watch_timeout,
                ):
                    raw: Any = obj
                    body = raw.to_dict()
                    name = body["metadata"]["name"]
                    if kind == "DELETED":
                        self._bodies.pop(name, None)
                    elif kind in ("ADDED", "MODIFIED"):
                        self._bodies[name] = body
                    else:
                        continue
                    await self._apply()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped watch: list and resume
                self.error = describe(exc)
                gone = expired(exc)
                delay = 0.0 if gone else retry_delay(failures)
                failures = 0 if gone else failures + 1
                logger.log(logging.INFO if gone else logging.WARNING,
                           "watching API key Secrets in %s failed (%s); retrying", self.namespace,
                           self.error)  # fmt: skip
                await asyncio.sleep(delay)

    async def _apply(self) -> None:
        """Every labelled Secret's key to ``keys``; the invalid ones reported (once per new problem)."""
        candidates: dict[str, Key] = {}
        problems: dict[str, str] = {}
        for name, body in self._bodies.items():
            try:
                candidates[name] = key_from_secret(body)
            except InvalidKeySecret as exc:
                problems[name] = str(exc)
        refused = admit(candidates, self.keys)
        problems.update(refused)
        self.keys.invalid_secrets = len(problems)
        for name in sorted(set(self._problems) - set(problems)):
            logger.info("API key Secret %s/%s is valid again (or gone)", self.namespace, name)
        previous, self._problems = self._problems, problems
        for name, problem in sorted(problems.items()):
            if previous.get(name) != problem:
                logger.warning("skipped an API key Secret: %s", problem)
                await self._report(self._bodies[name], problem)
        logger.debug("API keys from Secrets: %d", len(candidates) - len(refused))

    async def _report(self, body: Mapping[str, Any], problem: str) -> None:
        """A Warning Event on the Secret, shaped as client-go's recorder makes one (kubernetes/kubernetes commit
        015189e7, staging/src/k8s.io/client-go/tools/record/event.go makeEvent: name ``<object>.<UnixNano hex>``,
        firstTimestamp = lastTimestamp, count 1), so ``kubectl describe secret`` shows it."""
        if not self._events:
            return
        meta = body["metadata"]
        now = datetime.now(UTC)
        involved = {"apiVersion": "v1", "kind": "Secret", "namespace": meta["namespace"], "name": meta["name"],
                    "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}  # fmt: skip
        event = {
            "metadata": {"name": f"{meta['name']}.{int(now.timestamp() * 1e9):x}", "namespace": meta["namespace"]},
            "involvedObject": involved,
            "type": "Warning",
            "reason": REASON,
            "message": problem,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "count": 1,
        }
        try:
            await self.client.create(cast(Event, Event.from_dict(event)))
        except ApiError as exc:
            if exc.status.code == 403:
                self._events = False
                logger.warning("%s (%s)", EVENTS_HINT, describe(exc))
            else:
                logger.info("could not post an Event on Secret %s: %s", meta["name"], describe(exc))
        except Exception as exc:  # the API server unreachable: the log line and the gauge still say it
            logger.info("could not post an Event on Secret %s: %s", meta["name"], describe(exc))
