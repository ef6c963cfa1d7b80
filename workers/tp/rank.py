"""One rank of a tensor-parallel group: its shard of the model, and, for ranks 1 and up,
the loop that runs rank 0's commands.

Every rank builds the same things in the same order (process groups, the
sharded ``ModelRunner``, whose load-time probes already all-reduce, then the
command channel), so the collectives of all ranks line up. Ranks 1 and up
then wait for commands: apply the KV copies that came with each, run it on
their own shard and pool (same block ids as rank 0), and wait again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from ..lora.adapted_layers import AdaptedLayers
from ..lora.adapter_pages import PagesMirror
from ..lora.follower import LoRAFollower, LoRAUpdate
from ..lora.lora_request import LoRARequest
from ..model.model_input import ModelInput
from ..model.model_runner import ModelRunner, resolve_device
from ..model.model_support import load_config
from ..process.gc_heap import prepare_serving_heap
from ..process.progress_bars import hide_transformers_progress_bars
from .dispatch import CommandChannel, GroupBrokenError, open_channel
from .group import Rendezvous, TensorParallelGroup
from .load import ShardLoader
from .messages import (AllocateCache, EnableLoRA, EnableLoRAPages, KVCopies, ProfilePeak, ReadBlocks, RunStep, Stop,
                       WarmUpKernels, WriteBlocks, unpack)
from .plan import SliceSpec, TensorParallelError, check_tensor_parallel, shard_slice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group loads and where the ranks meet (plain data, sent to each)."""

    model: str
    rendezvous: Rendezvous
    dtype: str | None = None
    device: str | None = None
    trust_remote_code: bool = False
    kernel_backend: str | None = None
    merge_projections: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RankSpec":
        return cls(**{**data, "rendezvous": Rendezvous(**data["rendezvous"])})


def rank_device(device: str | None, gpu_index: int) -> torch.device:
    """A rank's device: the CPU, or GPU ``gpu_index`` of those this process sees (local
    processes see every GPU and take their rank's; a Ray actor sees only its own, index 0)."""
    resolved = resolve_device(device)
    if resolved.type != "cuda" or resolved.index is not None:
        return resolved
    return torch.device("cuda", gpu_index)


# Set in an engine core's process (which has no Ray) to its worker actor's Ray node id.
NODE_ID_ENV = "PAGEDSERVE_NODE_ID"


def node_key() -> str:
    """Which node this process runs on (the Ray node id under Ray, or the one an engine core's
    worker actor gave it, else the host name)."""
    if os.environ.get(NODE_ID_ENV):
        return os.environ[NODE_ID_ENV]
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return socket.gethostname()


def load_rank_runner(spec: RankSpec, group: TensorParallelGroup) -> tuple[ModelRunner, dict[str, SliceSpec]]:
    """This rank's ``ModelRunner``: the model cut down to its shard, all-reducing over ``group``;
    and how each cut parameter was cut (``ShardLoader.cuts``)."""
    config = load_config(spec.model, spec.trust_remote_code)
    check_tensor_parallel(config, group.size)
    loader = ShardLoader(group.rank, group.size, group.all_reduce)
    runner = ModelRunner(spec.model, spec.dtype, group.device, spec.trust_remote_code, spec.kernel_backend,
                         load=loader, merge_projections=spec.merge_projections)
    text_config = config.get_text_config()
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    if runner.num_kv_heads * group.size != num_kv_heads:
        raise TensorParallelError(
            f"model type {config.model_type!r}: rank {group.rank} attends over {runner.num_kv_heads} KV heads "
            f"after the split, not {num_kv_heads} / {group.size}")
    return runner, loader.cuts


class RankExecutor:
    """Rank 1 and up: runs rank 0's commands on its shard until told to stop or rank 0 is gone.
    ``weight_cuts``: how the shard was cut (``load_rank_runner``'s), which its adapters follow."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, channel: CommandChannel,
                 weight_cuts: dict[str, SliceSpec] | None = None) -> None:
        self.runner = runner
        self.group = group
        self.channel = channel
        self.weight_cuts = weight_cuts or {}
        self.lora: LoRAFollower | None = None
        self.num_steps = 0

    def run(self) -> None:
        """The command loop; returns on ``Stop`` or when rank 0 is gone."""
        try:
            while True:
                command, copies = unpack(self.channel.receive())
                self._apply_copies(copies)
                if isinstance(command, Stop):
                    return
                self.handle(command)
        except GroupBrokenError as exc:
            logger.warning("tensor-parallel rank %d: %s; leaving", self.group.rank, exc)
        finally:
            self.channel.close()

    def handle(self, command) -> None:
        runner = self.runner
        if isinstance(command, RunStep):
            if command.rows:
                runner.block_tables.ensure_rows(max(command.rows) + 1)
            pending_tokens = None
            if command.pending:
                pending_tokens = torch.empty(command.num_pending_sources, dtype=getattr(torch, command.pending_dtype),
                                             device=self.group.device)
                self.group.broadcast_model(pending_tokens)
            # The other ranks never sample: hidden states only (logits_indexes=[]).
            with self._adapters(command):
                runner.execute(ModelInput(command.rows, command.starts, command.input_ids, command.table_updates,
                                          command.num_tokens, logits_indexes=[], pending=command.pending),
                               pending_tokens)
            self.num_steps += 1
        elif isinstance(command, EnableLoRA):
            self.lora = LoRAFollower(AdaptedLayers(runner.model, command.max_loras, command.max_lora_rank,
                                                   runner.kernel_backend, self.weight_cuts))
        elif isinstance(command, EnableLoRAPages):
            self.lora.use_pages(PagesMirror(runner.kv_cache, command.min_features, command.zero_page))
        elif isinstance(command, WarmUpKernels):
            runner.warm_up_kernels(command.max_blocks_per_seq)
        elif isinstance(command, AllocateCache):
            runner.allocate_cache(command.block_size, command.num_device_blocks, command.num_host_blocks)
        elif isinstance(command, ProfilePeak):
            runner.profile_peak_memory(command.num_tokens, command.block_size)
        elif isinstance(command, ReadBlocks):
            self.group.gather_control(runner.kv_cache.read_blocks(command.block_ids))
        elif isinstance(command, WriteBlocks):
            payload = receive_payload(self.group, command.layout, command.dtype)
            runner.kv_cache.write_blocks(command.block_ids, local_heads(payload, self.group.rank, self.group.size))
        else:
            raise TypeError(f"unknown tensor-parallel command {type(command).__name__}")

    @contextlib.contextmanager
    def _adapters(self, command: RunStep) -> Iterator[None]:
        """Around a step's forward: its adapters, as rank 0 put them in slots (none without LoRA)."""
        if (command.lora_dropped is None and command.lora_loads is None and command.lora_slots is None
                and command.lora_pages is None):
            yield
            return
        if self.lora is None:
            raise RuntimeError("a step with adapters reached a rank whose layers take none (no EnableLoRA)")
        loads = [(slot, LoRARequest(name, lora_int_id, path))
                 for slot, lora_int_id, name, path in command.lora_loads or ()]
        pages = [(lora_int_id, LoRARequest(name, lora_int_id, path) if page_ids else None, page_ids)
                 for lora_int_id, name, path, page_ids in command.lora_pages or ()]
        update = LoRAUpdate(command.lora_dropped or [], loads, command.lora_slots, pages)
        self.lora.apply(update)
        with self.lora.step(update, command.num_tokens):
            yield

    def _apply_copies(self, copies: list[KVCopies]) -> None:
        for batch in copies:
            self.runner.kv_cache.execute_copies(batch.swap_out, batch.swap_in, batch.copy_on_write)


# KV payloads ([layers, 2, blocks, block_size, heads, head_dim]) hold heads in dim 4.
HEAD_DIM_OF_PAYLOAD = 4


def local_heads(payload: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s heads of a payload holding every head (re-sharding on import)."""
    return shard_slice(payload, HEAD_DIM_OF_PAYLOAD, rank, size)


def broadcast_payload(group: TensorParallelGroup, payload: torch.Tensor) -> None:
    """Rank 0: send a CPU payload to every rank as raw bytes (gloo knows no bfloat16)."""
    group.broadcast_control(payload.contiguous().view(torch.uint8))


def receive_payload(group: TensorParallelGroup, layout: list[int], dtype: str) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype)
    element_size = torch.empty((), dtype=torch_dtype).element_size()
    raw = torch.empty((*layout[:-1], layout[-1] * element_size), dtype=torch.uint8)
    group.broadcast_control(raw)
    return raw.view(torch_dtype)


def share_cpu(size: int) -> None:
    """On the CPU, a rank computes with its share of the cores: ``size`` processes with a thread
    per core each would spin against each other between the forward pass's all-reduces."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def publish_rank_info(group: TensorParallelGroup, **extra) -> None:
    """What rank 0 reports of this rank (status, dashboard), through the group's store."""
    info = {"rank": group.rank, "device": str(group.device), "node_id": node_key(),
            "host": socket.gethostname(), "pid": os.getpid(), **extra}
    group.store.set(f"rank-info/{group.rank}", json.dumps(info))


def read_rank_info(group: TensorParallelGroup) -> list[dict]:
    return [json.loads(group.store.get(f"rank-info/{rank}")) for rank in range(group.size)]


def run_rank(spec: dict, rank: int, gpu_index: int) -> None:
    """Entry point of rank ``rank`` >= 1 (a local process or a Ray actor's task): join the
    group, load the shard, run commands until rank 0 stops or is gone."""
    spec = RankSpec.from_dict(spec)
    hide_transformers_progress_bars()   # rank 0's process shows the load, if any
    if not os.path.isdir(spec.model):
        raise FileNotFoundError(
            f"tensor-parallel rank {rank} on {socket.gethostname()}: the model directory {spec.model} that "
            "rank 0 loaded is not on this node; ranks placed on other nodes (placement_strategy PACK) need "
            "the checkpoint at the same path on every node (shared storage, or a pre-filled hub cache)")
    device = rank_device(spec.device, gpu_index)
    if device.type == "cpu":
        share_cpu(spec.rendezvous.size)
    group = TensorParallelGroup(spec.rendezvous, rank, device)
    publish_rank_info(group)
    runner, weight_cuts = load_rank_runner(spec, group)
    channel = open_channel(group, node_key())
    logger.info("tensor-parallel rank %d of %d ready on %s (%s channel)", rank, group.size, group.device,
                getattr(channel, "name", "?"))
    executor = RankExecutor(runner, group, channel, weight_cuts)
    prepare_serving_heap(f"tensor-parallel rank {rank}")
    executor.run()
