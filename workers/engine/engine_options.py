"""The engine options: one schema, one defaults table, vLLM's names.

``EngineOptions`` is every per-worker engine setting with its default and its
check. The other forms are derived from it, never restated:

- ``EngineConfig`` (``LLM(...)``, a worker's constructor) is these options plus
  the checkpoint (``model``, ``tokenizer``, ``trust_remote_code``);
- the YAML ``engine:`` section and ``workers[].engine`` overrides validate with
  this class itself (``cluster.config`` re-exports it);
- the KV manager's ``PoolConfig`` is built from it by ``pool_config``. The options
  the pool shares (block size, allocation, prefix caching, watermark, preemption
  mode) take their defaults from ``PoolConfig``, the lowest layer that knows
  them, so each default is written once.

A bad value raises ``pydantic.ValidationError`` (a ``ValueError``) naming the option.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.kvmanager import ALLOCATION_POLICIES, PREEMPTION_MODES, PoolConfig

from ..spec_decode.config import SpeculativeConfig

# The values ``Scheduler`` and ``pagedserve.kernels.select_backend`` take. Both are written here,
# not imported, so that the schema (and with it the cluster's control-plane actors: controller,
# KV manager, relays) loads without torch; test_engine_options checks that the kernels agree.
SCHEDULING_POLICIES = ("fcfs", "priority")
KERNEL_BACKENDS = ("torch", "triton")

# Block sizes the attention kernels take (a power of two, at most one tile's rows).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)

POOL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PoolConfig)
                 if f.default is not dataclasses.MISSING}

# The options PoolConfig shares with the engine, passed down unchanged.
POOL_OPTIONS = ("block_size", "allocation", "enable_prefix_caching", "watermark", "preemption_mode")

Allocation = Literal[tuple(ALLOCATION_POLICIES)]  # type: ignore[valid-type]
PreemptionMode = Literal[PREEMPTION_MODES]  # type: ignore[valid-type]
SchedulingPolicy = Literal[SCHEDULING_POLICIES]  # type: ignore[valid-type]
KernelBackend = Literal[KERNEL_BACKENDS]  # type: ignore[valid-type]
ExecutorBackend = Literal["mp", "ray"]
LoRAPaging = Literal["slots", "unified"]


class EngineOptions(BaseModel):
    """Per-worker engine options; unknown names and bad values are errors naming the option."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    dtype: str | None = None
    """Weights' and KV cache's dtype. Unset or "auto": bfloat16 on GPUs with native bf16 (sm_80
    and newer), float16 on older GPUs, float32 on CPU."""
    device: str | None = None
    """"cpu" or "cuda"; unset or "auto": cuda where present."""
    block_size: int = POOL_DEFAULTS["block_size"]
    """Tokens per KV block: a power of two up to 128."""
    num_device_blocks: int | None = Field(None, ge=1)
    """KV blocks on the device; wins over the memory budgets below."""
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    """The device KV pool's budget; unset: 1 GiB on CPU, profiled on CUDA."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """CUDA only: the fraction of GPU memory for weights, activations and KV cache; the KV pool
    takes what a profiled forward pass leaves."""
    swap_space_gb: float = Field(0.25, ge=0)
    """Host memory for swapped-out sequences and prefix blocks evicted from the device. An engine
    whose host pools (this, and the device pool on the CPU) its node's available memory and
    free swap cannot hold is refused as it starts."""
    enable_prefix_caching: bool = POOL_DEFAULTS["enable_prefix_caching"]
    """Share full blocks of identical prefixes between requests (chained block hashes)."""
    preemption_mode: PreemptionMode | None = POOL_DEFAULTS["preemption_mode"]
    """How a sequence that cannot grow is preempted. Unset: migrate to another worker with room,
    else swap while host space is free, else recompute."""
    max_num_seqs: int = Field(256, ge=1)
    """Running sequences per worker at most (the decode batch)."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Token budget per step; long prompts are chunked to fit. Unset: max(2048, max_model_len)."""
    max_model_len: int | None = Field(None, ge=2)
    """Prompt plus output tokens per sequence at most. Unset: the longest context the model
    computes exactly."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """"fcfs" (arrival order) or "priority" (the request's priority, lower first, then arrival)."""
    allocation: Allocation = POOL_DEFAULTS["allocation"]
    """"paged"; "contiguous" reserves max_model_len per sequence (the benchmarks' baseline)."""
    watermark: float = Field(POOL_DEFAULTS["watermark"], ge=0, lt=1)
    """Fraction of device blocks kept free at admission, so running sequences can grow."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Seed of the sampler stream of requests without their own seed. Unset: a fresh random seed
    per engine (logged)."""
    kernel_backend: KernelBackend | None = None
    """Attention kernels: "triton" or "torch". Unset: triton on CUDA where installed, else torch."""
    enforce_eager: bool = False
    """CUDA: run every step eagerly, without CUDA graphs (vLLM's name)."""
    async_scheduling: bool | None = None
    """Plan and launch step n + 1 before step n's sampled ids are read: they stay on the device
    for n + 1's inputs (vLLM's name). Unset: on with CUDA, off on the CPU (where the forward does
    not run asynchronously, so it gains nothing)."""
    stream_interval: int = Field(1, ge=1)
    """A streamed request's tokens go out every this many tokens (vLLM's ``--stream-interval``):
    fewer, larger chunks for every stream, which cuts the server's cost per token at high
    concurrency. Its first token and its finish go out at once."""
    cuda_graph_sizes: list[int] | None = None
    """CUDA: the decode batch sizes captured as CUDA graphs (vLLM's name); a decode step runs at
    the smallest size that holds it. Unset: 1, 2, 4, 8, then every 8 up to 256 and every 16
    beyond, up to max_num_seqs."""
    torch_compile: bool | None = None
    """Run the forward through torch.compile, attention an opaque custom op, so the elementwise
    work around each matmul fuses into few kernels (vLLM compiles the same way): decode steps
    inside the CUDA graphs, mixed steps outside them. Compiling takes time at load.
    A model that fails to compile says why in the log and runs uncompiled. Unset: on where
    CUDA graphs are (CUDA, not enforce_eager, one rank), off on the CPU."""
    merge_projections: bool | None = None
    """One matmul for each attention's q/k/v projections and one for each MLP's gate/up, where
    the forward projects one input with them (vLLM's model code merges them the same way); the
    weights are concatenated at load, not copied. Unset: on with CUDA, off on the CPU (there the
    strided slices can round SiLU differently in the last bit, and small matmuls gain nothing)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks (GPUs) one model replica spans (vLLM's name). The model needs a tensor-parallel plan
    in transformers (``base_model_tp_plan``) and head counts that divide by it."""
    distributed_executor_backend: ExecutorBackend | None = None
    """How ranks 1 and up of a tensor-parallel group start (vLLM's name): "mp" local processes,
    "ray" actors in this worker's placement group. Unset: "ray" inside a placement group with a
    bundle per rank, else "mp"."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's name and keys), e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}``. Where decode steps replay CUDA graphs, verification steps
    of up to 512 tokens do too (k + 1 query rows a sequence; not with an EAGLE head or a sliding
    window); with ``async_scheduling`` only the steps of a batch at ``disable_by_batch_size``
    (which proposes nothing) overlap. Unset: off."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT checkpoints) on the base model: a request names one with a
    ``LoRARequest``, and a step mixes requests of different adapters and of the base model
    (vLLM's name). Decode steps replay CUDA graphs on CUDA (every layer's slots allocated at
    load); nothing runs through torch.compile; on a tensor-parallel group each rank holds its
    slices of the adapters, cut as its weights are."""
    max_loras: int = Field(1, ge=1)
    """With enable_lora: adapters one step may use, each in a slot of every adapted layer
    (vLLM's name). Requests of further adapters wait; slots go to the least recently used."""
    max_lora_rank: int = Field(16, ge=1)
    """With enable_lora: the highest adapter rank taken (vLLM's name); slots are this wide."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """With enable_lora: adapters kept in host memory, the least recently used dropped past it
    (never one an unfinished request uses) and read again when asked for (vLLM's name).
    At least max_loras; unset: max_loras."""
    lora_paging: LoRAPaging = "slots"
    """With enable_lora: where adapters' weights live on the device. "slots": slot tensors of
    max_loras adapters at max_lora_rank, kept out of the KV budget. "unified": pages of the KV
    pool itself (S-LoRA's unified paging): an adapter takes blocks of the pool at its own rank
    while a sequence may need it, a waiting sequence is admitted once its adapter holds pages,
    and idle adapters give their pages back, least recently used first, when sequences need
    them (their host copies stay, swapped back in on demand). On a tensor-parallel group
    every rank holds its cut of an adapter in the same blocks. Needs paged allocation."""

    @field_validator("block_size")
    @classmethod
    def _kernel_block_size(cls, block_size: int) -> int:
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two up to {BLOCK_SIZES[-1]}, got {block_size}")
        return block_size

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _graph_sizes(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive batch sizes, got {sizes}")
        return sizes

    def graph_sizes(self) -> list[int]:
        """The decode batch sizes to capture (``cuda_graph_sizes`` or the default), at most
        ``max_num_seqs``."""
        from ..model.decode_graphs import default_graph_sizes

        if self.cuda_graph_sizes is None:
            return default_graph_sizes(self.max_num_seqs)
        return sorted({min(size, self.max_num_seqs) for size in self.cuda_graph_sizes})

    @model_validator(mode="after")
    def _compile_on_one_rank(self) -> "EngineOptions":
        if self.torch_compile and self.tensor_parallel_size > 1:
            raise ValueError("torch_compile runs on one rank only; a tensor-parallel group "
                             f"(tensor_parallel_size={self.tensor_parallel_size}) runs eagerly: "
                             "leave torch_compile unset or false")
        return self

    @model_validator(mode="after")
    def _speculation_runs_synchronously(self) -> "EngineOptions":
        spec = self.speculative_config
        if spec is not None and spec.method in ("eagle", "eagle3") and self.async_scheduling:
            raise ValueError(f"speculative_config.method \"{spec.method}\": an EAGLE head reads every step's "
                             "hidden states with its tokens, so steps run synchronously; leave async_scheduling "
                             "unset or false")
        if self.speculative_config is not None and self.speculative_config.method == "eagle3" and self.torch_compile:
            raise ValueError("speculative_config.method \"eagle3\" reads hidden states inside the target's "
                             "forward, which torch_compile would compile away; leave torch_compile unset or false")
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> "EngineOptions":
        if not self.enable_lora:
            return self
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.torch_compile:
            raise ValueError("enable_lora runs steps eagerly: leave torch_compile unset or false")
        if self.lora_paging == "unified" and self.allocation != "paged":
            raise ValueError(f"lora_paging \"unified\" lends blocks of a paged pool; allocation is "
                             f"{self.allocation!r}: use allocation \"paged\" or lora_paging \"slots\"")
        return self

    @model_validator(mode="after")
    def _pool_accepts(self) -> "EngineOptions":
        self.pool_config(num_device_blocks=1, num_host_blocks=0, max_model_len=self.max_model_len or 2)
        return self

    def pool_config(self, num_device_blocks: int, num_host_blocks: int, max_model_len: int,
                    role: str = POOL_DEFAULTS["role"], sliding_window: int | None = None) -> PoolConfig:
        """The KV manager's view of one worker's pools, sized by the engine; ``sliding_window``
        is the model's (every layer windowed) for freeing out-of-window blocks."""
        return PoolConfig(num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                          max_model_len=max_model_len, role=role, sliding_window=sliding_window,
                          **{name: getattr(self, name) for name in POOL_OPTIONS})

    def to_engine_config(self, model: str, **checkpoint: Any) -> "EngineConfig":
        """These options for ``model`` (``checkpoint``: ``tokenizer``, ``trust_remote_code``)."""
        return EngineConfig(model=model, **self.model_dump(include=set(EngineOptions.model_fields)),
                            **checkpoint)


class EngineConfig(EngineOptions):
    """Everything ``LLM(...)`` and a worker accept: the checkpoint plus ``EngineOptions``."""

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, raising TypeError naming any unknown ones."""
        unknown = sorted(set(kwargs) - set(cls.model_fields))
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
