"""What the KV manager knows about one sequence."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .hashing import BlockHash


class SeqLocation(str, enum.Enum):
    """Where a sequence's KV lives."""

    WAITING = "waiting"    # no blocks: new, or preempted for recompute
    DEVICE = "device"      # block_table holds device blocks
    SWAPPED = "swapped"    # host_table holds host blocks


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """A sequence's tokens, block tables and progress, as the KV manager sees them.

    ``token_ids`` are all known tokens (prompt plus sampled). The first
    ``num_computed`` of them have KV in the cache; the rest are computed by
    the next steps. ``block_hashes`` is the hash chain of the sequence's full
    blocks so far, whether or not its physical block is the indexed copy.
    """

    seq_id: str
    token_ids: list[int]
    extra_key: str | None = None
    num_computed: int = 0
    location: SeqLocation = SeqLocation.WAITING
    block_table: list[int] = field(default_factory=list)
    host_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading full blocks already offered to the prefix index.
    num_indexed_blocks: int = 0
    # Contiguous policy only: every block reserved up front.
    reserved: list[int] = field(default_factory=list)
    # Set on resume; a protected sequence is never chosen as a victim until
    # it has produced a new token, so preemption cannot thrash.
    is_protected: bool = False
    # Tokens whose KV will arrive from another worker (until admitted).
    num_imported_tokens: int = 0
    num_preemptions: int = 0
    # Prefix-cache hits are never taken for it (see NewSequence.skip_prefix_cache).
    skip_prefix_cache: bool = False
    # Leading table entries freed out of the sliding window (-1 in block_table and,
    # while swapped, in host_table); see window.py.
    num_freed_blocks: int = 0
    # The first ``block_table`` entry changed since the sequence was last scheduled
    # (``ScheduledSeq.first_changed_block``): lowered by every change to the table.
    first_changed_block: int = 0
    # Trailing tokens whose values are not known yet (``PENDING_TOKEN``): blocks holding
    # them are indexed for the prefix cache only once they are resolved.
    num_pending: int = 0
    # Trailing proposed tokens (speculative decoding): computed by the step that verifies them,
    # never indexed for the prefix cache; the next step keeps the accepted ones and drops the
    # rest with their slots (``BlockManager.accept_tokens_of``).
    num_speculative: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed
