"""The C kernels against torch: decode attention against the reference path (gather + SDPA), on
random paged layouts — shuffled block tables, mixed context lengths, grouped-query heads, sliding
windows, a context ending exactly on a block boundary, strided q/k/v as the model passes them —
and RMSNorm against ``F.rms_norm``."""

from __future__ import annotations

import random

import pytest
import torch

from worker.attention import CpuPagedBackend, SdpaBackend
from worker.kernels import cpu as cpu_kernels
from worker.kv_cache import KVCache

kernel = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler: the kernel cannot be built here")


def _fill(cache: KVCache, keys: torch.Tensor, values: torch.Tensor, query_dtype: torch.dtype | None = None) -> None:
    """Natural [blocks, block_size, kv heads, dim] keys and values into a cache the kernels read, in
    its layout for queries of ``query_dtype`` (keys by dim, or bfloat16 in the pairs layout)."""
    layer = cache.keys[0]
    layout = cpu_kernels.kv_layout(kernel, layer.dtype, layer.shape[-1], cache.block_size, query_dtype)
    keys, values = cpu_kernels.kernel_layout(keys, values, layout)
    cache.keys[0].copy_(keys)
    cache.values[0].copy_(values)


def _twin_caches(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> list[KVCache]:
    """Two caches of the same random keys and values: the torch path's (the natural layout) and
    the kernels' (their layout)."""
    caches = [KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, torch.device("cpu")) for _ in range(2)]
    fill = torch.randn_like(caches[0].keys[0]), torch.randn_like(caches[0].values[0])
    caches[0].keys[0].copy_(fill[0])
    caches[0].values[0].copy_(fill[1])
    _fill(caches[1], *fill)
    return caches


def _natural(cache: KVCache, query_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a cache the kernels wrote holds, in the natural layout."""
    layer = cache.keys[0]
    layout = cpu_kernels.kv_layout(kernel, layer.dtype, layer.shape[-1], cache.block_size, query_dtype)
    return cpu_kernels.natural_layout(cache.keys[0], cache.values[0], layout)


def _layout(seed: int, rows: int, block_size: int, num_blocks: int, longest: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, starts = [], []
    for i in range(rows):
        start = rng.randrange(0, longest) if i else block_size * 3 - 1  # row 0 ends on a block boundary
        need = start // block_size + 1
        tables.append([free.pop() for _ in range(need + rng.randrange(0, 2))])  # sometimes a spare block
        starts.append(start)
    return tables, starts


# head_dim 24: the plain loops, not the vector path; bfloat16 at head_dim 64 or 128 with blocks of
# 16 or 32: the pairs layout (two chunks a block at 32)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "window"),
                         [(9, 3, 64, 16, None), (4, 4, 32, 8, None), (8, 2, 16, 16, 37), (6, 1, 128, 4, 5),
                          (4, 2, 24, 8, 11), (4, 2, 128, 32, 40)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_the_torch_path(heads: int, kv_heads: int, head_dim: int, block_size: int,
                                              window: int | None, seed: int, dtype: torch.dtype) -> None:
    torch.manual_seed(seed)
    rows = 13
    num_blocks = rows * (300 // block_size + 3)
    tables, starts = _layout(seed, rows, block_size, num_blocks, longest=300)
    caches = _twin_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    # As the model hands them over: q and k views of one rotated tensor, v a view of the projection.
    qk = torch.randn(rows, heads + kv_heads, head_dim, dtype=dtype)
    q, k = qk.split([heads, kv_heads], dim=1)
    v = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)[:, heads * head_dim : (heads + kv_heads) * head_dim]
    v = v.view(rows, kv_heads, head_dim)
    cpu = torch.device("cpu")
    ref_meta = SdpaBackend(cpu, window).build(caches[0], tables, starts, [1] * rows, list(range(rows)))
    kernel_meta = CpuPagedBackend(kernel, cpu, window).build(caches[1], tables, starts, [1] * rows, list(range(rows)))
    assert kernel_meta.decode_only() is not None
    want = ref_meta.attend(0, q, k, v, head_dim**-0.5)
    got = kernel_meta.attend(0, q, k, v, head_dim**-0.5)
    # bfloat16: both round their float32 results once; SDPA may round partial sums too.
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    # The kernel wrote this step's keys and values into the same slots the torch path did.
    keys, values = _natural(caches[1])
    assert torch.equal(caches[0].keys[0], keys)
    assert torch.equal(caches[0].values[0], values)


def test_decode_steps_build_decode_rows_and_others_rows_of_any_length() -> None:
    cache = KVCache(1, 16, 4, 2, 8, torch.float32, torch.device("cpu"))
    backend = CpuPagedBackend(kernel, torch.device("cpu"))
    mixed = backend.build(cache, [[0, 1], [2, 3]], [5, 0], [1, 3], [0, 3])
    decode = backend.build(cache, [[0, 1], [2, 3]], [5, 2], [1, 1], [0, 1])
    assert mixed.decode_only() is None and mixed.chunks is not None
    assert mixed.chunks.lengths.tolist() == [1, 3] and mixed.chunks.first_tokens.tolist() == [0, 1]
    assert mixed.chunks.ends.tolist() == [6, 3] and mixed.positions.tolist() == [5, 0, 1, 2]
    assert decode.decode_only() is not None and decode.chunks is None


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bs", "head_dim"), [(4, 32), (16, 64)])  # (16, 64): bfloat16 in the pairs layout
def test_mixed_steps_attend_as_the_torch_path(seed: int, window: int | None, dtype: torch.dtype, bs: int,
                                              head_dim: int) -> None:
    """Decode rows and prefill chunks in one step, shuffled tables, GQA, a sliding window: the
    kernel gives what the torch path (gather + masked SDPA) gives, and the cache ends the same."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads = 6, 2
    num_blocks = 200
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, starts, lengths = [], [], []
    for i in range(9):
        n = 1 if i % 3 else rng.randrange(2, 14)  # two decodes for every chunk
        start = rng.randrange(0, 60)
        tables.append([free.pop() for _ in range((start + n - 1) // bs + 1)])
        starts.append(start)
        lengths.append(n)
    caches = _twin_caches(num_blocks, bs, kv_heads, head_dim, dtype)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, dtype=dtype)
    k, v = torch.randn(total, kv_heads, head_dim, dtype=dtype), torch.randn(total, kv_heads, head_dim, dtype=dtype)
    cpu = torch.device("cpu")
    ref = SdpaBackend(cpu, window).build(caches[0], tables, starts, lengths, [total - 1])
    mixed = CpuPagedBackend(kernel, cpu, window).build(caches[1], tables, starts, lengths, [total - 1])
    assert mixed.chunks is not None and len(mixed.chunks.ends) == 9
    want = ref.attend(0, q, k, v, head_dim**-0.5)
    got = mixed.attend(0, q, k, v, head_dim**-0.5)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    keys, values = _natural(caches[1])
    assert torch.equal(caches[0].keys[0], keys) and torch.equal(caches[0].values[0], values)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bs", "head_dim"), [(4, 24), (16, 64)])  # plain loops; vectors (bfloat16: the pairs layout)
def test_soft_capped_scores_attend_as_the_torch_path(window: int | None, decode: bool, dtype: torch.dtype, bs: int,
                                                     head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's attention logit soft-capping (each scaled score s -> cap tanh(s / cap)) in every
    path of the kernel (contexts past 64 positions: the bfloat16 path's full spans), decode rows
    and mixed steps, with and without a window, against the torch path's written-out scores (the
    same whether it takes its queries in one chunk or one at a time); with queries large enough
    that the cap changes the result, and a cap so high it does not."""
    from worker.attention import sdpa

    rng = random.Random(7)
    torch.manual_seed(7)
    heads, kv_heads, num_blocks = 6, 2, 400
    free = list(range(num_blocks))
    rng.shuffle(free)
    lengths = [1 if decode or i % 2 else rng.randrange(2, 12) for i in range(6)]
    starts = [rng.randrange(0, 160) for _ in lengths]
    tables = [[free.pop() for _ in range((st + n - 1) // bs + 1)] for st, n in zip(starts, lengths, strict=True)]
    caches = _twin_caches(num_blocks, bs, kv_heads, head_dim, dtype)
    total = sum(lengths)
    q = (6 * torch.randn(total, heads, head_dim)).to(dtype)  # scores of several units: a cap of 2 bites
    k, v = torch.randn(total, kv_heads, head_dim, dtype=dtype), torch.randn(total, kv_heads, head_dim, dtype=dtype)
    cpu = torch.device("cpu")
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    results = {}
    for cap in (2.0, 0.0, 1e6):
        ref = SdpaBackend(cpu, window, cap).build(caches[0], tables, starts, lengths, [total - 1])
        meta = CpuPagedBackend(kernel, cpu, window, cap).build(caches[1], tables, starts, lengths, [total - 1])
        assert (meta.decode_only() is not None) == decode
        want = ref.attend(0, q, k, v, head_dim**-0.5)
        got = meta.attend(0, q, k, v, head_dim**-0.5)
        torch.testing.assert_close(got, want, **tol)
        results[cap] = got
        if cap == 2.0:
            monkeypatch.setattr(sdpa, "CAPPED_SCORES_BYTES", 1)  # a query at a time (another BLAS kernel: not bit for bit)
            chunked = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else tol  # bfloat16: a last bit
            torch.testing.assert_close(ref.attend(0, q, k, v, head_dim**-0.5), want, **chunked)
            monkeypatch.undo()
    assert not torch.allclose(results[2.0], results[0.0], **tol)  # the cap was applied
    torch.testing.assert_close(results[1e6], results[0.0], **tol)  # and is the identity far below it


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("bs", "head_dim"), [(4, 24), (16, 64)])  # the plain loops, the vector path
def test_float32_queries_over_a_bfloat16_cache_attend_as_the_torch_path(seed: int, window: int | None, bs: int,
                                                                         head_dim: int) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: new keys and values are rounded to
    bfloat16 as they are written (as torch rounds), and attention over the cache is float32
    attention over those rounded values: the torch path over a float32 cache holding them, to
    float32's rounding. Decode rows and prefill chunks in one step; and a decode-only step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads, num_blocks = 6, 2, 200
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, starts, lengths = [], [], []
    for i in range(9):
        n = 1 if i % 3 else rng.randrange(2, 14)
        start = rng.randrange(0, 60)
        tables.append([free.pop() for _ in range((start + n - 1) // bs + 1)])
        starts.append(start)
        lengths.append(n)
    cpu, rounded = torch.device("cpu"), lambda t: t.bfloat16().float()
    reference = KVCache(1, num_blocks, bs, kv_heads, head_dim, torch.float32, cpu)
    half = KVCache(1, num_blocks, bs, kv_heads, head_dim, torch.bfloat16, cpu)
    fill = rounded(torch.randn_like(reference.keys[0])), rounded(torch.randn_like(reference.values[0]))
    reference.keys[0].copy_(fill[0])
    reference.values[0].copy_(fill[1])
    _fill(half, fill[0].bfloat16(), fill[1].bfloat16(), torch.float32)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim)
    k, v = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
    ref = SdpaBackend(cpu, window).build(reference, tables, starts, lengths, [total - 1])
    got_meta = CpuPagedBackend(kernel, cpu, window).build(half, tables, starts, lengths, [total - 1])
    want = ref.attend(0, q, rounded(k), rounded(v), head_dim**-0.5)
    got = got_meta.attend(0, q, k, v, head_dim**-0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    keys, values = _natural(half, torch.float32)
    assert torch.equal(keys, reference.keys[0].bfloat16()) and torch.equal(values, reference.values[0].bfloat16())
    # a decode-only step after it: each row's next token
    nexts = [s + n for s, n in zip(starts, lengths, strict=True)]
    rows = [i for i, p in enumerate(nexts) if p < len(tables[i]) * bs]
    sub = ([tables[i] for i in rows], [nexts[i] for i in rows])
    q1 = torch.randn(len(rows), heads, head_dim)
    k1, v1 = torch.randn(len(rows), kv_heads, head_dim), torch.randn(len(rows), kv_heads, head_dim)
    decode = CpuPagedBackend(kernel, cpu, window).build(half, *sub, [1] * len(rows), list(range(len(rows))))
    assert decode.decode_only() is not None
    want = SdpaBackend(cpu, window).build(reference, *sub, [1] * len(rows), list(range(len(rows)))).attend(
        0, q1, rounded(k1), rounded(v1), head_dim**-0.5)
    torch.testing.assert_close(decode.attend(0, q1, k1, v1, head_dim**-0.5), want, atol=2e-5, rtol=1e-4)


def test_geometries_outside_the_kernels_scratch_are_refused() -> None:
    assert cpu_kernels.unsupported(torch.float32, 9, 3, 64, 16) is None
    assert cpu_kernels.unsupported(torch.bfloat16, 9, 3, 64, 16) is None
    assert "float16" in str(cpu_kernels.unsupported(torch.float16, 9, 3, 64, 16))
    assert "GQA groups up to 16" in str(cpu_kernels.unsupported(torch.float32, 64, 2, 64, 16))  # 32 per kv head
    assert "head sizes up to" in str(cpu_kernels.unsupported(torch.float32, 8, 8, 512, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_matches_torch(rows: int, dtype: torch.dtype) -> None:
    """One row and many (threaded), a strided input (rows of a wider tensor) included, with and
    without the residual add fused before it. In bfloat16 the kernel rounds where torch rounds
    (the sum, the normalised value, the product), so it must agree to the last bit but for the
    odd tie its float32 arithmetic breaks otherwise: at most one bfloat16 step apart."""
    from worker.model.layers import RMSNorm

    torch.manual_seed(rows)
    wide = (torch.randn(rows, 700) * 3).to(dtype)
    x = wide[:, :576]  # rows strided by 700, values contiguous
    residual = (torch.randn(rows, 576) * 2).to(dtype)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576).to(dtype)
    want = norm(x.contiguous())
    want_added, want_residual = norm.add_and_norm(x.contiguous(), residual.clone())
    norm.kernel = kernel
    got = norm(x)
    kernel_residual = residual.clone()
    got_added, got_residual = norm.add_and_norm(x, kernel_residual)
    assert got_residual.data_ptr() == kernel_residual.data_ptr()  # updated in place, no new tensor
    assert torch.equal(got_residual, want_residual)  # one rounding of one sum: exact
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_added, want_added, **tol)
    if dtype == torch.bfloat16:
        assert (got.float() != want.float()).float().mean() < 0.01  # nearly all bit-identical


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "bs", "n"),
                         [(9, 3, 64, None, 8, 45), (9, 3, 64, None, 16, 45), (8, 2, 64, 37, 16, 45),
                          (4, 1, 128, None, 32, 45), (8, 2, 16, 7, 8, 45), (4, 2, 24, None, 8, 45),
                          # past 64 positions: the bfloat16 kernel's whole spans of 64 (and GQA groups
                          # of 3, 4 and 8 heads in sets of up to 4, 2 at head_dim 128)
                          (9, 3, 64, None, 16, 150), (8, 1, 64, 100, 16, 150), (6, 2, 128, None, 32, 150)])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16)])
def test_a_tokens_attention_is_the_same_bits_in_a_prefill_a_chunk_and_a_decode(heads: int, kv_heads: int,
                                                                                 head_dim: int, window: int | None,
                                                                                 bs: int, n: int,
                                                                                 dtype: torch.dtype,
                                                                                 kv_dtype: torch.dtype) -> None:
    """An n-token prompt attended in one prefill, in chunks of 7 among other rows, and token by
    token as decode rows: every query's output is bitwise the same (the recompute after a
    restart relies on it), and the prefill is causal attention's within bfloat16's rounding.
    Also float32 queries over a bfloat16 cache (--kv-cache-dtype bfloat16)."""
    torch.manual_seed(1)
    cpu = torch.device("cpu")
    cache = KVCache(1, 64, bs, kv_heads, head_dim, kv_dtype, cpu)
    cache.keys[0].copy_(torch.randn_like(cache.keys[0]))
    cache.values[0].copy_(torch.randn_like(cache.values[0]))
    # shuffled blocks for n positions (45: 48 positions), apart from the neighbour row's 50 and 51
    table = [11, 3, 40, 7, 22, 9] if n <= 48 else random.Random(n).sample(range(48), -(-n // bs))
    other = [50, 51]  # a neighbour row in the chunked steps
    q = torch.randn(n, heads, head_dim, dtype=dtype)
    k, v = torch.randn(n, kv_heads, head_dim, dtype=dtype), torch.randn(n, kv_heads, head_dim, dtype=dtype)
    backend = CpuPagedBackend(kernel, cpu, window)
    whole = backend.build(cache, [table], [0], [n], [n - 1]).attend(0, q, k, v, head_dim**-0.5)
    chunked = []
    for start in range(0, n, 7):
        m = min(7, n - start)
        extra_q = torch.randn(3, heads, head_dim, dtype=dtype)
        extra_kv = torch.randn(3, kv_heads, head_dim, dtype=dtype)
        meta = backend.build(cache, [other, table], [5, start], [3, m], [2])
        out = meta.attend(0, torch.cat([extra_q, q[start : start + m]]), torch.cat([extra_kv, k[start : start + m]]),
                          torch.cat([extra_kv, v[start : start + m]]), head_dim**-0.5)
        chunked.append(out[3:])
    decoded = []
    for p in range(n):
        meta = backend.build(cache, [table, other], [p, 9], [1, 1], [0, 1])
        assert meta.decode_only() is not None
        out = meta.attend(0, torch.stack([q[p], q[0]]), torch.stack([k[p], k[0]]), torch.stack([v[p], v[0]]),
                          head_dim**-0.5)
        decoded.append(out[:1])
    assert torch.equal(torch.cat(chunked), whole)
    assert torch.equal(torch.cat(decoded), whole)
    # causal attention (with the window) in float64 on the same inputs
    group = heads // kv_heads
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * head_dim**-0.5
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    visible = (j <= i) & ((i - j < window) if window else True)
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv)
    tolerance = 2e-2 if torch.bfloat16 in (dtype, kv_dtype) else 1e-5
    assert (whole.double() - want).abs().max().item() <= tolerance * want.abs().max().item()

