"""Which tool-call format a model gets: ``--engine-arg tool_call_parser=NAME`` when given (an unknown name
stops start-up with one line naming the known ones), else the format whose markers its chat template
uses, else Hermes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.predictors.generation.tiny_llama import CHAT_TEMPLATE
from universal_predictors.base import StartupError
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.tools import TOOL_PARSERS, choose_tool_parser

#: The tool parts of the chat templates these families ship (abridged; the markers are theirs).
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n\\nYou may call one or more functions to assist with "
    "the user query.\\n<tools>{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}</tools>\\n\\nFor each "
    "function call, return a json object with function name and arguments within <tool_call></tool_call> XML "
    'tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    "<|im_end|>{%- endif %}"
)
LLAMA31 = (
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}{%- if builtin_tools is defined or tools is not none %}'
    '{{- "Environment: ipython\\n" }}{%- endif %}{{- \'Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.\' }}{%- for tool_call in message.tool_calls %}'
    '{{- "<|python_tag|>" + tool_call.function.name + ".call(" }}{%- endfor %}'
)
LLAMA32 = (
    '{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
)
MISTRAL_V03 = (
    '{%- if tools is not none and (message == user_messages[-1]) %}{{- "[AVAILABLE_TOOLS] [" }}'
    '{%- for tool in tools %}{{- \'{"type": "function", "function": {\' }}{%- endfor %}{{- "[/AVAILABLE_TOOLS]" }}'
    '{%- endif %}{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- "[TOOL_CALLS] [" }}'
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25, "hermes"),
        (CHAT_TEMPLATE, "hermes"),  # the test model's own template
        (LLAMA31, "llama3_json"),
        (LLAMA32, "llama3_json"),
        (MISTRAL_V03, "mistral"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # no markers: the default
        (None, "hermes"),  # no chat template at all
    ],
    ids=["qwen2.5", "tiny-llama", "llama-3.1", "llama-3.2", "mistral-v0.3", "no-markers", "no-template"],
)
def test_the_format_is_read_from_the_chat_templates_markers(template: str | None, expected: str) -> None:
    parser, _ = choose_tool_parser(None, template)
    assert parser.name == expected


def test_the_engine_arg_wins_over_the_chat_template() -> None:
    parser, why = choose_tool_parser("mistral", QWEN25)
    assert parser is TOOL_PARSERS["mistral"]
    assert "tool_call_parser" in why


def config(source: Path, **engine_args: str) -> PredictorConfig:
    return PredictorConfig(
        model_name="m", task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(source), engine_args=engine_args
    )


def test_an_unknown_parser_name_stops_start_up_naming_the_known_ones(tmp_path: Path) -> None:
    from universal_predictors.tasks.generate import GeneratePredictor

    with pytest.raises(StartupError) as error:  # before the engine is built, let alone loaded
        GeneratePredictor(config(tmp_path, tool_call_parser="qwen"))
    message = str(error.value)
    assert "\n" not in message
    assert "'tool_call_parser'" in message
    assert "'qwen'" in message
    assert "hermes, llama3_json, mistral" in message


def test_the_engine_arg_is_the_openai_layers_not_the_engines(tiny_llama_dir: Path) -> None:
    """The transformers engine, which rejects keys it does not know, never sees it."""
    from universal_predictors.tasks.generate import GeneratePredictor

    predictor = GeneratePredictor(config(tiny_llama_dir, tool_call_parser="llama3_json"))
    assert predictor.service.tool_parser.name == "llama3_json"
