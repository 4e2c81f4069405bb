"""The paged KV cache: its tensors, its size, and the block copies the scheduler orders.

Per layer one key and one value tensor shaped [num_blocks, block_size, num_kv_heads, head_dim].
Attention addresses them through a flat slot view (slot = block * block_size + offset). Which
block belongs to which request is the scheduler's business; the worker only follows block ids.

Blocks are zero-initialised: attention gathers padded context positions from slot 0 and masks
them, and a masked NaN would still poison the softmax-weighted sum, so the cache must never hold
garbage that was not written by a forward pass.
"""

from __future__ import annotations

import logging
import os
import re

import torch

from protocol.config import ConfigError, WorkerConfig

log = logging.getLogger("sluice.worker")

CPU_WEIGHTS_MULTIPLE = 2  # auto on the CPU: twice the weights' bytes (SmolLM2 float32: 1 GiB, 23k tokens)
CPU_MIN_BYTES = 256 << 20  # small models: the weights say little about how many streams are served
CPU_MAX_SHARE = 0.25  # of physical memory: the host also holds weights, the swap space, the OS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        self.keys = [make() for _ in range(num_layers)]
        self.values = [make() for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
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


def memory_budget(kv_cache_memory: str, weight_bytes: int = 0, min_bytes: int = 0) -> int:
    """Bytes for the KV cache: the flag's figure; or, for "auto" on the CPU, twice the weights'
    bytes, at least 256 MiB and ``min_bytes`` (one longest sequence), at most a quarter of
    physical memory. (On CUDA, "auto" is measured by a profiling run: ``worker.gpu_memory``.)

    Why twice the weights on the CPU: a CPU decodes tens of streams at once, not thousands, and
    a decode step reads every weight once and each stream's context once; a cache much larger
    than the weights holds more context than the CPU attends over at a useful speed, and is
    memory taken from the machine (the old fixed 2 GiB made a 135M-parameter server hold 3 GB)."""
    if kv_cache_memory != "auto":
        return parse_bytes(kv_cache_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(max(CPU_WEIGHTS_MULTIPLE * weight_bytes, CPU_MIN_BYTES, min_bytes), int(total * CPU_MAX_SHARE))


def sizing_reason(config: WorkerConfig, weight_bytes: int) -> str:
    """Which rule sized the cache, for the start-up log line."""
    if config.num_kv_blocks is not None:
        return "--num-kv-blocks"
    if config.kv_cache_memory != "auto":
        return "--kv-cache-memory"
    return (f"auto: twice the weights' {weight_bytes / 2**20:.0f} MiB, at least 256 MiB and one longest sequence, "
            "at most a quarter of RAM")


def num_blocks_for(config: WorkerConfig, per_block: int, weight_bytes: int = 0, max_model_len: int = 0) -> int:
    """``--num-kv-blocks`` if given, else as many blocks as the memory budget holds."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    longest = -(-max_model_len // config.block_size) * per_block
    budget = memory_budget(config.kv_cache_memory, weight_bytes, longest)
    blocks = budget // per_block
    if blocks < 1:
        raise ConfigError(f"--kv-cache-memory: {max(budget, 0)} bytes hold no KV block "
                          f"({per_block} bytes each); give more memory or --num-kv-blocks")
    return blocks
