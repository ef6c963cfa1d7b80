"""A model spanning a tensor-parallel group of ranks, behind ``ModelRunner``'s interface.

Rank 0 runs the engine: it plans (scheduler, KV manager, sampling) exactly as
a single-GPU engine does, with ``TensorParallelRunner`` as its runner. Each
call the engine makes is sent, as one packed command, to the other ranks
(``tp_dispatch``: pipes on one node, gloo broadcasts across nodes), which run
the same thing on their own shard: the forward pass (one all-reduce after
attention, one after the MLP, inside the model), cache allocation, and the
KV copies (swap out, swap in, copy-on-write), which ride with the next
command. Every rank's pool has the same block ids, so the KV manager, the
router and the rest of the cluster see one worker. With LoRA, rank 0's adapter
decisions for a step (``LoRAUpdate``) ride that step's command, and every rank
computes its cut of the adapters.

``GroupKVCache`` is the group's cache as the engine sees it: its shape holds
every head, and the blocks it reads and writes for transfers (migration,
disaggregation) hold every head too, gathered from and split across the
ranks, so groups of any TP size (and single-GPU workers) exchange KV.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from ..lora.adapted_layers import AdaptedLayers
from ..lora.follower import LoRAUpdate
from ..model.kv_cache import CacheShape, KVCache
from ..model.model_input import ExecuteOutput, ModelInput
from ..model.model_support import load_config
from .dispatch import CommandChannel, GroupBrokenError, open_channel
from .group import TensorParallelGroup, await_ranks, host_store
from .launch import RankLauncher, RankSet
from .messages import (AllocateCache, EnableLoRA, EnableLoRAPages, KVCopies, ProfilePeak, ReadBlocks, RunStep, Stop,
                       WarmUpKernels, WriteBlocks, pack)
from .plan import check_tensor_parallel
from .rank import (HEAD_DIM_OF_PAYLOAD, RankSpec, broadcast_payload, load_rank_runner, local_heads, node_key,
                      publish_rank_info, rank_device, read_rank_info)

logger = logging.getLogger(__name__)

# After a failed collective, how long to wait for the rank's death to show.
RANK_LOSS_WAIT_S = 5.0


class GroupKVCache:
    """The KV cache of a whole group, as rank 0's engine sees it.

    Copies run on rank 0's shard at once and on the other ranks before their
    next command. ``shape`` holds every head (``num_kv_heads`` of the model);
    ``read_blocks``/``write_blocks`` move every head.
    """

    def __init__(self, runner: "TensorParallelRunner", local: KVCache) -> None:
        self.runner = runner
        self.local = local
        size = runner.group.size
        shape = local.shape
        self.shape = CacheShape(shape.num_layers, shape.block_size, shape.num_kv_heads * size, shape.head_dim,
                                shape.dtype)
        self.device = local.device
        self.num_device_blocks = local.num_device_blocks
        self.num_host_blocks = local.num_host_blocks

    @property
    def num_bytes_swapped_out(self) -> int:
        return self.local.num_bytes_swapped_out * self.runner.group.size

    @property
    def num_bytes_swapped_in(self) -> int:
        return self.local.num_bytes_swapped_in * self.runner.group.size

    def execute_copies(self, swap_out, swap_in, copy_on_write) -> None:
        self.local.execute_copies(swap_out, swap_in, copy_on_write)
        if swap_out or swap_in or copy_on_write:
            self.runner.pending_copies.append(KVCopies(list(swap_out), list(swap_in), list(copy_on_write)))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Every head of these device blocks, gathered from the ranks."""
        with self.runner.on_group():
            self.runner.send(ReadBlocks(list(block_ids)))
            parts = self.runner.group.gather_control(self.local.read_blocks(block_ids))
        return torch.cat(parts, dim=HEAD_DIM_OF_PAYLOAD)

    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Split a payload holding every head across the ranks, into these device blocks."""
        group = self.runner.group
        expected = self.shape.num_kv_heads
        if payload.shape[HEAD_DIM_OF_PAYLOAD] != expected:
            raise ValueError(f"a KV payload of {payload.shape[HEAD_DIM_OF_PAYLOAD]} heads for a group "
                             f"of {expected}")
        payload = payload.contiguous()
        with self.runner.on_group():
            self.runner.send(WriteBlocks(list(block_ids), list(payload.shape),
                                         str(payload.dtype).removeprefix("torch.")))
            broadcast_payload(group, payload)
        self.local.write_blocks(block_ids, local_heads(payload, 0, group.size))


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group, with ``ModelRunner``'s interface.

    ``execute`` sends the step to the other ranks and runs rank 0's shard;
    it returns the full-vocabulary logits (the LM head is whole on rank 0),
    so sampling is unchanged. ``cache_shape`` is one rank's (KV budgets are
    per GPU); ``kv_cache`` is the group's (``GroupKVCache``). Any other
    attribute is rank 0's ``ModelRunner``'s.
    """

    def __init__(self, model: str, tensor_parallel_size: int, launcher: RankLauncher, dtype=None,
                 device=None, trust_remote_code: bool = False, kernel_backend: str | None = None,
                 merge_projections: bool | None = None) -> None:
        self.pending_copies: list[KVCopies] = []
        self.pending_lora: LoRAUpdate | None = None
        self.ranks: RankSet | None = None
        self.channel: CommandChannel | None = None
        self.kv_cache: GroupKVCache | None = None
        self.num_steps = 0
        start = time.perf_counter()
        # A model the group cannot split is refused here, before any rank process starts.
        check_tensor_parallel(load_config(model, trust_remote_code), tensor_parallel_size)
        device = rank_device(device, 0)
        store, rendezvous = host_store(tensor_parallel_size)
        self.spec = RankSpec(model, rendezvous, dtype, device.type,
                             trust_remote_code, kernel_backend, merge_projections)
        self.ranks = launcher.launch(self.spec)
        try:
            await_ranks(store, tensor_parallel_size, self.ranks.broken_reason)
            self.group = TensorParallelGroup(rendezvous, 0, device, store)
            publish_rank_info(self.group)
            self.local, self.weight_cuts = load_rank_runner(self.spec, self.group)
            self.channel = open_channel(self.group, node_key())
            self.rank_info = read_rank_info(self.group)
        except BaseException:
            self.ranks.stop()
            raise
        logger.info("tensor-parallel group of %d ranks (%s) ready in %.1f s: %s all-reduces, %s channel",
                    tensor_parallel_size, self.ranks.describe(), time.perf_counter() - start,
                    self.group.backend, getattr(self.channel, "name", "?"))

    def __getattr__(self, name):
        # Only reached for attributes not set here: rank 0's runner answers (model, attention, ...).
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.size

    @functools.cached_property
    def num_parameters(self) -> int:
        """The whole model's parameters (rank 0 holds ``local.num_parameters`` of them)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.local.config,
                                                     trust_remote_code=self.spec.trust_remote_code)
        return sum(p.numel() for p in model.parameters())

    # ---- the interface the engine uses ---------------------------------------------------
    def cache_shape(self, block_size: int) -> CacheShape:
        """One rank's block layout (its heads): a KV budget is per GPU."""
        return self.local.cache_shape(block_size)

    def allocate_cache(self, block_size: int, num_device_blocks: int, num_host_blocks: int) -> GroupKVCache:
        with self.on_group():
            self.send(AllocateCache(block_size, num_device_blocks, num_host_blocks))
        local = self.local.allocate_cache(block_size, num_device_blocks, num_host_blocks)
        self.kv_cache = GroupKVCache(self, local)
        return self.kv_cache

    def profile_peak_memory(self, num_tokens: int, block_size: int, graph_sizes: list[int] | None = None,
                            max_blocks_per_seq: int = 1, torch_compile: bool = False,
                            verify_query_len: int = 1) -> int:
        """Rank 0's peak (every rank runs the same shapes); no CUDA graphs (see
        ``enable_decode_graphs``), so ``graph_sizes`` take no memory."""
        if self.local.device.type != "cuda":
            return 0
        with self.on_group():
            self.send(ProfilePeak(num_tokens, block_size))
            return self.local.profile_peak_memory(num_tokens, block_size)

    def warm_up_kernels(self, max_blocks_per_seq: int) -> None:
        """Every rank at once: with Triton, the warm-up's forwards hold the group's all-reduces."""
        with self.on_group():
            self.send(WarmUpKernels(max_blocks_per_seq))
            self.local.warm_up_kernels(max_blocks_per_seq)

    def enable_decode_graphs(self, sizes: list[int], max_blocks_per_seq: int, capture: bool = True,
                             torch_compile: bool = False, lora=None) -> bool:
        """Decode steps of a group run eagerly: capturing CUDA graphs whose forward holds
        all-reduces needs every rank to capture and replay in step, which this runner does not
        do yet, and so does compiling every rank's forward alike. Returns False (the engine's
        answer when a model cannot be captured)."""
        logger.info("tensor-parallel group: decode steps run eagerly (no CUDA graphs or "
                    "torch.compile across ranks)")
        return False

    @property
    def decode_graphs(self):
        return None

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> AdaptedLayers:
        """Every rank's decoder takes adapters: the other ranks follow rank 0's ``LoRAManager``,
        whose updates (``queue_lora_update``) ride the next step. Returns rank 0's layers."""
        with self.on_group():
            self.send(EnableLoRA(max_loras, max_lora_rank))
        return AdaptedLayers(self.local.model, max_loras, max_lora_rank, self.spec.kernel_backend, self.weight_cuts)

    def enable_lora_pages(self, zero_page: int, min_features: int) -> None:
        """Unified paging: the other ranks' slots read pages of their KV caches, as rank 0's
        (``PagesMirror``); each step's update says which adapter is in which blocks."""
        with self.on_group():
            self.send(EnableLoRAPages(zero_page, min_features))

    def queue_lora_update(self, update: LoRAUpdate) -> None:
        """Send ``update`` (rank 0's adapter decisions for the coming step) with the next step."""
        self.pending_lora = update if self.pending_lora is None else self.pending_lora.then(update)

    def execute(self, model_input: ModelInput, pending_tokens: torch.Tensor | None = None) -> ExecuteOutput:
        pending = model_input.pending
        lora, self.pending_lora = self.pending_lora, None
        with self.on_group():
            self.send(RunStep(model_input.rows, model_input.starts, model_input.input_ids,
                              model_input.table_updates, model_input.num_tokens, pending,
                              0 if not pending else len(pending_tokens),
                              None if not pending else str(pending_tokens.dtype).removeprefix("torch."),
                              *_lora_fields(lora)))
            if pending:
                pending_tokens = pending_tokens.contiguous()
                self.group.broadcast_model(pending_tokens)
            self.num_steps += 1
            return self.local.execute(model_input, pending_tokens)

    def release_block_table(self, seq_id: str) -> None:
        self.local.release_block_table(seq_id)

    # ---- the group --------------------------------------------------------------------
    @contextlib.contextmanager
    def on_group(self):
        """Around whatever involves the other ranks: a rank found gone ends the group as one
        (``RankSet.fail``: under Ray this process exits, so the cluster restarts the worker)."""
        try:
            yield
        except GroupBrokenError as exc:
            self.ranks.fail(str(exc))
            raise
        except RuntimeError as exc:   # gloo and NCCL report a lost peer so
            if not self.ranks.wait_broken(RANK_LOSS_WAIT_S):
                raise
            self.ranks.fail(f"a collective failed ({str(exc).splitlines()[0]})")
            raise GroupBrokenError(f"a rank of the tensor-parallel group is gone: {exc}") from exc

    def send(self, command) -> None:
        """Hand ``command`` (with the copies made since the last one) to the other ranks."""
        if self.channel is None:
            raise GroupBrokenError("the tensor-parallel group was shut down")
        if self.ranks.is_broken():
            raise GroupBrokenError("a rank of the tensor-parallel group is gone")
        copies, self.pending_copies = self.pending_copies, []
        self.channel.send(pack(command, copies))

    def describe_ranks(self) -> list[dict]:
        """Each rank: its index, device, node and process, and its share of the pool."""
        cache = self.local.kv_cache
        pool = {} if cache is None else {
            "num_kv_heads": cache.shape.num_kv_heads, "num_device_blocks": cache.num_device_blocks,
            "num_host_blocks": cache.num_host_blocks,
            "device_pool_bytes": cache.num_device_blocks * cache.shape.bytes_per_block,
            "host_pool_bytes": cache.num_host_blocks * cache.shape.bytes_per_block}
        return [{**info, **pool} for info in self.rank_info]

    def shutdown(self) -> None:
        """Stop the other ranks (idempotent)."""
        if self.channel is not None:
            try:
                self.send(Stop())
            except Exception:
                pass
            self.channel.close()
            self.channel = None
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None


def _lora_fields(update: LoRAUpdate | None) -> tuple:
    """``RunStep``'s ``lora_dropped``, ``lora_loads``, ``lora_slots`` and ``lora_pages`` for ``update``."""
    if update is None:
        return None, None, None, None
    loads = [(slot, request.lora_int_id, request.lora_name, request.lora_path) for slot, request in update.loads]
    pages = [(adapter_id, "", "", []) if request is None else (adapter_id, request.lora_name, request.lora_path, ids)
             for adapter_id, request, ids in update.pages]
    return update.dropped, loads, update.chunk_slots, pages or None
