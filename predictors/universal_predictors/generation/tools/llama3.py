"""Llama 3.1/3.2/3.3 JSON tool calls (the format their chat templates ask for with custom tools)::

    {"name": "get_weather", "parameters": {"city": "Oslo"}}

optionally after ``<|python_tag|>`` (when the tokenizer keeps that special token in the text), several
calls separated by ``;``. ``arguments`` is accepted in place of ``parameters``.
"""

from __future__ import annotations

from universal_predictors.generation.tools.calls import JSONCallFormat

LLAMA3_JSON = JSONCallFormat(
    name="llama3_json",
    template_markers=("<|python_tag|>", '"parameters": dictionary of argument name'),
    open="<|python_tag|>",
    separator=r"(?:;|<\|python_tag\|>)?",
    argument_keys=("parameters", "arguments"),
)
