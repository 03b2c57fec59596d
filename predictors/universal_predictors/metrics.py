"""Prometheus metrics every predictor exports on ``/metrics`` (KServe serves the default registry).

All series carry the served model's name. Defined once here so tasks and engines share names.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from universal_predictors import metric_names

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

REQUESTS = Counter(
    "universal_predictor_requests_total",
    "Requests by route and outcome (ok, invalid, not_found, too_large, overloaded, cancelled, error).",
    ["model", "route", "outcome"],
)
LATENCY = Histogram(
    "universal_predictor_request_seconds", "Time from request to full response.", ["model", "route"],
    buckets=_LATENCY_BUCKETS,
)  # fmt: skip
# The gateway's Standard-mode TTL reads these two: each gateway replica sees only its own traffic.
IN_FLIGHT = Gauge(metric_names.IN_FLIGHT, "Requests being processed now.", ["model"])
LAST_REQUEST = Gauge(metric_names.LAST_REQUEST, "Unix time of the latest request start or end.", ["model"])
QUEUE_DEPTH = Gauge("universal_predictor_queue_depth", "Items waiting for the model.", ["model"])
BATCH_SIZE = Histogram("universal_predictor_batch_size", "Items per forward pass.", ["model"], buckets=_BATCH_BUCKETS)
ITEMS = Counter("universal_predictor_items_total", "Items processed (sentences, pairs, images, rows).", ["model"])
LOAD_SECONDS = Gauge(
    "universal_predictor_load_seconds",
    "Where the start-up went, by phase: process (interpreter and entry point), imports, weights, engine, "
    "first_inference "
    "(universal_predictors.wake_phases).", ["model", "phase"],
)  # fmt: skip

# Generation
TIME_TO_FIRST_TOKEN = Histogram(
    "universal_predictor_time_to_first_token_seconds", "Time from request to the first generated token.", ["model"],
    buckets=_LATENCY_BUCKETS,
)  # fmt: skip
INTER_TOKEN_LATENCY = Histogram(
    "universal_predictor_inter_token_latency_seconds", "Time between consecutive generated tokens.", ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)  # fmt: skip
TOKENS_GENERATED = Counter("universal_predictor_generated_tokens_total", "Tokens generated.", ["model"])
PROMPT_TOKENS = Counter("universal_predictor_prompt_tokens_total", "Prompt tokens processed.", ["model"])
OUT_OF_MEMORY = Counter(
    "universal_predictor_out_of_memory_total",
    "Engine steps that ran out of GPU memory (their sequences got 503 with Retry-After).",
    ["model"],
)
PREEMPTIONS = Counter(
    "universal_predictor_preemptions_total",
    "Running sequences sent back to wait because the batch's KV cache outgrew its budget (recomputed later).",
    ["model"],
)
CANCELLED = Counter(
    "universal_predictor_cancelled_total", "Generations stopped because the client went away.", ["model"]
)
ADAPTER_REQUESTS = Counter(
    "universal_predictor_adapter_requests_total", "Sequences generated with a LoRA adapter.", ["model", "adapter"]
)
ADAPTER_TOKENS = Counter(
    "universal_predictor_adapter_generated_tokens_total", "Tokens generated with a LoRA adapter.", ["model", "adapter"]
)
ADAPTER_LOADS = Counter(
    "universal_predictor_adapter_loads_total", "LoRA adapters loaded into the engine.", ["model", "adapter"]
)
ADAPTER_EVICTIONS = Counter(
    "universal_predictor_adapter_evictions_total",
    "LoRA adapters unloaded to make room (the least recently used beyond max_loras).",
    ["model", "adapter"],
)
ADAPTER_LOAD_SECONDS = Histogram(
    "universal_predictor_adapter_load_seconds",
    "Time to load a LoRA adapter into the engine (its files already local).",
    ["model", "adapter"],
    buckets=_LATENCY_BUCKETS,
)
