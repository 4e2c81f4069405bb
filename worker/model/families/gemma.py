"""Gemma 3 (text: ``Gemma3ForCausalLM``).

Norms as (1 + weight) in float32, four per layer (the attention's and the MLP's outputs are
normalised too), GeGLU with gelu-tanh, embeddings times sqrt(hidden), queries scaled by
``query_pre_attn_scalar``, q/k norms; layers alternate a sliding window (``layer_types``, or
every ``sliding_window_pattern``-th layer global) and rotate with their own base
(``rope_parameters.sliding_attention`` or ``rope_local_base_freq``) where the global layers use
``rope_theta`` and the scaling. Gemma 2's attention logit soft-capping and EmbeddingGemma's
bidirectional attention are not served."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.model.families.base import PLAIN, Family, Raw, Shape, rope_parameters

if TYPE_CHECKING:
    from worker.model.config import LlamaConfig


def _gemma3(raw: Raw, shape: Shape) -> dict[str, Any]:
    window = int(raw["sliding_window"])
    pattern = int(raw.get("sliding_window_pattern") or 6)
    kinds = raw.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                       for i in range(shape.layers)]
    per_type = isinstance((raw.get("rope_parameters") or {}).get("sliding_attention"), dict)
    local = rope_parameters(raw, "sliding_attention") if per_type else {}
    return PLAIN | dict(
        qk_norm=True, gemma=True, layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
        local_rope_theta=float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0),
        attention_scale=float(raw.get("query_pre_attn_scalar") or shape.head_dim) ** -0.5,
        final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0))


def _unsupported(raw: Raw, cfg: LlamaConfig) -> str | None:
    if raw.get("attn_logit_softcapping") or raw.get("use_bidirectional_attention"):
        return "attention logit soft-capping and bidirectional attention (Gemma 2, EmbeddingGemma) are not supported"
    return None


FAMILIES = (Family("gemma3", ("Gemma3ForCausalLM",), _gemma3, _unsupported, activation="gelu_pytorch_tanh"),)
