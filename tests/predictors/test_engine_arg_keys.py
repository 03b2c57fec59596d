"""Engine-argument keys as users write them: flat ``key=value`` pairs, whatever a predictor nests. The document
task takes the OCR engines' options as ``ocr_*`` keys (and ``tesseract_cmd``) and holds them as one nested
``OcrOptions``, the same model the ocr task takes unprefixed; errors and the list of known keys name the flat
keys, as before they were nested."""

from __future__ import annotations

import pytest

from universal_predictors.base import StartupError, parse_engine_args
from universal_predictors.ocr.engine import OcrOptions
from universal_predictors.tasks.document import DocumentEngineArgs
from universal_predictors.tasks.ocr import OcrEngineArgs


def test_the_documents_ocr_keys_are_the_ocr_tasks_options_nested() -> None:
    raw = {"ocr_engine": "tesseract", "ocr_threads": "2", "ocr_psm": "6", "tesseract_cmd": "/usr/bin/tesseract",
           "max_pixels": "20000"}  # fmt: skip
    args = parse_engine_args(DocumentEngineArgs, raw, "doc")
    assert (args.ocr.engine, args.ocr.threads, args.ocr.psm) == ("tesseract", 2, 6)
    assert args.ocr.tesseract_cmd == "/usr/bin/tesseract"
    assert args.max_pixels == 20000
    assert isinstance(args.ocr, OcrOptions)
    defaults = parse_engine_args(OcrEngineArgs, {}, "ocr")
    nested = parse_engine_args(DocumentEngineArgs, {}, "doc").ocr
    assert {name: getattr(defaults, name) for name in OcrOptions.model_fields} == nested.model_dump(
        include=set(OcrOptions.model_fields)
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"ocr_threads": "999"}, "engine arg 'ocr_threads': Input should be less than or equal to 256 (for doc)"),
        ({"ocr_engine": "easyocr"}, "engine arg 'ocr_engine': Input should be 'rapidocr' or 'tesseract' (for doc)"),
        ({"ocr_foo": "1"}, "engine arg 'ocr_foo' is not known to doc"),
        ({"ocr": "x"}, "engine arg 'ocr' is not known to doc"),
        ({"threads": "1"}, "engine arg 'threads' is not known to doc"),
    ],
)
def test_errors_name_the_flat_key_as_sent(raw: dict[str, str], message: str) -> None:
    with pytest.raises(StartupError) as caught:
        parse_engine_args(DocumentEngineArgs, raw, "doc")
    assert str(caught.value).startswith(message)


def test_the_known_keys_listed_are_the_flat_ones() -> None:
    with pytest.raises(StartupError) as caught:
        parse_engine_args(DocumentEngineArgs, {"nope": "1"}, "doc")
    known = str(caught.value).split("(known: ", 1)[1].rstrip(")").split(", ")
    assert known == sorted(known)
    assert {"ocr_engine", "ocr_source", "ocr_languages", "ocr_threads", "tesseract_cmd", "max_pixels"} <= set(known)
    assert "ocr" not in known
    with pytest.raises(StartupError, match=r"known: .*\bthreads\b.*use_angle_cls"):
        parse_engine_args(OcrEngineArgs, {"ocr_threads": "1"}, "ocr")
