"""``universal-runtime``: the one command. ``serve`` and ``ps`` here; ``operator`` and ``crd`` from the operator.

Each subcommand imports what it needs only when chosen.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from universal_gateway.limits import GatewayLimits, MiB
from universal_operator import cli as operator_cli

if TYPE_CHECKING:
    from universal_gateway.app import Gateway
    from universal_gateway.audit import AuditLog
    from universal_gateway.auth import ApiKeys
    from universal_gateway.metrics import GatewayMetrics
    from universal_gateway.quotas import Quotas
    from universal_gateway.responses_store import ResponseStore
    from universal_gateway.usage import UsageLedger

PROG = "universal-runtime"
DEFAULT_PORT = 8000
#: Every option's default is GatewayLimits' own.
LIMITS = GatewayLimits()
DEFAULT_LOCAL_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "local"
#: The response store's spec when --responses-store is not given (a redis:// URL with its password, from a Secret).
RESPONSES_STORE_ENV = "UNIVERSAL_RUNTIME_RESPONSES_STORE"
#: Where the limits' counters and the usage ledger live when --limits-store is not given.
LIMITS_STORE_ENV = "UNIVERSAL_RUNTIME_LIMITS_STORE"


def _cached_prefixes(values: list[str]) -> dict[str, Path]:
    """``--cached-prefix URI=DIR`` values, each a URI with a scheme and an existing folder."""
    found: dict[str, Path] = {}
    for value in values:
        uri, sep, folder = value.partition("=")
        if not sep or "://" not in uri or not folder:
            raise ValueError(f"--cached-prefix {value!r}: expected URI=DIR, e.g. s3://bucket/models=/mnt/models")
        if not Path(folder).is_dir():
            raise ValueError(f"--cached-prefix {value!r}: {folder} is not a folder")
        found[uri.rstrip("/")] = Path(folder)
    return found


def _fail(subcommand: str, message: str) -> int:
    print(f"{PROG} {subcommand}: error: {message}", file=sys.stderr)
    return 2


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when it is installed (it comes with uvicorn[standard], a kserve dependency): measured,
    it cuts the gateway's CPU per proxied request by about 15%; otherwise asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def freeze_startup_heap() -> None:
    """Move what start-up made (modules, routes, the manifests' models: some 75,000 objects) out of the garbage
    collector's reach, as the predictors do after loading (base.py): a full collection otherwise walks all of it with
    every request in flight held. Measured in front of an upstream answering in 50 ms at c=32 (``bench/gateway.py
    --part tenants``): two or three full collections per 4,000 requests, 42-64 ms each, before; under 1 ms after."""
    gc.collect()
    gc.freeze()


def _serve(args: argparse.Namespace) -> int:
    from universal_gateway.app import Gateway
    from universal_gateway.auth import ApiKeys, KeysError
    from universal_gateway.local import LocalSupervisor
    from universal_gateway.manifests import ManifestError, load_manifests
    from universal_gateway.metrics import GatewayMetrics

    paths = [Path(p) for p in args.paths] or [DEFAULT_LOCAL_EXAMPLES]
    try:
        # Folders may start empty (a pool's members, filled while it runs: they are watched); files may not.
        manifests = load_manifests(paths, allow_empty=all(p.is_dir() for p in paths))
        keys = ApiKeys.load(Path(args.api_keys_file) if args.api_keys_file else None)
        audit = _audit(args)
    except (ManifestError, OSError, KeysError) as exc:
        return _fail("serve", str(exc))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if (error := _start_tracing()) is not None:
        return _fail("serve", error)
    from universal_gateway.local import default_state_root

    state_root = Path(args.state_dir) if args.state_dir else default_state_root()
    try:
        responses = _responses_store(args, state_root)
    except ValueError as exc:
        return _fail("serve", str(exc))
    credentials_dir = Path(args.credentials_dir) if args.credentials_dir else None
    try:
        cached_prefixes = _cached_prefixes(args.cached_prefix or [])
    except ValueError as exc:
        return _fail("serve", str(exc))
    supervisor = LocalSupervisor(manifests, state_root=state_root, standby=args.standby,
                                 memory_budget_mb=args.memory_budget_mb, watch=paths,
                                 member_memory_limit_mb=args.member_memory_limit_mb,
                                 cache_dir=Path(args.cache_dir or state_root / "models"),
                                 shared_processes=args.member_processes == "shared",
                                 credentials_dir=credentials_dir, cached_prefixes=cached_prefixes)  # fmt: skip
    limits = _limits(args)
    metrics = GatewayMetrics()
    try:
        quotas, ledger = _tenant_stores(args, keys, metrics, _responses_spec(args, state_root))
    except ValueError as exc:
        return _fail("serve", str(exc))
    gateway = Gateway(supervisor, keys=keys, limits=limits, cors_origins=args.cors_origin, responses=responses,
                      audit=audit, quotas=quotas, ledger=ledger, metrics=metrics)  # fmt: skip
    names = ", ".join(m.model.served_name for m in manifests)
    print(f"serving {len(manifests)} models on http://{args.host}:{args.port}/v1 ({names})", flush=True)

    return _run_gateway(gateway, args, "serve")


def _gateway(args: argparse.Namespace) -> int:
    from universal_gateway.app import Gateway
    from universal_gateway.auth import ApiKeys, KeysError
    from universal_gateway.cluster import KubernetesBackends
    from universal_gateway.metrics import GatewayMetrics

    try:
        keys = ApiKeys.load(Path(args.api_keys_file) if args.api_keys_file else None)
        audit = _audit(args)
    except (OSError, KeysError) as exc:
        return _fail("gateway", str(exc))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if (error := _start_tracing()) is not None:
        return _fail("gateway", error)
    backends = KubernetesBackends(args.namespace)
    if args.api_key_secrets is not None:
        from universal_gateway.key_secrets import SELECTOR, KeySecrets

        try:
            backends.key_secrets = KeySecrets(keys, namespace=args.api_key_secrets_namespace,
                                              selector=args.api_key_secrets or SELECTOR)  # fmt: skip
        except ValueError as exc:
            return _fail("gateway", f"--api-key-secrets: {exc}")
    if args.upstream_token_file:
        try:
            backends.upstream_token = Path(args.upstream_token_file).read_text().strip() or None
        except OSError as exc:
            return _fail("gateway", str(exc))
    try:
        responses = _responses_store(args, None)
    except ValueError as exc:
        return _fail("gateway", str(exc))
    limits = _limits(args)
    metrics = GatewayMetrics()
    try:
        quotas, ledger = _tenant_stores(args, keys, metrics, _responses_spec(args, None))
    except ValueError as exc:
        return _fail("gateway", str(exc))
    gateway = Gateway(backends, keys=keys, limits=limits, cors_origins=args.cors_origin, responses=responses,
                      audit=audit, quotas=quotas, ledger=ledger, metrics=metrics)  # fmt: skip
    return _run_gateway(gateway, args, "gateway")


def _audit(args: argparse.Namespace) -> AuditLog | None:
    from universal_gateway.audit import AuditLog

    return AuditLog(args.audit_log, bodies=args.audit_bodies) if args.audit_log else None


def _keys_create(args: argparse.Namespace) -> int:
    """Add a key to a YAML keys file, stored hashed; its secret printed once (nowhere else has it)."""
    import secrets

    import yaml

    from universal_gateway.auth import ApiKeys, KeyEntry, KeysError, parse_keys

    path = Path(args.file)
    document: dict[str, object] = {"keys": []}
    if path.exists():
        text = path.read_text()
        loaded = yaml.safe_load(text) if text.strip() else None
        if loaded is not None and not (isinstance(loaded, dict) and "keys" in loaded):
            return _fail("keys create", f"{path} is not a YAML keys file (a mapping with `keys:`); name another file")
        document = loaded or document
    secret = "sk-ur-" + secrets.token_urlsafe(32)
    limits = {name: value for name, value in (
        ("requestsPerMinute", args.requests_per_minute), ("inputTokensPerMinute", args.input_tokens_per_minute),
        ("outputTokensPerMinute", args.output_tokens_per_minute), ("concurrentRequests", args.concurrent_requests),
    ) if value is not None}  # fmt: skip
    entry: dict[str, object] = {"id": args.id, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
    if args.owner:
        entry["owner"] = args.owner
    if args.models:
        entry["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if limits:
        entry["limits"] = limits
    if args.admin:
        entry["admin"] = True
    try:
        KeyEntry.model_validate(entry)
    except ValueError as exc:
        return _fail("keys create", f"--id {args.id!r}: {str(exc).splitlines()[-1].strip()}")
    keys = document.get("keys")
    assert isinstance(keys, list)
    keys.append(entry)
    text = yaml.safe_dump(document, sort_keys=False)
    try:
        ApiKeys(parse_keys(text, str(path))[0])  # every entry valid, ids and secrets unique
    except KeysError as exc:
        return _fail("keys create", str(exc))
    path.write_text(text)
    path.chmod(0o600)
    print(secret)
    print(f"added key {args.id!r} to {path} (stored as its SHA-256; the secret above is shown only now)",
          file=sys.stderr)  # fmt: skip
    return 0


_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s`` or plain seconds, as seconds; ValueError otherwise."""
    text = text.strip()
    unit = _DURATION.get(text[-1:], 0)
    number = text[:-1] if unit else text
    seconds = float(number) * (unit or 1)
    if not seconds > 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


def _responses_spec(args: argparse.Namespace, state_root: Path | None) -> str:
    return args.responses_store or os.environ.get(RESPONSES_STORE_ENV) or ("sqlite" if state_root else "off")


def _responses_store(args: argparse.Namespace, state_root: Path | None) -> ResponseStore | None:
    """The /v1/responses store the options name (``--responses-store``, ``--responses-retention``)."""
    from universal_gateway.responses_store import open_store

    spec = _responses_spec(args, state_root)
    try:
        retention = duration_s(args.responses_retention)
    except ValueError as exc:
        raise ValueError(f"--responses-retention: {exc} (give e.g. 30d, 12h or seconds)") from None
    store = open_store(spec, state_root, retention)
    if store is not None:
        logging.getLogger(__name__).info("stored responses: %s, kept %s", store.describe(), args.responses_retention)
    return store


def _tenant_stores(
    args: argparse.Namespace, keys: ApiKeys, metrics: GatewayMetrics, responses_spec: str
) -> tuple[Quotas | None, UsageLedger | None]:
    """Where the limits' counters and the usage ledger live (``--limits-store``, ``--usage-retention``): this
    process (None, None: the gateway's own), or a Redis every replica shares, by default the response store's."""
    from universal_gateway.redis_link import is_redis_url

    spec = (
        args.limits_store
        or os.environ.get(LIMITS_STORE_ENV)
        or (responses_spec if is_redis_url(responses_spec) else "memory")
    )
    try:
        retention = duration_s(args.usage_retention)
    except ValueError as exc:
        raise ValueError(f"--usage-retention: {exc} (give e.g. 400d, 12h or seconds)") from None
    if spec == "memory":
        return None, None
    if not is_redis_url(spec):
        raise ValueError(f"--limits-store {spec!r}: give memory or a redis:// URL")
    from universal_gateway.quotas import Quotas
    from universal_gateway.redis_counters import RedisCounters
    from universal_gateway.redis_ledger import RedisLedger

    counters = RedisCounters(spec, on_error=metrics.store_errors.labels("limits").inc)
    ledger = RedisLedger(spec, retention_s=retention, on_error=metrics.store_errors.labels("usage").inc,
                         on_dropped=metrics.usage_dropped.inc)  # fmt: skip
    logging.getLogger(__name__).info("limits and usage ledger: %s (usage kept %s)", counters.link.describe(),
                                     args.usage_retention)  # fmt: skip
    return Quotas(keys, counters), ledger


def _limits(args: argparse.Namespace) -> GatewayLimits:
    """The limits from the command line (whose defaults are GatewayLimits')."""
    return GatewayLimits(
        max_body_bytes=int(args.max_body_mb * MiB),
        max_concurrency_per_model=args.max_concurrency,
        max_queue_per_model=args.max_queue,
        max_held_per_model=args.max_held_requests,
        wake_keepalive_s=args.wake_keepalive,
        max_connections=args.max_connections,
        max_buffered_bytes=int(args.max_buffered_mb * MiB),
        head_timeout=args.head_timeout,
    )


def _start_tracing() -> str | None:
    """Tracing on when the OTEL_* environment asks (universal_gateway.tracing), before the Gateway binds its routes;
    what is wrong with that environment, if anything."""
    from universal_gateway import tracing

    try:
        tracing.configure("universal-gateway")
    except tracing.TracingConfigError as exc:
        return str(exc)
    return None


def _run_gateway(gateway: Gateway, args: argparse.Namespace, command: str) -> int:
    """Serve until SIGINT or SIGTERM; then requests in flight finish and every predictor stops."""

    async def run() -> int:
        try:
            await gateway.start(args.host, args.port)
        except OSError as exc:
            await gateway.close()
            return _fail(command, f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        freeze_startup_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await gateway.close()  # stops every predictor: no orphans
        return 0

    from universal_gateway import tracing

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(run())
    finally:
        tracing.shutdown()  # the spans still queued go out


def _add_gateway_options(parser: argparse.ArgumentParser, host: str) -> None:
    parser.add_argument("--host", default=host, help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="listen port (default %(default)d)")
    parser.add_argument(
        "--api-keys-file",
        help="require API keys: a YAML keys file (ids, owners, models, limits; `keys create` writes one) or one key "
             "per line, optionally 'KEY model-a,model-b'; re-read when it changes",
    )  # fmt: skip
    parser.add_argument(
        "--audit-log", help="write one JSON line per request (key id, model, route, status, tokens, latency, wake) "
                            "to this file, or - for standard output"
    )  # fmt: skip
    parser.add_argument("--audit-bodies", action="store_true",
                        help="with --audit-log, also each request's body (it holds what users wrote)")  # fmt: skip
    parser.add_argument("--cors-origin", action="append", default=[], help="allow this browser origin (repeatable)")
    parser.add_argument(
        "--max-body-mb", type=float, default=LIMITS.max_body_bytes / MiB,
        help="largest request body in MiB (default %(default)g)",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrency", type=int, default=LIMITS.max_concurrency_per_model,
        help="requests per model at once (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queue", type=int, default=LIMITS.max_queue_per_model,
        help="requests per model waiting; beyond: 429 (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--max-held-requests", type=int, default=LIMITS.max_held_per_model,
        help="requests per model held while it wakes, unless its scaling.maxHeldRequests says; beyond: 429 with "
             "Retry-After from the expected wake time (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--wake-keepalive", type=float, default=LIMITS.wake_keepalive_s,
        help="a held streaming request gets its head at once and an SSE comment this often (seconds) until the "
             "model answers; 0: none (default %(default)g)",
    )  # fmt: skip
    parser.add_argument(
        "--max-connections", type=int, default=LIMITS.max_connections,
        help="open client connections; beyond: 503 (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--max-buffered-mb", type=float, default=LIMITS.max_buffered_bytes / MiB,
        help="request body MiB held across all connections; beyond: 503 (default %(default)g)",
    )  # fmt: skip
    parser.add_argument(
        "--head-timeout", type=float, default=LIMITS.head_timeout,
        help="seconds from a request's first byte to the end of its headers (default %(default)g)",
    )  # fmt: skip
    parser.add_argument(
        "--responses-store",
        help="where /v1/responses keeps stored responses: sqlite (serve's default: a file in the state directory), "
             "sqlite:PATH, a redis:// URL (every gateway replica sharing it), or off (the cluster gateway's default; "
             f"the {RESPONSES_STORE_ENV} environment variable when unset, which keeps a password out of the command "
             "line)",
    )  # fmt: skip
    parser.add_argument(
        "--responses-retention", default="30d",
        help="how long a stored response is kept: 30d, 12h, 90m or seconds (default %(default)s, as OpenAI)",
    )  # fmt: skip
    parser.add_argument(
        "--limits-store",
        help="where the per-key limits' counters and the usage ledger live: memory (each gateway process its own) "
             "or a redis:// URL (every gateway replica sharing them; if it cannot be reached, each replica holds the "
             "limits in memory and buffers usage meanwhile). Default: the "
             f"{LIMITS_STORE_ENV} environment variable, else the --responses-store's Redis if it is one, else memory",
    )  # fmt: skip
    parser.add_argument(
        "--usage-retention", default="400d",
        help="how long the usage ledger's hours are kept in Redis: 400d, 12h or seconds (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _age(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    seconds = max(0, int(time.time() - timestamp))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def format_ps(models: list[dict[str, object]]) -> str:
    """The ``ps`` table: name, task, backend, state (with a starting model's step), requests held for its wake,
    last used, requests, p50 latency.

    Not the predictors' ports or pids: the API does not publish where a predictor listens."""
    header = ["NAME", "TASK", "BACKEND", "STATE", "HELD", "LAST USED", "REQUESTS", "P50"]
    rows = [header]
    for m in models:
        p50 = m.get("p50_ms")
        last_used = m.get("last_used")
        rows.append(
            [
                str(m["id"]),
                str(m.get("task", "")),
                str(m.get("backend", "")),
                str(m.get("state", "")) + (f" ({m['step']})" if m.get("step") else ""),
                str(m.get("held", 0)),
                _age(float(last_used) if isinstance(last_used, int | float) else None),
                str(m.get("requests", 0)),
                f"{float(p50):.0f}ms" if isinstance(p50, int | float) else "-",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _ps(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/v1/models"
    request = urllib.request.Request(url)
    if args.api_key:
        request.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            data = json.load(response)["data"]
    except (urllib.error.URLError, OSError) as exc:
        return _fail(
            "ps", f"no gateway answers at {args.url} ({getattr(exc, 'reason', exc)}); is `{PROG} serve` running?"
        )
    print(format_ps(data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Serve any Hugging Face-style model, locally or on Kubernetes."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve UniversalModel manifests on this machine behind one OpenAI API")
    serve.add_argument(
        "paths",
        nargs="*",
        help="manifest files or folders, watched while serving: models added, removed or edited there are "
        f"applied one by one (default: {DEFAULT_LOCAL_EXAMPLES})",
    )
    _add_gateway_options(serve, "127.0.0.1")
    serve.add_argument("--state-dir", help="where predictors keep state (default ~/.local/state/universal-runtime)")
    serve.add_argument(
        "--no-standby", dest="standby", action="store_false",
        help="keep no predictor process waiting with its libraries imported (saves about 0.5 GB while no model "
             "wakes; each wake then imports them again, seconds for a small model)",
    )  # fmt: skip
    serve.add_argument(
        "--memory-budget-mb", type=float,
        help="the memory the running predictors may hold together: starting a model that would go over it stops "
             "the least recently used idle ones first (default: no bound)",
    )  # fmt: skip
    serve.add_argument(
        "--member-memory-limit-mb", type=float,
        help="the memory each predictor may hold when its spec.resources.memory names none; over it, that "
             "predictor alone is killed and restarts on its next request (a cgroup where this process may make one, "
             "else an address-space limit of 4 times it; default: no limit)",
    )  # fmt: skip
    serve.add_argument(
        "--member-processes", choices=("own", "shared"), default="own",
        help="own: each model in a predictor process of its own (one crash ends one model); shared: the models of "
             "one library family (torch; PyOD, RapidOCR, Tesseract) in one process, each on its own port, saving "
             "about 400 MB a model, at the cost of a crash ending that family's models together (a pool's "
             "default; each restarts on its next request). Models with spec.env, on a GPU, or on llama.cpp or "
             "vLLM always get their own",
    )  # fmt: skip
    serve.add_argument(
        "--cache-dir",
        help="where models with s3://, gs:// or https:// sources are downloaded (by KServe's storage code, with the "
             "model's Secret under --credentials-dir, else the AWS_*, GOOGLE_APPLICATION_CREDENTIALS and "
             "<host>-headers of this environment) and kept for their next "
             "start (default: STATE_DIR/models)",
    )  # fmt: skip
    serve.add_argument(
        "--credentials-dir",
        help="copies of the Secrets the models name in source.credentialsSecret, one <secret>.json each (data and "
             "serving.kserve.io/* annotations, as the operator writes a pool's): each such model is downloaded with "
             "its own, as KServe's storage initializer would be, and fails alone, naming the Secret, when its copy is "
             "not there (default: the names are not read, the environment's credentials are used)",
    )  # fmt: skip
    serve.add_argument(
        "--cached-prefix",
        action="append",
        metavar="URI=DIR",
        help="DIR holds a copy of the files under URI (a pool's KServe LocalModelCache mounted in its pod): a model "
             "whose source is URI or below it loads from DIR (its path below URI) instead of being downloaded; one "
             "DIR lacks is downloaded as without it. Repeatable",
    )  # fmt: skip
    serve.set_defaults(handler=_serve)

    gateway = sub.add_parser("gateway", help="the OpenAI gateway in a cluster (routes to UniversalModels)")
    gateway.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable; default: all)"
    )
    _add_gateway_options(gateway, "0.0.0.0")
    gateway.add_argument(
        "--upstream-token-file", help="send this file's token to every predictor (they refuse requests without it)"
    )
    gateway.add_argument(
        "--api-key-secrets", nargs="?", const="", metavar="SELECTOR",
        help="also take API keys from the Secrets with this label (default "
             "serving.universal-runtime.dev/api-key=true), one key each, reloaded as they change; needs list and "
             "watch on secrets in that namespace",
    )  # fmt: skip
    gateway.add_argument(
        "--api-key-secrets-namespace",
        help="where those Secrets are (default: the gateway's own namespace, its ServiceAccount's)",
    )
    gateway.set_defaults(handler=_gateway)

    ps = sub.add_parser("ps", help="list the models a running gateway serves")
    ps.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the gateway (default %(default)s)")
    ps.add_argument("--api-key", help="an API key, if the gateway requires one")
    ps.set_defaults(handler=_ps)

    keys = sub.add_parser("keys", help="manage a gateway's API keys file")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = keys_sub.add_parser("create", help="add a key to a YAML keys file, hashed; print its secret once")
    create.add_argument("--file", required=True, help="the keys file (made if missing)")
    create.add_argument("--id", required=True, help="the key's id, shown in logs, metrics and usage")
    create.add_argument("--owner", help="who it belongs to (a team)")
    create.add_argument("--models", help="the models (and adapters) it may use, comma-separated (default: all)")
    create.add_argument("--requests-per-minute", type=int)
    create.add_argument("--input-tokens-per-minute", type=int)
    create.add_argument("--output-tokens-per-minute", type=int)
    create.add_argument("--concurrent-requests", type=int)
    create.add_argument("--admin", action="store_true", help="may read every key's usage")
    create.set_defaults(handler=_keys_create)

    operator_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
