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

from worker.model.families.base import PLAIN, Family, GGUFView, Raw, Shape, rope_parameters

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


def _gemma3_gguf(view: GGUFView) -> dict[str, Any]:
    """llama.cpp's gemma3 files (the text model; the image tower is a separate file): the window
    as ``attention.sliding_window``, every sixth layer global and the local layers' base 10,000
    as llama.cpp sets them in its code (unless the file says otherwise), the queries scaled by
    1/sqrt(head width) but in the 27B model (62 layers), which scales by 1/sqrt(hidden / heads)."""
    layers, heads = int(view.get("block_count")), int(view.get("attention.head_count"))
    hidden = int(view.get("embedding_length"))
    head_dim = int(view.get("attention.key_length") or hidden // heads)
    window = int(view.get("attention.sliding_window"))
    pattern = int(view.get("attention.sliding_window_pattern") or 6)
    scalar = hidden / heads if layers == 62 else head_dim
    return dict(qk_norm=True, gemma=True, head_dim=head_dim,
                layer_windows=tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers)),
                local_rope_theta=float(view.get("rope.freq_base_swa") or 10000.0), attention_scale=scalar**-0.5,
                final_logit_softcapping=float(view.get("final_logit_softcapping") or 0.0))


FAMILIES = (Family("gemma3", ("Gemma3ForCausalLM",), _gemma3, _unsupported, activation="gelu_pytorch_tanh",
                   gguf={"gemma3": "Gemma3ForCausalLM"}, gguf_fields=_gemma3_gguf,
                   gguf_names={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                               "post_ffw_norm": "post_feedforward_layernorm"},
                   # llama.cpp's converter stores Gemma's norm weights as 1 + w (its norm multiplies by w)
                   gguf_norm_offset=-1.0),)
