"""The paged KV cache: its tensors, its size, and the block copies the scheduler orders.

Per layer one key and one value tensor shaped [num_blocks, block_size, num_kv_heads, head_dim].
Attention addresses them through a flat slot view (slot = block * block_size + offset). Which
block belongs to which request is the scheduler's business; the worker only follows block ids.

Blocks are zero-initialised: attention gathers padded context positions from slot 0 and masks
them, and a masked NaN would still poison the softmax-weighted sum, so the cache must never hold
garbage that was not written by a forward pass. On the CPU the zeros are the kernel's: the cache
is one anonymous memory map, whose pages are committed as attention first writes them, so a
server holds the memory its streams use, not the memory it could use (a 720 MiB cache serving
one short stream adds a few MiB to the process).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re

import torch

from protocol.config import ConfigError, WorkerConfig

log = logging.getLogger("sluice.worker")

# auto on the CPU: room for one longest sequence, or for CPU_STREAMS streams of CPU_TOKENS_PER_STREAM
# tokens (as llama.cpp's server is run with a slot per stream and 512 tokens of context each):
# a CPU decodes tens of streams at once, not thousands.
CPU_STREAMS = 64
CPU_TOKENS_PER_STREAM = 512
CPU_MAX_SHARE = 0.25  # of physical memory: the host also holds weights, the swap space, the OS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self._map: mmap.mmap | None = None
        if device.type == "cpu" and not pin_memory:
            # One anonymous map for every layer: zero pages, committed as they are first written.
            per_tensor = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self._map = mmap.mmap(-1, max(1, 2 * num_layers * per_tensor))
            flat = torch.frombuffer(self._map, dtype=torch.uint8)
            tensors = [flat[i * per_tensor : (i + 1) * per_tensor].view(dtype).view(shape)
                       for i in range(2 * num_layers)]
        else:
            tensors = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
                       for _ in range(2 * num_layers)]
        self.keys = tensors[:num_layers]
        self.values = tensors[num_layers:]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # Flat [num_blocks * block_size, kv_heads, head_dim] views sharing the same storage.
        self.key_slots = [k.view(-1, num_kv_heads, head_dim) for k in self.keys]
        self.value_slots = [v.view(-1, num_kv_heads, head_dim) for v in self.values]

    @property
    def layers(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device-to-device block copies (copy-on-write of a shared block), one op per tensor."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.keys[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.keys[0].device)
        for layer in self.layers:
            layer[dst] = layer[src]

    def like_on_host(self, num_blocks: int) -> KVCache:
        """An empty cache of the same geometry in host memory (pinned when this one is on CUDA)."""
        k = self.keys[0]
        return KVCache(len(self.keys), num_blocks, self.block_size, k.shape[2], k.shape[3], k.dtype,
                       torch.device("cpu"), pin_memory=k.is_cuda)


class SwapSpace:
    """Host memory for swap preemption, allocated on the first swap and grown to the highest host
    block id a plan names (the scheduler numbers host blocks 0..n-1, n <= device blocks)."""

    def __init__(self, device_cache: KVCache) -> None:
        self.device_cache = device_cache
        self.host: KVCache | None = None

    def _ensure(self, highest_block: int) -> KVCache:
        if self.host is None or self.host.num_blocks <= highest_block:
            self.host = self._grown(self.host, highest_block)
        return self.host

    def _grown(self, old: KVCache | None, highest_block: int) -> KVCache:
        # Doubling keeps regrowth rare; the device's block count bounds what is ever needed.
        have = old.num_blocks if old is not None else 0
        grown = self.device_cache.like_on_host(max(highest_block + 1, min(2 * have, self.device_cache.num_blocks)))
        if old is not None:
            for new_layer, old_layer in zip(grown.layers, old.layers, strict=True):
                new_layer[:have] = old_layer
        return grown

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs to host memory."""
        if pairs:
            host = self._ensure(max(h for _, h in pairs))
            self._copy(self.device_cache, host, [d for d, _ in pairs], [h for _, h in pairs])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs back into the device cache."""
        if pairs:
            host = self._ensure(max(h for h, _ in pairs))
            self._copy(host, self.device_cache, [h for h, _ in pairs], [d for _, d in pairs])

    @staticmethod
    def _copy(src: KVCache, dst: KVCache, src_blocks: list[int], dst_blocks: list[int]) -> None:
        src_idx = torch.tensor(src_blocks, device=src.keys[0].device)
        dst_idx = torch.tensor(dst_blocks, device=dst.keys[0].device)
        for s, d in zip(src.layers, dst.layers, strict=True):
            d[dst_idx] = s[src_idx].to(d.device)


# ------------------------------------------------------------------------------------------ sizing


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or a plain byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"--kv-cache-memory: cannot read {text!r}; use bytes or e.g. 512MiB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def memory_budget(kv_cache_memory: str, per_token: int, max_model_len: int, max_num_seqs: int) -> int:
    """Bytes for the KV cache: the flag's figure; or, for "auto" on the CPU, what the server is
    asked to serve: one longest sequence (``max_model_len`` tokens) or ``max_num_seqs`` streams
    (at most 64) of 512 tokens each, whichever is more, at most a quarter of physical memory.
    (On CUDA, "auto" is measured by a profiling run: ``worker.gpu_memory``.)

    Why not more on the CPU: a CPU decodes tens of streams at once, not thousands, and a decode
    step reads each stream's context once; and since the cache's pages are committed only as
    they are written, what it holds beyond what is used costs address space, not memory."""
    if kv_cache_memory != "auto":
        return parse_bytes(kv_cache_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = max(max_model_len, min(max_num_seqs, CPU_STREAMS) * CPU_TOKENS_PER_STREAM)
    return min(tokens * per_token, int(total * CPU_MAX_SHARE))


def sizing_reason(config: WorkerConfig) -> str:
    """Which rule sized the cache, for the start-up log line."""
    if config.num_kv_blocks is not None:
        return "--num-kv-blocks"
    if config.kv_cache_memory != "auto":
        return "--kv-cache-memory"
    streams = min(config.max_num_seqs, CPU_STREAMS)
    return (f"auto: one longest sequence or {streams} streams of {CPU_TOKENS_PER_STREAM} tokens, at most a quarter "
            "of RAM; pages committed as they are used")


def num_blocks_for(config: WorkerConfig, per_block: int, max_model_len: int = 0) -> int:
    """``--num-kv-blocks`` if given, else as many blocks as the memory budget holds."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_token = per_block / config.block_size
    budget = memory_budget(config.kv_cache_memory, math.ceil(per_token), -(-max_model_len // config.block_size)
                           * config.block_size, config.max_num_seqs)
    blocks = budget // per_block
    if blocks < 1:
        raise ConfigError(f"--kv-cache-memory: {max(budget, 0)} bytes hold no KV block "
                          f"({per_block} bytes each); give more memory or --num-kv-blocks")
    return blocks
