"""A Llama-family decoder (Llama 1-3, Mistral, Qwen2) over flattened variable-length batches.

Module and parameter names match Hugging Face's, so a checkpoint's state dict loads as it is.
The forward takes all tokens of a step as one flat sequence (no padding) plus the step's
``AttentionMetadata``; attention reads and writes the paged KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionMetadata, paged_attention
from worker.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from worker.model_config import LlamaConfig


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
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
        self.gate_proj = Linear(h, inter, bias=bias)
        self.up_proj = Linear(h, inter, bias=bias)
        self.down_proj = Linear(inter, h, bias=bias)

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
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of the positions in ``meta.logits_indices`` only (the ones that sample)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, meta, self.rotary)
        x = self.model.norm(x[meta.logits_indices])
        return self.lm_head(x).float()
