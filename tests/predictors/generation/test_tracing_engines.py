"""Each engine's spans (issue 28, item 5): a predictor with traces on, one sequence slot, two requests at once. The
second waits for the first: on the engines that say when a sequence's prefill began (transformers, llama.cpp) that
wait is its ``queue`` span, before ``prefill`` and ``decode``; vLLM's ``prefill`` includes it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import wait_for
from tests.otlp_collector import CollectedSpan, running_collector
from tests.predictors.generation.conftest import EngineCase, engine_params, start_engine
from universal_predictors.catalog import Backend

ENGINES = [
    EngineCase(Backend.TRANSFORMERS, "transformers", engine_args=(("max_batch_size", "1"),)),
    EngineCase(Backend.LLAMACPP, "llama_cpp", gguf=True, engine_args=(("n_parallel", "1"),)),
    EngineCase(Backend.VLLM, "vllm", engine_args=(("dtype", "float32"), ("enforce_eager", "true"),
                                                  ("kv_cache_memory_bytes", "256M"), ("max_num_seqs", "1"))),
]  # fmt: skip
STAMPED = {Backend.TRANSFORMERS, Backend.LLAMACPP}  # engines that say when a sequence's prefill began


@pytest.mark.parametrize("case", engine_params(ENGINES), ids=lambda case: case.backend.value)
def test_a_sequence_that_waited_for_the_engine_shows_queue_prefill_and_decode(
    case: EngineCase, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source = request.getfixturevalue("tiny_llama_gguf" if case.gguf else "tiny_llama_dir")
    with running_collector() as collector:
        env = (("OTEL_TRACES_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint),
               ("OTEL_BSP_SCHEDULE_DELAY", "50"))  # fmt: skip
        with start_engine(dataclasses.replace(case, env=case.env + env), source, tmp_path) as predictor:
            traces = [f"{n:032x}" for n in (0xA1, 0xB2)]

            def ask(trace: str) -> dict[str, object]:
                body = {"model": "tiny-llama", "prompt": "Once upon", "max_tokens": 64, "temperature": 0,
                        "ignore_eos": True}  # fmt: skip
                headers = {"traceparent": f"00-{trace}-{'1' * 16}-01"}
                answer = httpx.post(f"{predictor.url}/openai/v1/completions", json=body, headers=headers, timeout=120)
                assert answer.status_code == 200, answer.text
                return dict(answer.json()["usage"])

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                usages = list(pool.map(ask, traces))

            names = {"predictor.request", "parse", "prefill", "decode"}
            if case.backend in STAMPED:
                names.add("queue")

            def complete(trace: str) -> list[CollectedSpan] | None:
                found = collector.trace(trace)
                return found if names <= {s.name for s in found} else None

            def spans_of(trace: str) -> list[CollectedSpan]:
                return wait_for(lambda: complete(trace), 30)  # type: ignore[no-any-return]

            for trace, usage in zip(traces, usages, strict=True):
                spans = {s.name: s for s in spans_of(trace)}
                root = spans["predictor.request"]
                assert root.parent_id == "1" * 16
                assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
                assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 64
                assert spans["decode"].attributes["gen_ai.response.finish_reasons"] == ["length"]
                assert spans["prefill"].end_ns <= spans["decode"].start_ns + 1
                if case.backend in STAMPED:
                    assert spans["queue"].end_ns <= spans["prefill"].start_ns + 1
                else:
                    assert spans["prefill"].attributes["universal_runtime.includes_queue"] is True
            if case.backend in STAMPED:
                # One slot: the later sequence waited while the earlier one generated, and began only after its
                # first token (the engine thread takes it once the earlier one has left the batch).
                spans = {t: {s.name: s for s in collector.trace(t)} for t in traces}
                earlier, later = sorted(spans.values(), key=lambda named: named["queue"].end_ns)
                assert later["queue"].start_ns < earlier["decode"].end_ns
                assert later["queue"].end_ns >= earlier["decode"].start_ns
