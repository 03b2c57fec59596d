"""Traces (issue 28, item 5): a real ``universal-runtime serve`` and its real predictor export OpenTelemetry spans over
OTLP/HTTP to an in-test collector. The tree runs from the client's traceparent through the gateway (request, auth,
hold while the model woke, upstream) into the predictor (request, parse, queue, prefill, decode), with the GenAI
attributes equal to the response's usage; with OTEL_TRACES_EXPORTER unset nothing is exported at all."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

from tests.gateway.harness import running_gateway, wait_for, write_chat_manifest
from tests.otlp_collector import CollectedSpan, Collector, running_collector
from tests.predictors.generation.tiny_llama import build_llama
from universal_gateway import tracing as gateway_tracing
from universal_gateway.tracing import DEFERRED_BODY, RequestTrace, Upstream
from universal_predictors import tracing as shared
from universal_predictors.errors import InvalidRequest
from universal_predictors.tracing import (
    CLIENT,
    SERVER,
    Batches,
    Remote,
    Sampler,
    Span,
    Tracing,
    TracingConfigError,
    encode,
    export_transport,
    exporters_from_env,
    extract,
    start,
)

MODEL = "tiny-chat"
KEY = "key-tracing"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama = build_llama(tmp_path_factory.mktemp("models") / "llama")
    folder = tmp_path_factory.mktemp("manifests")
    write_chat_manifest(folder, "chat", MODEL, llama)
    return folder


@pytest.fixture
def collector() -> Iterator[Collector]:
    with running_collector() as running:
        yield running


def tracing_env(collector: Collector) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms (the default waits 5 s)
    }


def one(spans: list[CollectedSpan], name: str) -> CollectedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


def children(spans: list[CollectedSpan], parent: CollectedSpan) -> set[str]:
    return {s.name for s in spans if s.parent_id == parent.span_id}


def complete(collector: Collector, trace_id: str, names: set[str]) -> list[CollectedSpan]:
    """The trace's spans once every one of ``names`` has arrived (the processes export in batches)."""
    return wait_for(lambda: (spans := collector.trace(trace_id)) and names <= {s.name for s in spans} and spans, 30)  # type: ignore[no-any-return]


def test_a_request_that_woke_its_model_is_one_trace_from_the_client_to_the_engine(
    manifests: Path, collector: Collector, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY + "\n")
    with running_gateway([manifests], tmp_path, "--api-keys-file", str(keys), env=tracing_env(collector)) as gateway:
        headers = {"Authorization": f"Bearer {KEY}", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
        answer = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=300)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        finish = [c["finish_reason"] for c in answer.json()["choices"]]

        # The model was asleep (serve starts predictors on demand): this request woke it and shows the hold.
        spans = complete(collector, CLIENT_TRACE, {"gateway.request", "auth", "hold", "upstream", "predictor.request",
                                                   "parse", "queue", "prefill", "decode"})  # fmt: skip
        root = one(spans, "gateway.request")
        assert root.parent_id == CLIENT_SPAN  # the child of the client's traceparent
        assert root.service == "universal-gateway"
        assert children(spans, root) == {"auth", "hold", "upstream"}
        hold = one(spans, "hold")
        assert hold.attributes["gen_ai.request.model"] == MODEL
        assert hold.attributes["universal_runtime.wake_seconds"] > 0
        upstream = one(spans, "upstream")
        predictor = one(spans, "predictor.request")
        assert predictor.parent_id == upstream.span_id  # the traceparent the gateway sent up, not the client's
        assert predictor.service == "universal-predictor"
        assert children(spans, predictor) == {"parse", "queue", "prefill", "decode"}
        queue, prefill, decode = one(spans, "queue"), one(spans, "prefill"), one(spans, "decode")
        assert queue.end_ns <= prefill.start_ns + 1
        assert prefill.end_ns <= decode.start_ns + 1

        for span in (root, upstream, predictor):
            assert span.attributes["gen_ai.request.model"] == MODEL
            assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
            assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
            assert span.attributes["gen_ai.response.finish_reasons"] == finish
        assert root.attributes["gen_ai.operation.name"] == predictor.attributes["gen_ai.operation.name"] == "chat"
        assert root.attributes["http.response.status_code"] == 200
        assert decode.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert prefill.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert not any("Hi" in json.dumps(s.attributes) for s in spans)  # no bodies

        # A caller that did not sample its trace: the gateway and the predictor follow it and record nothing.
        unsampled = "5bf92f3577b34da6a3ce929d0e0e4736"
        headers = {"Authorization": f"Bearer {KEY}", "traceparent": f"00-{unsampled}-{CLIENT_SPAN}-00"}
        answer = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=300)
        assert answer.status_code == 200, answer.text

        # Awake now: a streamed request without a traceparent starts its own trace, with no hold in it.
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=streamed,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as response:  # fmt: skip
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        final = events[-1]["usage"]
        roots = wait_for(lambda: [s for s in collector.spans if s.name == "gateway.request" and s.parent_id == ""])
        trace_id = roots[0].trace_id
        spans = complete(collector, trace_id, {"gateway.request", "upstream", "predictor.request", "decode"})
        assert "hold" not in {s.name for s in spans}
        root = one(spans, "gateway.request")
        assert root.attributes["gen_ai.usage.input_tokens"] == final["prompt_tokens"]
        assert root.attributes["gen_ai.usage.output_tokens"] == final["completion_tokens"]
        predictor = one(spans, "predictor.request")
        assert predictor.end_ns >= one(spans, "decode").end_ns  # a stream's request span lasts to its last event
        assert collector.trace(unsampled) == []  # exported in order: its spans would have come before these
        assert predictor.attributes["gen_ai.usage.output_tokens"] == final["completion_tokens"]


def test_with_the_exporter_unset_nothing_is_exported(manifests: Path, collector: Collector, tmp_path: Path) -> None:
    env = {**tracing_env(collector), "OTEL_TRACES_EXPORTER": ""}  # an endpoint alone does not turn tracing on
    with running_gateway([manifests], tmp_path, env=env) as gateway:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        answer = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=300)
        assert answer.status_code == 200, answer.text
    # The gateway and its predictor have stopped (a traced process flushes its spans as it stops): none came.
    assert collector.requests == 0
    assert collector.spans == []


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none,otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp"]),
    ],
)
def test_tracing_is_on_only_when_otel_traces_exporter_names_an_exporter(
    environ: dict[str, str], exporters: list[str]
) -> None:
    assert exporters_from_env(environ) == exporters


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER=zipkin"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "OTEL_TRACES_EXPORTER=console"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER=jaeger_remote"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG=half"),
        ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY=soon"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "TRACES_PROTOCOL=grpc"),
    ],
)
def test_an_exporter_or_protocol_not_installed_is_one_line_naming_the_variable(
    environ: dict[str, str], named: str
) -> None:
    with pytest.raises(TracingConfigError, match=named):
        start("test", {"OTEL_TRACES_EXPORTER": "otlp", **environ})


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True)),
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), False)),
        (f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-future", (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True)),
        (f"00-{'0' * 32}-{CLIENT_SPAN}-01", None),  # an all-zero trace id is invalid
        (f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", None),  # version ff is invalid
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra", None),  # version 00 has exactly four parts
        ("00-xyz-abc-01", None),
    ],
)
def test_a_traceparent_is_read_as_w3c_trace_context_defines_it(
    header: str, parsed: tuple[int, int, bool] | None
) -> None:
    remote = extract({"traceparent": header, "tracestate": "vendor=1"})
    assert (None if remote is None else (remote.trace_id, remote.span_id, remote.sampled)) == parsed


def test_samplers_decide_as_the_sdks_do() -> None:
    low, high = 1 << 62, (1 << 64) - 1  # trace ids whose low 64 bits are below and above a quarter of 2**64
    quarter = Sampler("traceidratio", 0.3)
    assert quarter.sampled(low, None)
    assert not quarter.sampled(high, None)
    sampled_parent, unsampled_parent = Remote(1, 2, True, ""), Remote(1, 2, False, "")
    assert Sampler("parentbased_always_off", 1.0).sampled(low, sampled_parent)  # the parent decides
    assert not Sampler("parentbased_always_on", 1.0).sampled(low, unsampled_parent)
    assert not Sampler("parentbased_always_off", 1.0).sampled(low, None)
    assert Sampler("always_on", 1.0).sampled(high, unsampled_parent)  # not parent-based: the parent is ignored


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_spans_are_sent_through_urllib3_with_the_sdk_s_client(
    collector: Collector, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    """Without a proxy in the environment the SDK's exporter sends through its urllib3 transport (requests merges the
    environment into every call: twice the CPU, held under the GIL); its client still compresses and posts."""
    for name, value in {**tracing_env(collector), "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": compression}.items():
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    assert type(export_transport()).__name__ == "Urllib3HTTPTransport"
    tracing = start("svc", dict(os.environ))
    assert tracing is not None
    monkeypatch.setattr(shared, "ACTIVE", tracing)  # where an ending span is queued
    try:
        for i in range(3):
            tracing.start(f"span-{i}", SERVER, attributes={"i": i}).end()
    finally:
        tracing.shutdown()  # exports what is queued
    assert [(s.name, s.service, s.attributes) for s in collector.spans] == [
        (f"span-{i}", "svc", {"i": i}) for i in range(3)
    ]


@pytest.mark.parametrize(
    ("environ", "transport"),
    [
        ({"HTTPS_PROXY": "http://proxy.example:3128"}, "RequestsHTTPTransport"),
        ({"http_proxy": "http://proxy.example:3128"}, "RequestsHTTPTransport"),
        ({"NO_PROXY": "collector"}, "Urllib3HTTPTransport"),
        ({"OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER": "mine"}, "RequestsHTTPTransport"),
    ],
)
def test_a_proxy_or_a_credential_provider_keeps_the_sdk_s_requests_transport(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], transport: str
) -> None:
    for name in [n for n in os.environ if n.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    chosen = export_transport()
    if transport == "RequestsHTTPTransport":
        assert chosen is None  # the exporter builds its default, requests, which reads these
    else:
        assert type(chosen).__name__ == transport


def test_the_tls_files_are_the_ones_the_sdk_resolves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The traces' own variable wins over the general one; a client certificate goes with its key."""
    for name in [n for n in os.environ if n.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", "/general/ca.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/traces/ca.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/general/client.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/traces/client.key")
    pool = export_transport()._pool.connection_pool_kw
    assert (pool["ca_certs"], pool["cert_file"], pool["key_file"], pool["cert_reqs"]) == (
        "/traces/ca.pem",
        "/general/client.pem",
        "/traces/client.key",
        "CERT_REQUIRED",
    )
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_CERTIFICATE")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY")
    pool = export_transport()._pool.connection_pool_kw
    assert ("ca_certs" in pool, pool["cert_file"], "key_file" in pool) == (False, "/general/client.pem", False)


def test_spans_are_encoded_by_the_export_thread_which_offers_the_gil_every_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ending a span queues it; the export thread encodes (off the event loop that ended it) and gives the GIL up
    every ENCODED_BETWEEN_YIELDS spans, so a loop that wants it back waits for a few spans, not a switch interval."""
    encoded_on: list[str] = []
    yielded_on: list[str] = []
    sent: list[tuple[str, list[bytes]]] = []

    def encode_here(span: Span) -> bytes:
        encoded_on.append(threading.current_thread().name)
        return encode(span)

    monkeypatch.setattr(shared, "encode", encode_here)
    monkeypatch.setattr(os, "sched_yield", lambda: yielded_on.append(threading.current_thread().name))
    batch = 8 * shared.ENCODED_BETWEEN_YIELDS
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(batch)}
    tracing = Tracing(Sampler("always_on", 1.0), Batches(lambda spans: sent.append((threading.current_thread().name,
                                                                                   spans)), environ))  # fmt: skip
    monkeypatch.setattr(shared, "ACTIVE", tracing)
    try:
        for i in range(batch - 1):
            tracing.start(f"span-{i}", SERVER, attributes={"i": i}).end(1_000 + i)
        assert encoded_on == []
        assert sent == []
        tracing.start(f"span-{batch - 1}", SERVER, attributes={"i": batch - 1}).end(1_000 + batch - 1)
        deadline = time.monotonic() + 10
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        tracing.shutdown()
    [(thread, spans)] = sent
    assert thread == "otlp-traces"
    assert set(encoded_on) == {"otlp-traces"}
    assert len(encoded_on) == batch
    assert yielded_on == ["otlp-traces"] * 8
    decoded = ScopeSpans.FromString(b"".join(spans)).spans
    assert [(s.name, s.end_time_unix_nano, s.attributes[0].value.int_value) for s in decoded] == [
        (f"span-{i}", 1_000 + i, i) for i in range(batch)
    ]


def test_spans_ended_while_the_export_thread_is_behind_are_encoded_as_they_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that leaves the export thread no time (a saturated gateway) encodes its spans itself once half the queue
    is waiting, rather than fill it and drop them; the batches still go out whole and in order."""
    release = threading.Event()
    sent: list[list[bytes]] = []

    def send(spans: list[bytes]) -> None:
        release.wait(10)  # an export that takes long: the thread is behind
        sent.append(spans)

    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
               "OTEL_BSP_MAX_QUEUE_SIZE": "16"}  # fmt: skip
    batches = Batches(send, environ)
    tracing = Tracing(Sampler("always_on", 1.0), batches)
    monkeypatch.setattr(shared, "ACTIVE", tracing)
    try:
        for i in range(4):  # a batch: the thread takes it and waits in send
            tracing.start(f"span-{i}", SERVER).end()
        deadline = time.monotonic() + 10
        while batches._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(4, 20):
            tracing.start(f"span-{i}", SERVER).end()
        assert [type(span).__name__ for span in batches._queue] == ["Span"] * 8 + ["bytes"] * 8
        assert batches.dropped == 0
        release.set()
    finally:
        release.set()
        tracing.shutdown()
    decoded = [span.name for batch in sent for span in ScopeSpans.FromString(b"".join(batch)).spans]
    assert decoded == [f"span-{i}" for i in range(20)]
    assert [len(batch) for batch in sent] == [4] * 5


def test_spans_encode_as_otlp_protobuf_decodes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder writes OTLP's protobuf by hand; opentelemetry-proto reads back every field and attribute type."""
    added: list[bytes] = []

    class Collect:
        def add(self, span: Span) -> None:
            added.append(encode(span))  # as the export thread does

    tracing = Tracing(Sampler("always_on", 1.0), Collect())  # type: ignore[arg-type]
    monkeypatch.setattr(shared, "ACTIVE", tracing)
    parent = Remote(int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True, "vendor=1")
    attributes = {"s": "x" * 300, "b": True, "i": 2**40, "n": -1, "f": 0.25, "l": ["stop", "length"], "none": None}
    for _ in range(2):  # the second time from the caches
        span = tracing.start("predictor.request", SERVER, parent, dict(attributes), start=1_000)
        span.error = True
        span.end(2_000)
    decoded = ScopeSpans.FromString(b"".join(added)).spans
    assert len(decoded) == 2
    assert decoded[0].attributes == decoded[1].attributes  # the cached encodings are the same
    one = decoded[0]
    assert (one.trace_id.hex(), one.parent_span_id.hex(), one.trace_state) == (CLIENT_TRACE, CLIENT_SPAN, "vendor=1")
    assert (one.name, one.kind) == ("predictor.request", 2)
    assert (one.start_time_unix_nano, one.end_time_unix_nano) == (1000, 2000)
    assert one.status.code == 2  # STATUS_CODE_ERROR
    values = {a.key: a.value for a in one.attributes}
    assert values["s"].string_value == "x" * 300
    assert values["b"].bool_value is True
    assert (values["i"].int_value, values["n"].int_value, values["f"].double_value) == (2**40, -1, 0.25)
    assert [v.string_value for v in values["l"].array_value.values] == ["stop", "length"]
    assert "none" not in values


def request_trace(tracing: Tracing, path: str = "/v1/chat/completions") -> RequestTrace:
    """A proxied request's record, as the gateway's traced route starts it."""
    request = SimpleNamespace(headers={}, method="POST", path=path)
    return RequestTrace(tracing, request, (("gen_ai.operation.name", "chat"), ("universal_runtime.task", "generate")))  # type: ignore[arg-type]


def exported(trace: RequestTrace) -> dict[str, dict[str, Any]]:
    """A request's spans as the export thread encodes them, decoded by opentelemetry-proto: name -> attributes."""
    trace.finish = trace.finish or time.time_ns()
    spans = ScopeSpans.FromString(trace.encoded()).spans
    assert trace.spans == len(spans)
    decoded: dict[str, dict[str, Any]] = {}
    for span in spans:
        values = {}
        for attribute in span.attributes:
            value = attribute.value
            kind = value.WhichOneof("value")
            values[attribute.key] = ([v.string_value for v in value.array_value.values] if kind == "array_value"
                                     else getattr(value, kind))  # fmt: skip
        decoded[span.name] = values
    return decoded


async def test_a_streams_usage_and_finish_reason_are_read_however_its_chunks_fall() -> None:
    tracing = Tracing(Sampler("always_on", 1.0), None)  # type: ignore[arg-type]
    stream = (
        b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
        b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    )
    for size in (1, 5, 13, 64, len(stream)):
        trace = request_trace(tracing)
        upstream = Upstream(trace, 7, MODEL, "http://127.0.0.1:1", "/openai/v1/chat/completions")
        observe = upstream.observing(None)
        assert observe is not None
        for at in range(0, len(stream), size):
            await observe(stream[at : at + size], False)
        upstream.end(200)
        for name in ("gateway.request", "upstream"):
            attributes = exported(trace)[name]
            assert attributes["gen_ai.usage.input_tokens"] == 3, size
            assert attributes["gen_ai.usage.output_tokens"] == 2, size
            assert attributes["gen_ai.response.finish_reasons"] == ["length"], size


async def test_a_unary_body_s_usage_and_finish_reason_are_read_with_the_ledger_and_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A unary body's usage and finish reasons are read by the export thread as it encodes the request's spans (a body
    larger than DEFERRED_BODY as the request ends, not kept); the ledger's counts are preferred where it read some,
    and then a body of a route without finish reasons (embeddings) is not kept at all."""

    class Metered:
        input_tokens, output_tokens = 7, 0

    tracing = Tracing(Sampler("always_on", 1.0), None)  # type: ignore[arg-type]
    monkeypatch.setattr(shared, "ACTIVE", tracing)
    embeddings = b'{"object": "list", "data": [], "usage": {"prompt_tokens": 7, "total_tokens": 7}}'
    chat = b'{"choices": [{"index": 0, "finish_reason": "stop"}],"usage": {"prompt_tokens": 7, "completion_tokens": 2}}'
    messages = b'{"type": "message", "stop_reason": "end_turn", "usage": {"input_tokens": 7, "output_tokens": 3}}'
    responses = b'{"object": "response", "status": "completed", "usage": {"input_tokens": 7, "output_tokens": 4}}'
    large = b'{"object": "list", "data": [%s], "usage": {"prompt_tokens": 7}}' % b", ".join([b"0.5"] * 30000)
    bodies = {
        "/openai/v1/embeddings": (embeddings, 7, None, None),
        "/openai/v1/chat/completions": (chat, 7, 2, ["stop"]),
        "/openai/v1/messages": (messages, 7, 3, ["end_turn"]),
        "/openai/v1/responses": (responses, 7, 4, None),
        "/openai/v1/embeddings ": (large, 7, None, None),
    }  # fmt: skip
    for route, (body, inputs, outputs, finish) in bodies.items():
        for metered in (None, Metered()):
            trace = request_trace(tracing, route)
            token = gateway_tracing.REQUEST.set(trace)
            try:
                upstream = gateway_tracing.upstream(MODEL, "http://127.0.0.1:1", route.strip())
            finally:
                gateway_tracing.REQUEST.reset(token)
            assert isinstance(upstream, Upstream)
            observe = upstream.observing(None)
            assert observe is not None
            await observe(body, True)
            upstream.end(200, metered)
            kept = upstream._unary
            # Kept for the export thread only while something is left to read in it, and not when it is large.
            readable = metered is None or finish is not None or route.endswith("responses")  # finish reasons
            assert (kept == body) == (len(body) <= DEFERRED_BODY and readable), route
            for name in ("gateway.request", "upstream"):
                attributes = exported(trace)[name]
                assert attributes["gen_ai.usage.input_tokens"] == inputs, (route, metered)
                # With the ledger's counts, the ledger's output count (0 here) is the span's, as before.
                expected = 0 if metered is not None else outputs
                assert attributes.get("gen_ai.usage.output_tokens") == expected, (route, metered)
                assert attributes.get("gen_ai.response.finish_reasons") == finish, (route, metered)


def recording(monkeypatch: pytest.MonkeyPatch, sampler: str) -> list[Any]:
    """Tracing on in this process with ``sampler``, what it queues for export collected in the list returned."""
    added: list[Any] = []

    class Collect:
        def add(self, entry: Any) -> None:
            added.append(entry)

    monkeypatch.setattr(shared, "ACTIVE", Tracing(Sampler(sampler, 1.0), Collect()))  # type: ignore[arg-type]
    return added


def test_a_request_s_record_encodes_its_span_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spans the export thread makes of one request's record: the root the child of the client's traceparent, the
    auth, each hold and each upstream its children (the upstream's id the one its traceparent sent up), with their
    times, statuses and errors; and one entry of the export queue."""
    added = recording(monkeypatch, "parentbased_always_on")
    request = SimpleNamespace(headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "v=1"},
                              method="POST", path="/v1/chat/completions")  # fmt: skip
    sent_up: list[int] = []

    async def handler(request: Any, params: Any) -> Any:
        with gateway_tracing.auth():
            pass
        gateway_tracing.model(MODEL, "team-a")
        gateway_tracing.held(MODEL, 0.25)
        first = gateway_tracing.upstream(MODEL, "http://a:1", "/openai/v1/chat/completions")
        first.end(0)  # its process was gone: replayed
        second = gateway_tracing.upstream(MODEL, "http://a:1", "/openai/v1/chat/completions")
        assert isinstance(second, Upstream)
        expected = b"traceparent: 00-%s-%016x-01\r\ntracestate: v=1\r\n" % (CLIENT_TRACE.encode(), second.span_id)
        assert second.head_lines == expected
        sent_up.append(second.span_id)
        second.end(200)
        raise InvalidRequest("no")

    with pytest.raises(InvalidRequest):
        asyncio.run(gateway_tracing.traced(handler, "chat_completions", "generate")(request, None))  # type: ignore[arg-type]
    [trace] = added
    assert isinstance(trace, RequestTrace)
    spans = ScopeSpans.FromString(trace.encoded()).spans
    assert trace.spans == 5
    assert [s.name for s in spans] == ["gateway.request", "auth", "hold", "upstream", "upstream"]
    root = spans[0]
    assert (root.trace_id.hex(), root.parent_span_id.hex(), root.trace_state) == (CLIENT_TRACE, CLIENT_SPAN, "v=1")
    assert {s.parent_span_id for s in spans[1:]} == {root.span_id}
    assert {s.trace_id.hex() for s in spans} == {CLIENT_TRACE}
    assert len({s.span_id for s in spans}) == 5
    assert int(spans[4].span_id.hex(), 16) == sent_up[0]
    values = {a.key: a.value for a in root.attributes}
    assert values["gen_ai.request.model"].string_value == MODEL
    assert values["universal_runtime.key_id"].string_value == "team-a"
    assert values["http.response.status_code"].int_value == 400
    assert values["error.type"].string_value == "400"
    assert root.status.code == 0  # a 4xx is the client's, not the server span's error
    hold = spans[2]
    assert hold.end_time_unix_nano - hold.start_time_unix_nano == 250_000_000
    assert root.start_time_unix_nano <= spans[1].start_time_unix_nano <= spans[1].end_time_unix_nano
    assert spans[3].status.code == 2  # none came: an error
    assert spans[4].status.code == 0  # a 200
    assert spans[4].end_time_unix_nano <= root.end_time_unix_nano


def test_a_request_the_sampler_leaves_out_sends_its_traceparent_unsampled_and_queues_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client's traceparent flagged not sampled, under the default parent-based sampler: the upstream still gets a
    traceparent of the same trace (flags 00), and nothing is recorded or queued."""
    added = recording(monkeypatch, "parentbased_always_on")
    request = SimpleNamespace(headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}, method="POST",
                              path="/v1/chat/completions")  # fmt: skip
    heads: list[bytes] = []

    async def handler(request: Any, params: Any) -> Any:
        assert gateway_tracing.auth() is shared.OFF
        gateway_tracing.held(MODEL, 0.5)
        upstream = gateway_tracing.upstream(MODEL, "http://a:1", "/openai/v1/chat/completions")
        observe = object()
        assert upstream.observing(observe) is observe  # type: ignore[arg-type]
        heads.append(upstream.head_lines)
        upstream.end(200)
        return SimpleNamespace(status=200)

    asyncio.run(gateway_tracing.traced(handler, "chat_completions", "generate")(request, None))  # type: ignore[arg-type]
    [head] = heads
    assert head.startswith(b"traceparent: 00-%s-" % CLIENT_TRACE.encode())
    assert head.endswith(b"-00\r\n")
    assert added == []


def test_a_batch_counts_the_spans_of_the_requests_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE counts spans, a request's record several of them: with batches of 6, requests of
    three spans (the root, auth, upstream) go two a batch, each whole, in order."""
    records = recording(monkeypatch, "always_on")

    async def handler(request: Any, params: Any) -> Any:
        with gateway_tracing.auth():
            pass
        gateway_tracing.upstream(MODEL, "http://a:1", "/openai/v1/chat/completions").end(200)
        return SimpleNamespace(status=200)

    route = gateway_tracing.traced(handler, "chat_completions", "generate")
    for i in range(8):
        request = SimpleNamespace(headers={}, method="POST", path=f"/v1/chat/completions/{i}")
        asyncio.run(route(request, None))  # type: ignore[arg-type]
    sent: list[list[bytes]] = []
    batches = Batches(sent.append, {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "6"})
    batches._queue.extend(records)  # all queued before the thread drains (at shutdown), whatever the timing
    batches.shutdown()
    assert [len(batch) for batch in sent] == [2, 2, 2, 2]
    decoded = [ScopeSpans.FromString(b"".join(batch)).spans for batch in sent]
    assert [len(spans) for spans in decoded] == [6, 6, 6, 6]
    roots = [span for spans in decoded for span in spans if span.name == "gateway.request"]
    paths = [next(a.value.string_value for a in root.attributes if a.key == "url.path") for root in roots]
    assert paths == [f"/v1/chat/completions/{i}" for i in range(8)]


def test_a_span_s_header_lines_are_its_traceparent() -> None:
    tracing = Tracing(Sampler("always_on", 1.0), None)  # type: ignore[arg-type]
    for parent in (None, Remote(int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True, "vendor=1"),
                   Remote(int(CLIENT_TRACE, 16), 1, False, "")):  # fmt: skip
        span = tracing.start("upstream", CLIENT, parent)
        lines = "".join(f"{k}: {v}\r\n" for k, v in span.traceparent().items()).encode()
        assert span.header_lines() == lines


def test_off_the_gateway_imports_no_sdk_and_its_hooks_are_the_handlers_themselves() -> None:
    """Off is free: the route handlers are not wrapped, the per-request hooks are shared no-ops, and no part of the
    OpenTelemetry SDK is imported (a fresh interpreter, as `universal-runtime serve` starts)."""
    script = (
        "import sys, asyncio\n"
        "from universal_gateway import tracing\n"
        "assert tracing.configure('universal-gateway') is None\n"
        "async def handler(request, params): return None\n"
        "assert tracing.traced(handler, 'chat_completions', 'generate') is handler\n"
        "assert tracing.upstream('m', 'http://x:1', '/p') is tracing.NO_UPSTREAM\n"
        "assert tracing.auth() is tracing.auth()\n"
        "from universal_gateway.app import Gateway\n"
        "from tests.gateway.harness import OneUpstream\n"
        "Gateway(OneUpstream('http://127.0.0.1:1', 'm', 'generate'))\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')))\n"
        "assert not bad, bad\n"
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
