"""desired_inference_service: a UniversalModel manifest in, the InferenceService the operator applies out.

Each table row is a manifest (YAML) and the fragment of the child it must produce (YAML); a key written
``null`` in an expected fragment must be absent from the child.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.factories import CONFIG, at, is_label_value, load, model, pick, render
from universal_operator.config import parse_config
from universal_operator.reconcile.checks import check_servable
from universal_operator.reconcile.render import desired_inference_service
from universal_operator.reconcile.service_account import desired_service_account
from universal_operator.spec import SpecError, parse_model
from universal_predictors.config import GPUS_ENV, PredictorConfig

EMBED = """
metadata: {name: minilm}
spec:
  task: embed
  source: {uri: hf://sentence-transformers/all-MiniLM-L6-v2}
"""


def with_spec(extra: str, base: str = EMBED) -> str:
    """``base`` with ``extra`` (YAML for spec keys) merged into its spec."""
    body = load(base)
    body["spec"].update(load(extra) or {})
    return json.dumps(body)


# --------------------------------------------------------------------------------------------------
# Scaling: Knative and Standard

SCALING_CASES = {
    "knative defaults: 60s stable window + 240s retention = the default 5m idleTimeout, deadline from startupTimeout": (
        EMBED,
        """
        minReplicas: 0
        maxReplicas: 1
        scaleMetric: null
        scaleTarget: null
        annotations:
          autoscaling.knative.dev/window: 60s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 240s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "knative with targetConcurrency: concurrency metric and target": (
        with_spec(
            """
            scaling: {maxReplicas: 4, idleTimeout: 15m, startupTimeout: 30m, targetConcurrency: 32}
            """
        ),
        """
        minReplicas: 0
        maxReplicas: 4
        scaleMetric: concurrency
        scaleTarget: 32
        annotations:
          autoscaling.knative.dev/window: 60s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 840s
          serving.knative.dev/progress-deadline: 30m
        """,
    ),
    "knative idleTimeout of 1h: 60s window + 3540s retention (within Knative's 1h bound)": (
        with_spec("scaling: {idleTimeout: 1h}"),
        """
        annotations:
          autoscaling.knative.dev/window: 60s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 3540s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "knative idleTimeout of 90s: 60s window + 30s retention (the default grace period)": (
        with_spec("scaling: {idleTimeout: 90s}"),
        """
        annotations:
          autoscaling.knative.dev/window: 60s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 30s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "knative idleTimeout of 60s shrinks the window to leave the 30s grace period room": (
        with_spec("scaling: {idleTimeout: 60s, minReplicas: 1, maxReplicas: 3}"),
        """
        minReplicas: 1
        maxReplicas: 3
        annotations:
          autoscaling.knative.dev/window: 30s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 30s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "knative idleTimeout with a fraction keeps a whole-second window and the fraction in the retention": (
        with_spec("scaling: {idleTimeout: 90.5s}"),
        """
        annotations:
          autoscaling.knative.dev/window: 60s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 30.5s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "knative idleTimeout below 6s window + 30s grace gets Knative's shortest window": (
        with_spec("scaling: {idleTimeout: 20s}"),
        """
        annotations:
          autoscaling.knative.dev/window: 6s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 14s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "knative idleTimeout below the 6s minimum window: 6s window, no retention": (
        with_spec("scaling: {idleTimeout: 2s}"),
        """
        annotations:
          autoscaling.knative.dev/window: 6s
          autoscaling.knative.dev/scale-to-zero-pod-retention-period: 0s
          serving.knative.dev/progress-deadline: 20m
        """,
    ),
    "standard mode raises minReplicas 0 to 1 and carries no Knative annotations or concurrency metric": (
        with_spec("scaling: {mode: Standard, idleTimeout: 20s, targetConcurrency: 8, maxReplicas: 2}"),
        """
        minReplicas: 1
        maxReplicas: 2
        scaleMetric: null
        scaleTarget: null
        annotations: null
        """,
    ),
    "standard mode keeps a minReplicas above 1": (
        with_spec("scaling: {mode: Standard, minReplicas: 2, maxReplicas: 5}"),
        """
        minReplicas: 2
        maxReplicas: 5
        scaleMetric: null
        scaleTarget: null
        annotations: null
        """,
    ),
}


@pytest.mark.parametrize(("manifest_yaml", "expected_yaml"), SCALING_CASES.values(), ids=SCALING_CASES.keys())
def test_scaling_renders_to_predictor_fields_and_annotations(manifest_yaml: str, expected_yaml: str) -> None:
    expected = load(expected_yaml)
    assert pick(at(render(manifest_yaml), "spec.predictor"), expected) == expected


@pytest.mark.parametrize(("mode", "expected"), [("Knative", "Knative"), ("Standard", "Standard")])
def test_deployment_mode_annotation_names_the_scaling_mode(mode: str, expected: str) -> None:
    child = render(with_spec(f"scaling: {{mode: {mode}}}"))
    assert at(child, "metadata.annotations")["serving.kserve.io/deploymentMode"] == expected


# --------------------------------------------------------------------------------------------------
# Hardware: GPU profiles, images, resources

LLAMA_GPU = """
metadata: {name: llama-8b}
spec:
  task: generate
  backend: vllm
  source: {uri: s3://models/meta-llama/Llama-3.1-8B-Instruct}
  resources: {profile: gpu-l4, gpus: 1, cpu: "4", memory: 24Gi}
"""

HARDWARE_CASES = {
    "named GPU profile: nvidia.com/gpu, node selector, tolerations, runtime class, CUDA image, sized /dev/shm": (
        LLAMA_GPU,
        """
        nodeSelector:
          cloud.google.com/gke-accelerator: nvidia-l4
        tolerations:
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
        runtimeClassName: nvidia
        volumes:
        - {name: cache, emptyDir: {}}
        - {name: tmp, emptyDir: {}}
        - {name: dshm, emptyDir: {medium: Memory, sizeLimit: 2Gi}}
        containers:
        - image: registry.example/predictor-cuda:1
          resources:
            requests: {cpu: "4", memory: 24Gi, nvidia.com/gpu: "1"}
            limits: {cpu: "4", memory: 24Gi, nvidia.com/gpu: "1"}
          volumeMounts:
          - {name: cache, mountPath: /cache}
          - {name: tmp, mountPath: /tmp}
          - {name: dshm, mountPath: /dev/shm}
        """,
    ),
    "profile with its own gpuResource and image: that resource name and that image": (
        with_spec("resources: {profile: amd, gpus: 2, memory: 64Gi}", LLAMA_GPU),
        """
        nodeSelector: {accelerator: mi300}
        tolerations: null
        runtimeClassName: null
        volumes:
        - {name: cache, emptyDir: {}}
        - {name: tmp, emptyDir: {}}
        - {name: dshm, emptyDir: {medium: Memory}}
        containers:
        - image: registry.example/predictor-rocm:1
          resources:
            requests: {memory: 64Gi, amd.com/gpu: "2"}
            limits: {memory: 64Gi, amd.com/gpu: "2"}
          volumeMounts:
          - {name: cache, mountPath: /cache}
          - {name: tmp, mountPath: /tmp}
          - {name: dshm, mountPath: /dev/shm}
        """,
    ),
    "GPUs without a profile: nvidia.com/gpu and the CUDA image, no scheduling constraints": (
        with_spec("resources: {gpus: 1}", LLAMA_GPU),
        """
        nodeSelector: null
        tolerations: null
        runtimeClassName: null
        volumes:
        - {name: cache, emptyDir: {}}
        - {name: tmp, emptyDir: {}}
        - {name: dshm, emptyDir: {medium: Memory}}
        containers:
        - image: registry.example/predictor-cuda:1
          resources:
            requests: {nvidia.com/gpu: "1"}
            limits: {nvidia.com/gpu: "1"}
          volumeMounts:
          - {name: cache, mountPath: /cache}
          - {name: tmp, mountPath: /tmp}
          - {name: dshm, mountPath: /dev/shm}
        """,
    ),
    "CPU model: the CPU image by default, no /dev/shm, cpu and memory requested and limited alike": (
        with_spec("resources: {cpu: 500m, memory: 1Gi}"),
        """
        nodeSelector: null
        tolerations: null
        runtimeClassName: null
        volumes:
        - {name: cache, emptyDir: {}}
        - {name: tmp, emptyDir: {}}
        containers:
        - image: registry.example/predictor-cpu:1
          resources:
            requests: {cpu: 500m, memory: 1Gi}
            limits: {cpu: 500m, memory: 1Gi}
          volumeMounts:
          - {name: cache, mountPath: /cache}
          - {name: tmp, mountPath: /tmp}
        """,
    ),
    "spec.image beats the profile's image": (
        with_spec("image: registry.example/my-predictor:2\nresources: {profile: amd, gpus: 1}", LLAMA_GPU),
        """
        nodeSelector: {accelerator: mi300}
        tolerations: null
        runtimeClassName: null
        volumes:
        - {name: cache, emptyDir: {}}
        - {name: tmp, emptyDir: {}}
        - {name: dshm, emptyDir: {medium: Memory}}
        containers:
        - image: registry.example/my-predictor:2
          resources:
            requests: {amd.com/gpu: "1"}
            limits: {amd.com/gpu: "1"}
          volumeMounts:
          - {name: cache, mountPath: /cache}
          - {name: tmp, mountPath: /tmp}
          - {name: dshm, mountPath: /dev/shm}
        """,
    ),
}


@pytest.mark.parametrize(("manifest_yaml", "expected_yaml"), HARDWARE_CASES.values(), ids=HARDWARE_CASES.keys())
def test_hardware_renders_to_scheduling_image_resources_and_volumes(manifest_yaml: str, expected_yaml: str) -> None:
    expected = load(expected_yaml)
    predictor = at(render(manifest_yaml), "spec.predictor")
    got = pick(predictor, expected)
    got["containers"] = [pick(c, expected["containers"][0]) for c in predictor["containers"]]
    assert got == expected


def test_a_gpu_pod_is_told_how_many_gpus_it_got_so_an_engine_that_cannot_use_them_stops_at_start_up() -> None:
    env = at(render(with_spec("resources: {profile: amd, gpus: 2}", LLAMA_GPU)), "spec.predictor.containers[0].env")
    assert {"name": GPUS_ENV, "value": "2"} in env
    cpu_env = at(render(EMBED), "spec.predictor.containers[0].env")
    assert GPUS_ENV not in {item["name"] for item in cpu_env}


def test_no_resources_means_no_resources_block() -> None:
    assert "resources" not in at(render(EMBED), "spec.predictor.containers[0]")


def test_default_profile_applies_when_the_spec_names_none() -> None:
    config = parse_config(
        load(
            """
            knative: {features: [kubernetes.podspec-nodeselector]}
            defaultProfile: cpu-pool
            profiles:
              cpu-pool:
                nodeSelector: {pool: inference}
                image: registry.example/predictor-avx512:1
            """
        )
    )
    child = desired_inference_service(model(EMBED), config)
    assert pick(at(child, "spec.predictor"), {"nodeSelector": None}) == {"nodeSelector": {"pool": "inference"}}
    assert at(child, "spec.predictor.containers[0].image") == "registry.example/predictor-avx512:1"


def test_service_account_and_pull_policy_come_from_the_operator_config() -> None:
    config = parse_config(load("serviceAccountName: predictors\nimages: {pullPolicy: Always}"))
    child = desired_inference_service(model(EMBED), config)
    assert at(child, "spec.predictor.serviceAccountName") == "predictors"
    assert at(child, "spec.predictor.containers[0].imagePullPolicy") == "Always"


# --------------------------------------------------------------------------------------------------
# Sources, environment, credentials

SOURCE_CASES = {
    "remote source: STORAGE_URI for KServe's storage initializer, predictor reads /mnt/models offline": (
        EMBED,
        """
        env:
        - {name: STORAGE_URI, value: "hf://sentence-transformers/all-MiniLM-L6-v2"}
        - {name: HOME, value: /cache}
        - {name: XDG_CACHE_HOME, value: /cache}
        - {name: HF_HOME, value: /cache/huggingface}
        - {name: HF_HUB_OFFLINE, value: "1"}
        source: /mnt/models
        """,
    ),
    "remote GGUF with source.file: the whole repo is fetched (no KServe passes patterns), the predictor picks": (
        with_spec("source: {uri: 'hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF', file: '*q4_k_m.gguf'}\ntask: generate"),
        """
        env:
        - {name: STORAGE_URI, value: "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF"}
        - {name: HOME, value: /cache}
        - {name: XDG_CACHE_HOME, value: /cache}
        - {name: HF_HOME, value: /cache/huggingface}
        - {name: HF_HUB_OFFLINE, value: "1"}
        source: /mnt/models
        """,
    ),
    # KServe v0.16.0 storage_initializer_injector.go: an oci:// STORAGE_URI becomes a modelcar sidecar (with
    # enableModelcar) whose /models the predictor sees at /mnt/models, the same path as a fetched source.
    "oci:// model image (a KServe modelcar, the Dockerfile's model target): STORAGE_URI, read at /mnt/models": (
        with_spec("source: {uri: 'oci://registry.example.com/model-all-minilm-l6-v2:0.1.0'}"),
        """
        env:
        - {name: STORAGE_URI, value: "oci://registry.example.com/model-all-minilm-l6-v2:0.1.0"}
        - {name: HOME, value: /cache}
        - {name: XDG_CACHE_HOME, value: /cache}
        - {name: HF_HOME, value: /cache/huggingface}
        - {name: HF_HUB_OFFLINE, value: "1"}
        source: /mnt/models
        """,
    ),
    "absolute path baked into the image: no STORAGE_URI, the path itself": (
        with_spec("source: {uri: /opt/models/minilm}"),
        """
        env:
        - {name: HOME, value: /cache}
        - {name: XDG_CACHE_HOME, value: /cache}
        - {name: HF_HOME, value: /cache/huggingface}
        - {name: HF_HUB_OFFLINE, value: "0"}
        source: /opt/models/minilm
        """,
    ),
    "user env naming a default variable replaces it (once), other user env appended": (
        with_spec(
            """
            env:
            - {name: HF_HUB_OFFLINE, value: "0"}
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            """
        ),
        """
        env:
        - {name: STORAGE_URI, value: "hf://sentence-transformers/all-MiniLM-L6-v2"}
        - {name: HOME, value: /cache}
        - {name: XDG_CACHE_HOME, value: /cache}
        - {name: HF_HOME, value: /cache/huggingface}
        - {name: HF_HUB_OFFLINE, value: "0"}
        - name: POD_IP
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        source: /mnt/models
        """,
    ),
}


@pytest.mark.parametrize(("manifest_yaml", "expected_yaml"), SOURCE_CASES.values(), ids=SOURCE_CASES.keys())
def test_source_renders_to_env_and_source_argument(manifest_yaml: str, expected_yaml: str) -> None:
    expected = load(expected_yaml)
    container = at(render(manifest_yaml), "spec.predictor.containers[0]")
    assert container["env"] == expected["env"]
    assert PredictorConfig.from_args(container["args"]).source == expected["source"]
    assert f"--source={expected['source']}" in container["args"]


def test_credentials_reach_the_storage_initializer_through_the_models_own_service_account() -> None:
    manifest = with_spec("source: {uri: 's3://models/llama', credentialsSecret: model-store}")
    predictor = at(render(manifest), "spec.predictor")
    # KServe's pod webhook gives the storage-initializer the secrets of the pod's ServiceAccount.
    assert predictor["serviceAccountName"] == "minilm-storage"
    assert desired_service_account(model(manifest, uid="model-uid")) == load(
        """
        apiVersion: v1
        kind: ServiceAccount
        metadata:
          name: minilm-storage
          namespace: models
          labels:
            app.kubernetes.io/managed-by: universal-runtime
            app.kubernetes.io/part-of: universal-runtime
            app.kubernetes.io/name: minilm
            serving.universal-runtime.dev/model: minilm
          ownerReferences:
          - apiVersion: serving.universal-runtime.dev/v1alpha1
            kind: UniversalModel
            name: minilm
            uid: model-uid
            controller: true
            blockOwnerDeletion: true
        secrets:
        - {name: model-store}
        automountServiceAccountToken: false
        """
    )


@pytest.mark.parametrize("uri", ["hf://org/private", "s3://models/llama", "gs://bucket/model", "https://x.test/m"])
def test_the_predictor_container_gets_no_credentials_it_reads_the_fetched_files_offline(uri: str) -> None:
    child = render(with_spec(f"source: {{uri: '{uri}', credentialsSecret: hub-token}}"))
    env = at(child, "spec.predictor.containers[0].env")
    assert [item["name"] for item in env] == ["STORAGE_URI", "HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE"]
    # GOOGLE_APPLICATION_CREDENTIALS is a file path KServe mounts for the initializer, never key contents here.
    assert "hub-token" not in json.dumps(child)


def test_without_credentials_there_is_no_service_account_and_the_configured_one_applies() -> None:
    config = parse_config(load("serviceAccountName: predictors"))
    assert desired_service_account(model(EMBED)) is None
    assert at(desired_inference_service(model(EMBED), config), "spec.predictor.serviceAccountName") == "predictors"
    assert "serviceAccountName" not in at(render(EMBED), "spec.predictor")
    # With credentials the model's own account replaces the configured one (for this model only).
    with_credentials = model(with_spec("source: {uri: 'hf://org/private', credentialsSecret: hub-token}"))
    assert at(desired_inference_service(with_credentials, config), "spec.predictor.serviceAccountName") == (
        "minilm-storage"
    )


def test_user_env_can_still_hand_the_predictor_a_secret() -> None:
    env = at(
        render(
            with_spec(
                """
                source: {uri: 'hf://org/private', credentialsSecret: hub-token}
                env:
                - name: HF_TOKEN
                  valueFrom: {secretKeyRef: {name: other, key: token}}
                """
            )
        ),
        "spec.predictor.containers[0].env",
    )
    hf_tokens = [item for item in env if item["name"] == "HF_TOKEN"]
    assert hf_tokens == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "other", "key": "token"}}}]


def test_the_operators_tracing_env_reaches_every_predictor_beneath_the_models_own_env() -> None:
    config = parse_config(load("""
        tracing:
          env: {OTEL_TRACES_EXPORTER: otlp, OTEL_EXPORTER_OTLP_ENDPOINT: "http://collector.obs:4318"}
        """))  # fmt: skip
    env = at(render(EMBED, config), "spec.predictor.containers[0].env")
    assert {"name": "OTEL_TRACES_EXPORTER", "value": "otlp"} in env
    assert {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://collector.obs:4318"} in env
    own = render(with_spec("env: [{name: OTEL_TRACES_EXPORTER, value: none}]"), config)
    exporters = [i for i in at(own, "spec.predictor.containers[0].env") if i["name"] == "OTEL_TRACES_EXPORTER"]
    assert exporters == [{"name": "OTEL_TRACES_EXPORTER", "value": "none"}]  # a model may opt out
    assert "OTEL_" not in json.dumps(at(render(EMBED), "spec.predictor.containers[0].env"))  # off by default


@pytest.mark.parametrize("version", ["0.14.1", "0.15.2", "0.16.0", "0.20.0"])
def test_no_kserve_release_gets_download_patterns_the_predictor_picks_the_gguf_file(version: str) -> None:
    # KServe's initializer reads STORAGE_ALLOW_PATTERNS from v0.17.0 (python/storage/kserve_storage), but up to
    # v0.20.0 the pod webhook builds its env from credentials only: env on kserve-container never reaches it.
    config = parse_config({"kserve": {"version": version}})
    gguf = with_spec("source: {uri: 'hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF', file: '*q4_k_m.gguf'}\ntask: generate")
    container = at(desired_inference_service(model(gguf), config), "spec.predictor.containers[0]")
    assert "STORAGE_ALLOW_PATTERNS" not in [item["name"] for item in container["env"]]
    assert "--source-file=*q4_k_m.gguf" in container["args"]


def test_a_projector_pattern_reaches_the_predictor_and_makes_auto_llamacpp() -> None:
    config = parse_config({})
    vlm = with_spec("source: {uri: 'hf://ggml-org/SmolVLM-256M-Instruct-GGUF', projectorFile: 'mmproj-*.gguf'}\n"
                    "task: generate")  # fmt: skip
    container = at(desired_inference_service(model(vlm), config), "spec.predictor.containers[0]")
    assert "--source-projector-file=mmproj-*.gguf" in container["args"]
    assert "--backend=llamacpp" in container["args"]


def test_source_revision_of_a_hub_model_reaches_the_storage_initializer() -> None:
    child = render(with_spec("source: {uri: 'hf://Qwen/Qwen2.5-0.5B-Instruct', revision: 7ae557604adf67be}"))
    env = at(child, "spec.predictor.containers[0].env")
    assert env[0] == {"name": "STORAGE_URI", "value": "hf://Qwen/Qwen2.5-0.5B-Instruct:7ae557604adf67be"}


# --------------------------------------------------------------------------------------------------
# Security, labels, ownership


RESTRICTED_CONTAINER = """
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
"""


def test_knative_mode_carries_the_restricted_profile_on_the_container_only() -> None:
    # A default Knative refuses every pod-level securityContext field (PodSecurityContextMask).
    predictor = at(render(EMBED), "spec.predictor")
    assert "securityContext" not in predictor
    assert predictor["containers"][0]["securityContext"] == load(RESTRICTED_CONTAINER)


def test_standard_mode_and_knative_with_podspec_securitycontext_add_the_pod_level_context() -> None:
    pod_level = load(
        """
        runAsNonRoot: true
        runAsUser: 1000
        runAsGroup: 1000
        fsGroup: 1000
        seccompProfile: {type: RuntimeDefault}
        """
    )
    standard = at(render(with_spec("scaling: {mode: Standard}")), "spec.predictor")
    assert standard["securityContext"] == pod_level
    assert standard["containers"][0]["securityContext"] == load(RESTRICTED_CONTAINER)
    enabled = parse_config(load("knative: {features: [kubernetes.podspec-securitycontext]}"))
    knative = at(desired_inference_service(model(EMBED), enabled), "spec.predictor")
    assert knative["securityContext"] == pod_level


def test_pod_security_ids_come_from_the_operator_config_and_are_left_out_when_empty() -> None:
    openshift = parse_config(load("podSecurity: {runAsUser: null, runAsGroup: null, fsGroup: null}"))
    standard = model(with_spec("scaling: {mode: Standard}"))
    predictor = at(desired_inference_service(standard, openshift), "spec.predictor")
    assert predictor["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "runAsUser" not in predictor["containers"][0]["securityContext"]
    assert "runAsGroup" not in predictor["containers"][0]["securityContext"]
    custom = parse_config(load("podSecurity: {runAsUser: 2000, runAsGroup: 3000, fsGroup: 4000}"))
    predictor = at(desired_inference_service(standard, custom), "spec.predictor")
    assert pick(predictor["securityContext"], {"runAsUser": 0, "runAsGroup": 0, "fsGroup": 0}) == {
        "runAsUser": 2000,
        "runAsGroup": 3000,
        "fsGroup": 4000,
    }
    assert pick(predictor["containers"][0]["securityContext"], {"runAsUser": 0, "runAsGroup": 0}) == {
        "runAsUser": 2000,
        "runAsGroup": 3000,
    }


def test_container_runs_the_predictor_module_on_port_8080_with_a_v2_readiness_probe() -> None:
    container = at(render(EMBED), "spec.predictor.containers[0]")
    assert pick(container, {"name": 0, "command": 0, "ports": 0, "readinessProbe": 0}) == load(
        """
        name: kserve-container
        command: [python, -m, universal_predictors]
        ports: [{name: http1, containerPort: 8080, protocol: TCP}]
        readinessProbe:
          httpGet: {path: /v2/health/ready, port: 8080}
          periodSeconds: 5
          failureThreshold: 3
        """
    )


def test_labels_name_the_manager_model_task_and_served_name_on_child_and_pods() -> None:
    child = render(with_spec("servedName: all-minilm-l6-v2"))
    expected = load(
        """
        app.kubernetes.io/managed-by: universal-runtime
        app.kubernetes.io/part-of: universal-runtime
        app.kubernetes.io/name: minilm
        app.kubernetes.io/component: predictor
        serving.universal-runtime.dev/model: minilm
        serving.universal-runtime.dev/task: embed
        serving.universal-runtime.dev/served-name: all-minilm-l6-v2
        """
    )
    assert at(child, "metadata.labels") == {**expected, "networking.knative.dev/visibility": "cluster-local"}
    assert at(child, "spec.predictor.labels") == expected
    assert at(child, "metadata.annotations") == load(
        """
        serving.kserve.io/deploymentMode: Knative
        serving.universal-runtime.dev/served-name: all-minilm-l6-v2
        """
    )


@pytest.mark.parametrize(
    ("mode", "label"),
    [("Knative", "networking.knative.dev/visibility"), ("Standard", "networking.kserve.io/visibility")],
)
def test_models_are_cluster_local_so_the_gateway_is_the_only_way_in_unless_the_operator_exposes_them(
    mode: str, label: str
) -> None:
    # KServe publishes an external host for every InferenceService unless its mode's visibility label says
    # cluster-local; that host would bypass the gateway's API keys.
    manifest = with_spec(f"scaling: {{mode: {mode}}}")
    assert {k: v for k, v in at(render(manifest), "metadata.labels").items() if "visibility" in k} == {
        label: "cluster-local"
    }
    exposed = render(manifest, CONFIG.model_copy(update={"expose_models": True}))
    assert not [k for k in at(exposed, "metadata.labels") if "visibility" in k]


def test_served_name_defaults_to_the_model_name() -> None:
    child = render(EMBED)
    assert at(child, "metadata.labels")["serving.universal-runtime.dev/served-name"] == "minilm"
    assert at(child, "metadata.annotations")["serving.universal-runtime.dev/served-name"] == "minilm"


@pytest.mark.parametrize(
    ("served_name", "label_pattern"),
    [
        ("Qwen/Qwen2.5-0.5B", r"Qwen-Qwen2\.5-0\.5B-[0-9a-f]{8}"),
        ("org/model:v1@sha", r"org-model-v1-sha-[0-9a-f]{8}"),
        ("a" * 80, r"a{54}-[0-9a-f]{8}"),
        ("model+", r"model-[0-9a-f]{8}"),
    ],
)
def test_served_name_that_is_no_label_value_gets_a_sanitized_label_but_the_exact_annotation(
    served_name: str, label_pattern: str
) -> None:
    child = render(with_spec(f"servedName: '{served_name}'"))
    label = at(child, "metadata.labels")["serving.universal-runtime.dev/served-name"]
    assert re.fullmatch(label_pattern, label)
    assert is_label_value(label)
    assert at(child, "spec.predictor.labels")["serving.universal-runtime.dev/served-name"] == label
    assert at(child, "metadata.annotations")["serving.universal-runtime.dev/served-name"] == served_name


def test_served_names_that_sanitize_alike_still_get_different_labels() -> None:
    first = render(with_spec("servedName: 'Qwen/Qwen2.5-0.5B'"))
    second = render(with_spec("servedName: 'Qwen:Qwen2.5-0.5B'"))
    key = "serving.universal-runtime.dev/served-name"
    assert at(first, "metadata.labels")[key] != at(second, "metadata.labels")[key]


def test_child_is_owned_by_the_model_as_its_controller() -> None:
    child = desired_inference_service(model(EMBED, uid="0b1c-uid"), CONFIG)
    assert pick(child["metadata"], {"name": 0, "namespace": 0, "ownerReferences": 0}) == load(
        """
        name: minilm
        namespace: models
        ownerReferences:
        - apiVersion: serving.universal-runtime.dev/v1alpha1
          kind: UniversalModel
          name: minilm
          uid: 0b1c-uid
          controller: true
          blockOwnerDeletion: true
        """
    )
    assert pick(child, {"apiVersion": 0, "kind": 0}) == {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
    }


# --------------------------------------------------------------------------------------------------
# Predictor arguments

QWEN_GGUF = """
metadata: {name: qwen-chat}
spec:
  task: generate
  source: {uri: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF, file: "*q4_k_m.gguf"}
  servedName: qwen2.5-0.5b-instruct
  engineArgs:
    n_ctx: 8192
    flash_attn: true
    use_mmap: false
    temperature: 0.7
    chat_format: chatml
"""


def test_predictor_args_render_engine_args_as_sorted_key_value_with_lower_case_booleans() -> None:
    args = at(render(QWEN_GGUF), "spec.predictor.containers[0].args")
    assert args == load(
        """
        - --model_name=qwen2.5-0.5b-instruct
        - --task=generate
        - --backend=llamacpp
        - --source=/mnt/models
        - --source-file=*q4_k_m.gguf
        - --engine-arg=chat_format=chatml
        - --engine-arg=flash_attn=true
        - --engine-arg=n_ctx=8192
        - --engine-arg=temperature=0.7
        - --engine-arg=use_mmap=false
        - --http_port=8080
        """
    )


@pytest.mark.parametrize(
    ("manifest_yaml", "expected_yaml"),
    [
        (
            QWEN_GGUF,
            """
            model_name: qwen2.5-0.5b-instruct
            task: generate
            backend: llamacpp
            source: /mnt/models
            source_file: "*q4_k_m.gguf"
            engine_args: {n_ctx: "8192", flash_attn: "true", use_mmap: "false", temperature: "0.7",
                          chat_format: chatml}
            http_port: 8080
            """,
        ),
        (
            with_spec("source: {uri: /opt/models/ocr}\nbackend: tesseract\ntask: ocr"),
            """
            model_name: minilm
            task: ocr
            backend: tesseract
            source: /opt/models/ocr
            http_port: 8080
            """,
        ),
        (
            with_spec("source: {uri: 'hf://BAAI/bge-m3', revision: v2}"),
            """
            model_name: minilm
            task: embed
            backend: transformers
            source: /mnt/models
            http_port: 8080
            """,
        ),
    ],
    ids=["gguf on llama.cpp with engine args", "ocr on tesseract from a path", "hub revision fetched, not passed"],
)
def test_predictor_args_parse_back_to_the_intended_config(manifest_yaml: str, expected_yaml: str) -> None:
    args = at(render(manifest_yaml), "spec.predictor.containers[0].args")
    assert PredictorConfig.from_args(args) == PredictorConfig.model_validate(load(expected_yaml))


# --------------------------------------------------------------------------------------------------
# What only the operator rejects

REJECTIONS = {
    "unknown profile": (with_spec("resources: {profile: tpu-v5, gpus: 1}"), "spec.resources.profile", "tpu-v5"),
    "relative path source": (with_spec("source: {uri: ./models/minilm}"), "spec.source.uri", "./models/minilm"),
    "bare relative path source": (with_spec("source: {uri: models/minilm}"), "spec.source.uri", "models/minilm"),
    "file:// source": (with_spec("source: {uri: 'file:///srv/minilm'}"), "spec.source.uri", "file:///srv/minilm"),
}


@pytest.mark.parametrize(("manifest_yaml", "field", "mentioned"), REJECTIONS.values(), ids=REJECTIONS.keys())
def test_operator_only_rejections_name_the_field(manifest_yaml: str, field: str, mentioned: str) -> None:
    parsed = model(manifest_yaml)  # valid for the API server ...
    with pytest.raises(SpecError) as caught:
        desired_inference_service(parsed, CONFIG)  # ... but not servable by this operator
    assert caught.value.field == field
    assert mentioned in caught.value.message
    with pytest.raises(SpecError):
        check_servable(parsed, CONFIG)


def test_unknown_profile_message_lists_the_configured_profiles() -> None:
    with pytest.raises(SpecError, match=r"amd, gpu-l4"):
        check_servable(model(with_spec("resources: {profile: tpu-v5}")), CONFIG)


@pytest.mark.parametrize("value", [{"nested": 1}, [1, 2]], ids=["mapping", "list"])
def test_check_servable_rejects_a_non_scalar_engine_arg_naming_its_key(value: object) -> None:
    parsed = model(EMBED)
    parsed.spec.engine_args["max_batch_size"] = value  # type: ignore[assignment]  # as the API server may keep it
    with pytest.raises(SpecError) as caught:
        check_servable(parsed, CONFIG)
    assert caught.value.field == "spec.engineArgs.max_batch_size"


@pytest.mark.parametrize("value", [{"nested": 1}, [1, 2], None], ids=["mapping", "list", "null"])
def test_parse_model_rejects_a_non_scalar_engine_arg_naming_its_key(value: object) -> None:
    body = load(EMBED)
    body["spec"]["engineArgs"] = {"max_batch_size": value}
    with pytest.raises(SpecError) as caught:
        parse_model(body)
    assert caught.value.field.startswith("spec.engineArgs")
    assert "max_batch_size" in str(caught.value)
    assert "string, number or boolean" in caught.value.message


def test_state_claim_is_mounted_and_passed_as_state_dir() -> None:
    from universal_operator.config import OperatorConfig
    from universal_operator.reconcile.render import desired_inference_service
    from universal_operator.spec import parse_model
    from universal_predictors.config import PredictorConfig

    model = parse_model(
        {
            "metadata": {"name": "anomaly", "namespace": "ml", "uid": "u", "generation": 1},
            "spec": {
                "task": "anomaly",
                "source": {"uri": "/opt/models/anomaly"},
                "scaling": {"mode": "Standard"},
                "state": {"claimName": "detectors", "subPath": "team-a"},
            },
        }
    )
    predictor = desired_inference_service(model, OperatorConfig())["spec"]["predictor"]
    assert {"name": "state", "persistentVolumeClaim": {"claimName": "detectors"}} in predictor["volumes"]
    container = predictor["containers"][0]
    assert {
        "name": "state",
        "mountPath": "/var/lib/universal-runtime/state",
        "subPath": "team-a",
    } in container["volumeMounts"]
    assert PredictorConfig.from_args(container["args"]).state_dir == "/var/lib/universal-runtime/state"


def test_a_single_standard_replica_with_a_state_claim_is_recreated_not_rolled() -> None:
    # The new pod would wait for the ReadWriteOnce claim the old one holds: Recreate stops the old one first.
    body = """
    metadata: {name: detectors, namespace: ml, uid: u1}
    spec:
      task: anomaly
      source: {uri: /opt/a}
      state: {claimName: detectors}
      scaling: {mode: Standard, maxReplicas: $max}
    """
    one = desired_inference_service(model(body.replace("$max", "1")), parse_config({}))
    assert one["spec"]["predictor"]["deploymentStrategy"] == {"type": "Recreate"}
    several = desired_inference_service(model(body.replace("$max", "3")), parse_config({}))  # ReadWriteMany
    assert "deploymentStrategy" not in several["spec"]["predictor"]
