"""A Llama-family decoder (Llama 1-3, Mistral, Qwen2) over flattened variable-length batches.

Module and parameter names match Hugging Face's, so a checkpoint's state dict loads as it is.
The forward takes all tokens of a step as one flat sequence (no padding) plus the step's
``AttentionMetadata``; attention reads and writes the paged KV cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionMetadata, paged_attention
from worker.model_config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 scaling when the config asks for it."""
    d = cfg.head_dim
    # float32 throughout, as transformers computes it, so long positions round the same way.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, inv_freq)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, built once."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, d]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(meta.positions, q, k)
        out = paged_attention(q, k, v, meta, self.layer, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, inter, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of the positions in ``meta.logits_indices`` only (the ones that sample)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, meta, self.rotary)
        x = self.model.norm(x[meta.logits_indices])
        return self.lm_head(x).float()
