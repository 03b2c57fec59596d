"""The predictor a UniversalModel runs: its container's name, its backend and its command line.

The one contract the operator's render, the gateway's local mode (``universal-runtime serve``) and the
simulated cluster share, so a model runs the same way in a cluster and on a laptop. Pure: a UniversalModel
(and the operator's config) in, a :class:`PredictorConfig` or a backend out.
"""

from __future__ import annotations

from universal_operator import kserve
from universal_operator.config import OperatorConfig, Profile
from universal_operator.spec import ScalingMode, UniversalModel
from universal_predictors.catalog import Backend
from universal_predictors.config import (
    DEFAULT_HTTP_PORT,
    MODEL_MOUNT_PATH,
    STATE_MOUNT_PATH,
    TASK_BACKENDS,
    PredictorConfig,
    render_engine_arg,
    resolve_backend,
)

#: The predictor's container: the name KServe gives a custom predictor's container (KServe v0.16.0
#: pkg/apis/serving/v1beta1/predictor_custom.go, CustomPredictor.Default), which the operator renders itself.
CONTAINER_NAME = "kserve-container"
#: vLLM's engine argument that shards one model over several GPUs.
TENSOR_PARALLEL_ARG = "tensor_parallel_size"
PIPELINE_PARALLEL_ARG = "pipeline_parallel_size"
#: vLLM's engine argument that skips torch.compile and CUDA graphs (nothing to recompile on a wake).
EAGER_ARG = "enforce_eager"


def predictor_config(
    model: UniversalModel,
    http_port: int = DEFAULT_HTTP_PORT,
    *,
    source: str | None = None,
    state_dir: str | None = None,
    engine_arg_defaults: dict[Backend, dict[str, str]] | None = None,
    adapters_file: str | None = None,
    adapter_credentials_dir: str | None = None,
) -> PredictorConfig:
    """The predictor's command line as a config: the one contract cluster and local runs share.

    In a cluster remote sources arrive at /mnt/models (KServe's storage initializer) and state lives on
    ``spec.state``'s volume; the local supervisor passes the paths it fetched and chose instead.
    """
    spec = model.spec
    if source is None:
        source = MODEL_MOUNT_PATH if spec.source.is_remote else spec.source.uri.removeprefix("file://")
    if state_dir is None and spec.state is not None:
        state_dir = STATE_MOUNT_PATH
    backend = resolved_backend(model)
    engine_args = {k: render_engine_arg(v) for k, v in spec.engine_args.items()}
    defaults = {b: dict(args) for b, args in (engine_arg_defaults or {}).items()}
    if spec.resources.gpus > 1 and not engine_args.keys() & {TENSOR_PARALLEL_ARG, PIPELINE_PARALLEL_ARG}:
        # vLLM runs a model on one GPU unless told otherwise: spread it over every GPU the replica gets, unless the
        # user chose a split (tensor_parallel_size x pipeline_parallel_size) themselves. With backend auto it is a
        # vLLM default, which the predictor applies if it picks vLLM (vllm 0.32 engine/arg_utils.py: both 1).
        if backend is Backend.VLLM:
            engine_args[TENSOR_PARALLEL_ARG] = str(spec.resources.gpus)
        elif backend is Backend.AUTO and Backend.VLLM in TASK_BACKENDS[spec.task]:
            defaults.setdefault(Backend.VLLM, {}).setdefault(TENSOR_PARALLEL_ARG, str(spec.resources.gpus))
    return PredictorConfig(
        model_name=model.served_name,
        task=spec.task,
        backend=backend,
        source=source,
        source_file=spec.source.file,
        source_projector_file=spec.source.projector_file,
        engine_args=engine_args,
        engine_arg_defaults=defaults,
        http_port=http_port,
        state_dir=state_dir,
        adapters_file=adapters_file,
        adapter_credentials_dir=adapter_credentials_dir,
    )


def resolved_backend(model: UniversalModel) -> Backend:
    """The backend as far as the spec can decide it (see :func:`resolve_backend`)."""
    spec = model.spec
    # A projector is a llama.cpp file: with one, auto means llama.cpp as a GGUF weights pattern does.
    pattern = spec.source.file or spec.source.projector_file
    return resolve_backend(spec.task, spec.backend, spec.source.uri, pattern, spec.resources.gpus)


def reported_backend(model: UniversalModel) -> Backend:
    """The backend the status reports: the spec's resolution, or, where that is ``auto``, the one the running
    predictor reported for this very generation (``status.predictorReport``, which the gateway writes) if it is
    one of the task's. A report for an earlier generation says nothing about the current spec: ``auto`` again."""
    backend = resolved_backend(model)
    report = model.status.predictor_report
    if (
        backend is not Backend.AUTO
        or report is None
        or report.backend is None
        or report.generation != model.metadata.generation
    ):
        return backend
    try:
        running = Backend(report.backend)
    except ValueError:
        return backend
    return running if running in TASK_BACKENDS[model.spec.task] else backend


def possible_backends(model: UniversalModel) -> tuple[Backend, ...]:
    """The backends the predictor may run: the resolved one, or every one of the task's when that is ``auto``."""
    backend = resolved_backend(model)
    return TASK_BACKENDS[model.spec.task] if backend is Backend.AUTO else (backend,)


def scales_to_zero(model: UniversalModel, config: OperatorConfig) -> bool:
    """Whether the model's replicas go away when idle: Knative with minReplicas 0, or Standard mode where the
    gateway stops idle models (KServe releases that have the stop annotation)."""
    scaling = model.spec.scaling
    if scaling.mode is ScalingMode.KNATIVE:
        return scaling.min_replicas == 0
    return kserve.can_stop(config.kserve.release, scaling.mode)


def compile_cache_claim(model: UniversalModel, profile: Profile | None) -> str | None:
    """The profile's compile-cache claim, for a model that may run vLLM (the only engine that compiles)."""
    if profile is None or Backend.VLLM not in possible_backends(model):
        return None
    return profile.compile_cache_claim


def engine_arg_defaults(
    model: UniversalModel, config: OperatorConfig, profile: Profile | None
) -> dict[Backend, dict[str, str]]:
    """Engine-arg defaults by backend, for the backends the predictor may run (it applies only its own's).

    The profile's ``engineArgs``; and for vLLM on a model that scales to zero without a compile cache,
    ``enforce_eager=true``: every wake would otherwise torch.compile the model and capture its CUDA graphs
    again, into an emptyDir that is gone at the next scale to zero (a minute or more of a cold start on
    large models, paid by the request that woke it), where eager mode costs decode speed instead. A
    profile's or the model's own ``enforce_eager`` wins; a compile-cache claim keeps compilation.
    ``profile`` is the model's, as :func:`~universal_operator.reconcile.checks.check_servable` returns it.
    """
    defaults: dict[Backend, dict[str, str]] = {}
    for backend in possible_backends(model):
        given = profile.engine_args.get(backend, {}) if profile is not None else {}
        defaults[backend] = {key: render_engine_arg(value) for key, value in given.items()}
    if Backend.VLLM in defaults and scales_to_zero(model, config) and compile_cache_claim(model, profile) is None:
        defaults[Backend.VLLM].setdefault(EAGER_ARG, "true")
    return {backend: args for backend, args in defaults.items() if args}
