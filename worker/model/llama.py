"""A Llama-family decoder (Llama 1-3, Mistral, Qwen2, Qwen3) over flattened variable-length batches.

Module and parameter names match Hugging Face's, so a checkpoint's state dict loads as it is.
The forward takes all tokens of a step as one flat sequence (no padding) plus the step's
``AttentionMetadata``; attention reads and writes the paged KV cache.

Projections that read the same input are held fused: q, k and v as one ``qkv_proj``, gate and up
as one ``gate_up_proj``: one matrix multiply instead of three or two, the biggest line of a
decode step's profile. Checkpoints keep Hugging Face's separate names:
``checkpoint_shapes`` / ``load_checkpoint`` / ``checkpoint_state`` translate.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention.base import AttentionMetadata, DecodeRows
from worker.kernels import cpu as cpu_kernels
from worker.model.config import LlamaConfig
from worker.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, StepRope
from worker.model.quantized import CheckpointValue, PendingQuantized, QuantizedWeight, read_now

if TYPE_CHECKING:
    from worker.parallel import TensorParallelGroup


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
        # Qwen3: each query and key head RMS-normalised (one weight per family of heads) before
        # the rotation; OLMoE: the whole query and the whole key (all heads as one vector).
        self.whole_qk_norm, self.clip = cfg.qk_norm_whole, cfg.clip_qkv
        q_width, k_width = (self.q_size, self.kv_size) if self.whole_qk_norm else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, cfg.gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, cfg.gemma) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or self.head_dim**-0.5
        # Gemma 3: this layer's own window, read through the step's metadata for it.
        self.window = cfg.window_of(layer) if cfg.layer_windows else None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum the ranks' o_proj

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rope: StepRope) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.whole_qk_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            qk = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous())], dim=-1)
        if self.clip:  # after the norms, as OLMoE clamps
            qk, v = qk.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.whole_qk_norm:
            qk = self._norm_heads(qk, self.q_norm, self.k_norm)
        # q and k are adjacent columns: one rotation for both.
        qk = rope.rotate(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.window is not None:
            meta = meta.windowed[self.window]
        out = self.o_proj(meta.attend(self.layer, q, k, v, self.scale).reshape(t, self.num_heads * self.head_dim))
        return self.reduce(out) if self.reduce is not None else out

    def _norm_heads(self, qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """``qk`` [T, heads + kv_heads, d] with every query head normalised by ``q_norm`` and every
        key head by ``k_norm``: as rows of d, each head on its own (a new contiguous tensor)."""
        t = qk.shape[0]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q = q_norm(q.reshape(t * self.num_heads, self.head_dim)).view(t, self.num_heads, self.head_dim)
        k = k_norm(k.reshape(t * self.num_kv_heads, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        return torch.cat([q, k], dim=1)


class MLP(nn.Module):
    def __init__(self, h: int, inter: int, bias: bool, gelu: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gelu = gelu  # Gemma's GeGLU: gelu-tanh(gate) * up, in torch (the C kernel is silu's)
        self.gate_up_proj = Linear(h, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, h, bias=bias)
        self.silu_kernel: ctypes.CDLL | None = None  # the C kernels, on the CPU (LlamaForCausalLM.use_cpu_kernels)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum the ranks' down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(self.inter, dim=-1)
            out = self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        elif self.silu_kernel is not None and gate_up.dtype in (torch.float32, torch.bfloat16):
            out = self.down_proj(cpu_kernels.silu_mul(self.silu_kernel, gate_up, self.inter))
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            out = self.down_proj(F.silu(gate).mul_(up))
        return self.reduce(out) if self.reduce is not None else out


class SparseMoE(nn.Module):
    """A mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the router
    (``gate``) scores every expert for each token; the ``top_k`` best, with their softmax weights
    (renormalised over the chosen ones where the model does), each run their MLP on the token, and
    the weighted outputs are summed. Qwen2-MoE adds a shared expert that every token runs, scaled
    by sigmoid(``shared_expert_gate``), after the chosen ones' sum.

    The tokens are grouped by expert (one stable sort of the step's choices), and each expert that
    was chosen runs once over its group: a step reads the weights of the experts its tokens chose,
    once each. Each expert is an ``MLP`` of ``Linear`` layers, packed and (from a GGUF file) kept
    quantized like any other, so a row's result does not depend on which rows share its group.
    A token's expert outputs are added in the experts' order, as ``transformers`` adds them."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.num_experts
        self.top_k, self.normalize = cfg.experts_per_token, cfg.normalize_expert_weights
        self.gate = Linear(h, e, bias=False)
        self.experts = nn.ModuleList(MLP(h, cfg.expert_intermediate_size, bias=False) for _ in range(e))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(h, shared, bias=False) if shared else None
        self.shared_expert_gate = Linear(h, 1, bias=False) if shared else None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum the ranks' outputs

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts [T, k] and their weights [T, k] (float32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # choices grouped by expert, each group in token order
        tokens = order // self.top_k
        weights = weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if n:
                rows = tokens[start : start + n]
                y = self.experts[expert](x[rows])
                out.index_add_(0, rows, (y * weights[start : start + n]).to(x.dtype))
                start += n
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # a rank's share of the shared expert's rows, scaled alike on every rank: the sum is whole
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.reduce(out) if self.reduce is not None else out

    def mlps(self) -> list[MLP]:
        """Every MLP of the mixture: the experts, and the shared one where the model has it."""
        shared = [self.shared_expert] if self.shared_expert is not None else []
        return [cast(MLP, m) for m in [*self.experts, *shared]]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: MLP | SparseMoE = (SparseMoE(cfg) if cfg.is_moe_layer(layer) else
                                     MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, gelu=cfg.gemma))
        self.local = cfg.window_of(layer) is not None and cfg.gemma  # rotates with the local tables
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        # Gemma 3: post_attention_layernorm normalises the attention's output, and the MLP has a
        # norm before (instead of post_attention_layernorm) and after it.
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True) if cfg.gemma else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True) if cfg.gemma else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                rope: StepRope) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's output, not yet added to the residual stream (the first
        layer: the embeddings, and no stream yet). Returns this layer's output and the stream."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, meta, rope)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaBody(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        if cfg.gemma:
            self.rotary.local = RotaryEmbedding.for_local(cfg, max_positions)
        # A decode step's whole stack in one C call, on a CPU where every piece has its kernel
        # (worker/model/cpu_decoder.py); set after the weights are packed.
        self.cpu_decoder: Callable[[torch.Tensor, AttentionMetadata, DecodeRows],
                                   tuple[torch.Tensor, torch.Tensor]] | None = None
        # Tensor parallel (``use_tensor_parallel``): this rank's part of the model and its group.
        self.group: TensorParallelGroup | None = None
        self.vocab_start, self.full_vocab = 0, cfg.vocab_size
        # The last forward's final hidden states at its ``hidden_rows`` (embedding requests).
        self.hidden: torch.Tensor | None = None

    def use_tensor_parallel(self, group: TensorParallelGroup, vocab_start: int, full_vocab: int) -> None:
        """Built from a rank's ``ShardLayout.local_config()`` and loaded with its slices: sum the
        row-parallel projections and the vocabulary-parallel embedding over the ranks, and gather
        the logits on rank 0. The whole-stack decoder does not run (its one C call has no place
        for the all-reduces)."""
        self.group, self.vocab_start, self.full_vocab = group, vocab_start, full_vocab
        self.cpu_decoder = None
        for layer in self.model.decoder_layers():
            layer.self_attn.reduce = layer.mlp.reduce = group.all_reduce

    def use_cpu_kernels(self) -> None:
        """RMSNorm, the rotary embedding and silu(gate) * up through the C kernels (float32 or
        bfloat16 on the CPU), when they can be built here: the same functions the whole-stack
        decoder runs (``worker/model/cpu_decoder.py``), so a row's bits do not depend on which path
        computed its step."""
        kernels = cpu_kernels.load()
        self.rotary.kernel = kernels
        if self.rotary.local is not None:
            self.rotary.local.kernel = kernels
        self.model.norm.kernel = kernels
        for layer in self.model.decoder_layers():
            layer.input_layernorm.kernel = layer.post_attention_layernorm.kernel = kernels
            for mlp in layer.mlp.mlps() if isinstance(layer.mlp, SparseMoE) else [layer.mlp]:
                mlp.silu_kernel = kernels
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if norm is not None:
                    norm.kernel = kernels

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                hidden_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of the positions in ``meta.logits_indices`` only (the ones that sample); None
        on a tensor-parallel rank other than 0. ``hidden_rows``: positions whose final hidden
        states (after the last norm, in float32) are kept in ``self.hidden`` (embeddings)."""
        x = self._embed(input_ids)
        decoding = meta.decode_only() if self.cpu_decoder is not None else None
        if decoding is not None:
            assert self.cpu_decoder is not None
            x, residual = self.cpu_decoder(x, meta, decoding)
        else:
            rope = self.rotary.for_step(meta.rope_positions, x.dtype)
            local = self.rotary.local.for_step(meta.rope_positions, x.dtype) if self.rotary.local is not None else rope
            residual = None
            for layer in self.model.decoder_layers():
                x, residual = layer(x, residual, meta, local if layer.local else rope)
        assert residual is not None
        if hidden_rows is not None:
            self.hidden = self.model.norm(x[hidden_rows] + residual[hidden_rows]).float()
        x = self.model.norm(x[meta.logits_indices] + residual[meta.logits_indices])
        logits = self.lm_head(x).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.group is None:
            return logits
        if not len(logits):  # no row samples this step, on every rank alike
            return logits.new_empty(0, self.full_vocab) if self.group.rank == 0 else None
        gathered = self.group.gather_columns(logits)
        return gathered[:, : self.full_vocab] if gathered is not None else None

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(ids)
        if self.config.gemma:  # sqrt(hidden), rounded to the weights' dtype first, as Gemma scales
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.model.embed_tokens(ids)
        # This rank's vocabulary rows: ids outside them look up zeros, and the ranks' sum is the row.
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.config.vocab_size)
        x = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    # ------------------------------------------------------------------ checkpoint names

    def checkpoint_shapes(self) -> dict[str, torch.Size]:
        """Every tensor a checkpoint holds for this model, under Hugging Face's names."""
        shapes: dict[str, torch.Size] = {}
        for name, p in self.named_parameters():
            parts = _unfused(name, self.config)
            if parts is None:
                shapes[name] = p.shape
            else:
                shapes |= {part: torch.Size((rows, *p.shape[1:])) for part, rows in parts}
        return shapes

    def load_checkpoint(self, state: dict[str, CheckpointValue], dtype: torch.dtype,
                        pack: Callable[[Linear], None] | None = None) -> None:
        """Take a checkpoint's tensors (``checkpoint_shapes``' names, all present) as parameters.

        A linear weight whose parts are all quantized stays quantized (``Linear.keep_quantized``;
        its parameter an empty ``dtype`` tensor; its parts are removed from ``state`` once
        stacked, so a model's load never holds both), handed to ``pack`` at once if given (with
        ``PendingQuantized`` parts, the load then holds one weight's codes at a time), and an
        embedding tied to such an output projection looks its rows up there. Any other quantized
        tensor is dequantized to ``dtype``."""
        linears = {f"{name}.weight": m for name, m in self.named_modules() if isinstance(m, Linear)}
        fused: dict[str, torch.Tensor] = {}
        kept: dict[str, nn.Module] = {}  # parameters held elsewhere: name -> module
        embed = state.get("model.embed_tokens.weight")
        if isinstance(embed, (QuantizedWeight, PendingQuantized)) and state.get("lm_head.weight") is embed:
            self.model.embed_tokens.tied_rows = self.lm_head.weight_rows
            kept["model.embed_tokens.weight"] = self.model.embed_tokens
        for name, _ in self.named_parameters():
            if name in kept:
                continue
            parts = _unfused(name, self.config)
            values = [read_now(state[name])] if parts is None else [read_now(state[part]) for part, _ in parts]
            if name in linears and all(isinstance(v, QuantizedWeight) for v in values):
                linears[name].keep_quantized(QuantizedWeight.cat(cast(list[QuantizedWeight], values)))
                del values
                kept[name] = linears[name]
                if parts is not None:  # the parts are copied into the fused weight: let them go now
                    for part, _ in parts:
                        del state[part]
                if pack is not None:
                    pack(linears[name])
                continue
            dense = [v.dequantize().to(dtype) if isinstance(v, QuantizedWeight) else v for v in values]
            fused[name] = dense[0] if parts is None else torch.cat(dense)
        for module in kept.values():
            module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        result = self.load_state_dict(fused, strict=False, assign=True)
        assert set(result.missing_keys) == set(kept) and not result.unexpected_keys, result

    def size(self) -> tuple[int, int]:
        """(parameters, bytes) of the weights as loaded, tied ones counted once; a weight kept
        quantized counts its codes and factors as the kernel stores them."""
        unique = {p.data_ptr(): p for p in self.parameters() if p.numel()}.values()
        params, nbytes = sum(p.numel() for p in unique), sum(p.numel() * p.element_size() for p in unique)
        for m in self.modules():
            if isinstance(m, Linear) and m.kept_formats:
                params += m.kept_size[0]
                nbytes += m.kept_size[1]
        return params, nbytes

    def quantized_formats(self) -> str:
        """The GGUF types of the weights kept quantized ("Q4_1, Q8_0"), "" if none."""
        return ", ".join(dict.fromkeys(f for m in self.modules() if isinstance(m, Linear) for f in m.kept_formats))

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The parameters under a checkpoint's names (views of the fused tensors; packed linear
        weights unpacked into copies)."""
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        state: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            module, _, leaf = name.rpartition(".")
            value = linears[module].dense_weight() if leaf == "weight" and module in linears else p.detach()
            if name == "model.embed_tokens.weight" and self.model.embed_tokens.tied_rows is not None:
                value = self.lm_head.dense_weight()
            parts = _unfused(name, self.config)
            if parts is None:
                state[name] = value
                continue
            offset = 0
            for part, rows in parts:
                state[part] = value[offset : offset + rows]
                offset += rows
        return state


def _unfused(name: str, cfg: LlamaConfig) -> list[tuple[str, int]] | None:
    """The checkpoint tensors a fused parameter is made of, with their row counts, in order
    (an expert's gate and up: ``mlp.experts.N.gate_up_proj`` from ``mlp.experts.N.gate_proj``
    and ``up_proj``, the names a family's ``checkpoint_name`` gives its files')."""
    if cfg.fused_checkpoint:  # Phi-3: the files hold them as the model does
        return None
    prefix, _, rest = name.partition("self_attn.qkv_proj.")
    if rest:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(f"{prefix}self_attn.{p}_proj.{rest}", rows) for p, rows in (("q", q), ("k", kv), ("v", kv))]
    prefix, _, rest = name.partition("gate_up_proj.")
    if rest:
        rows = (cfg.expert_intermediate_size if ".experts." in prefix else
                cfg.shared_expert_intermediate_size if ".shared_expert." in prefix else cfg.intermediate_size)
        return [(f"{prefix}{p}_proj.{rest}", rows) for p in ("gate", "up")]
    return None
