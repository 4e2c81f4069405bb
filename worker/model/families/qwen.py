"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE.

Qwen2: q/k/v biases always. Qwen3: ``attention_bias`` on all four projections (off in the
released models), and an RMSNorm over each query and key head before the rotation (``qk_norm``).
Qwen3-MoE: Qwen3's attention and a mixture of experts (``mixtral.experts``' fields, under Qwen's
keys), with dense layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say. Qwen2-MoE
(Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention and the same mixture, plus a shared expert
every token runs, gated by sigmoid(``shared_expert_gate``). All carry a
``sliding_window`` they use only with ``use_sliding_window``, and then per layer, which is not
served. GGUF: ``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe`` (q/k not permuted)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.model.families.base import PLAIN, Family, GGUFView, Raw, Shape

if TYPE_CHECKING:
    from worker.model.config import LlamaConfig


def _qwen2(raw: Raw, shape: Shape) -> dict[str, Any]:
    return PLAIN | dict(qkv_bias=True)


def _qwen3(raw: Raw, shape: Shape) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return PLAIN | dict(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _experts(raw: Raw, shape: Shape) -> dict[str, Any]:
    """Qwen's mixture fields, both generations."""
    step = int(raw.get("decoder_sparse_step", 1)) or 1
    only_mlp = {int(i) for i in raw.get("mlp_only_layers") or []}
    # The Hub's files say num_experts; transformers 5 writes num_local_experts.
    experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
    return dict(
        num_experts=int(experts), experts_per_token=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        normalize_expert_weights=bool(raw.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(shape.layers) if i in only_mlp or (i + 1) % step))


def _qwen3_moe(raw: Raw, shape: Shape) -> dict[str, Any]:
    return _qwen3(raw, shape) | _experts(raw, shape)


def _qwen2_moe(raw: Raw, shape: Shape) -> dict[str, Any]:
    return _qwen2(raw, shape) | _experts(raw, shape) | dict(
        shared_expert_intermediate_size=int(raw["shared_expert_intermediate_size"]))


def _qwen2_moe_gguf(view: GGUFView) -> dict[str, Any]:
    """llama.cpp's qwen2moe files: the shared expert's width, and the chosen experts' weights
    not renormalised (as llama.cpp computes this architecture, and the released models are)."""
    return dict(shared_expert_intermediate_size=int(view.get("expert_shared_feed_forward_length")),
                normalize_expert_weights=False)


def _window_used(raw: Raw, cfg: LlamaConfig) -> str | None:
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        return f"{cfg.architecture.removesuffix('ForCausalLM')} per-layer sliding window attention " \
               "(use_sliding_window) is not supported"
    return None


FAMILIES = (
    Family("qwen2", ("Qwen2ForCausalLM",), _qwen2, _window_used, gguf={"qwen2": "Qwen2ForCausalLM"}),
    Family("qwen3", ("Qwen3ForCausalLM",), _qwen3, _window_used, gguf={"qwen3": "Qwen3ForCausalLM"}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _qwen3_moe, _window_used, gguf={"qwen3moe": "Qwen3MoeForCausalLM"}),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), _qwen2_moe, _window_used, gguf={"qwen2moe": "Qwen2MoeForCausalLM"},
           gguf_fields=_qwen2_moe_gguf,
           gguf_names={"ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                       "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}),
)
