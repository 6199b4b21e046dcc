"""What a LoRA adapter looks like: rank, scale, which projections it wraps, dropout."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from asyncrl.config_base import PositiveInt, config

__all__ = ["DEFAULT_TARGETS", "LoraConfig"]

# The attention and MLP projections of Llama / Qwen2 / Mistral-style decoders (by module name).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

ModuleName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


@config
class LoraConfig:
    """A low-rank adapter on the policy (``asyncrl.lora.apply_lora``): each targeted linear layer ``W`` computes
    ``W x + (alpha / rank) * B A x``, with ``A`` (rank x in) and ``B`` (out x rank) the only weights trained."""

    rank: Annotated[PositiveInt, Field(description=(
        "rank r of each adapter (the inner size of B A); more capacity and memory as it grows"))] = 16
    alpha: Annotated[PositiveInt, Field(description=(
        "scale numerator: the adapter's output is multiplied by alpha / rank"))] = 32
    target_modules: Annotated[tuple[ModuleName, ...], Field(min_length=1, description=(
        "names of the linear modules to adapt (the last part of their dotted name, e.g. 'q_proj'); every "
        "name must match at least one module of the model. Default: the attention and MLP projections of "
        "Llama/Qwen2-style decoders"))] = DEFAULT_TARGETS
    dropout: Annotated[float, Field(strict=True, ge=0, lt=1, description=(
        "dropout on the adapter's input while training (0 = none, and a deterministic forward)"))] = 0.0
