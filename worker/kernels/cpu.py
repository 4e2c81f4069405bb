"""The worker's C kernels for the CPU, built, loaded and called: attention over the paged cache,
decode rows and prefill chunks alike (``csrc/paged_attention.c``), RMSNorm with the residual add before it (``csrc/rms_norm.c``),
the rotary embedding and silu(gate) * up (``csrc/decoder.c``), each in float32 and bfloat16;
linear layers on CPUs with AVX-512 or AVX2, float32 and bfloat16 (``csrc/linear.c``),
and with their weights kept in GGUF's quantized blocks (AVX-512 VNNI or AVX2: ``csrc/linear_q.c``);
and a decode step's whole decoder stack in one call, built from those same pieces
(``csrc/decoder.c``, driven by ``worker/model/cpu_decoder.py``).

The kernels are plain C, compiled on first use by the system C compiler into Sluice's cache
directory (a second or two, once per machine and source version) and called through ctypes:
no torch headers, no build step at install time. ``-march=native`` (or the level
``worker/cpu_isa.py`` names) makes it fast on the machine that built it, so the file name
carries a digest of the CPU's flags as well as of the source and flags: a cache directory shared
between machines never hands one a binary for another.

Where there is no compiler (a slim container image) or the build fails, ``load()`` returns
None, says why once, and attention keeps to its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from worker import cpu_isa
from worker.kernels.quant_records import PackedFormat
from worker.model.tiny import default_cache_dir

log = logging.getLogger("sluice.worker")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.c", "rms_norm.c", "linear.c", "linear_q.c", "decoder.c")]
HEADERS = [CSRC / name for name in ("bf16.h", "kernels.h", "norm.h", "simd.h")]
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-ffp-contract=off"]
# Per source, after FLAGS. linear_q.c widens a factor and multiplies it by the activations' scale
# as two products: reassociated, they would round differently in each row count's copy of the
# loop, and a row's result would depend on its batch. paged_attention.c's vector path sums a
# head's probabilities chunk by chunk over the chunks its tile covers: reassociated, that sum's
# order would depend on the tile.
SOURCE_FLAGS = {"linear_q.c": ["-fno-associative-math"], "paged_attention.c": ["-fno-associative-math"]}
# What the kernel's fixed-size scratch holds (see the #defines in the source).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 128

_loaded: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    """The CPU's instruction-set line: ``flags`` on x86, ``Features`` on ARM."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {features}"


def _flags() -> list[str]:
    """``FLAGS`` for the instruction-set level in force (``worker/cpu_isa.py``), then
    ``SLUICE_KERNEL_CFLAGS``."""
    return [*FLAGS, cpu_isa.march_flag(), *os.environ.get("SLUICE_KERNEL_CFLAGS", "").split()]


def _library_path() -> Path:
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    flags = " ".join(_flags()) + repr(sorted(SOURCE_FLAGS.items()))
    digest = hashlib.sha256(sources + flags.encode() + _cpu_signature().encode())
    return default_cache_dir() / "kernels" / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


BUILD_TIMEOUT_S = 600  # a busy 2-core machine; each source compiles in under 30 s on an idle one


def _build(target: Path) -> None:
    """Compile each source in its own compiler process, at once (paged_attention.c takes most of
    the time), then link them."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling Sluice's CPU kernels for this CPU (%s; once per machine, 10-60 s)", cpu_isa.march_flag())
    began = time.monotonic()
    # Built beside the target and renamed into place: concurrent workers never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        compiles = [subprocess.Popen([compiler, *_flags(), *SOURCE_FLAGS.get(source.name, []), "-c", "-o", str(obj),
                                      str(source)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for source, obj in zip(SOURCES, objects, strict=True)]
        errors = []
        try:
            for proc in compiles:
                _, stderr = proc.communicate(timeout=BUILD_TIMEOUT_S)
                if proc.returncode != 0:
                    errors.append(stderr.strip().splitlines()[-1:])
        finally:
            for proc in compiles:
                proc.kill()
        if errors:
            raise RuntimeError(f"{compiler} failed: {errors[0]}")
        linked = Path(tmp) / target.name
        done = subprocess.run([compiler, *_flags(), "-o", str(linked), *map(str, objects), "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:]}")
        os.chmod(linked, 0o755)
        os.replace(linked, target)
    log.info("compiled the CPU kernels in %.0f s (kept in %s)", time.monotonic() - began, target.parent)


def load() -> ctypes.CDLL | None:
    """The kernel library, built if need be; None (said once) when it cannot be."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get("SLUICE_NO_C_KERNELS"):
        log.info("C kernels: off (SLUICE_NO_C_KERNELS)")
        return None
    target = _library_path()
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("C kernels unavailable (%s); decode attention gathers the context and RMSNorm runs "
                    "in torch instead", e)
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.write_kv.argtypes = [p, p, i64, i64, p, p, p, i32, i32, i32, i32, i32, i32]
    lib.write_kv.restype = None
    lib.kv_layout.argtypes = [i32, i32, i32, i32]
    lib.kv_layout.restype = i32
    # The float32 entries take one more int before the threads: 1 where the cache is bfloat16.
    lib.paged_decode_bf16.argtypes = [p, i64, p, p, p, i32, p, p, p, i32, i32, i32, i32, i32, f32, f32, i32]
    lib.paged_decode.argtypes = [*lib.paged_decode_bf16.argtypes[:-1], i32, i32]
    lib.paged_attention_bf16.argtypes = [p, i64, p, p, p, i32, p, p, p, p, i32, p, i32, i32, i32, i32, i32, f32, f32,
                                         i32]
    lib.paged_attention.argtypes = [*lib.paged_attention_bf16.argtypes[:-1], i32, i32]
    for entry in (lib.paged_decode, lib.paged_decode_bf16, lib.paged_attention, lib.paged_attention_bf16):
        entry.restype = None
    lib.rms_norm.argtypes = [p, i64, p, p, p, i32, i32, f32, i32]
    lib.rms_norm.restype = None
    lib.rms_norm_bf16.argtypes = lib.rms_norm.argtypes
    lib.rms_norm_bf16.restype = None
    for entry in (lib.linear_f32, lib.linear_bf16):
        entry.argtypes = [p, i64, p, p, p, i32, i32, i32, i32]
        entry.restype = None
    for entry in (lib.rope_f32, lib.rope_bf16):
        entry.argtypes = [p, i64, i32, i32, i32, p, p, p, i32]
        entry.restype = None
    for entry in (lib.silu_mul_f32, lib.silu_mul_bf16):
        entry.argtypes = [p, p, i32, i32, i32]
        entry.restype = None
    lib.decode_layers_bf16.argtypes = [p, p, p, p, p, p, p, p, p, i32, p, p, p, p, p, i32, p, p, i32, i32, i32, i32, i32,
                                       i32, i32, f32, f32, i32]
    lib.decode_layers_f32.argtypes = [*lib.decode_layers_bf16.argtypes, i32]  # and kv16
    for entry in (lib.decode_layers_f32, lib.decode_layers_bf16):
        entry.restype = None
    lib.linear_q.argtypes = [p, i64, p, p, p, i32, i32, i32, i32, p, i32, i32]
    lib.linear_q.restype = None
    lib.dequantize_rows.argtypes = [p, i32, i32, i32, p, i32, p]
    lib.dequantize_rows.restype = i32
    for available in (lib.linear_available, lib.linear_q_available, lib.attention_path, lib.vector_lanes):
        available.argtypes = []
        available.restype = i32
    _loaded = lib
    log.info("C kernels (%s): %s", cpu_isa.march_flag(), instruction_sets(lib))
    return lib


def instruction_sets(lib: ctypes.CDLL) -> str:
    """Which instructions each kernel uses, in words, for the start-up log."""
    lanes = lib.vector_lanes()
    vector = {16: "AVX-512", 8: "AVX2"}.get(lanes)
    attention = {2: f"{vector}, bfloat16 caches by AVX512-BF16", 1: vector}.get(lib.attention_path(), "plain loops")
    return (f"linear {linear_instructions(lib, torch.float32) or 'none (torch)'}; "
            f"quantized linear {quantized_instructions(lib) or 'none (dequantized at load)'}; "
            f"attention {attention}; silu {vector or 'plain loops'}; norms and rotation: loops the compiler "
            "vectorises for the -march")


def unsupported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Why the decode kernel cannot attend this geometry (float32 or bfloat16, within its
    scratch sizes), or None when it can."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the C decode kernel computes float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"the C decode kernel takes GQA groups up to {MAX_GROUP}, not {num_heads} heads over {num_kv_heads}"
    if head_dim > MAX_HEAD_DIM or block_size > MAX_BLOCK:
        return f"the C decode kernel takes head sizes up to {MAX_HEAD_DIM} and blocks up to {MAX_BLOCK} tokens"
    return None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def write_kv(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, key_slots: torch.Tensor, value_slots: torch.Tensor,
             slots: torch.Tensor, block_size: int) -> None:
    """k, v [B, KVH, D] (rows may be strided, heads contiguous) into the flat caches at ``slots``
    (int64), in the cache's layout (``kv_layout``): float32 rows into a float32 or a bfloat16
    cache (rounded to nearest even), bfloat16 rows into a bfloat16 one."""
    assert key_slots.element_size() <= k.element_size(), "a bfloat16 row goes only into a bfloat16 cache"
    lib.write_kv(_ptr(k), _ptr(v), k.stride(0), v.stride(0), _ptr(key_slots), _ptr(value_slots), _ptr(slots),
                 k.shape[0], k.shape[1], k.shape[2], block_size, k.element_size(), key_slots.element_size())


KEYS_BY_DIM, PAIRS = "keys by dim", "pairs"


def kv_layout(lib: ctypes.CDLL, dtype: torch.dtype, head_dim: int, block_size: int,
              query_dtype: torch.dtype | None = None) -> str:
    """How the C kernels keep a cache of this dtype and geometry (``csrc/paged_attention.c``),
    read by queries of ``query_dtype`` (the cache's own by default): ``KEYS_BY_DIM`` (per block
    and kv head, keys as [dim, position]; values [slot, head, dim]) or, for bfloat16 queries and
    cache with AVX512-BF16, ``PAIRS`` (laid out for vdpbf16ps)."""
    size = torch.empty((), dtype=dtype).element_size()
    query_size = size if query_dtype is None else torch.empty((), dtype=query_dtype).element_size()
    return PAIRS if lib.kv_layout(size, query_size, head_dim, block_size) == 2 else KEYS_BY_DIM


def natural_layout(keys: torch.Tensor, values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values [blocks, block_size, kv_heads, head_dim] as the kernels keep them
    in ``layout``, as copies in the natural one (for reading a cache the kernels wrote: tests,
    debugging)."""
    blocks, bs, kvh, d = keys.shape
    if layout == KEYS_BY_DIM:
        return keys.reshape(blocks, kvh, d, bs).permute(0, 3, 1, 2).contiguous(), values.clone()
    k = keys.reshape(blocks, kvh, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    v = values.reshape(blocks, kvh, bs // 16, 8, d // 16, 16, 2).permute(0, 2, 3, 6, 1, 4, 5)
    return k.reshape(blocks, bs, kvh, d).contiguous(), v.reshape(blocks, bs, kvh, d).contiguous()


def kernel_layout(keys: torch.Tensor, values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``natural_layout``: natural [blocks, block_size, kv_heads, head_dim] keys and
    values as ``layout`` holds them (same shape), for filling a cache directly."""
    blocks, bs, kvh, d = keys.shape
    if layout == KEYS_BY_DIM:
        return keys.permute(0, 2, 3, 1).reshape(blocks, bs, kvh, d).contiguous(), values.clone()
    k = keys.reshape(blocks, bs // 16, 16, kvh, d // 2, 2).permute(0, 3, 1, 4, 2, 5)
    v = values.reshape(blocks, bs // 16, 8, 2, kvh, d // 16, 16).permute(0, 4, 1, 2, 5, 6, 3)
    return k.reshape(blocks, bs, kvh, d).contiguous(), v.reshape(blocks, bs, kvh, d).contiguous()


def decode(lib: ctypes.CDLL, q: torch.Tensor, key_slots: torch.Tensor, value_slots: torch.Tensor,
           block_table: torch.Tensor, context_lens: torch.Tensor, first_positions: torch.Tensor, block_size: int,
           scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, D] (rows may be strided) against each row's context -> [B, H, D] in q's dtype:
    float32 (over a float32 or a bfloat16 cache) or bfloat16 (over a bfloat16 cache); the
    arithmetic is float32. ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap)
    before the softmax (Gemma 2's attention logit soft-capping).

    ``block_table`` [B, max blocks] int32 contiguous; ``context_lens`` / ``first_positions`` [B]
    int32: row b attends positions first_positions[b] .. context_lens[b] - 1."""
    rows, heads, head_dim = q.shape
    out = torch.empty((rows, heads, head_dim), dtype=q.dtype)
    args = [_ptr(q), q.stride(0), _ptr(key_slots), _ptr(value_slots), _ptr(block_table), block_table.shape[1],
            _ptr(context_lens), _ptr(first_positions), _ptr(out), rows, heads, key_slots.shape[1], head_dim, block_size,
            scale, softcap]
    if q.dtype == torch.bfloat16:
        assert key_slots.dtype == torch.bfloat16, "bfloat16 queries read a bfloat16 cache"
        lib.paged_decode_bf16(*args, torch.get_num_threads())
    else:
        lib.paged_decode(*args, int(key_slots.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] float32 or bfloat16 (rows may be strided, values contiguous) -> RMSNorm(x) *
    weight, [T, D]. With ``residual`` (contiguous [T, D], same dtype): it becomes x + residual,
    in place, and is what is normalised."""
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    entry = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm
    entry(_ptr(x), x.stride(0), None if residual is None else _ptr(residual), _ptr(weight), _ptr(out), rows, dim, eps,
          torch.get_num_threads())
    return out


LINEAR_TILE = 64  # outputs per tile of the linear kernel: its packed weights are padded to this


def has_linear(lib: ctypes.CDLL | None, dtype: torch.dtype) -> bool:
    """The linear kernel was compiled for this CPU (AVX-512, or AVX2 and FMA) and takes ``dtype``
    (float32 or bfloat16)."""
    return lib is not None and dtype in (torch.float32, torch.bfloat16) and lib.linear_available() > 0


def linear_instructions(lib: ctypes.CDLL | None, dtype: torch.dtype) -> str | None:
    """Which instructions the linear kernel multiplies ``dtype`` with, in words; None without one."""
    if not has_linear(lib, dtype):
        return None
    assert lib is not None
    level = lib.linear_available()
    if dtype == torch.bfloat16 and level == 3:
        return "AVX512-BF16"
    isa = "AVX-512" if level >= 2 else "AVX2"
    return f"{isa}, bfloat16 widened to float32" if dtype == torch.bfloat16 else isa


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 weight [out, in] in the kernel's layout: 16 outputs by one input
    (float32: [out / 16, in, 16]) or by two (bfloat16, in even: [out / 16, in / 2, 16, 2]) per
    64 bytes, out padded with zero rows to a multiple of 64."""
    out_features, in_features = weight.shape
    per_load = 2 if weight.dtype == torch.bfloat16 else 1
    if in_features % per_load:
        raise ValueError(f"the bfloat16 linear kernel needs an even input size, not {in_features}")
    padded = -(-out_features // LINEAR_TILE) * LINEAR_TILE
    w = weight.detach()
    if padded != out_features:  # only then a padded copy: packing a big weight holds two at most
        w = weight.new_zeros((padded, in_features))
        w[:out_features] = weight.detach()
    return w.contiguous().view(padded // 16, 16, in_features // per_load, per_load).permute(0, 2, 1, 3).contiguous()


def unpack_linear(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The plain [out, in] weight ``pack_linear`` packed (a copy)."""
    blocks, loads, lanes, per_load = packed.shape if packed.dim() == 4 else (*packed.shape, 1)
    weight = packed.view(blocks, loads, lanes, per_load).permute(0, 2, 1, 3).reshape(blocks * lanes, loads * per_load)
    return weight[:out_features].clone()


def linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """x [T, in] (rows may be strided, values contiguous) times the packed weight
    (``pack_linear``, same dtype), plus ``bias`` [out] -> [T, out]."""
    rows, in_features = x.shape
    y = torch.empty((rows, out_features), dtype=x.dtype)
    entry = lib.linear_bf16 if x.dtype == torch.bfloat16 else lib.linear_f32
    entry(_ptr(x), x.stride(0), _ptr(packed), None if bias is None else _ptr(bias), _ptr(y), rows, out_features,
          in_features, torch.get_num_threads())
    return y


def rope(lib: ctypes.CDLL, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] (float32 or bfloat16; rows may be strided, heads contiguous) in place
    by ``positions`` [T] (int64), reading the float32 tables ``cos``/``sin`` [positions, D]."""
    rows, heads, head_dim = x.shape
    entry = lib.rope_bf16 if x.dtype == torch.bfloat16 else lib.rope_f32
    entry(_ptr(x), x.stride(0), rows, heads, head_dim, _ptr(positions), _ptr(cos), _ptr(sin), torch.get_num_threads())


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up [T, 2 * inter] contiguous (gate, then up) -> silu(gate) * up [T, inter]."""
    rows = gate_up.shape[0]
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    entry = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul_f32
    entry(_ptr(gate_up), _ptr(out), rows, inter, torch.get_num_threads())
    return out


def attention(lib: ctypes.CDLL, q: torch.Tensor, key_slots: torch.Tensor, value_slots: torch.Tensor,
              block_table: torch.Tensor, ends: torch.Tensor, lengths: torch.Tensor, first_tokens: torch.Tensor,
              first_positions: torch.Tensor, window: int, block_size: int, scale: float,
              softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D] (rows may be strided) of rows of any length against their contexts -> [T, H, D].
    Row r's ``lengths[r]`` queries end at position ``ends[r] - 1`` and are tokens
    ``first_tokens[r]`` onwards; ``block_table`` [B, max blocks] and the per-row tensors int32;
    ``window`` > 0: a sliding window (Mistral's rule), besides ``first_positions``. Dtypes as
    ``decode``'s."""
    tokens, heads, head_dim = q.shape
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
    args = [_ptr(q), q.stride(0), _ptr(key_slots), _ptr(value_slots), _ptr(block_table), block_table.shape[1],
            _ptr(ends), _ptr(lengths), _ptr(first_tokens), _ptr(first_positions), window, _ptr(out), len(ends), heads,
            key_slots.shape[1], head_dim, block_size, scale, softcap]
    if q.dtype == torch.bfloat16:
        assert key_slots.dtype == torch.bfloat16, "bfloat16 queries read a bfloat16 cache"
        lib.paged_attention_bf16(*args, torch.get_num_threads())
    else:
        lib.paged_attention(*args, int(key_slots.dtype == torch.bfloat16), torch.get_num_threads())
    return out



# ------------------------------------------------------------------ quantized weights (csrc/linear_q.c)

QBLOCK = 32  # inputs per quantized block


def has_quantized_linear(lib: ctypes.CDLL | None) -> bool:
    """The quantized linear kernel was compiled for this CPU (AVX-512 VNNI, or AVX2 and FMA)."""
    return quantized_instructions(lib) is not None


def quantized_instructions(lib: ctypes.CDLL | None) -> str | None:
    """Which instructions the quantized linear kernel was built with, in words; None without one."""
    return {2: "AVX-512 VNNI", 1: "AVX2"}.get(lib.linear_q_available()) if lib is not None else None


def linear_q(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
             fmt: PackedFormat) -> torch.Tensor:
    """x [T, in] float32 or bfloat16 (rows may be strided, values contiguous) times a weight packed
    by ``quant_records.pack`` in ``fmt`` (plus ``bias``, x's dtype) -> [T, out] in x's dtype."""
    rows, in_features = x.shape
    y = torch.empty((rows, out_features), dtype=x.dtype)
    scratch = torch.empty(quantized_scratch_bytes(rows, in_features), dtype=torch.uint8)
    lib.linear_q(_ptr(x), x.stride(0), _ptr(packed), None if bias is None else _ptr(bias), _ptr(y), rows,
                 out_features, in_features, fmt.word, _ptr(scratch), int(x.dtype == torch.bfloat16),
                 torch.get_num_threads())
    return y


def dequantize_rows(lib: ctypes.CDLL, packed: torch.Tensor, fmt: PackedFormat, out_features: int,
                    rows: torch.Tensor) -> torch.Tensor:
    """Rows of a weight packed by ``quant_records.pack`` as float32 [len(rows), in]: the values
    ``quant_records.unpack(packed, fmt, out_features, rows).dequantize()`` gives, in one C call
    (a tied embedding's lookup, every step)."""
    assert packed.is_contiguous()
    blocks = packed.shape[1] * 8 // (8 * fmt.record + fmt.header)
    ids = rows.to(torch.int64).contiguous()
    y = torch.empty((len(ids), blocks * QBLOCK), dtype=torch.float32)
    if lib.dequantize_rows(_ptr(packed), fmt.word, out_features, blocks * QBLOCK, _ptr(ids), len(ids), _ptr(y)):
        raise IndexError(f"a row id outside 0..{out_features - 1}: {ids.tolist()}")
    return y


def quantized_scratch_bytes(rows: int, in_features: int) -> int:
    """The int8 activations and, per 32 inputs, four floats (a scale and three sums) and two
    integer sums."""
    return rows * (in_features + 24 * (in_features // QBLOCK))
