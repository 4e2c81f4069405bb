"""The typed subset of a Hugging Face ``config.json`` that the shared decoder needs.

Every family Sluice serves (``worker.model.families``: Llama, Mistral, Qwen2/3, Qwen3-MoE,
Mixtral, Phi-3/4-mini, Gemma 3) is this one decoder; what sets a family apart is a field here
(biases, q/k norms, experts, fused files, Gemma's norms and windows), which its module reads from
its ``config.json``. Anything the decoder cannot reproduce exactly (another activation, another
rope type, a per-layer window it lacks) is rejected here with one line naming the file, rather
than served with silently different outputs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from worker.model.families import FAMILIES
from worker.model.families.base import Shape, rope_parameters

# freq_factors: each rotated pair's frequency divided by its factor, as GGUF files keep Llama 3's
# scaling (the tensor rope_freqs); not a config.json kind
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope", "freq_factors")


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
    # Qwen2-MoE: beside the chosen experts, a shared expert every token runs (an MLP this wide;
    # 0: none), its output scaled by sigmoid of a one-output gate (``shared_expert_gate``).
    shared_expert_intermediate_size: int = 0
    # OLMoE: the q/k norms take the whole projection (every head at once), not each head; and
    # q, k, v clamped to +-clip_qkv after them where the config sets it (0: not clamped).
    qk_norm_whole: bool = False
    clip_qkv: float = 0.0
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
    attention_softcap: float = 0.0  # 0: none; else each scaled attention score s = cap * tanh(s / cap) (Gemma 2)

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
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise ModelLoadError(
                f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(FAMILIES)}"
            )
        raw = FAMILIES[arch].text_config(raw)
        try:
            cfg = _parse(raw, arch)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: missing or invalid field {e}") from None
        problem = cfg._unsupported(raw)
        if problem:
            raise ModelLoadError(f"{path}: {problem}")
        return cfg

    def _unsupported(self, raw: dict[str, Any]) -> str | None:
        family = FAMILIES[self.architecture]
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act != family.activation:
            return f"hidden_act {act!r} is not supported (only {family.activation})"
        problem = family.unsupported(raw, self)
        if problem:
            return problem
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            return f"rope scaling type {rope_type!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)})"
        if self.rotated_dims % 2 or self.rotated_dims > self.head_dim:
            return f"partial_rotary_factor gives {self.rotated_dims} of {self.head_dim} dimensions rotated"
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


def _parse(raw: dict[str, Any], arch: str) -> LlamaConfig:
    """The fields every family reads alike, then the family's own (``worker.model.families``)."""
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    rope = rope_parameters(raw)
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    layers = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    family = FAMILIES[arch].fields(raw, Shape(arch, layers, head_dim, rope))
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
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        **family,
    )
