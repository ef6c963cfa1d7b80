"""KV block accounting: pools, block tables, prefix cache, preemption. Pure Python (one optional
C extension, ``keyset``'s, with a Python fallback).

Nothing here imports torch: inputs and outputs are plain data. Two levels:
each worker runs ``LocalKVManager`` (the same ``KVManager`` code) on its own
pools, in-process, and reports changes as KV events; the central
``service.KVManagerService`` keeps the ``ClusterIndex`` and decides
preemptions. The offline engine runs ``KVManager`` alone.
"""

from .allocation import ALLOCATION_POLICIES
from .block_manager import BlockManager, PrefixMatch
from .block_pool import BlockPool, ContiguousBlockPool
from .cluster_index import ClusterIndex
from .errors import (DoubleFreeError, IntegrityError, KVManagerError, NoFreeBlocksError,
                     UnknownSequenceError, UnknownWorkerError)
from .events import (AdapterReport, AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEventBatch,
                     KVSnapshot, PublishAck, TierOccupancy)
from .hashing import BlockHash, block_hash_key, hash_block, hash_prefix_blocks, prefix_extra_key
from .kv_manager import PREEMPTION_MODES, KVManager, PoolConfig
from .local_manager import LocalKVManager
from .publisher import InProcessTransport, KVPublisher, KVTransport
from .preemption import (LocalPreemptionPolicy, PreemptionCandidate, PreemptionChoice, PreemptionDecision,
                         PreemptionRequest, RemotePreemptionPolicy, decide_preemption)
from .sequence import SeqLocation, SequenceBlocks
from .step import (PENDING_TOKEN, NewSequence, Preemption, ScheduledSeq, StepInput, StepOutput, from_wire,
                   to_wire)

__all__ = [
    "ALLOCATION_POLICIES", "AdapterReport", "AllBlocksCleared", "BlockHash", "BlockManager", "BlockPool", "BlockRemoved",
    "BlockStored", "ClusterIndex", "ContiguousBlockPool", "EventLog", "InProcessTransport", "KVEventBatch",
    "KVPublisher", "KVSnapshot", "KVTransport",
    "LocalKVManager", "LocalPreemptionPolicy", "PreemptionCandidate", "PreemptionChoice",
    "PreemptionDecision", "PreemptionRequest", "PublishAck", "RemotePreemptionPolicy", "TierOccupancy",
    "block_hash_key", "decide_preemption",
    "DoubleFreeError", "IntegrityError", "KVManager", "KVManagerError", "NewSequence",
    "NoFreeBlocksError", "PENDING_TOKEN", "PREEMPTION_MODES", "PoolConfig", "Preemption", "PrefixMatch",
    "ScheduledSeq", "SeqLocation", "SequenceBlocks", "StepInput", "StepOutput",
    "UnknownSequenceError", "UnknownWorkerError", "from_wire", "hash_block",
    "hash_prefix_blocks", "prefix_extra_key", "to_wire",
]
