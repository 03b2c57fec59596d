"""KServe's own CRDs in the API emulator: vendored verbatim from the release, and enforced on writes as a real API
server enforces them (defaults, pruning of unknown fields, required fields), through the real kubectl."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from universal_simcluster.apiserver import serve_emulator
from universal_simcluster.apiserver.registration import KSERVE_CRDS

ISVC = """\
apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata: {name: NAME}
spec:
  predictor:
    minReplicas: 0
    minReplica: 2
    containers:
    - name: kserve-container
      image: example.com/predictor:1
      ports: [{containerPort: 8080}]
"""


def git_blob_id(data: bytes) -> str:
    """What ``git hash-object`` prints for a file's bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_every_vendored_crd_is_byte_for_byte_the_releases() -> None:
    table = (KSERVE_CRDS / "README.md").read_text()
    row = r"\| `(serving\.kserve\.io_\w+\.yaml)` \| `config/crd/full/[\w/.]+` \| `([0-9a-f]{40})` \|"
    rows = re.findall(row, table)
    assert {name for name, _ in rows} == {p.name for p in KSERVE_CRDS.glob("*.yaml")}
    for name, blob in rows:
        assert git_blob_id((KSERVE_CRDS / name).read_bytes()) == blob, name


async def test_a_field_kserves_schema_lacks_is_pruned_and_its_defaults_filled(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path) as served:
        applied = await served.kubectl("apply", "--validate=false", "-f", "-", input=ISVC.replace("NAME", "m"))
        assert applied.returncode == 0, applied.stderr
        stored = served.emulator.get_object("inferenceservices", "default", "m")
        assert stored is not None
        predictor = stored["spec"]["predictor"]
        assert "minReplica" not in predictor  # pruned, as KServe's structural schema makes the API server do
        assert served.emulator.pruned == [("InferenceService", "m", "spec.predictor.minReplica")]
        assert predictor["minReplicas"] == 0
        assert predictor["containers"][0]["ports"] == [{"containerPort": 8080, "protocol": "TCP"}]  # the CRD default


async def test_kserves_required_fields_and_types_are_refused_by_name(tmp_path: Path) -> None:
    async with serve_emulator(tmp_path) as served:
        no_predictor = yaml.safe_load(ISVC.replace("NAME", "p"))
        no_predictor["spec"] = {"transformer": {}}
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(no_predictor))
        assert refused.returncode != 0
        assert "spec.predictor: Required value" in refused.stderr
        wrong_type = ISVC.replace("NAME", "t").replace("minReplicas: 0", "minReplicas: none")
        refused = await served.kubectl("apply", "--validate=false", "-f", "-", input=wrong_type)
        assert "spec.predictor.minReplicas" in refused.stderr
        assert "must be of type integer" in refused.stderr
