"""One engine-options schema: its defaults, its checks, and the forms derived from it.

``EngineOptions`` (workers/engine/engine_options.py) is the only declaration; ``LLM(...)``,
``EngineConfig``, the YAML ``engine:`` section, per-group overrides and the KV
manager's ``PoolConfig`` must agree with it on every default and every check.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml

from pagedserve.cluster import config as cluster_config
from pagedserve.cluster.cli import GENERATE_ENGINE_OPTIONS, build_parser
from pagedserve.cluster.config import ConfigError, load_config
from pagedserve.kvmanager import BlockManager, PoolConfig
from pagedserve.workers.engine.engine_options import (BLOCK_SIZES, KERNEL_BACKENDS, POOL_OPTIONS, EngineConfig,
                                               EngineOptions)

# The defaults table, written out once more on purpose: changing a default is a
# decision that this test makes visible (and docs/configuration.md, generated from the schema, states).
DEFAULTS = {
    "dtype": None, "device": None, "block_size": 16, "num_device_blocks": None,
    "kv_cache_memory_gb": None, "gpu_memory_utilization": 0.9, "swap_space_gb": 0.25,
    "enable_prefix_caching": True, "preemption_mode": None, "max_num_seqs": 256,
    "max_num_batched_tokens": None, "max_model_len": None, "scheduling_policy": "fcfs",
    "allocation": "paged", "watermark": 0.01, "seed": None, "kernel_backend": None,
    "enforce_eager": False, "async_scheduling": None, "stream_interval": 1, "cuda_graph_sizes": None,
    "torch_compile": None,
    "merge_projections": None, "tensor_parallel_size": 1, "distributed_executor_backend": None,
    "enable_lora": False, "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None,
}

# option -> values every form must refuse (the old forms disagreed on several).
BAD_VALUES = {
    "block_size": [0, -16, 12, 24, 256, 1.5, "x"],
    "stream_interval": [0, -1, 1.5, "x"],
    "cuda_graph_sizes": [[], [0, 8], [-1], "8", [1.5]],
    "torch_compile": ["sometimes", 2],
    "merge_projections": ["sometimes", 2],
    "num_device_blocks": [0, -1, 2.5],
    "kv_cache_memory_gb": [0, -1.0, float("inf"), float("nan")],
    "gpu_memory_utilization": [0, 1.01, -0.5],
    "swap_space_gb": [-0.1, float("inf"), float("nan")],
    "preemption_mode": ["sometimes", "migrate", ""],
    "max_num_seqs": [0, -3],
    "max_num_batched_tokens": [0],
    "max_model_len": [0, 1],
    "scheduling_policy": ["lifo"],
    "allocation": ["buddy"],
    "watermark": [-0.01, 1.0, 2],
    "seed": [-1, 2**63],
    "kernel_backend": ["cuda"],
    "tensor_parallel_size": [0, -2, 1.5],
    "distributed_executor_backend": ["uni", "threads"],
    "enable_lora": ["sometimes", 2],
    "max_loras": [0, -1, 1.5],
    "max_lora_rank": [0, -8],
    "max_cpu_loras": [0, -1],
}


def test_the_defaults_table():
    assert EngineOptions().model_dump() == DEFAULTS


def test_every_form_has_the_same_defaults():
    from_llm_kwargs = EngineConfig.from_kwargs(model="m").model_dump()
    assert {k: from_llm_kwargs[k] for k in DEFAULTS} == DEFAULTS
    assert load_config(None).engine.model_dump() == DEFAULTS
    pool = EngineOptions().pool_config(num_device_blocks=8, num_host_blocks=0, max_model_len=64)
    assert {name: getattr(pool, name) for name in POOL_OPTIONS} == {name: DEFAULTS[name] for name in POOL_OPTIONS}


def test_the_forms_cannot_drift():
    # The cluster's YAML section is the schema itself, not a copy of it.
    assert cluster_config.EngineOptions is EngineOptions
    assert cluster_config.ClusterConfig.model_fields["engine"].annotation is EngineOptions
    # EngineConfig is the options plus the checkpoint, nothing else.
    assert issubclass(EngineConfig, EngineOptions)
    assert set(EngineConfig.model_fields) - set(EngineOptions.model_fields) == {"model", "tokenizer",
                                                                               "trust_remote_code"}
    # The pool options are PoolConfig fields; their defaults are PoolConfig's (and BlockManager's).
    pool_fields = {f.name: f for f in dataclasses.fields(PoolConfig)}
    manager_defaults = {name: p.default for name, p in inspect.signature(BlockManager).parameters.items()}
    for name in POOL_OPTIONS:
        assert EngineOptions.model_fields[name].default == pool_fields[name].default, name
        if name in manager_defaults:
            assert manager_defaults[name] == pool_fields[name].default, name
    # `pagedserve generate` leaves unset engine flags to the schema.
    args = build_parser().parse_args(["generate"])
    assert all(getattr(args, name) is None for name in GENERATE_ENGINE_OPTIONS)
    assert set(GENERATE_ENGINE_OPTIONS) <= set(EngineOptions.model_fields)


@pytest.mark.parametrize("option,value", [(k, v) for k, values in BAD_VALUES.items() for v in values],
                         ids=lambda x: repr(x))
def test_every_form_refuses_a_bad_value_naming_the_option(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig.from_kwargs(model="m", **{option: value})
    with pytest.raises(ValueError, match=option):
        EngineOptions(**{option: value})
    with pytest.raises(ConfigError, match=rf"engine\.{option}"):
        load_config(None, [f"engine.{option}={yaml.safe_dump(value).splitlines()[0]}"])


@pytest.mark.parametrize("options,message", [
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"torch_compile": True}, "torch_compile"),
])
def test_lora_options_that_cannot_go_together_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(enable_lora=True, **options)
    EngineOptions(enable_lora=False, **options)  # without LoRA they are no concern of its


def test_group_overrides_use_the_same_checks():
    with pytest.raises(ConfigError, match="block_size"):
        load_config(None, ["workers.0.engine.block_size=24"])  # the YAML form once took any size >= 1
    with pytest.raises(ConfigError, match="bogus"):
        load_config(None, ["workers.0.engine.bogus=1"])
    assert load_config(None, ["workers.0.engine.block_size=32"]).workers[0].engine == {"block_size": 32}


def test_unknown_options_are_named():
    with pytest.raises(TypeError, match="bogus"):
        EngineConfig.from_kwargs(model="m", bogus=1)
    with pytest.raises(ValueError, match="bogus"):
        EngineOptions(bogus=1)
    with pytest.raises(ConfigError, match="engine.bogus"):
        load_config(None, ["engine.bogus=1"])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_whatever_the_schema_accepts_the_kv_manager_accepts(block_size):
    for allocation in ("paged", "contiguous"):
        for preemption_mode in (None, "swap", "recompute"):
            for watermark in (0.0, 0.5, 0.999):
                options = EngineOptions(block_size=block_size, allocation=allocation, watermark=watermark,
                                        preemption_mode=preemption_mode, enable_prefix_caching=False)
                pool = options.pool_config(num_device_blocks=4, num_host_blocks=2, max_model_len=2)
                BlockManager(pool.num_device_blocks, pool.num_host_blocks, pool.block_size, pool.max_model_len,
                             pool.allocation, pool.enable_prefix_caching, pool.watermark).check_integrity()


def test_the_schema_offers_the_kernels_backends():
    """Written in the schema so that it loads without torch (test_import_graph), checked here."""
    from pagedserve.kernels import BACKENDS

    assert KERNEL_BACKENDS == BACKENDS
    for backend in KERNEL_BACKENDS:
        assert EngineOptions(kernel_backend=backend).kernel_backend == backend


def test_options_round_trip_to_a_worker_and_assignment_is_checked():
    config = EngineOptions(block_size=32, swap_space_gb=0).to_engine_config("m", trust_remote_code=True)
    assert EngineConfig(**config.model_dump()) == config  # what a worker receives over Ray
    assert config.block_size == 32 and config.trust_remote_code and config.swap_space_gb == 0
    with pytest.raises(ValueError, match="block_size"):
        config.block_size = 24
