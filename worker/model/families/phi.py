"""Phi-3, Phi-3.5-mini and Phi-4-mini: the files hold q/k/v and gate/up fused, as the model holds
them (``fused_checkpoint``); LongRoPE (``layers.long_rope_angles``); Phi-4-mini rotates only
``partial_rotary_factor`` of each head (common to every family: ``config``); a sliding window
where the config sets one, as Mistral's."""

from __future__ import annotations

from typing import Any

from worker.model.families.base import PLAIN, Family, GGUFView, Raw, Shape, window


def _phi3(raw: Raw, shape: Shape) -> dict[str, Any]:
    return PLAIN | dict(sliding_window=window(raw), fused_checkpoint=True)


def _phi3_gguf(view: GGUFView) -> dict[str, Any]:
    """llama.cpp's phi3 files: the rotated dimensions as ``rope.dimension_count``, LongRoPE's
    factors as the tensors ``rope_factors_long`` / ``_short``, its original context as
    ``rope.scaling.original_context_length``."""
    heads, hidden = int(view.get("attention.head_count")), int(view.get("embedding_length"))
    head_dim = hidden // heads
    rotated = int(view.get("rope.dimension_count") or head_dim)
    fields: dict[str, Any] = dict(fused_checkpoint=True, head_dim=head_dim,
                                  rotary_dim=rotated if rotated != head_dim else 0,
                                  sliding_window=int(view.get("attention.sliding_window") or 0) or None)
    if "rope_factors_long.weight" in view.tensors:
        scaling: dict[str, Any] = {
            "rope_type": "longrope", "long_factor": view.floats("rope_factors_long.weight"),
            "short_factor": view.floats("rope_factors_short.weight"),
            "original_max_position_embeddings": int(view.get("rope.scaling.original_context_length")),
        }
        if view.get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(view.get("rope.scaling.attn_factor"))
        fields["rope_scaling"] = scaling
    return fields


FAMILIES = (Family("phi3", ("Phi3ForCausalLM",), _phi3, gguf={"phi3": "Phi3ForCausalLM"}, gguf_fields=_phi3_gguf,
                   gguf_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                   gguf_config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),)
