"""Attention on CUDA through FlashInfer's paged kernels, when ``flashinfer`` is importable.

FlashInfer reads the paged cache in place, as it is laid out here ([blocks, block_size,
kv_heads, head_dim] per layer: its "NHD" layout), through a CSR page table: row b's pages are
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, the last of them holding ``last_page_len[b]``
tokens; its queries are ``q[qo_indptr[b]:qo_indptr[b+1]]``, aligned to the end of its context
(causal: query i of a row of n queries and context length L sees positions <= L - n + i). That
is Sluice's chunked prefill, whose new keys and values are written before attention runs, and
a decode step is the case n = 1. A sliding window is ``window_left = window - 1``.

Per step the layout is built on the host (``PagedLayout``: CPU logic, tested there) and planned
once — decode steps with the decode wrapper, steps with prefill chunks with the prefill one —
and every layer's ``run`` reuses the plan. Positions, slots and logits indices travel in the
step's one staged copy, as on the torch path.

What it supports is checked at selection (``unsupported``): half precision only (float16 or
bfloat16: no float32 kernels), head sizes 64, 128 and 256, and the decode kernel's GQA groups
1, 2, 3, 4 and 8 on CUDA cores; any other group runs the decode wrapper on tensor cores
(``use_tensor_cores``), as vLLM does. Anything else falls back to the torch backend, and the log
says why.

The installed FlashInfer is checked at selection too (``api_mismatch``): every keyword ``build``
passes to each wrapper's ``plan`` must be one that ``plan`` takes, read with
``inspect.signature``. FlashInfer 0.2.0 calls the prefill head size ``head_dim`` where 0.2.1 and
later call it ``head_dim_qk``; such a version is refused with one warning naming the keyword
and the range Sluice is written for (``SUPPORTED``, pinned as the ``cuda`` extra of
``pyproject.toml`` and in the image), and attention falls back to the torch path, instead of a
``TypeError`` in the first request's step.

``plan`` copies its host-built page table through a pinned buffer with an asynchronous copy. A
wrapper planned again before that copy has landed would overwrite it mid-transfer (the race of
vLLM #40756 and mini-sglang #103), so two sets of wrappers take turns, step by step, and a set
is planned again only once the event recorded after its last ``plan`` has completed.

Written against FlashInfer's wrapper API (``plan``/``run``) as 0.2.1 to 0.7.2 define it, read
from their sources; no GPU was available where it was written, so the CUDA selection logs which
backend runs and the torch path (gather + SDPA) remains the fallback whenever flashinfer is
missing or refused.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, FlatTokens, as_tables, check_cover
from worker.input_batch import RowTables
from worker.kv_cache import KVCache

WORKSPACE_BYTES = 128 << 20
HEAD_SIZES = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 8)  # GQA groups the decode kernel has without tensor cores
SUPPORTED = ">=0.2.1,<0.8"  # flashinfer-python versions whose plan() takes what build passes (pyproject's cuda extra)
# The keywords ``build`` passes to each wrapper's ``plan``, beside the positional CSR tensors.
_COMMON_PLAN_KEYWORDS = ("num_qo_heads", "num_kv_heads", "page_size", "window_left", "q_data_type", "kv_data_type",
                         "sm_scale")
DECODE_PLAN_KEYWORDS = (*_COMMON_PLAN_KEYWORDS, "head_dim")
PREFILL_PLAN_KEYWORDS = (*_COMMON_PLAN_KEYWORDS, "head_dim_qk", "causal")


class Refused(str):
    """Why an installed FlashInfer is not used (its API is not the one ``build`` calls): worth a
    warning in the selection log, where a model FlashInfer has no kernels for is a note."""

    __slots__ = ()


def unsupported(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why FlashInfer cannot attend this model, or None when it can."""
    if dtype not in DTYPES:
        return f"FlashInfer has no {str(dtype).removeprefix('torch.')} kernels (float16 or bfloat16 only)"
    if head_dim not in HEAD_SIZES:
        return f"FlashInfer has no kernels for head size {head_dim} (only {', '.join(map(str, HEAD_SIZES))})"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    return None


def keywords_not_taken(wrapper: Any, keywords: Iterable[str]) -> list[str]:
    """The ``keywords`` that ``wrapper.plan`` would not take by name. A ``plan`` that hands
    ``**kwargs`` on to ``_plan_impl`` (the decode wrapper's since FlashInfer 0.6) is judged by
    that method's parameters; one with ``**kwargs`` and no ``_plan_impl`` takes any keyword."""
    params = inspect.signature(wrapper.plan).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        impl = getattr(wrapper, "_plan_impl", None)
        if impl is None:
            return []
        params = inspect.signature(impl).parameters
    named = {name for name, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return [k for k in keywords if k not in named]


def api_mismatch(flashinfer: Any) -> Refused | None:
    """Why this ``flashinfer`` module's wrappers cannot be planned as ``build`` plans them, in one
    line naming its version, each missing keyword and the supported range; None when they can."""
    wrappers = (("BatchDecodeWithPagedKVCacheWrapper", DECODE_PLAN_KEYWORDS),
                ("BatchPrefillWithPagedKVCacheWrapper", PREFILL_PLAN_KEYWORDS))
    problems = []
    for name, keywords in wrappers:
        cls = getattr(flashinfer, name, None)
        if cls is None or not callable(getattr(cls, "plan", None)):
            problems.append(f"it has no {name}.plan")
            continue
        missing = keywords_not_taken(cls, keywords)
        if missing:
            problems.append(f"{name}.plan takes no {', '.join(missing)}")
    if not problems:
        return None
    version = getattr(flashinfer, "__version__", "of unknown version")
    return Refused(f"flashinfer {version} is not a version Sluice is written for ({'; '.join(problems)}): "
                   f"pip install 'flashinfer-python{SUPPORTED}'")


@dataclasses.dataclass
class PagedLayout:
    """A step's rows as FlashInfer's CSR page table, on the host."""

    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [sum of pages] int32
    last_page_len: torch.Tensor  # [B] int32, 1 .. block_size
    positions: torch.Tensor  # [T] long: the position of every query
    slot_mapping: torch.Tensor  # [T] long: where its key and value go

    @classmethod
    def build(cls, tables: RowTables, starts: list[int], lengths: list[int], block_size: int) -> PagedLayout:
        """Row b computes ``lengths[b]`` tokens from position ``starts[b]``; its context is then
        ``starts[b] + lengths[b]`` tokens long, in the first blocks of its table row."""
        starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
        kv_lens = starts_t + lengths_t
        pages = (kv_lens + block_size - 1) // block_size
        check_cover(tables.num_blocks, pages, kv_lens - 1)
        zero = torch.zeros(1, dtype=torch.long)
        kv_indptr = torch.cat([zero, pages.cumsum(0)])
        width = tables.table.shape[1]
        in_row = torch.arange(width)[None, :] < pages[:, None]
        kv_indices = tables.table[in_row]  # row-major: each row's first pages, rows in order
        tokens = FlatTokens.of(starts_t, lengths_t)
        return cls(
            qo_indptr=torch.cat([zero, lengths_t.cumsum(0)]).to(torch.int32),
            kv_indptr=kv_indptr.to(torch.int32),
            kv_indices=kv_indices.to(torch.int32),
            last_page_len=(kv_lens - (pages - 1) * block_size).to(torch.int32),
            positions=tokens.positions,
            slot_mapping=tokens.slots(tables.table, block_size),
        )


@dataclasses.dataclass(kw_only=True)
class FlashInferMetadata(AttentionMetadata):
    wrapper: Any  # planned for this step: every layer's ``run`` reuses the plan


@dataclasses.dataclass
class _Wrappers:
    """One decode and one prefill wrapper, and the event recorded after the last ``plan`` of either."""

    decode: Any
    prefill: Any
    planned: torch.cuda.Event | None = None


class FlashInferBackend(AttentionBackend):
    name = "flashinfer (paged decode and prefill kernels)"

    def __init__(self, flashinfer: Any, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, sliding_window: int | None) -> None:
        super().__init__(device, sliding_window)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # shared: runs are in stream order
        tensor_cores = num_heads // num_kv_heads not in CUDA_CORE_DECODE_GROUPS
        self.sets = [_Wrappers(flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                             use_tensor_cores=tensor_cores),
                               flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"))
                     for _ in range(2)]
        self.turn = 0
        self.dtype = dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window_left = sliding_window - 1 if sliding_window is not None else -1
        if tensor_cores:
            self.name += f", decode on tensor cores for a GQA group of {num_heads // num_kv_heads}"

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
               sliding_window: int | None) -> FlashInferBackend | str:
        """The backend, or why not: flashinfer not installed, a version whose ``plan`` takes other
        keywords (a ``Refused``), or the model outside what it supports."""
        why = unsupported(dtype, num_heads, num_kv_heads, head_dim)
        if why is not None:
            return why
        try:
            import flashinfer
        except ImportError:
            return f"flashinfer is not installed (pip install 'flashinfer-python{SUPPORTED}' for paged kernels)"
        except Exception as e:  # installed, but not for this torch or CUDA (a missing library, an ABI error)
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return Refused(f"flashinfer is installed but cannot be imported ({type(e).__name__}: {first_line[:300]})")
        refused = api_mismatch(flashinfer)
        if refused is not None:
            return refused
        return cls(flashinfer, device, dtype, num_heads, num_kv_heads, head_dim, sliding_window)

    def _next_set(self) -> _Wrappers:
        """The wrappers planned two steps ago, once their plan's copies have landed."""
        self.turn ^= 1
        wrappers = self.sets[self.turn]
        if wrappers.planned is not None:
            wrappers.planned.synchronize()
        return wrappers

    def build(self, cache: KVCache, block_tables: RowTables | list[list[int]], starts: list[int], lengths: list[int],
              logits_indices: list[int], extra: list[torch.Tensor] | None = None) -> FlashInferMetadata:
        layout = PagedLayout.build(as_tables(block_tables), starts, lengths, cache.block_size)
        common = dict(num_kv_heads=self.num_kv_heads, page_size=cache.block_size, window_left=self.window_left,
                      q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.head_dim**-0.5)
        wrappers = self._next_set()
        if all(n == 1 for n in lengths):
            wrapper = wrappers.decode
            wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.last_page_len, num_qo_heads=self.num_heads,
                         head_dim=self.head_dim, **common)
        else:
            wrapper = wrappers.prefill
            wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.last_page_len,
                         num_qo_heads=self.num_heads, head_dim_qk=self.head_dim, causal=True, **common)
        wrappers.planned = torch.cuda.Event()
        wrappers.planned.record()
        positions, slots, logits, *moved = self.to_device(
            [layout.positions, layout.slot_mapping, torch.tensor(logits_indices, dtype=torch.long), *(extra or [])])
        return FlashInferMetadata(backend=self, positions=positions, slot_mapping=slots, logits_indices=logits,
                                  cache=cache, extra=moved, wrapper=wrapper)

    def forward(self, meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Write the step's keys and values into their slots, then attend: q [T, H, D] -> [T, H, D]."""
        assert isinstance(meta, FlashInferMetadata)
        if scale != self.head_dim**-0.5:  # the plan fixed its scale (sm_scale) at build
            raise ValueError(f"FlashInfer was planned with scale head_dim**-0.5, asked for {scale}")
        cache = meta.cache
        cache.key_slots[layer].index_copy_(0, meta.slot_mapping, k)
        cache.value_slots[layer].index_copy_(0, meta.slot_mapping, v)
        return meta.wrapper.run(q.contiguous(), (cache.keys[layer], cache.values[layer]))
