"""The typed subset of a Hugging Face ``config.json`` that a Llama-family model needs.

Llama, Mistral, Qwen2 and Qwen3 share one decoder; they differ in which projections carry a bias,
in Qwen3's RMSNorm of each query and key head before the rotation, and in defaults. Mixtral and
Qwen3-MoE are the same decoder with a mixture of experts in place of the MLP (``num_experts``);
Phi-3 and Phi-4-mini the same with their projections fused in the files and, for Phi-4-mini, part
of each head rotated. Gemma 3 (text) adds its own norms, GeGLU, scaled embeddings and sliding
window layers between global ones (``gemma``). Anything this decoder cannot reproduce exactly (another activation, another
rope type, an active sliding window) is rejected here with one line naming the file, rather
than served with silently different outputs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM")
# Families whose configs carry ``use_sliding_window``: a window applies only when it is set (and
# then per layer, which this decoder does not do).
_WINDOW_IF_USED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message is one line naming the file and the reason."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # its rope_type one of SUPPORTED_ROPE_TYPES; None = plain rope
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama and Qwen3 when attention_bias
    o_bias: bool  # Llama and Qwen3 when attention_bias (Qwen2's o_proj never has one)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each query and key head (head_dim wide) before the rotation
    sliding_window: int | None  # attention span limit when the model uses one
    bos_token_id: int | None
    eos_token_ids: list[int]
    # Mixture of experts (Mixtral, Qwen3-MoE): in each layer not in ``dense_layers``, a router
    # picks ``experts_per_token`` of ``num_experts`` MLPs (``expert_intermediate_size`` wide) for
    # each token, their outputs summed with the router's softmax weights, renormalised over the
    # chosen ones when ``normalize_expert_weights``. 0 experts: every layer is a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True
    dense_layers: tuple[int, ...] = ()
    # Phi-3 / Phi-4-mini: the files hold q/k/v and gate/up fused as the model holds them
    # (``qkv_proj``, ``gate_up_proj``), and Phi-4-mini rotates only the first ``rotary_dim`` of
    # each head's dimensions (``partial_rotary_factor``). 0: the whole head.
    fused_checkpoint: bool = False
    rotary_dim: int = 0

    # Gemma 3: norms as (1 + weight) computed in float32, four per layer (the attention's and the
    # MLP's outputs normalised too), GeGLU (gelu-tanh), embeddings times sqrt(hidden), queries
    # scaled by ``attention_scale``; layers with a window in ``layer_windows`` (0: global) rotate
    # with ``local_rope_theta`` and no scaling, the global ones with rope_theta and rope_scaling.
    gemma: bool = False
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float = 0.0
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    final_logit_softcapping: float = 0.0  # 0: none; else logits = cap * tanh(logits / cap)

    def window_of(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: it sees its whole context)."""
        if self.layer_windows:
            return self.layer_windows[layer] or None
        return self.sliding_window

    @property
    def rotated_dims(self) -> int:
        """How many of each head's dimensions the rotation turns."""
        return self.rotary_dim or self.head_dim

    def context_limit(self) -> int:
        """The longest context the model's rotation reaches: ``max_position_embeddings``, times the
        factor of the scalings that stretch it (linear, dynamic NTK, YaRN: from
        ``original_max_position_embeddings`` where the config gives it), as vLLM derives it. Llama 3's
        and LongRoPE's configs already say their stretched length."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") not in ("linear", "dynamic", "yarn") or not scaling.get("factor"):
            return self.max_position_embeddings
        base = int(scaling.get("original_max_position_embeddings") or self.max_position_embeddings)
        return max(self.max_position_embeddings, int(base * float(scaling["factor"])))

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        raw = _read_json(path)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            cfg = _parse(raw, arch)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: missing or invalid field {e}") from None
        problem = cfg._unsupported(raw)
        if problem:
            raise ModelLoadError(f"{path}: {problem}")
        return cfg

    def _unsupported(self, raw: dict[str, Any]) -> str | None:
        act = raw.get("hidden_activation") or raw.get("hidden_act", "silu") if self.gemma else raw.get("hidden_act", "silu")
        if act != ("gelu_pytorch_tanh" if self.gemma else "silu"):
            return f"hidden_act {act!r} is not supported (only {'gelu_pytorch_tanh' if self.gemma else 'silu'})"
        if self.gemma and (raw.get("attn_logit_softcapping") or raw.get("use_bidirectional_attention")):
            return "attention logit soft-capping and bidirectional attention (Gemma 2, EmbeddingGemma) are not supported"
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            return f"rope scaling type {rope_type!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)})"
        if self.rotated_dims % 2 or self.rotated_dims > self.head_dim:
            return f"partial_rotary_factor gives {self.rotated_dims} of {self.head_dim} dimensions rotated"
        if self.architecture in _WINDOW_IF_USED and self.sliding_window is not None:
            return f"{self.architecture.removesuffix('ForCausalLM')} per-layer sliding window attention " \
                   "(use_sliding_window) is not supported"
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            return f"{self.experts_per_token} experts per token of {self.num_experts}"
        if self.num_heads % self.num_kv_heads:
            return f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing (a model directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return raw


def _rope_parameters(raw: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """transformers >= 5 writes one ``rope_parameters`` dict (Gemma 3: one per layer type); older
    files write ``rope_theta`` and ``rope_scaling`` (whose type key was once ``type``). Merge both
    spellings into one dict."""
    params = dict(raw.get("rope_parameters") or {})
    if layer_type in params:  # per layer type
        return _rope_parameters({"rope_parameters": params[layer_type]})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    params.update(raw.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    return params


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    """Mistral applies ``sliding_window`` in every layer when set. Qwen2 and Qwen3 configs carry a
    window they use only with ``use_sliding_window`` (and then per layer, which is rejected elsewhere)."""
    window = raw.get("sliding_window")
    if arch in ("LlamaForCausalLM", "Gemma3ForCausalLM") or (arch in _WINDOW_IF_USED and not raw.get("use_sliding_window")):
        return None
    return int(window) if window else None


def _parse(raw: dict[str, Any], arch: str) -> LlamaConfig:
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    rope = _rope_parameters(raw)
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    # attention_bias puts a bias on all four projections in Llama and Qwen3; Qwen2 has q/k/v biases always.
    attention_bias = bool(raw.get("attention_bias", False)) and arch in ("LlamaForCausalLM", *_QWEN3)
    layers = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    gemma: dict[str, Any] = {}
    if arch == "Gemma3ForCausalLM":
        window = int(raw["sliding_window"])
        pattern = int(raw.get("sliding_window_pattern") or 6)
        kinds = raw.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                           for i in range(layers)]
        local = _rope_parameters(raw, "sliding_attention") if isinstance(
            (raw.get("rope_parameters") or {}).get("sliding_attention"), dict) else {}
        gemma = dict(gemma=True, layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
                     local_rope_theta=float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0),
                     attention_scale=float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                     final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0))
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    moe: dict[str, Any] = {}
    if arch == "MixtralForCausalLM":  # every layer; Mixtral always renormalises its top-k weights
        moe = dict(num_experts=int(raw["num_local_experts"]), experts_per_token=int(raw["num_experts_per_tok"]),
                   expert_intermediate_size=int(raw["intermediate_size"]), normalize_expert_weights=True)
    elif arch == "Qwen3MoeForCausalLM":
        step = int(raw.get("decoder_sparse_step", 1)) or 1
        only_mlp = {int(i) for i in raw.get("mlp_only_layers") or []}
        # The Hub's files say num_experts; transformers 5 writes num_local_experts.
        experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        moe = dict(num_experts=int(experts), experts_per_token=int(raw["num_experts_per_tok"]),
                   expert_intermediate_size=int(raw["moe_intermediate_size"]),
                   normalize_expert_weights=bool(raw.get("norm_topk_prob", False)),
                   dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step))
    return LlamaConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        qk_norm=arch in (*_QWEN3, "Gemma3ForCausalLM"),
        sliding_window=_sliding_window(raw, arch),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        **moe,
        fused_checkpoint=arch == "Phi3ForCausalLM",
        **gemma,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
    )
