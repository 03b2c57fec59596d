"""The engine arguments every encoder task takes (``--engine-arg key=value``); tasks subclass to add theirs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EncoderEngineArgs(BaseModel):
    """Batching, placement and the input cap, shared by embed, rerank, classify and NER."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=32, ge=1, le=4096, description="Inputs per forward pass at most.")
    max_wait_ms: float = Field(default=5.0, ge=0, le=1000, description="How long a batch waits for company.")
    max_batch_tokens: int = Field(default=16384, ge=1, description="Token budget of one forward pass.")
    max_input_tokens: int | None = Field(
        default=None, ge=2, description="Cap below the model's own input limit (special tokens included)."
    )
    device: str = "auto"
    dtype: str = "auto"
