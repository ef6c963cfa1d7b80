"""Stable, chained block hashes for the prefix cache.

Python's ``hash()`` is salted per process, so a cluster-wide index needs a
hash that every process and machine computes identically. A block's hash
covers its parent's hash, so equal hashes mean equal whole prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence

BlockHash = bytes

_DIGEST_SIZE = 16


def hash_block(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_key: str | None = None,
) -> BlockHash:
    """Hash one full block: (parent hash, token ids, extra key) -> 16 bytes.

    ``extra_key`` separates caches that must never share blocks even for
    equal tokens (a cache salt, an adapter name).
    """
    data = (parent_hash or b"root") + array("q", token_ids).tobytes()
    if extra_key is not None:
        data += b"\x00extra\x00" + extra_key.encode()
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest()


def prefix_extra_key(cache_salt: str | None, lora_name: str | None = None) -> str | None:
    """A request's ``extra_key``: its cache salt, and its LoRA adapter's key (``LoRARequest.
    cache_key``: a request with an adapter shares blocks only with requests of that adapter
    and salt; NUL-free keys).

    Keys of different (salt, adapter) pairs differ: an adapter's key starts with NUL "lora"
    NUL; a salt-only key is the salt itself (as it has always been) unless the salt starts
    with NUL, when NUL "salt" NUL goes before it.
    """
    if lora_name is None:
        if cache_salt is None or not cache_salt.startswith("\x00"):
            return cache_salt
        return "\x00salt\x00" + cache_salt
    key = "\x00lora\x00" + lora_name
    return key if cache_salt is None else key + "\x00salt\x00" + cache_salt


def hash_blocks(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    extra_key: str | None = None,
) -> list[BlockHash]:
    """The chain of ``hash_block`` over the consecutive full blocks of ``token_ids``
    (a partial last block is ignored) after ``parent_hash``, in one pass over one buffer."""
    tokens = array("q", token_ids)
    data = tokens.tobytes()
    suffix = b"" if extra_key is None else b"\x00extra\x00" + extra_key.encode()
    step = tokens.itemsize * block_size
    blake2b = hashlib.blake2b
    parent = parent_hash or b"root"
    hashes: list[BlockHash] = []
    for offset in range(0, len(data) - step + 1, step):
        parent = blake2b(parent + data[offset:offset + step] + suffix, digest_size=_DIGEST_SIZE).digest()
        hashes.append(parent)
    return hashes


def hash_prefix_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: str | None = None,
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks at the start of ``token_ids``."""
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    return hash_blocks(None, token_ids[:num_full * block_size], block_size, extra_key)


def block_hash_key(block_hash: BlockHash) -> int:
    """The 8-byte integer key of a hash, for the cluster index and KV events.

    A prefix of the digest: two different prefixes sharing a key (2^-64 per
    pair) would make the index report a cached prefix a worker lacks, which
    costs that request a cache miss, never a wrong token (the worker's own
    pool compares full hashes and tokens).
    """
    return int.from_bytes(block_hash[:8], "little")


def hash_hex(block_hash: BlockHash | None, length: int = 12) -> str:
    """A short printable prefix of a hash, for logs and dashboards."""
    return "" if block_hash is None else block_hash.hex()[:length]


def chain_is_valid(hashes: Iterable[BlockHash], blocks_tokens: Iterable[Sequence[int]],
                   extra_key: str | None = None) -> bool:
    """True if ``hashes`` is exactly the chain over ``blocks_tokens``."""
    parent: BlockHash | None = None
    for expected, tokens in zip(hashes, blocks_tokens):
        parent = hash_block(parent, tokens, extra_key)
        if parent != expected:
            return False
    return True
