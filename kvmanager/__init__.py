"""KV block accounting: pools, block tables, prefix cache, preemption. Pure Python.

Nothing here imports torch: inputs and outputs are plain data, so the same
``KVManager`` runs in-process and as the cluster's central Ray actor.
"""

from .allocation import ALLOCATION_POLICIES
from .block_manager import BlockManager, PrefixMatch
from .block_pool import BlockPool, ContiguousBlockPool
from .errors import (DoubleFreeError, IntegrityError, KVManagerError, NoFreeBlocksError,
                     UnknownSequenceError, UnknownWorkerError)
from .hashing import BlockHash, hash_block, hash_prefix_blocks
from .kv_manager import PREEMPTION_MODES, KVManager, PoolConfig
from .sequence import SeqLocation, SequenceBlocks
from .step import NewSequence, Preemption, ScheduledSeq, StepInput, StepOutput, from_wire, to_wire

__all__ = [
    "ALLOCATION_POLICIES", "BlockHash", "BlockManager", "BlockPool", "ContiguousBlockPool",
    "DoubleFreeError", "IntegrityError", "KVManager", "KVManagerError", "NewSequence",
    "NoFreeBlocksError", "PREEMPTION_MODES", "PoolConfig", "Preemption", "PrefixMatch",
    "ScheduledSeq", "SeqLocation", "SequenceBlocks", "StepInput", "StepOutput",
    "UnknownSequenceError", "UnknownWorkerError", "from_wire", "hash_block",
    "hash_prefix_blocks", "to_wire",
]
