"""Rendering the chart with Helm's own Go SDK (``helm-python-sdk``), offline, into plain objects."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from universal_gateway.cli import build_parser
from universal_operator.config import OperatorConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "universal-runtime"
RELEASE = "ur"
NAMESPACE = "universal-runtime-system"
#: The objects are named after the release and the chart: <release>-universal-runtime-<component>.
OPERATOR = f"{RELEASE}-universal-runtime-operator"
GATEWAY = f"{RELEASE}-universal-runtime-gateway"


@dataclass
class Rendered:
    """The objects one render produced, with lookups by kind and name."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found = [
            obj
            for obj in self.of_kind(kind)
            if obj["metadata"]["name"] == name and (namespace is None or obj["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def kinds(self) -> set[str]:
        return {obj["kind"] for obj in self.objects}

    def container(self, deployment: str) -> dict[str, Any]:
        [container] = self.one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        return dict(container)

    def pod_spec(self, deployment: str) -> dict[str, Any]:
        return dict(self.one("Deployment", deployment)["spec"]["template"]["spec"])

    def args(self, deployment: str) -> argparse.Namespace:
        """The container's command line, parsed by the real ``universal-runtime`` parser."""
        container = self.container(deployment)
        assert container["command"] == ["universal-runtime"]
        return build_parser().parse_args(container["args"])


def _documents(manifests: dict[str, str]) -> Iterator[dict[str, Any]]:
    for path, text in sorted(manifests.items()):
        if not path.endswith(".yaml"):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc:
                yield doc


def render(chart: helm.Chart, values: dict[str, Any] | None = None, *, upgrade: bool = False) -> Rendered:
    """``helm template`` of the chart (``upgrade``: as ``helm upgrade`` renders it, ``.Release.IsUpgrade``);
    its values schema is checked first, as on install."""
    manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE,
                             is_upgrade=upgrade or None, revision=2 if upgrade else None)  # fmt: skip
    return Rendered(list(_documents(manifests)))


def install_dry_run(values: dict[str, Any]) -> str:
    """``helm install --dry-run=client``: the whole install action without a cluster; the manifest text."""
    with helm.Config(kubeconfig_content="apiVersion: v1\nkind: Config\n", namespace=NAMESPACE) as config:
        release = config.install(str(CHART_DIR), RELEASE, values, namespace=NAMESPACE, dry_run="client")
    return str(release["manifest"])


def load_operator_config(rendered: Rendered, tmp_path: Path) -> OperatorConfig:
    """Load the rendered ConfigMap as the operator does: the file $UNIVERSAL_RUNTIME_OPERATOR_CONFIG names."""
    container = rendered.container(OPERATOR)
    [env] = [e for e in container["env"] if e["name"] == "UNIVERSAL_RUNTIME_OPERATOR_CONFIG"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert mount["readOnly"] is True
    assert Path(env["value"]).parent == Path(mount["mountPath"])
    [volume] = [v for v in rendered.pod_spec(OPERATOR)["volumes"] if v["name"] == "config"]
    config_map = rendered.one("ConfigMap", volume["configMap"]["name"])
    file = tmp_path / "config.yaml"
    file.write_text(config_map["data"][Path(env["value"]).name])
    return load_config(file)
