"""Phi-3, Phi-3.5-mini and Phi-4-mini: the files hold q/k/v and gate/up fused, as the model holds
them (``fused_checkpoint``); LongRoPE (``layers.long_rope_angles``); Phi-4-mini rotates only
``partial_rotary_factor`` of each head (common to every family: ``config``); a sliding window
where the config sets one, as Mistral's."""

from __future__ import annotations

from typing import Any

from worker.model.families.base import PLAIN, Family, Raw, Shape, window


def _phi3(raw: Raw, shape: Shape) -> dict[str, Any]:
    return PLAIN | dict(sliding_window=window(raw), fused_checkpoint=True)


FAMILIES = (Family("phi3", ("Phi3ForCausalLM",), _phi3),)
