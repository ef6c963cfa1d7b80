"""No Triton kernel compiles inside a request: every variant that a model's steps launch
was launched at load (``ModelRunner.warm_up_kernels``). Checked on the CPU with the kernels
interpreted, against Triton's own specialisation rules for a CUDA target
(``pagedserve.devtools.triton_variants``)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_matrix import ensure_matrix_model

pytest.importorskip("triton")
from pagedserve.devtools.triton_variants import TritonVariants  # noqa: E402
from pagedserve.kernels import triton_ops  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _workload(llm: LLM) -> None:
    """Steps of 1, 2 and 17 sequences, prompts of 1-40 tokens (chunked, so mixed steps),
    then a fork (n=2) of a 70-token prompt, whose decodes split."""
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for batch in (1, 2, 17):
        llm.generate([[rng.randrange(1, 400) for _ in range(rng.choice([1, 5, 16, 17, 40]))]
                      for _ in range(batch)], greedy)
    llm.generate([list(range(1, 71))], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1))


ON_CPU = pytest.mark.skipif(not triton_ops._interpreting(), reason="CPU tensors need Triton's interpreter")
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name,device", [pytest.param("llama", "cpu", marks=ON_CPU),
                                         # windowed and full layers, soft-capped: more variants
                                         pytest.param("gemma2", "cpu", marks=[ON_CPU, pytest.mark.long_form]),
                                         # compiled: CUDA graphs of the torch.compile'd forward
                                         pytest.param("llama", "cuda", marks=ON_CUDA)])
def test_every_kernel_variant_the_steps_launch_compiles_at_load(name, device, monkeypatch):
    """Before, the prefill kernel compiled anew for a step whose number of sequences or
    block-table width was 1, a multiple of 16 or neither, the decode kernel likewise for
    its table width and split count, and the K/V write kernel in the first request; on an
    H200 that was about a second of compiling inside the benchmark's timed run."""
    # Short contexts split: from 32 tokens (1,024 by default), and on the CPU's one "SM" as
    # on a GPU of 16.
    monkeypatch.setattr(triton_ops, "_MIN_SPLIT_TOKENS", 32)
    monkeypatch.setattr(triton_ops, "_PROGRAMS_PER_SM", 64)
    device_options = ({"dtype": "float16", "cuda_graph_sizes": [1, 2, 4, 8, 16]} if device == "cuda"
                      else {"dtype": "float32"})
    with TritonVariants() as variants:
        llm = LLM(str(ensure_matrix_model(name)), device=device, block_size=16, num_device_blocks=96,
                  kernel_backend="triton", max_num_batched_tokens=32, max_model_len=256, **device_options)
        variants.mark("served")
        _workload(llm)
    assert variants.new_in("served") == {}
    # Every kernel a step launches ran, splits too (the reduce kernel merges them). On CUDA
    # the decode steps replay graphs, which launch nothing from Python: their kernels ran
    # when the graphs were captured at load.
    served = variants.launched_in("served")
    decode_kernels = {"paged_decode_kernel", "paged_decode_reduce_kernel"}
    assert {"paged_prefill_kernel", "write_kv_kernel"} <= served
    if device == "cuda":
        assert llm.engine.stats()["num_graph_replays"] > 0
        assert decode_kernels <= variants.launched_in("start")
    else:
        assert decode_kernels <= served
    llm.check_integrity()


@ON_CPU
def test_the_record_tells_a_new_variant_apart(monkeypatch):
    """The recorder itself: a decode step wider than any at load is a new variant when the
    table width specialises (as it did), and none when it does not."""
    from pagedserve.kernels import triton_attention_kernels as kernels

    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(4, 16, 2, 16)
    lens = torch.tensor([3, 0], dtype=torch.int32)

    def decode(width: int) -> None:
        triton_ops.paged_decode_attention(q, cache, cache, torch.zeros(2, width, dtype=torch.int32), lens,
                                          num_splits=1)

    with TritonVariants() as variants:
        decode(1)
        variants.mark("wider")
        decode(3)
    assert variants.new_in("wider") == {}
    monkeypatch.setattr(kernels.paged_decode_kernel, "kwargs", {})  # the decorator without do_not_specialize
    with TritonVariants() as variants:
        decode(1)
        variants.mark("wider")
        decode(3)
        decode(16)
    assert variants.new_in("wider") == {"paged_decode_kernel": [[("stride_bts", "('i32', '')")],
                                                                [("stride_bts", "('i32', 'D')")]]}


@ON_CPU
def test_the_compile_check_specialises_kernels_as_their_launches_are():
    """``gpu_targets`` sizes each kernel's shared memory at load with ``compile_kernel``,
    which must compile what a launch compiles: before it took the head-dim strides as
    variables and nothing as aligned, and the prefill kernel came out with 40% less shared
    memory than at launch (no vectorised, pipelined K/V tiles) and spilling registers."""
    from triton.backends.compiler import GPUTarget

    from pagedserve.devtools.triton_variants import launched_kernels, specialisation_mismatch
    from pagedserve.kernels.triton_compile import PLAIN, kernel_configs

    kernels = launched_kernels()
    launches = {}
    hooks = [(kernel, lambda *args, name=name, **kwargs: launches.setdefault(name, (args, kwargs)))
             for name, kernel in kernels.items()]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        # As the engine launches them: q, k and v are views of one fused projection.
        generator = torch.Generator().manual_seed(0)
        fused = torch.randn(24, 16 + 2 * 4, 128, generator=generator).half()
        q, key, value = fused[:, :16], fused[:, 16:20], fused[:, 20:]
        k_cache = torch.zeros(16, 16, 4, 128, dtype=torch.float16)
        v_cache = torch.zeros_like(k_cache)
        tables = torch.arange(16, dtype=torch.int32).view(2, 8)   # 128 positions: two splits of 64
        triton_ops.write_kv(key, value, k_cache, v_cache, torch.arange(24, dtype=torch.int64))
        seq_lens = torch.tensor([20, 4], dtype=torch.int32)
        cu_seqlens_q = torch.tensor([0, 20, 24], dtype=torch.int32)
        triton_ops.paged_attention(q, k_cache, v_cache, tables, cu_seqlens_q, seq_lens)
        triton_ops.paged_decode_attention(q[:2], k_cache, v_cache, tables, seq_lens, num_splits=2)
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    target = GPUTarget("cuda", 90, 32)
    checked, differences = set(), {}
    for kernel, arg_types, constexprs, _ in kernel_configs(torch.float16, 128, 4, 16, variants=(PLAIN,)):
        name = kernel.__name__
        if name not in launches or name in checked:
            continue
        checked.add(name)
        args, kwargs = launches[name]
        differences[name] = specialisation_mismatch(kernel, arg_types, constexprs, target, args, kwargs)
    assert differences == {name: (set(), set()) for name in differences}
    assert checked == {"paged_prefill_kernel", "paged_decode_kernel", "paged_decode_reduce_kernel", "write_kv_kernel"}
