"""The operator's subcommands of ``universal-runtime`` (``crd``, ``operator``).

The ``universal-runtime`` command itself lives in :mod:`universal_gateway.cli`, which adds ``serve``,
``ps`` and ``gateway``; ``python -m universal_operator.cli`` runs the operator's part alone. Heavy
imports happen only in the chosen subcommand, so ``universal-runtime crd`` never loads kopf.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "universal-runtime"


def _fail(subcommand: str, message: str) -> int:
    print(f"{PROG} {subcommand}: error: {message}", file=sys.stderr)
    return 2


def _crd(args: argparse.Namespace) -> int:
    from universal_operator.crd import render_crd_yaml, render_pool_crd_yaml

    text = render_pool_crd_yaml() if args.pool else render_crd_yaml()
    if args.check:
        path = Path(args.check)
        current = path.read_text() if path.exists() else ""
        if current != text:
            pool = " --pool" if args.pool else ""
            return _fail("crd", f"{path} is out of date; regenerate it with `{PROG} crd{pool} -o {path}`")
        return 0
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _operator(args: argparse.Namespace) -> int:
    if args.liveness == "":
        args.liveness = None
    from universal_operator.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _fail("operator", str(exc))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from universal_operator.runner import run

    run(config, namespaces=args.namespace, liveness_endpoint=args.liveness)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the operator's subcommands (``crd``, ``operator``) to a ``universal-runtime`` parser."""
    crd = sub.add_parser("crd", help="print the UniversalModel CustomResourceDefinition")
    crd.add_argument("-o", "--output", help="write to this file instead of standard output")
    crd.add_argument("--check", metavar="FILE", help="exit 2 if FILE differs from the generated CRD")
    crd.add_argument("--pool", action="store_true", help="the UniversalModelPool CRD instead of UniversalModel's")
    crd.set_defaults(handler=_crd)

    op = sub.add_parser("operator", help="run the operator (reconciles UniversalModels into InferenceServices)")
    op.add_argument(
        "--config",
        help="operator config YAML (default: $UNIVERSAL_RUNTIME_OPERATOR_CONFIG, else built-in defaults)",
    )
    op.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable; default: all)"
    )
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL ('' to disable)")
    op.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    op.set_defaults(handler=_operator)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Serve any Hugging Face-style model on Kubernetes.")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
