"""The operator's configuration file: defaults, validation with one-line errors, and the CLI's use of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import load
from universal_operator.config import (
    CONFIG_ENV,
    DEFAULT_CPU_IMAGE,
    DEFAULT_CUDA_IMAGE,
    ConfigError,
    OperatorConfig,
    Profile,
    Toleration,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parents[2]

FULL_YAML = """
images:
  cpu: registry.example/cpu:1
  cuda: registry.example/cuda:1
  pullPolicy: Always
profiles:
  gpu-l4:
    gpuResource: nvidia.com/gpu
    nodeSelector: {cloud.google.com/gke-accelerator: nvidia-l4}
    tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule, tolerationSeconds: 300}
    runtimeClassName: nvidia
    image: registry.example/cuda-l4:1
    shmSize: 4Gi
  cpu-big: {}
defaultProfile: cpu-big
namespaces: [models, staging]
serviceAccountName: predictors
repairIntervalSeconds: 15
"""


def test_no_file_and_no_environment_gives_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    config = load_config()
    assert config == OperatorConfig()
    assert (config.images.cpu, config.images.cuda, config.images.pull_policy) == (
        DEFAULT_CPU_IMAGE,
        DEFAULT_CUDA_IMAGE,
        "IfNotPresent",
    )
    assert config.profiles == {}
    assert config.clusterwide
    assert config.profile(None) is None
    assert config.repair_interval_seconds == 60.0


@pytest.mark.parametrize("document", ["", "# only a comment\n", "{}"], ids=["empty", "comment", "empty mapping"])
def test_an_empty_file_gives_the_defaults(tmp_path: Path, document: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(document)
    assert load_config(path) == OperatorConfig()


def test_a_full_file_is_read_in_camel_case(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FULL_YAML)
    config = load_config(path)
    assert config.images.pull_policy == "Always"
    assert config.profiles["gpu-l4"] == Profile(
        gpu_resource="nvidia.com/gpu",
        node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
        tolerations=[Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule", toleration_seconds=300)],
        runtime_class_name="nvidia",
        image="registry.example/cuda-l4:1",
        shm_size="4Gi",
    )
    assert config.profile(None) == Profile()  # the default profile, cpu-big
    assert config.profile("gpu-l4").shm_size == "4Gi"
    assert (config.namespaces, config.clusterwide) == (["models", "staging"], False)
    assert (config.service_account_name, config.repair_interval_seconds) == ("predictors", 15.0)


def test_the_environment_variable_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("serviceAccountName: from-env\n")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert load_config().service_account_name == "from-env"


def test_an_explicit_path_beats_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "env.yaml").write_text("serviceAccountName: from-env\n")
    (tmp_path / "arg.yaml").write_text("serviceAccountName: from-arg\n")
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "env.yaml"))
    assert load_config(tmp_path / "arg.yaml").service_account_name == "from-arg"


def test_unknown_profile_name_raises_key_error() -> None:
    config = parse_config(load(FULL_YAML))
    with pytest.raises(KeyError):
        config.profile("tpu")


BAD_DOCUMENTS = {
    "misspelt profile key": ("profiles: {gpu: {nodeSelectr: {a: b}}}", "profiles.gpu.nodeSelectr"),
    "unknown top-level key": ("imagez: {cpu: x}", "imagez"),
    "bad pull policy": ("images: {pullPolicy: Sometimes}", "images.pullPolicy"),
    "bad toleration effect": ("profiles: {g: {tolerations: [{effect: Never}]}}", "profiles.g.tolerations.0.effect"),
    "non-positive repair interval": ("repairIntervalSeconds: 0", "repairIntervalSeconds"),
    "namespaces not a list": ("namespaces: models", "namespaces"),
    "default profile that does not exist": ("defaultProfile: gpu\nprofiles: {cpu: {}}", "defaultProfile 'gpu'"),
    "top level not a mapping": ("- a\n- b", "expected a mapping at the top level"),
    "a tracing variable that is not OTEL_*": ("tracing: {env: {HF_TOKEN: x}}", "'HF_TOKEN' is not an OTEL_* variable"),
}


@pytest.mark.parametrize(("document", "named"), BAD_DOCUMENTS.values(), ids=BAD_DOCUMENTS.keys())
def test_a_bad_document_raises_one_line_naming_the_key(document: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(load(document), origin="cfg.yaml")
    message = str(caught.value)
    assert named in message
    assert message.startswith("cfg.yaml: ")
    assert "\n" not in message


def test_default_profile_error_lists_the_profiles_there_are() -> None:
    with pytest.raises(ConfigError, match=r"\['a', 'cpu'\]"):
        parse_config({"defaultProfile": "gpu", "profiles": {"cpu": {}, "a": {}}})


def test_an_unreadable_path_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read the operator config") as caught:
        load_config(missing)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


def test_invalid_yaml_is_a_one_line_config_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("profiles:\n  gpu: {nodeSelector: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML") as caught:
        load_config(path)
    assert "\n" not in str(caught.value)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    return subprocess.run(
        [sys.executable, "-m", "universal_operator.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_operator_command_with_a_bad_config_exits_2_with_one_line_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("profiles:\n  gpu:\n    nodeSelectr: {a: b}\n")
    result = run_cli("operator", "--config", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("universal-runtime operator: error: ")
    assert "profiles.gpu.nodeSelectr" in lines[0]
    assert str(path) in lines[0]


def test_operator_command_with_a_missing_config_exits_2_naming_the_file(tmp_path: Path) -> None:
    result = run_cli("operator", "--config", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert "absent.yaml" in result.stderr


def test_crd_check_passes_on_the_committed_crd() -> None:
    result = run_cli("crd", "--check", "crds/universalmodels.yaml")
    assert (result.returncode, result.stderr) == (0, "")


def test_crd_check_fails_on_a_stale_file_and_says_how_to_regenerate(tmp_path: Path) -> None:
    stale = tmp_path / "stale.yaml"
    stale.write_text((REPO / "crds/universalmodels.yaml").read_text().replace("um\n", "xx\n"))
    result = run_cli("crd", "--check", str(stale))
    assert result.returncode == 2
    assert f"universal-runtime crd -o {stale}" in result.stderr
