"""What the operator renders for GPU runtimes: probes that follow the predictor's health without killing a
slow load, engine-arg defaults per backend from a profile, and where vLLM's compile cache lives when a
model scales to zero. Each rendering is also put through the imitated KServe and Knative admission.
"""

from __future__ import annotations

import json

import pytest

from tests.factories import CONFIG_YAML, at, load, model, pick, render
from universal_operator.config import parse_config
from universal_operator.reconcile.checks import check_servable
from universal_operator.spec import SpecError
from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig
from universal_simcluster.admission import Cluster, Denied, admit

GPU_CHAT = """
metadata: {name: llama}
spec:
  task: generate
  source: {uri: hf://meta-llama/Llama-3.1-8B-Instruct}
  resources: {profile: gpu-l4, gpus: 1}
"""
#: The knative flags the factories' profiles need, as a cluster that admits them.
PROFILE_FLAGS = frozenset(load(CONFIG_YAML)["knative"]["features"])


def config_with(profile_extra: str, features: tuple[str, ...] = ()) -> object:
    data = load(CONFIG_YAML)
    data["profiles"]["gpu-l4"].update(load(profile_extra) or {})
    data["knative"]["features"] += list(features)
    return parse_config(data)


def with_spec(extra: str, base: str = GPU_CHAT) -> str:
    body = load(base)
    body["spec"].update(load(extra) or {})
    return json.dumps(body)


def predictor_args(isvc: dict) -> PredictorConfig:
    return PredictorConfig.from_args(at(isvc, "spec.predictor.containers[0]")["args"])


def test_the_predictor_gets_readiness_liveness_and_a_startup_probe_as_long_as_startup_timeout() -> None:
    isvc = render(with_spec("scaling: {startupTimeout: 30m}"))
    container = at(isvc, "spec.predictor.containers[0]")
    assert pick(container, {"readinessProbe": 0, "livenessProbe": 0, "startupProbe": 0}) == load(
        """
        readinessProbe:
          httpGet: {path: /v2/health/ready, port: 8080}
          periodSeconds: 5
          failureThreshold: 3
        livenessProbe:
          httpGet: {path: /v2/health/live, port: 8080}
          periodSeconds: 10
          timeoutSeconds: 5
          failureThreshold: 6
        startupProbe:
          httpGet: {path: /v2/health/live, port: 8080}
          periodSeconds: 10
          timeoutSeconds: 5
          failureThreshold: 180
        """
    )
    assert admit(isvc, None, Cluster(knative_features=PROFILE_FLAGS))


def test_knative_admission_checks_the_liveness_probe() -> None:
    isvc = render(GPU_CHAT)
    at(isvc, "spec.predictor.containers[0]")["livenessProbe"]["httpGet"]["port"] = "metrics"
    with pytest.raises(Denied) as denied:
        admit(isvc, None, Cluster(knative_features=PROFILE_FLAGS))
    assert "livenessProbe.httpGet.port" in str(denied.value)


def test_a_profiles_engine_args_become_per_backend_defaults_and_a_scale_to_zero_vllm_runs_eager() -> None:
    config = config_with("engineArgs: {vllm: {gpu_memory_utilization: 0.85}, transformers: {max_batch_size: 8}}")
    args = predictor_args(render(with_spec("engineArgs: {max_num_seqs: 64}"), config))
    assert args.backend is Backend.AUTO  # generation on a GPU: the predictor decides between vLLM and transformers
    assert args.engine_args == {"max_num_seqs": "64"}
    assert args.engine_arg_defaults == {
        Backend.VLLM: {"gpu_memory_utilization": "0.85", "enforce_eager": "true"},
        Backend.TRANSFORMERS: {"max_batch_size": "8"},
    }
    # What the predictor runs with once auto chose vLLM: the model's own args over the profile's.
    assert args.engine_args_for(Backend.VLLM) == {"gpu_memory_utilization": "0.85", "enforce_eager": "true",
                                                 "max_num_seqs": "64"}  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "profile", "eager"),
    [
        ("scaling: {minReplicas: 0}", "", "true"),
        ("scaling: {minReplicas: 1}", "", None),  # never scales to zero: compile once per replica
        ("{engineArgs: {enforce_eager: false}, scaling: {minReplicas: 0}}", "", "true"),  # the model's own wins
        ("scaling: {minReplicas: 0}", "engineArgs: {vllm: {enforce_eager: false}}", "false"),
        ("scaling: {minReplicas: 0}", "compileCacheClaim: vllm-compile", None),
    ],
)
def test_vllm_defaults_to_eager_only_where_a_wake_would_recompile(spec: str, profile: str, eager: str | None) -> None:
    features = ("kubernetes.podspec-persistent-volume-claim", "kubernetes.podspec-persistent-volume-write",
                "kubernetes.podspec-securitycontext")  # fmt: skip
    args = predictor_args(render(with_spec(spec), config_with(profile, features)))
    assert args.engine_arg_defaults.get(Backend.VLLM, {}).get("enforce_eager") == eager


def test_a_compile_cache_claim_holds_vllms_and_tritons_caches() -> None:
    flags = ("kubernetes.podspec-persistent-volume-claim", "kubernetes.podspec-persistent-volume-write",
             "kubernetes.podspec-securitycontext")  # fmt: skip
    isvc = render(GPU_CHAT, config_with("compileCacheClaim: vllm-compile", flags))
    predictor = at(isvc, "spec.predictor")
    assert predictor["securityContext"]["fsGroup"] == 1000  # the predictor's user may write the claim
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "vllm-compile"}} in predictor["volumes"]
    container = predictor["containers"][0]
    assert {"name": "compile-cache", "mountPath": "/var/cache/universal-runtime/compile"} in container["volumeMounts"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["VLLM_CACHE_ROOT"] == "/var/cache/universal-runtime/compile/vllm"
    assert env["TRITON_CACHE_DIR"] == "/var/cache/universal-runtime/compile/triton"
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/var/cache/universal-runtime/compile/flashinfer"
    assert admit(isvc, None, Cluster(knative_features=PROFILE_FLAGS | frozenset(flags)))


def test_a_compile_cache_claim_on_a_knative_without_volume_flags_is_refused_naming_them() -> None:
    with pytest.raises(SpecError) as refused:
        check_servable(model(GPU_CHAT), config_with("compileCacheClaim: vllm-compile"))
    assert refused.value.field == "spec.resources.profile"
    assert "kubernetes.podspec-persistent-volume-claim" in refused.value.message
    assert "kubernetes.podspec-persistent-volume-write" in refused.value.message
    assert "kubernetes.podspec-securitycontext" in refused.value.message


def test_a_compile_cache_claim_on_a_knative_without_the_security_context_flag_is_refused() -> None:
    # Without kubernetes.podspec-securitycontext the pod gets no fsGroup: the claim would not be writable.
    flags = ("kubernetes.podspec-persistent-volume-claim", "kubernetes.podspec-persistent-volume-write")
    with pytest.raises(SpecError) as refused:
        check_servable(model(GPU_CHAT), config_with("compileCacheClaim: vllm-compile", flags))
    assert "compileCacheClaim) needs kubernetes.podspec-securitycontext" in refused.value.message


def test_a_model_that_cannot_run_vllm_gets_no_compile_cache_and_only_its_own_backends_defaults() -> None:
    embed = """
    metadata: {name: minilm}
    spec:
      task: embed
      source: {uri: hf://sentence-transformers/all-MiniLM-L6-v2}
      resources: {profile: gpu-l4, gpus: 1}
    """
    config = config_with("{compileCacheClaim: vllm-compile, engineArgs: {transformers: {batch_size: 64}, "
                         "vllm: {enforce_eager: true}}}")  # fmt: skip
    isvc = render(embed, config)
    assert "compile-cache" not in [v["name"] for v in at(isvc, "spec.predictor.volumes")]
    assert predictor_args(isvc).engine_arg_defaults == {Backend.TRANSFORMERS: {"batch_size": "64"}}


@pytest.mark.parametrize(
    ("spec", "args", "vllm_default"),
    [
        # auto: a vLLM default, applied only if the predictor picks vLLM (transformers never sees it).
        ("resources: {profile: gpu-l4, gpus: 4}", {}, "4"),
        ("{backend: vllm, resources: {profile: gpu-l4, gpus: 4}}", {"tensor_parallel_size": "4"}, None),
        # The user's split wins, tensor or pipeline: 2 x 2 on 4 GPUs, not 4 x 2.
        ("{backend: vllm, resources: {profile: gpu-l4, gpus: 4}, engineArgs: {pipeline_parallel_size: 2, "
         "tensor_parallel_size: 2}}", {"pipeline_parallel_size": "2", "tensor_parallel_size": "2"}, None),
        ("{resources: {profile: gpu-l4, gpus: 4}, engineArgs: {pipeline_parallel_size: 4}}",
         {"pipeline_parallel_size": "4"}, None),
        ("resources: {profile: gpu-l4, gpus: 1}", {}, None),
    ],
)  # fmt: skip
def test_several_gpus_are_spread_by_tensor_parallelism_whichever_way_vllm_is_chosen(
    spec: str, args: dict[str, str], vllm_default: str | None
) -> None:
    rendered = predictor_args(render(with_spec(spec)))
    assert rendered.engine_args == args
    assert rendered.engine_arg_defaults.get(Backend.VLLM, {}).get("tensor_parallel_size") == vllm_default
    assert "tensor_parallel_size" not in rendered.engine_arg_defaults.get(Backend.TRANSFORMERS, {})
