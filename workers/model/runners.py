"""The model runner an engine gets: one device's ``ModelRunner``, or rank 0 of a
tensor-parallel group (``TensorParallelRunner``) when the model spans several."""

from __future__ import annotations

from ..engine.engine_options import EngineConfig
from .model_runner import ModelRunner
from ..tp.runner import TensorParallelRunner
from ..tp.launch import choose_launcher


def build_runner(config: EngineConfig) -> ModelRunner | TensorParallelRunner:
    """The runner for ``config``: ``tensor_parallel_size`` ranks, started as
    ``distributed_executor_backend`` says."""
    size = config.tensor_parallel_size
    if size == 1:
        return ModelRunner(config.model, config.dtype, config.device, config.trust_remote_code,
                           config.kernel_backend, merge_projections=config.merge_projections)
    return TensorParallelRunner(config.model, size, choose_launcher(config.distributed_executor_backend, size),
                                config.dtype, config.device, config.trust_remote_code, config.kernel_backend,
                                merge_projections=config.merge_projections)
