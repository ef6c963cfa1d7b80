"""The Triton LoRA kernels (SGMV shrink and expand) against each token's own product in
float64 and against the torch path (``workers/lora/punica.py``), then inside the layers and
an engine; and the compile check compiling them as their launches specialise them.

Without CUDA the kernels run in Triton's interpreter, set up as in test_kernels_triton.py:
TRITON_INTERPRET=1 before triton is first imported, or the file re-run in a fresh process.
Shapes stay small (a few dozen programs per launch); bf16 runs on CUDA only, because the
interpreter's bf16 arithmetic is wrong.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

IS_CUDA = torch.cuda.is_available()
if not IS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pagedserve.kernels import triton_lora_kernels as lora_kernels  # noqa: E402
from pagedserve.kernels import triton_lora_ops  # noqa: E402
from pagedserve.kernels.lora_pages import PagedLoRAWeights  # noqa: E402
from pagedserve.workers.lora import punica  # noqa: E402
from pagedserve.workers.lora.layers import LoRAContext, LoRALinear, lora_ops_for  # noqa: E402
from triton_interpreter import can_interpret_kernels, interpreter_guard  # noqa: E402

IS_RUNNABLE_HERE = IS_CUDA or can_interpret_kernels()
DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not IS_CUDA, reason="interpreter bf16 is wrong"))]
# Against float64, relative to the largest magnitude of the result.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
TILE = lora_kernels.TILE_TOKENS


kernels_runnable, test_in_fresh_interpreter_process = interpreter_guard(__file__, IS_RUNNABLE_HERE)


def slot_weights(generator, num_slots: int, max_rank: int, features: int, ranks: list[int], dtype) -> torch.Tensor:
    """``[slots, max_rank, features]`` of unit-scale products, zero past each slot's own rank."""
    weights = torch.randn(num_slots, max_rank, features, generator=generator) / features ** 0.5
    for slot, rank in enumerate(ranks):
        weights[slot, rank:] = 0
    return weights.to(dtype=dtype, device=DEVICE)


def each_tokens_product(x, y, lora_a, lora_b, slots: list[int]) -> torch.Tensor:
    """``y[t] + x[t] @ A[s]ᵀ @ B[s]`` for each token t of slot s >= 0, in float64, token by token."""
    expected = y.double().cpu()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += x[t].double().cpu() @ lora_a[slot].double().cpu().T @ lora_b[slot].double().cpu()
    return expected


# (token slots, max rank, each slot's own rank, in, out): not multiples of the tiles (16 tokens,
# rank tiles of 16-64, K steps of 128, output tiles of 64).
CASES = {
    "mixed, uneven": ([2, -1, 2, 0, -1] + [2] * 36 + [0, 5, -1, 1], 16, [16, 3, 8, 16, 16, 5], 200, 70),
    "one slot, one token": ([3], 8, [8, 8, 8, 2], 40, 24),
    "base and one token": ([-1, -1, 1, -1], 8, [8, 4], 136, 130),
    "every slot, decode": ([0, 1, 2, 3] * 5, 16, [16, 1, 7, 12], 64, 64),
    "rank over one tile": ([1, 0, -1, 1, 1, 0], 80, [80, 33], 48, 150),
}


def run_case(case: str, dtype):
    slots, max_rank, ranks, in_features, out_features = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    lora_a = slot_weights(generator, len(ranks), max_rank, in_features, ranks, dtype)
    lora_b = slot_weights(generator, len(ranks), max_rank, out_features, ranks, dtype)
    x = torch.randn(len(slots), in_features, generator=generator).to(dtype=dtype, device=DEVICE)
    y = torch.randn(len(slots), out_features, generator=generator).to(dtype=dtype, device=DEVICE)
    return slots, lora_a, lora_b, x, y


def products(ops, slots, x, y, lora_a, lora_b) -> torch.Tensor:
    segments = ops.build_segments(torch.tensor(slots), DEVICE)
    out = y.clone()
    ops.lora_expand(out, ops.lora_shrink(x, lora_a, segments), lora_b, segments)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_each_tokens_product_and_the_torch_path(case, dtype):
    slots, lora_a, lora_b, x, y = run_case(case, dtype)
    expected = each_tokens_product(x, y, lora_a, lora_b, slots)
    ours = products(triton_lora_ops, slots, x, y, lora_a, lora_b)
    torch_path = products(punica, slots, x, y, lora_a, lora_b)
    scale = expected.abs().max().item()
    tolerance = TOLERANCES[dtype] * scale
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.double().cpu(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(ours.double().cpu(), torch_path.double().cpu(), atol=2 * tolerance, rtol=0)
    base_rows = [t for t, slot in enumerate(slots) if slot < 0]
    assert torch.equal(ours[base_rows], y[base_rows])  # base-model tokens untouched


def paged(dense: torch.Tensor, ranks: list[int], piece: int, generator) -> PagedLoRAWeights:
    """``dense`` ``[slots, R, features]`` moved into shuffled pieces of a flat storage, as in pages
    of a KV cache: rows past a slot's rank point at piece 0, which holds zeros."""
    num_slots, max_rank, features = dense.shape
    num_pieces = -(-features // piece)
    rows = [(slot, r) for slot in range(num_slots) for r in range(ranks[slot])]
    order = torch.randperm(len(rows) * num_pieces, generator=generator) + 1 + 3  # a few unused pieces
    storage = torch.full(((len(rows) * num_pieces + 4) * piece,), float("nan"), dtype=dense.dtype, device=DEVICE)
    storage[:piece] = 0
    table = torch.zeros((num_slots, max_rank, num_pieces), dtype=torch.int32)
    padded = torch.nn.functional.pad(dense, (0, num_pieces * piece - features))
    for i, (slot, r) in enumerate(rows):
        for j in range(num_pieces):
            index = int(order[i * num_pieces + j])
            table[slot, r, j] = index
            storage[index * piece:(index + 1) * piece] = padded[slot, r, j * piece:(j + 1) * piece]
    return PagedLoRAWeights(storage, table.to(DEVICE), piece, features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["mixed, uneven", "every slot, decode", "rank over one tile"])
def test_weights_in_pages_give_the_products_of_slot_tensors(case, dtype):
    """Both backends read A and B through a page table of pieces (shuffled, a row's last piece
    partly used, rows past a rank on a shared zero piece, every other piece NaN) as they read
    slot tensors."""
    slots, lora_a, lora_b, x, y = run_case(case, dtype)
    ranks = CASES[case][2]
    generator = torch.Generator().manual_seed(7)
    paged_a, paged_b = paged(lora_a, ranks, 32, generator), paged(lora_b, ranks, 16, generator)
    assert torch.equal(paged_a.gather(None, len(ranks)), lora_a)
    expected = each_tokens_product(x, y, lora_a, lora_b, slots)
    tolerance = TOLERANCES[dtype] * expected.abs().max().item()
    for ops in (triton_lora_ops, punica):
        ours = products(ops, slots, x, y, paged_a, paged_b)
        torch.testing.assert_close(ours.double().cpu(), expected, atol=tolerance, rtol=0)


def test_segments_tile_each_adapted_token_once_by_slot():
    slots = [4, -1, 4, 0] + [1] * (2 * TILE + 3) + [-1, 0, 4]
    segments = triton_lora_ops.build_segments(torch.tensor(slots), DEVICE)
    order = segments.token_order[:segments.num_adapted].tolist()
    starts, ends, tile_slots = (t[:segments.num_tiles].tolist()
                                for t in (segments.tile_starts, segments.tile_ends, segments.tile_slots))
    assert sorted(order) == [t for t, slot in enumerate(slots) if slot >= 0]
    assert [slots[t] for t in order] == sorted(slot for slot in slots if slot >= 0)   # sorted by slot
    assert starts[0] == 0 and ends[-1] == segments.num_adapted and starts[1:] == ends[:-1]
    assert all(0 < end - start <= TILE for start, end in zip(starts, ends))
    assert all({slots[t] for t in order[start:end]} == {slot} for start, end, slot in zip(starts, ends, tile_slots))
    assert segments.num_tiles == 1 + 3 + 1   # slot 0: 2 tokens; slot 1: 35; slot 4: 3
    assert segments.slot_bits == 0b10011
    assert all(row.data_ptr() % 16 == 0 for row in (segments.token_order, segments.tile_starts,
                                                     segments.tile_ends, segments.tile_slots))
    assert triton_lora_ops.build_segments(torch.tensor([-1, -1]), DEVICE) is None


@pytest.mark.parametrize("case", CASES)
def test_static_segments_give_each_steps_products_on_fixed_shapes(case):
    """``StaticSegments`` (what a CUDA graph's kernels read): one buffer filled step after
    step, shapes fixed for the most tokens and slots, the products equal each step's own
    segments'; a step without adapters leaves every row as it was."""
    dtype = torch.float32
    slots, lora_a, lora_b, x, y = run_case(case, dtype)
    static = triton_lora_ops.StaticSegments(64, lora_a.shape[0], DEVICE)
    for step_slots in (slots, [-1] * len(slots), list(reversed(slots))):
        segments = static.fill(torch.tensor(step_slots))
        assert (segments.num_adapted, segments.num_tiles) == (64, -(-64 // TILE) + lora_a.shape[0])
        ours = y.clone()
        triton_lora_ops.lora_expand(ours, triton_lora_ops.lora_shrink(x, lora_a, segments), lora_b, segments)
        if all(slot < 0 for slot in step_slots):
            assert torch.equal(ours, y)
            continue
        expected = products(triton_lora_ops, step_slots, x, y, lora_a, lora_b)
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
    assert static.fill(None) is segments and segments.token_order.data_ptr() == static.table.data_ptr()


def test_shrink_and_expand_refuse_mismatched_operands():
    slots, lora_a, lora_b, x, y = run_case("one slot, one token", torch.float32)
    segments = triton_lora_ops.build_segments(torch.tensor(slots), DEVICE)
    with pytest.raises(ValueError, match="features"):
        triton_lora_ops.lora_shrink(x[:, :-1], lora_a, segments)
    with pytest.raises(TypeError, match="float16"):
        triton_lora_ops.lora_shrink(x.half(), lora_a, segments)
    with pytest.raises(ValueError, match="lora_shrink's"):
        triton_lora_ops.lora_expand(y, torch.zeros(2, lora_b.shape[1], device=DEVICE), lora_b, segments)


def test_the_products_are_chosen_once_by_device_and_backend():
    assert lora_ops_for(torch.device("cpu")) is punica
    assert lora_ops_for(torch.device("cuda")) is triton_lora_ops
    assert lora_ops_for(torch.device("cuda"), "torch") is punica
    assert lora_ops_for(torch.device("cpu"), "triton") is triton_lora_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_lora_linear_on_triton_equals_it_on_torch(dtype):
    """One ``LoRALinear`` computed with each context's products: 3-d input, a slot left empty."""
    generator = torch.Generator().manual_seed(7)
    base = torch.nn.Linear(48, 40, bias=True).to(dtype=dtype, device=DEVICE)
    adapters = {slot: (torch.randn(rank, 48, generator=generator).to(dtype) / 7,
                       torch.randn(rank, 40, generator=generator).to(dtype) / 3) for slot, rank in ((1, 8), (3, 2))}
    slots = [1, -1, 1, 1, 3, -1, 1]
    x = torch.randn(1, len(slots), 48, generator=generator).to(dtype=dtype, device=DEVICE)
    outputs = {}
    for ops in (punica, triton_lora_ops):
        layer = LoRALinear(base, LoRAContext(ops))
        layer.allocate(num_slots=4, max_rank=8)
        for slot, weights in adapters.items():
            layer.set_slot(slot, weights)
        layer.context.segments = ops.build_segments(torch.tensor(slots), DEVICE)
        outputs[ops] = layer(x)
    assert not torch.allclose(outputs[punica], base(x))
    torch.testing.assert_close(outputs[triton_lora_ops], outputs[punica], atol=TOLERANCES[dtype] * 10, rtol=0)


@pytest.mark.skipif(IS_CUDA, reason="the CPU engine's Triton kernels run interpreted")
def test_an_engine_on_triton_kernels_generates_what_it_does_on_torch(tiny_model, tmp_path):
    """The engine's LoRA steps (prefill and decode, two adapters and the base model in one
    step, q/k/v and gate/up merged) on the Triton kernels, interpreted, against the torch
    kernels: the same tokens."""
    from pagedserve import LLM, LoRARequest, SamplingParams
    from peft_adapters import make_peft_adapter

    path = tiny_model("llama")
    loras = [LoRARequest(name, i + 1, make_peft_adapter(path, tmp_path / name, rank, 2 * rank, targets, seed=i))
             for i, (name, rank, targets) in enumerate((("attn", 8, ["q_proj", "v_proj"]),
                                                        ("mlp", 4, ["gate_proj", "down_proj"])))]
    prompts = [[5 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate((9, 21, 4, 13))]
    which = [loras[0], None, loras[1], loras[0]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cpu", dtype="float32", swap_space_gb=0.001, enable_lora=True, max_loras=2,
                  kernel_backend=backend, merge_projections=True)   # expand into strided slices
        assert llm.engine.lora.context.ops is (punica if backend == "torch" else triton_lora_ops)
        assert llm.engine.runner.merged_projections
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=which)
        tokens[backend] = [output.outputs[0].token_ids for output in outputs]
    assert tokens["triton"] == tokens["torch"]
    base = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    assert [ours != theirs for ours, theirs in zip(tokens["triton"], base)] == [True, False, True, True]


@pytest.mark.skipif(IS_CUDA, reason="records interpreted launches")
def test_the_compile_check_specialises_the_lora_kernels_as_their_launches_are():
    """``triton_compile_check`` compiles what a launch would compile: the same constants
    and the same 16-byte-aligned arguments, by Triton's own binder for a CUDA target."""
    from triton.backends.compiler import GPUTarget

    from pagedserve.devtools.triton_variants import specialisation_mismatch
    from pagedserve.kernels.triton_compile import lora_kernel_configs

    kernels = (lora_kernels.lora_shrink_kernel, lora_kernels.lora_expand_kernel)
    launches = {}
    hooks = [(kernel, lambda *args, kernel=kernel, **kwargs: launches.setdefault(kernel, (args, kwargs)))
             for kernel in kernels]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        slots, lora_a, lora_b, x, y = run_case("every slot, decode", torch.float16)
        products(triton_lora_ops, slots, x, y, lora_a, lora_b)
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    num_slots, max_rank, features = lora_a.shape
    differences = {}
    for kernel, arg_types, constexprs, _ in lora_kernel_configs(torch.float16, max_rank, features, features, None):
        args, kwargs = launches[kernel]
        differences[kernel.__name__] = specialisation_mismatch(kernel, arg_types, constexprs,
                                                               GPUTarget("cuda", 90, 32), args, kwargs)
    assert differences == {"lora_shrink_kernel": (set(), set()), "lora_expand_kernel": (set(), set())}
