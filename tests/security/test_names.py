"""Issue 31, item 16: names are validated whole.

``re.match`` with a pattern ending in ``$`` also accepts the name followed by one newline (``$`` matches
before a final newline). Every name check in the tree now uses ``fullmatch``; these pin the ones a
caller can reach: anomaly detector names, engine-argument keys, and the stand-in KServe webhook's
InferenceService names (Go's ``$``, which it copies, is the end of the text).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.operator.test_admission import isvc, refusal
from universal_predictors.anomaly.store import valid_name
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig


@pytest.mark.parametrize("name", ["ok\n", "ok\r", "ok\n\n", "\nok"])
def test_a_detector_name_with_a_line_break_is_invalid(name: str) -> None:
    assert valid_name("ok")
    assert not valid_name(name)


def test_an_engine_argument_key_ending_in_a_newline_is_refused() -> None:
    with pytest.raises(ValidationError, match="engine argument key 'max_rows\\\\n'"):
        PredictorConfig(model_name="m", task=Task.EMBED, source="/m", engine_args={"max_rows\n": "1"})


def test_an_inference_service_name_ending_in_a_newline_is_refused_at_admission() -> None:
    assert "a InferenceService name must consist of" in refusal(isvc('metadata: {name: "custom-model\\n"}')).message
