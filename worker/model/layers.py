"""The building blocks of a Llama-family decoder: weight-only linear and embedding layers,
RMSNorm, and rotary position embeddings (with the scalings configs use: Llama 3's, linear,
dynamic NTK, YaRN, LongRoPE).

``Linear`` and ``Embedding`` allocate their parameters uninitialised: every weight comes from a
checkpoint, and skipping ``reset_parameters`` also keeps building a model on the meta device
cheap (torch's random initialisers on meta tensors pull in its compiler stack, ~3 s per process).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import cpu as cpu_kernels
from worker.kernels import quant_records
from worker.kernels.quant_records import PackedFormat
from worker.model.config import LlamaConfig
from worker.model.quantized import QuantizedWeight


class Linear(nn.Module):
    """``y = x W^T (+ b)``, parameter names as ``torch.nn.Linear``. On a CPU the weight may be
    replaced by a packed copy (``cpu_matmul.pack_layer``): in the C kernel's layout when
    ``kernels`` is set, else (bfloat16) in oneDNN's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.kernels: ctypes.CDLL | None = None
        # A weight kept quantized (a GGUF file's blocks): held here until packed for the quantized
        # kernel (cpu_matmul.pack_layer), then ``quant_format`` says how the records store it.
        self.quantized: QuantizedWeight | None = None
        self.quant_format: PackedFormat | None = None
        # What a weight kept quantized is, known before and after packing: its GGUF types, and
        # its parameters and bytes as the kernel stores them.
        self.kept_formats: tuple[str, ...] = ()
        self.kept_size = (0, 0)

    def keep_quantized(self, q: QuantizedWeight) -> None:
        """Hold ``q`` as the weight, until it is packed (``cpu_matmul.pack_layer``)."""
        self.quantized = q
        self.kept_formats, self.kept_size = q.formats, (q.codes.numel(), q.nbytes)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] as a checkpoint holds it, unpacked if need be (a quantized one
        dequantized to float32)."""
        if self.quantized is not None:
            return self.quantized.dequantize()
        if self.packed is None:
            return self.weight.detach()
        if self.quant_format is not None:
            return quant_records.unpack(self.packed, self.quant_format, self.out_features).dequantize()
        if self.kernels is None:
            raise RuntimeError("a weight packed for oneDNN cannot be read back; load the model without packing")
        return cpu_kernels.unpack_linear(self.packed, self.out_features)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (float32), read from its quantized form (a tied embedding's lookup)."""
        if self.quantized is not None:
            return self.quantized.rows(rows).dequantize()
        assert self.packed is not None and self.quant_format is not None
        if self.kernels is not None:
            return cpu_kernels.dequantize_rows(self.kernels, self.packed, self.quant_format, self.out_features, rows)
        return quant_records.unpack(self.packed, self.quant_format, self.out_features, rows).dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.kernels is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            if self.quant_format is not None:
                return cpu_kernels.linear_q(self.kernels, x, self.packed, self.bias, self.out_features, self.quant_format)
            return cpu_kernels.linear(self.kernels, x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))
        # Tied to an output projection kept quantized: its rows, dequantized as they are looked up
        # (no second, dense copy of the vocabulary). A bound method, not a submodule.
        self.tied_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tied_rows is not None:
            return self.tied_rows(ids.reshape(-1)).to(self.weight.dtype).reshape(*ids.shape, -1)
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Gemma's: times (1 + weight), all in float32 and rounded once (never the C kernel's).
        self.gemma = gemma
        self.kernel: ctypes.CDLL | None = None  # the C kernels, on the CPU (LlamaForCausalLM.use_cpu_kernels)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and not self.gemma and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if self._kernel_takes(x):
            assert self.kernel is not None
            return cpu_kernels.rms_norm(self.kernel, x, self.weight, self.eps)  # one call instead of six operators
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one kernel instead of six
        # Half precision normalises in float32 and rounds before the weight, as transformers does.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(RMSNorm(x + residual), x + residual)``: the residual stream's add fused with the
        norm that reads it. ``residual`` is the worker's own buffer and may be updated in place."""
        if self._kernel_takes(x) and residual.dtype == x.dtype and residual.is_contiguous():
            assert self.kernel is not None
            return cpu_kernels.rms_norm(self.kernel, x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self(residual), residual


def _exponents(cfg: LlamaConfig) -> torch.Tensor:
    """2i / d for each rotated pair of dimensions: a frequency is ``base ** -exponent``."""
    d = cfg.rotated_dims
    return torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies for the config's scaling at positions the model was trained on
    (``rope_angles`` handles the kinds that change with the position): plain, Llama 3's, linear,
    YaRN, LongRoPE's short factors. Computed in float32 as ``transformers`` computes them, so long
    positions round the same way."""
    exponents = _exponents(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "llama3":
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
    elif kind == "linear":  # positions divided by the factor: the same as frequencies divided
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "yarn":
        inv_freq = _yarn(cfg, scaling, exponents)
    elif kind == "longrope":
        inv_freq = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
                          * cfg.rope_theta ** exponents)
    elif kind == "freq_factors":  # as llama.cpp turns a pair: position x base^-exponent / factor
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    return inv_freq


def _yarn(cfg: LlamaConfig, scaling: dict[str, object], exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by the factor), those that turn more than ``beta_fast`` times kept,
    and a linear ramp between the two."""
    d, base = cfg.rotated_dims, cfg.rope_theta
    factor = float(scaling.get("factor") or cfg.max_position_embeddings / _original_len(scaling))  # type: ignore[arg-type]
    original = _original_len(scaling)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)  # type: ignore[arg-type]

    def dim_turning(turns: float) -> float:  # the dimension whose frequency turns ``turns`` times
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(fast), dim_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    pos_freqs = base ** exponents
    return (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def _original_len(scaling: dict[str, object]) -> float:
    return float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]


def rope_attention_factor(cfg: LlamaConfig) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (1.0 for the other kinds)."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor") or cfg.max_position_embeddings / _original_len(scaling))
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(_original_len(scaling)))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)


def rope_angles(cfg: LlamaConfig, max_positions: int) -> torch.Tensor:
    """Every position's rotation angles [max_positions, rotated_dims / 2]. Dynamic NTK changes its
    frequencies past the trained context, here position by position (so a token's rotation never
    depends on the batch it runs in): the base for position p is the one ``transformers`` uses
    when the sequence is p + 1 long, so decoding token by token gives its keys and queries
    exactly. (LongRoPE's long factors are a second table: ``long_rope_angles``.)"""
    positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    angles = torch.outer(positions, rope_inv_freq(cfg))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "dynamic" and max_positions > cfg.max_position_embeddings:
        trained = cfg.max_position_embeddings
        d, factor = cfg.rotated_dims, float(scaling["factor"])
        later = torch.arange(trained, max_positions, dtype=torch.float64, device="cpu")
        bases = cfg.rope_theta * ((factor * (later + 1) / trained) - (factor - 1)) ** (d / (d - 2))
        angles[trained:] = later.float().unsqueeze(1) * (1.0 / (bases.float().unsqueeze(1) ** _exponents(cfg)))
    return angles


def long_rope_angles(cfg: LlamaConfig, max_positions: int) -> torch.Tensor | None:
    """LongRoPE's angles with its long factors, for requests whose prompt is longer than the
    original context (None for the other kinds). ``transformers`` switches a sequence to them
    once it is that long; here a request takes one table for its whole life (chosen by its
    prompt's length), so its keys and queries always turn alike and no batch changes them."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return None
    inv = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32, device="cpu") * cfg.rope_theta ** _exponents(cfg))
    return torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, built once on the CPU (even
    inside a meta-device context: they are computed, never loaded) and moved with the model."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        self.kernel: ctypes.CDLL | None = None  # the C kernels, on the CPU (LlamaForCausalLM.use_cpu_kernels)
        self.partial = cfg.rotated_dims < cfg.head_dim  # Phi-4-mini: the C rotation turns whole heads only
        self.local: RotaryEmbedding | None = None  # Gemma 3: the sliding-window layers' own (``for_local``)
        freqs = rope_angles(cfg, max_positions)
        long = long_rope_angles(cfg, max_positions)
        # LongRoPE: the long table after the short one; a long request's positions are read
        # ``long_offset`` further on (``AttentionMetadata.rope_offsets``).
        self.long_offset = max_positions if long is not None else 0
        self.long_after = int((cfg.rope_scaling or {}).get("original_max_position_embeddings") or 0)
        if long is not None:
            freqs = torch.cat([freqs, long])
        emb = torch.cat([freqs, freqs], dim=-1)
        factor = rope_attention_factor(cfg)  # YaRN's and LongRoPE's, on both tables as transformers applies it
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)

    @classmethod
    def for_local(cls, cfg: LlamaConfig, max_positions: int) -> RotaryEmbedding:
        """Gemma 3's sliding-window layers' rotation: their own base, no scaling."""
        return cls(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None), max_positions)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, d] of a step's positions: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def check(self, positions: torch.Tensor) -> None:
        """The C kernels read the tables by position unchecked, where torch's indexing raised."""
        if len(positions) and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} is past the rotary tables' {self.cos.shape[0]}")

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        """What every layer of a step rotates its queries and keys with."""
        if (self.kernel is not None and not self.partial and dtype in (torch.float32, torch.bfloat16)
                and positions.device.type == "cpu"):
            self.check(positions)
            return StepRope(kernel=self.kernel, positions=positions.contiguous(), tables=(self.cos, self.sin))
        return StepRope(kernel=None, positions=positions, tables=self.lookup(positions, dtype))


@dataclasses.dataclass
class StepRope:
    """A step's rotation: the C kernel reading the float32 tables by position, or torch's
    operators on the step's looked-up cos and sin."""

    kernel: ctypes.CDLL | None
    positions: torch.Tensor  # [T] int64
    tables: tuple[torch.Tensor, torch.Tensor]  # kernel: the whole float32 tables; else the step's [T, 1, d] rows

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, heads, d] (rows may be strided, heads contiguous) rotated: in place by the
        kernel, into a new tensor by torch."""
        if self.kernel is not None:
            cpu_kernels.rope(self.kernel, x, self.positions, *self.tables)
            return x
        return apply_rotary(x, *self.tables)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, d] by its positions' angles (``RotaryEmbedding.lookup``); with
    tables narrower than d (a partial rotation), its first dimensions only, the rest as they are."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]], dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
