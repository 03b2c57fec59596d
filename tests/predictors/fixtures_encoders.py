"""Fixtures for the embed and rerank tests: in-process reference models and extra predictor processes.

Import the fixtures into a test module (``from tests.predictors.fixtures_encoders import ...``); they
are session-scoped so each model loads once per test session.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

#: The files of all-MiniLM-L6-v2 that make a plain transformers directory (no sentence-transformers files).
_PLAIN_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json")  # fmt: skip


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when the series is absent)."""
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}") + 1]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="session")
def metric() -> Callable[..., float]:
    """:func:`metric_value`, as a fixture so test modules need not import this plugin module."""
    return metric_value


@pytest.fixture(scope="session")
def minilm_in_process(minilm_path: Path) -> Any:
    """The same model loaded in this process by sentence-transformers: the reference vectors."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu", local_files_only=True)


@pytest.fixture(scope="session")
def plain_minilm_dir(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 as a plain transformers directory: weights and tokenizer, no modules.json."""
    directory = tmp_path_factory.mktemp("plain-minilm")
    for name in _PLAIN_FILES:
        (directory / name).symlink_to(minilm_path / name)
    return directory


@pytest.fixture(scope="session")
def plain_embed_predictor(
    plain_minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PredictorProcess]:
    """The plain directory served with a declared Matryoshka list and a 64-token batch budget."""
    config = PredictorConfig(
        model_name="plain-minilm",
        task=Task.EMBED,
        source=str(plain_minilm_dir),
        engine_args={"matryoshka_dimensions": "384,256,128", "max_batch_tokens": "64", "max_batch_size": "4"},
    )
    with running_predictor(config, tmp_path_factory.mktemp("plain-embed")) as predictor:
        yield predictor


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight BERT with a one-logit sequence-classification head and a word-level vocabulary."""
    return build_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))


def build_cross_encoder(directory: Path) -> Path:
    """:func:`tiny_cross_encoder_dir`'s model, written into ``directory``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    words = [
        "the",
        "a",
        "cat",
        "dog",
        "sat",
        "on",
        "mat",
        "paris",
        "is",
        "capital",
        "of",
        "france",
        "berlin",
        "germany",
        "weather",
        "today",
        "rain",
        "what",
        "where",
        "who",
        "city",
        "river",
        "bread",
        "eats",
        "runs",
        "quickly",
        "blue",
        "sky",
    ]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(words))]
    vocab_file = directory / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(vocab_file=str(vocab_file), do_lower_case=True, model_max_length=64)
    torch.manual_seed(1234)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=1,
    )  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def cross_encoder_predictor(
    tiny_cross_encoder_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name="tiny-reranker",
        task=Task.RERANK,
        source=str(tiny_cross_encoder_dir),
        engine_args={"max_batch_size": "4"},
    )
    with running_predictor(config, tmp_path_factory.mktemp("cross-encoder")) as predictor:
        yield predictor


@pytest.fixture(scope="session")
def bi_encoder_predictor(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="minilm-reranker", task=Task.RERANK, source=str(minilm_path))
    with running_predictor(config, tmp_path_factory.mktemp("bi-encoder")) as predictor:
        yield predictor


@pytest.fixture(scope="session")
def tiny_llama_embed_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random-weight Llama (the generation tests' builder) as a transformers directory and as GGUF."""
    from tests.predictors.generation.tiny_llama import build_llama, write_gguf

    root = tmp_path_factory.mktemp("tiny-llama-embed")
    hf_dir = build_llama(root / "hf")
    (root / "gguf").mkdir()
    return hf_dir, write_gguf(hf_dir, root / "gguf" / "tiny-llama-f32.gguf")


@pytest.fixture(scope="session")
def llamacpp_embed_predictor(
    tiny_llama_embed_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PredictorProcess]:
    pytest.importorskip("llama_cpp", reason="the llamacpp engine needs llama-cpp-python")
    gguf = tiny_llama_embed_dirs[1]
    config = PredictorConfig(
        model_name="tiny-llama-embed",
        task=Task.EMBED,
        source=str(gguf.parent),
        source_file="*.gguf",
        engine_args={"n_ctx": "64"},
    )
    with running_predictor(config, tmp_path_factory.mktemp("llamacpp-embed")) as predictor:
        yield predictor
