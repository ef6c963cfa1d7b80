"""The model runner an engine gets: one device's ``ModelRunner``, or rank 0 of a
tensor-parallel group (``TensorParallelRunner``) when the model spans several; and the
adapters of its model (``enable_lora``)."""

from __future__ import annotations

from typing import Callable

from ..lora.adapted_layers import AdaptedLayers
from ..lora.adapter_pages import AdapterPages, PagePool
from ..lora.manager import LoRAManager
from ..model.model_runner import ModelRunner
from ..tp.launch import RankLauncher, choose_launcher
from ..tp.runner import TensorParallelRunner
from .engine_options import EngineConfig


def build_runner(config: EngineConfig, rank_launcher: RankLauncher | None = None) -> ModelRunner | TensorParallelRunner:
    """The runner for ``config``: ``tensor_parallel_size`` ranks, started by ``rank_launcher``
    if given (an engine core whose worker actor starts them), else as
    ``distributed_executor_backend`` says."""
    size = config.tensor_parallel_size
    if size == 1:
        return ModelRunner(config.model, config.dtype, config.device, config.trust_remote_code,
                           config.kernel_backend, merge_projections=config.merge_projections)
    launcher = rank_launcher or choose_launcher(config.distributed_executor_backend, size)
    return TensorParallelRunner(config.model, size, launcher,
                                config.dtype, config.device, config.trust_remote_code, config.kernel_backend,
                                merge_projections=config.merge_projections)


def build_lora_manager(runner: ModelRunner | TensorParallelRunner, config: EngineConfig,
                       in_use: Callable[[], set[int]]) -> LoRAManager:
    """The adapters of ``runner``'s model (``in_use``: the ids of unfinished requests'). On a
    tensor-parallel group every rank's layers take them, cut as the rank's weights were, and
    the other ranks follow rank 0's manager."""
    max_cpu_loras = config.max_cpu_loras or config.max_loras
    if isinstance(runner, TensorParallelRunner):
        return LoRAManager(runner.enable_lora(config.max_loras, config.max_lora_rank), max_cpu_loras, in_use,
                           publish=runner.queue_lora_update)
    layers = AdaptedLayers(runner.model, config.max_loras, config.max_lora_rank, config.kernel_backend)
    return LoRAManager(layers, max_cpu_loras, in_use)


def enable_lora_pages(runner: ModelRunner | TensorParallelRunner, lora: LoRAManager, pool: PagePool,
                      sequence_blocks: int) -> None:
    """Unified paging: ``lora``'s adapters in pages of ``pool`` (the KV manager's device pool for
    this worker) in ``runner``'s KV cache; on a tensor-parallel group rank 0 picks the pages
    and every rank writes its cut of each adapter into the same blocks of its own cache."""
    is_group = isinstance(runner, TensorParallelRunner)
    pages = AdapterPages(pool, runner.local.kv_cache if is_group else runner.kv_cache, lora.layers.min_features,
                         sequence_blocks)
    if is_group:
        runner.enable_lora_pages(pages.zero_page, pages.min_features)
    lora.use_pages(pages)
