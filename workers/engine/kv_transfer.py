"""Moving a sequence's KV blocks between workers (disaggregated prefill/decode).

A transfer is two parts: a msgpack header (layout, dtype, token count, the
tokens and their block hashes) and the payload, ONE contiguous numpy buffer
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` for all
blocks of the sequence. Ray's object store moves numpy buffers zero-copy
between processes on one node, so a transfer costs about one memory copy
on each side.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from pagedserve.kvmanager.hashing import hash_prefix_blocks

from ..model.kv_cache import KVCache

FORMAT_VERSION = 1

# numpy has no bfloat16: such payloads travel as their raw 16-bit patterns.
_WIRE_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


class KVTransferError(ValueError):
    """A transfer does not fit the receiving worker's cache."""


@dataclass
class KVTransfer:
    """A serialised sequence KV: header bytes plus the contiguous payload."""

    header: bytes
    payload: np.ndarray

    @property
    def num_bytes(self) -> int:
        return self.payload.nbytes


def export_kv(cache: KVCache, block_table: list[int], num_tokens: int, token_ids: list[int]) -> KVTransfer:
    """Pack the KV of the first ``num_tokens`` tokens of a sequence."""
    shape = cache.shape
    num_blocks = -(-num_tokens // shape.block_size)
    _check_held(block_table[:num_blocks], "export")
    stacked = cache.read_blocks(block_table[:num_blocks])
    if shape.dtype == torch.bfloat16:
        payload = stacked.view(torch.int16).numpy().view(np.uint16)
    else:
        payload = stacked.numpy()
    header = msgpack.packb({
        "version": FORMAT_VERSION,
        "layout": list(payload.shape),
        "dtype": str(shape.dtype).removeprefix("torch."),
        "block_size": shape.block_size,
        "num_tokens": num_tokens,
        "token_ids": list(token_ids[:num_tokens]),
        "block_hashes": [h.hex() for h in hash_prefix_blocks(token_ids[:num_tokens], shape.block_size)],
    })
    return KVTransfer(header, payload)


def _check_held(blocks: list[int], what: str) -> None:
    """A -1 entry (a block freed out of the sliding window) would index the cache's last
    block: refuse instead of moving another sequence's KV."""
    if any(block < 0 for block in blocks):
        raise KVTransferError(f"cannot {what} KV of a sequence whose out-of-window blocks were freed")


def read_header(header: bytes) -> dict:
    meta = msgpack.unpackb(header)
    if meta.get("version") != FORMAT_VERSION:
        raise KVTransferError(f"unsupported KV transfer format {meta.get('version')!r}")
    return meta


def check_compatible(cache: KVCache, meta: dict, token_ids: list[int]) -> None:
    """Refuse a transfer whose layout, dtype or tokens do not match this worker."""
    shape = cache.shape
    expected = [shape.num_layers, 2, -(-meta["num_tokens"] // shape.block_size), shape.block_size,
                shape.num_kv_heads, shape.head_dim]
    if meta["layout"] != expected:
        raise KVTransferError(f"KV layout {meta['layout']} does not match this worker's {expected}")
    if meta["dtype"] != str(shape.dtype).removeprefix("torch."):
        raise KVTransferError(f"KV dtype {meta['dtype']} does not match this worker's {shape.dtype}")
    if list(token_ids[:meta["num_tokens"]]) != meta["token_ids"]:
        raise KVTransferError("the transferred KV belongs to other tokens than this request's")


def import_kv(cache: KVCache, transfer: KVTransfer, block_table: list[int]) -> None:
    """Write a transfer's payload into the given device blocks."""
    meta = read_header(transfer.header)
    with warnings.catch_warnings():
        # Object-store arrays are read-only views; they are only read here.
        warnings.simplefilter("ignore", UserWarning)
        payload = torch.from_numpy(np.ascontiguousarray(transfer.payload))
    if meta["dtype"] == "bfloat16":
        payload = payload.view(torch.int16).view(torch.bfloat16)
    num_blocks = payload.shape[2]
    _check_held(block_table[:num_blocks], "import")
    cache.write_blocks(block_table[:num_blocks], payload)
