"""The KV cache tensors of one worker: a device pool and a host swap pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve import kernels

from .host_lists import int64_tensor, to_device


@dataclass(frozen=True)
class CacheShape:
    """The per-layer block layout ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


class KVCache:
    """Per-layer (k, v) tensors for the device pool and the host pool.

    ``execute_copies`` runs a KV manager step's copies in the order the
    manager requires: swap out, swap in, then copy-on-write.
    """

    def __init__(self, shape: CacheShape, num_device_blocks: int, num_host_blocks: int,
                 device: torch.device) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        block = (shape.block_size, shape.num_kv_heads, shape.head_dim)
        pin = self.device.type == "cuda"
        self.device_caches = [
            (torch.zeros((num_device_blocks, *block), dtype=shape.dtype, device=self.device),
             torch.zeros((num_device_blocks, *block), dtype=shape.dtype, device=self.device))
            for _ in range(shape.num_layers)]
        self.host_caches = [
            (torch.zeros((num_host_blocks, *block), dtype=shape.dtype, pin_memory=pin),
             torch.zeros((num_host_blocks, *block), dtype=shape.dtype, pin_memory=pin))
            for _ in range(shape.num_layers)]
        if self.device.type == "cpu":
            # Commit the pages now (zeros() maps them lazily), so the first writes
            # into the pool don't pay page faults mid-serving.
            for k_cache, v_cache in self.device_caches:
                k_cache.fill_(0)
                v_cache.fill_(0)
        self.num_bytes_swapped_out = 0
        self.num_bytes_swapped_in = 0

    def execute_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       copy_on_write: list[tuple[int, int]]) -> None:
        if swap_out:
            self._swap(self.device_caches, self.host_caches, swap_out)
            self.num_bytes_swapped_out += len(swap_out) * self.shape.bytes_per_block
        if swap_in:
            self._swap(self.host_caches, self.device_caches, swap_in)
            self.num_bytes_swapped_in += len(swap_in) * self.shape.bytes_per_block
        if copy_on_write:
            pairs = to_device(torch.tensor(copy_on_write, dtype=torch.int64), self.device)
            kernels.copy_blocks([k for k, _ in self.device_caches], [v for _, v in self.device_caches],
                                pairs)

    @staticmethod
    def _swap(src_caches, dst_caches, pairs: list[tuple[int, int]]) -> None:
        block_pairs = torch.tensor(pairs, dtype=torch.int64)
        for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
            kernels.swap_blocks(src_k, dst_k, block_pairs)
            kernels.swap_blocks(src_v, dst_v, block_pairs)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy of the given device blocks, every layer, keys and values:
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (transfers)."""
        index = to_device(int64_tensor(block_ids), self.device)
        layers = [torch.stack([k_cache.index_select(0, index), v_cache.index_select(0, index)])
                  for k_cache, v_cache in self.device_caches]
        return torch.stack(layers).cpu().contiguous()

    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Write ``payload`` (``read_blocks``'s layout, possibly from another worker) into
        the given device blocks."""
        index = to_device(int64_tensor(block_ids), self.device)
        for layer, (k_cache, v_cache) in enumerate(self.device_caches):
            k_cache.index_copy_(0, index, payload[layer, 0].to(self.device, k_cache.dtype, non_blocking=True))
            v_cache.index_copy_(0, index, payload[layer, 1].to(self.device, v_cache.dtype, non_blocking=True))
