"""The FlashInfer backend's host half, on the CPU: the CSR page table it plans from.

FlashInfer itself needs a GPU. What it is handed does not: ``PagedLayout`` turns a step's rows
(block tables, starts, lengths) into ``qo_indptr``/``kv_indptr``/``kv_indices``/
``last_page_len`` plus positions and slots. Here a plain-torch reading of that table, written
from FlashInfer's documented semantics (row b's pages in order, the last one holding
``last_page_len[b]`` tokens, queries aligned to the end of the context, causal, a window of
``window_left + 1`` positions), must attend exactly as the torch path (gather + SDPA) does, on
shuffled tables with prefill chunks, decodes and spare blocks mixed, with and without a window.
And what selection checks of an installed FlashInfer: that its wrappers' ``plan`` take the
keywords ``build`` passes (read from stand-ins with each release's signature).
"""

from __future__ import annotations

import logging
import random
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from worker.attention import SdpaBackend
from worker.attention.flashinfer import PagedLayout
from worker.input_batch import RowTables
from worker.kv_cache import KVCache

CPU = torch.device("cpu")


def _attend_by_layout(q: torch.Tensor, layout: PagedLayout, cache: KVCache, window: int | None,
                      scale: float) -> torch.Tensor:
    """What FlashInfer's run computes from ``layout``, one row and one query at a time."""
    keys, values = cache.keys[0], cache.values[0]  # [blocks, bs, KVH, D]
    bs, heads, kv_heads = keys.shape[1], q.shape[1], keys.shape[2]
    out = torch.empty_like(q)
    for b in range(len(layout.last_page_len)):
        pages = layout.kv_indices[layout.kv_indptr[b] : layout.kv_indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * bs + int(layout.last_page_len[b])
        k = keys[pages].reshape(-1, kv_heads, keys.shape[-1])[:kv_len]
        v = values[pages].reshape(-1, kv_heads, keys.shape[-1])[:kv_len]
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        first, last = int(layout.qo_indptr[b]), int(layout.qo_indptr[b + 1])
        for i in range(first, last):
            pos = kv_len - (last - first) + (i - first)  # aligned to the end of the context
            lo = max(0, pos - window + 1) if window is not None else 0
            scores = torch.einsum("hd,thd->ht", q[i].float(), k[lo : pos + 1].float()) * scale
            out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[lo : pos + 1].float()).to(q.dtype)
    return out


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_csr_layout_attends_as_the_torch_path(seed: int, window: int | None) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bs, heads, kv_heads, head_dim = 4, 6, 2, 16
    num_blocks = 120
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, starts, lengths = [], [], []
    for _ in range(7):
        n = rng.choice([1, 1, rng.randrange(2, 12)])  # decodes and prefill chunks
        start = rng.randrange(0, 40)
        tables.append([free.pop() for _ in range((start + n - 1) // bs + 1 + rng.randrange(0, 2))])
        starts.append(start)
        lengths.append(n)
    caches = [KVCache(1, num_blocks, bs, kv_heads, head_dim, torch.float32, CPU) for _ in range(2)]
    fill = torch.randn_like(caches[0].keys[0]), torch.randn_like(caches[0].values[0])
    for cache in caches:
        cache.keys[0].copy_(fill[0])
        cache.values[0].copy_(fill[1])
    total = sum(lengths)
    q, k, v = torch.randn(total, heads, head_dim), torch.randn(total, kv_heads, head_dim), torch.randn(
        total, kv_heads, head_dim)
    scale = head_dim**-0.5

    meta = SdpaBackend(CPU, window).build(caches[0], tables, starts, lengths, [total - 1])
    want = meta.attend(0, q, k, v, scale)

    layout = PagedLayout.build(RowTables.from_lists(tables), starts, lengths, bs)
    assert torch.equal(layout.positions, meta.positions)
    assert torch.equal(layout.slot_mapping, meta.slot_mapping)
    assert layout.kv_indptr[-1] == len(layout.kv_indices) and layout.qo_indptr[-1] == total
    assert ((layout.last_page_len >= 1) & (layout.last_page_len <= bs)).all()
    caches[1].key_slots[0].index_copy_(0, layout.slot_mapping, k)  # what attend() writes first
    caches[1].value_slots[0].index_copy_(0, layout.slot_mapping, v)
    got = _attend_by_layout(q, layout, caches[1], window, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_table_that_does_not_cover_the_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        PagedLayout.build(RowTables.from_lists([[3]]), [2], [5], 4)


# ------------------------------------------------------------------ the installed FlashInfer's API
# Stand-ins for FlashInfer's wrapper classes, each ``plan`` with the signature a release has (as
# read from its sources; only the parameters up to those Sluice passes, and the bodies empty):
# what selection reads is the signature alone, and FlashInfer does not run without a GPU.


class _Decode020:  # 0.2.0 to 0.5: every option a named parameter
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=False) -> None: ...


class _Prefill020:  # 0.2.0: the head size is head_dim
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim, page_size, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", allow_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=False) -> None: ...


class _Prefill021:  # 0.2.1 on: head_dim_qk (and head_dim_vo, for MLA)
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True) -> None: ...


class _Decode06:  # 0.6 on: options after page_size reach _plan_impl through **kwargs
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *deprecated_positional_args, **kwargs) -> None: ...

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                   pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
                   q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
                   rope_scale=None, rope_theta=None, non_blocking=True) -> None: ...


class _Decode06WithoutScale(_Decode06):  # a release whose _plan_impl dropped a keyword Sluice passes
    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                   window_left=-1, q_data_type="float16", kv_data_type=None) -> None: ...


def _flashinfer(version: str, decode: type, prefill: type) -> types.SimpleNamespace:
    return types.SimpleNamespace(__version__=version, BatchDecodeWithPagedKVCacheWrapper=decode,
                                 BatchPrefillWithPagedKVCacheWrapper=prefill)


def test_flashinfer_versions_whose_plan_takes_other_keywords_are_refused_in_one_line() -> None:
    from worker.attention.flashinfer import SUPPORTED, Refused, api_mismatch, keywords_not_taken

    assert api_mismatch(_flashinfer("0.2.1", _Decode020, _Prefill021)) is None
    assert api_mismatch(_flashinfer("0.7.2", _Decode06, _Prefill021)) is None
    old = api_mismatch(_flashinfer("0.2.0", _Decode020, _Prefill020))
    assert isinstance(old, Refused) and "\n" not in old
    assert "flashinfer 0.2.0" in old and "BatchPrefillWithPagedKVCacheWrapper.plan takes no head_dim_qk" in old
    assert "Decode" not in old and SUPPORTED in old
    dropped = api_mismatch(_flashinfer("0.9", _Decode06WithoutScale, _Prefill021))
    assert dropped is not None and "BatchDecodeWithPagedKVCacheWrapper.plan takes no sm_scale" in dropped
    assert "no BatchPrefillWithPagedKVCacheWrapper.plan" in str(api_mismatch(types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_Decode020)))

    class AnyKeyword:
        def plan(self, *args, **kwargs) -> None: ...

    assert keywords_not_taken(AnyKeyword, ["head_dim_qk"]) == []  # nothing to read: no refusal
    # The range named in the refusal is the one pyproject's cuda extra (and so the image) installs.
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["cuda"] == [f"flashinfer-python{SUPPORTED}"]


def test_a_refused_flashinfer_falls_back_to_the_torch_path_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Selection on a "cuda" device reaches no CUDA call before the API check refuses: it runs here.
    from worker.attention import select_backend

    monkeypatch.setitem(sys.modules, "flashinfer", _flashinfer("0.2.0", _Decode020, _Prefill020))
    with caplog.at_level(logging.INFO, logger="sluice.worker"):
        backend = select_backend(torch.device("cuda"), torch.bfloat16, 8, 2, 64, 16)
    assert isinstance(backend, SdpaBackend)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "head_dim_qk" in record.getMessage() and "flashinfer 0.2.0" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sluice.worker"):  # a model it has no kernels for: a note
        select_backend(torch.device("cuda"), torch.float32, 8, 2, 64, 16)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "float32" in record.getMessage()


def test_a_flashinfer_that_cannot_be_imported_is_refused_not_a_crash(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Installed for another CUDA or torch: its import fails with something other than ImportError.
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text(
        "raise OSError('libcudart.so.13: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    from worker.attention import select_backend

    with caplog.at_level(logging.INFO, logger="sluice.worker"):
        backend = select_backend(torch.device("cuda"), torch.float16, 8, 8, 128, 16)
    assert isinstance(backend, SdpaBackend)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "OSError: libcudart.so.13" in record.getMessage()

