"""Hermes (NousResearch Hermes 2 Pro/3, Qwen 2.5/3 and most ChatML tool templates)::

    I'll check. <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Content may come before the first block. A whole output that is one bare call object counts too, but
only the end can tell it from JSON content, so it is sent whole at the end of a stream.
"""

from __future__ import annotations

from universal_predictors.generation.tools.calls import JSONCallFormat

HERMES = JSONCallFormat(
    name="hermes",
    template_markers=("<tool_call>",),
    open="<tool_call>",
    separator=r"\s*</tool_call>[\s\S]*?<tool_call>",
    stream_bare=False,
)
