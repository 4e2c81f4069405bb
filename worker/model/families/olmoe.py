"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B): Llama's layer with a mixture of experts in every
layer (Qwen's fields: ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``; each expert
``intermediate_size`` wide), and q/k RMSNorms over the whole projection, every head at once,
before the rotation, then q, k and v clamped to ``clip_qkv`` where the config sets it. GGUF:
``olmoe`` (q/k not permuted; the chosen experts' weights never renormalised, as llama.cpp
computes this architecture)."""

from __future__ import annotations

from typing import Any

from worker.model.families.base import PLAIN, Family, GGUFView, Raw, Shape


def _olmoe(raw: Raw, shape: Shape) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return PLAIN | dict(
        qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True, clip_qkv=float(raw.get("clip_qkv") or 0.0),
        num_experts=int(raw["num_experts"]), experts_per_token=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["intermediate_size"]),
        normalize_expert_weights=bool(raw.get("norm_topk_prob", False)))


def _olmoe_gguf(view: GGUFView) -> dict[str, Any]:
    return dict(qk_norm_whole=True, normalize_expert_weights=False,
                clip_qkv=float(view.get("attention.clamp_kqv") or 0.0))


FAMILIES = (Family("olmoe", ("OlmoeForCausalLM",), _olmoe, gguf={"olmoe": "OlmoeForCausalLM"},
                   gguf_fields=_olmoe_gguf),)
