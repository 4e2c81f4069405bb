"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3: the text models (``Gemma3ForCausalLM``: 270M, 1B)
and the text model of the image-and-text checkpoints (``Gemma3ForConditionalGeneration``: 4B, 12B,
27B), whose image tower is not loaded.

Norms as (1 + weight) in float32, four per layer (the attention's and the MLP's outputs are
normalised too), GeGLU with gelu-tanh, embeddings times sqrt(hidden), queries scaled by
``query_pre_attn_scalar``, q/k norms; layers alternate a sliding window (``layer_types``, or
every ``sliding_window_pattern``-th layer global) and rotate with their own base
(``rope_parameters.sliding_attention`` or ``rope_local_base_freq``) where the global layers use
``rope_theta`` and the scaling. Gemma 2 has the same layer without the q/k norms, every other
layer windowed (from the first) with one rope base for all, and its attention scores and final
logits soft-capped (``cap tanh(x / cap)``). EmbeddingGemma's bidirectional attention is not
served."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.model.families.base import PLAIN, Family, GGUFView, Raw, Shape, rope_parameters

# Gemma3TextConfig's defaults, which the image-and-text checkpoints rely on: their config.json's
# ``text_config`` holds only what differs (the 4B model's: hidden and MLP sizes, layers, the
# window, the rope scaling), and ``transformers`` fills in the rest from its class.
TEXT_DEFAULTS: Raw = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
    query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6)
ROPE_DEFAULTS: Raw = dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)  # where no rope_parameters
# The parts of an image-and-text checkpoint that are not the text model, in both spellings
# (``transformers`` < 4.52 and the released files; newer versions under ``model.``).
IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(raw: Raw) -> Raw:
    """An image-and-text checkpoint's config.json as its text model's: ``text_config`` over the
    class defaults, with the top level's token ids and tying where it sets them."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    merged = TEXT_DEFAULTS | ({} if "rope_parameters" in text else ROPE_DEFAULTS) | text
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if raw.get(key) is not None:
            merged[key] = raw[key]
    return merged | {"architectures": raw.get("architectures")}


def checkpoint_name(name: str) -> str | None:
    """The text model's tensors of an image-and-text checkpoint under the text model's names
    (``language_model.model.X`` or ``model.language_model.X`` -> ``model.X``); its image tower's
    are not loaded."""
    if name.startswith(IMAGE_PARTS):
        return None
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name.removeprefix("language_model.")  # language_model.lm_head.weight (untied)

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


# Gemma2Config's defaults where a file leaves the key out (an explicit null: no cap)
GEMMA2_DEFAULTS: Raw = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096)


def _gemma2(raw: Raw, shape: Shape) -> dict[str, Any]:
    raw = GEMMA2_DEFAULTS | raw
    window = int(raw["sliding_window"])
    kinds = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(shape.layers)]
    return PLAIN | dict(
        gemma=True, layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
        local_rope_theta=float(shape.rope.get("rope_theta", 10000.0)),
        attention_scale=float(raw.get("query_pre_attn_scalar") or shape.head_dim) ** -0.5,
        final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0),
        attention_softcap=float(raw.get("attn_logit_softcapping") or 0.0))


def _unsupported(raw: Raw, cfg: LlamaConfig) -> str | None:
    if raw.get("use_bidirectional_attention"):
        return "bidirectional attention (EmbeddingGemma) is not supported"
    if raw.get("attn_logit_softcapping") and not cfg.attention_softcap:
        return "attention logit soft-capping is supported in Gemma 2 only"
    if cfg.attention_softcap < 0 or cfg.final_logit_softcapping < 0:
        return "a soft-cap must be positive (or null: none)"
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


def _gemma2_gguf(view: GGUFView) -> dict[str, Any]:
    """llama.cpp's gemma2 files: the window as ``attention.sliding_window`` in every other layer from
    the first, one rope base, both soft-caps (llama.cpp's defaults, Gemma 2's, where early files
    leave them out), and the query scaling llama.cpp sets in its code (1/sqrt(head width), but
    1/sqrt(hidden / heads) in the 27B model, of 46 layers)."""
    layers, heads = int(view.get("block_count")), int(view.get("attention.head_count"))
    hidden = int(view.get("embedding_length"))
    head_dim = int(view.get("attention.key_length") or hidden // heads)
    window = int(view.get("attention.sliding_window", GEMMA2_DEFAULTS["sliding_window"]))
    scalar = hidden / heads if layers == 46 else head_dim
    return dict(gemma=True, head_dim=head_dim, layer_windows=tuple(window if i % 2 == 0 else 0 for i in range(layers)),
                local_rope_theta=float(view.get("rope.freq_base") or 10000.0), attention_scale=scalar**-0.5,
                final_logit_softcapping=float(view.get("final_logit_softcapping",
                                                       GEMMA2_DEFAULTS["final_logit_softcapping"])),
                attention_softcap=float(view.get("attn_logit_softcapping", GEMMA2_DEFAULTS["attn_logit_softcapping"])))


# llama.cpp's names for the four norms of a Gemma layer
GGUF_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}

FAMILIES = (Family("gemma2", ("Gemma2ForCausalLM",), _gemma2, _unsupported, activation="gelu_pytorch_tanh",
                   gguf={"gemma2": "Gemma2ForCausalLM"}, gguf_fields=_gemma2_gguf, gguf_names=GGUF_NORMS,
                   gguf_norm_offset=-1.0),
            Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), _gemma3, _unsupported,
                   checkpoint_name=checkpoint_name, text_config=text_config, activation="gelu_pytorch_tanh",
                   gguf={"gemma3": "Gemma3ForCausalLM"}, gguf_fields=_gemma3_gguf,
                   gguf_names=GGUF_NORMS,
                   # llama.cpp's converter stores Gemma's norm weights as 1 + w (its norm multiplies by w)
                   gguf_norm_offset=-1.0),)
