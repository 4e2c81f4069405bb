"""A decode step's whole decoder stack in one C call, on a CPU (``kernels/csrc/decoder.c``).

Run operator by operator, a SmolLM2 decode step at one row spent 4.8 of its 14.5 ms outside its
matrix products (measured on a 2-core Zen 5): about fifteen torch operators and ctypes calls per
layer, each a few microseconds, and a parallel region per kernel. ``decode_layers`` runs every
layer inside one parallel region instead, each stage a work-shared loop ending at a barrier.

It runs where every piece has its kernel: every linear packed for Sluice's own kernel (float32
on AVX-512, bfloat16 on AVX512-BF16 too), attention through the C decode kernel (the
``cpu-paged`` backend), and a step whose rows all decode one token. Every other step (prefill
chunks, mixed steps) goes through the per-operator forward, which calls the same C functions for
the same stages: a row gets the same bits whichever path ran it.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch

from worker.attention.base import AttentionMetadata, DecodeRows
from worker.kernels import cpu as cpu_kernels
from worker.kv_cache import KVCache
from worker.model.layers import Linear, RMSNorm
from worker.model.llama import MLP, LlamaForCausalLM, SparseMoE

log = logging.getLogger("sluice.worker")

LAYER_FIELDS = 18  # the addresses (and quantized linears' formats) decoder.c reads per layer, in its enum's order


class CpuDecoder:
    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM) -> None:
        cfg = model.config
        self.lib, self.model = lib, model
        self.dtype = model.model.embed_tokens.weight.dtype
        self.entry = lib.decode_layers_bf16 if self.dtype == torch.bfloat16 else lib.decode_layers_f32
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        first = model.model.decoder_layers()[0]
        self.eps = first.input_layernorm.eps
        self.scale = first.self_attn.scale
        self.cos, self.sin = model.rotary.cos, model.rotary.sin
        self._tables: weakref.WeakKeyDictionary[KVCache, torch.Tensor] = weakref.WeakKeyDictionary()
        self._scratch: list[torch.Tensor] = []
        self._xq: torch.Tensor | None = None
        self.quantized = any(m.quant_format is not None for m in model.modules() if isinstance(m, Linear))
        self.widest_input = max(self.hidden, self.heads * self.head_dim, self.inter)  # of the layers' linears
        # The scratch rows of h, qkv, attention, gate/up and silu * up, in decoder.c's order.
        self.widths = [self.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, self.heads * self.head_dim,
                       2 * self.inter, self.inter]

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> CpuDecoder | None:
        """The decoder, or None (said in the log) where a piece has no kernel here."""
        why = _unsupported(model)
        if why is not None:
            log.info("decode steps run operator by operator: %s", why)
            return None
        lib = cpu_kernels.load()
        assert lib is not None
        log.info("decode steps run the whole decoder stack in one C call")
        return cls(lib, model)

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings ``x`` [T, hidden] (overwritten) of a step whose rows all decode ->
        (the last layer's output, the residual stream), as the per-operator forward returns them."""
        num_rows = x.shape[0]
        rope_positions = meta.rope_positions
        self.model.rotary.check(rope_positions)
        residual = torch.empty_like(x)
        h, qkv, attn, gate_up, act = self._buffers(num_rows)
        ptr = cpu_kernels._ptr
        self.entry(ptr(x), ptr(residual), ptr(h), ptr(qkv), ptr(attn), ptr(gate_up), ptr(act),
                   ptr(self._quantized_scratch(num_rows)), ptr(self._layer_table(meta.cache)), len(self.model.model.layers), ptr(meta.slot_mapping),
                   ptr(rope_positions), ptr(self.cos), ptr(self.sin), ptr(rows.block_table), rows.block_table.shape[1],
                   ptr(rows.context_lens), ptr(rows.first_positions), num_rows, self.hidden, self.heads, self.kv_heads,
                   self.head_dim, self.inter, meta.cache.block_size, self.eps, self.scale, torch.get_num_threads(),
                   *self._cache_flag(meta.cache))
        return x, residual

    def _cache_flag(self, cache: KVCache) -> tuple[int, ...]:
        """The float32 stack's last argument: 1 where its cache is bfloat16 (``--kv-cache-dtype``)."""
        if self.dtype == torch.bfloat16:
            assert cache.dtype == torch.bfloat16, "a bfloat16 model keeps a bfloat16 cache"
            return ()
        return (int(cache.dtype == torch.bfloat16),)

    def _buffers(self, num_rows: int) -> list[torch.Tensor]:
        """Scratch rows for every stage, kept across steps (a fresh large buffer pays its page
        faults on every step); grown to the most rows seen."""
        if not self._scratch or self._scratch[0].shape[0] < num_rows:
            self._scratch = [torch.empty((num_rows, w), dtype=self.dtype) for w in self.widths]
        return [b[:num_rows] for b in self._scratch]

    def _quantized_scratch(self, num_rows: int) -> torch.Tensor:
        """The quantized linears' int8 activations for the widest input (a byte where none is quantized)."""
        need = cpu_kernels.quantized_scratch_bytes(num_rows, self.widest_input) if self.quantized else 1
        if self._xq is None or self._xq.numel() < need:
            self._xq = torch.empty(need, dtype=torch.uint8)
        return self._xq

    def _layer_table(self, cache: KVCache) -> torch.Tensor:
        """Every layer's tensor addresses ([layers, LAYER_FIELDS] int64); built once per cache.
        Weights and cache never move once loaded, so the addresses stay valid."""
        table = self._tables.get(cache)
        if table is None:
            rows = []
            for i, layer in enumerate(self.model.model.decoder_layers()):
                attn, mlp = layer.self_attn, layer.mlp
                assert isinstance(mlp, MLP)  # ``_unsupported`` turned mixtures of experts away
                rows.append([_address(layer.input_layernorm.weight), *_linear(attn.qkv_proj), *_linear(attn.o_proj),
                             _address(layer.post_attention_layernorm.weight), *_linear(mlp.gate_up_proj),
                             *_linear(mlp.down_proj), _address(cache.key_slots[i]), _address(cache.value_slots[i]),
                             _address(_weight(attn.q_norm)), _address(_weight(attn.k_norm))])
            table = torch.tensor(rows, dtype=torch.int64)
            assert table.shape[1] == LAYER_FIELDS
            self._tables[cache] = table
        return table


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _linear(layer: Linear) -> tuple[int, int, int]:
    return _address(layer.packed), _address(layer.bias), layer.quant_format.word if layer.quant_format else 0


def _unsupported(model: LlamaForCausalLM) -> str | None:
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"no C kernels for {str(dtype).removeprefix('torch.')}"
    if model.rotary.cos.device.type != "cpu" or model.rotary.kernel is None:
        return "the C kernels are not loaded"
    if model.config.gemma:
        return "decoder.c has no stages for Gemma's norms, GeGLU and sliding-window layers"
    if model.config.attention_softcap:
        return "decoder.c's attention does not soft-cap scores"
    if model.config.qk_norm_whole or model.config.clip_qkv:
        return "decoder.c normalises q and k head by head, and clamps nothing"
    if model.rotary.partial:
        return "decoder.c rotates whole heads, and this model rotates part of each (partial_rotary_factor)"
    layers = model.model.decoder_layers()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoE):
            return "decoder.c has no stage for a mixture of experts"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear.kernels is None:
                return f"the linear layers are not packed for Sluice's {str(dtype).removeprefix('torch.')} kernel here"
        if layer.input_layernorm.eps != layers[0].input_layernorm.eps or \
                layer.post_attention_layernorm.eps != layer.input_layernorm.eps:
            return "the norms' eps differ between layers"
        if mlp.silu_kernel is None:
            return "the C kernels are not loaded"
        if attn.q_norm is not None and (attn.q_norm.eps != layer.input_layernorm.eps or attn.k_norm is None
                                        or attn.k_norm.eps != attn.q_norm.eps):
            return "the q/k norms' eps differ from the layers' norms"
    return None
