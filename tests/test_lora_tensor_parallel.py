"""LoRA adapters on a tensor-parallel group: each rank holds its cut of every adapter, cut as
its layers' weights are, and the group computes what the whole model with the adapter does.

A colwise layer (q/k/v, gate/up) keeps A whole and takes its slice of B's rows; a rowwise
layer (o_proj, down_proj) takes its slice of A's columns, and its partial delta is summed by
the layer's all-reduce with the partial base outputs (the ``out`` adapter adapts only those
layers: a delta added after the all-reduce fails it). The shards, as threads of this process,
must compute the logits of transformers + PEFT; the engine's greedy outputs on a group of rank
processes must equal transformers + PEFT's and the one-rank engine's, while adapters past
``max_loras`` and ``max_cpu_loras`` move through slots and host memory, are removed and
replaced, and an adapter too wide is refused as on one rank. Ranks 1 and up follow rank 0's
decisions, which ride each step's ``RunStep``.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.lora.adapted_layers import AdaptedLayers, wrap_linear_layers
from pagedserve.workers.lora.layers import LoRAContext
from pagedserve.workers.lora.peft_adapter import LoRAAdapterError
from pagedserve.workers.model.merged_projections import merge_same_input_projections
from pagedserve.workers.tp.load import ShardLoader
from pagedserve.workers.tp.messages import EnableLoRA, EnableLoRAPages, RunStep, pack, unpack
from offline_checks import assert_idle
from peft_adapters import adapter_sets, make_peft_adapter
from test_tensor_parallel import make_engine, random_prompts, run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 16
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target_modules, use_rslora): ranks 2 to 16, colwise and rowwise layers.
ADAPTERS = {
    "attn": (8, 16, ["q_proj", "v_proj"], False),
    "mlp": (4, 8, MLP, False),
    "all": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", *MLP], True),
    "out": (2, 4, ["o_proj", "down_proj"], False),          # rowwise only
}
# A mixture of experts' experts are not linear layers: attention only.
MOE_ADAPTERS = {
    "attn": (8, 16, ["q_proj", "v_proj"], False),
    "all": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    "out": (2, 4, ["o_proj"], False),
}


@pytest.fixture(scope="module")
def tp_model():
    return lambda arch: str(ensure_model(arch, "tiny-tp"))


@pytest.fixture(scope="module")
def adapters(tp_model, tmp_path_factory):
    """``adapters(arch) -> {name: LoRARequest}`` on the tiny-tp checkpoint, built once per arch."""
    return adapter_sets(tp_model, lambda arch: tmp_path_factory.mktemp(f"tp-lora-{arch}"),
                        lambda arch: MOE_ADAPTERS if arch.endswith("_moe") else ADAPTERS, first_seed=11)


@pytest.fixture(scope="module")
def peft_models(tp_model):
    """``peft_models(arch, lora) -> model``: transformers (+ PEFT with the adapter; None: the base
    model), float32, memoised."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}

    def get(arch: str, lora: LoRARequest | None):
        key = (arch, lora.lora_path if lora else None)
        if key not in models:
            model = AutoModelForCausalLM.from_pretrained(tp_model(arch), dtype=torch.float32,
                                                         attn_implementation="sdpa")
            models[key] = (PeftModel.from_pretrained(model, lora.lora_path) if lora else model).eval()
        return models[key]

    return get


@pytest.fixture(scope="module")
def peft_greedy(peft_models):
    """``peft_greedy(arch, lora, prompt) -> list[int]``: transformers + PEFT's greedy tokens."""
    cache: dict[tuple, list[int]] = {}

    def generate(arch: str, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
        key = (arch, lora.lora_path if lora else None, tuple(prompt))
        if key not in cache:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = peft_models(arch, lora).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                       max_new_tokens=MAX_TOKENS)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return generate


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


# ---- the parts ------------------------------------------------------------------------------

def test_a_wrapped_layer_keeps_its_forward_hooks_after_the_adapters_delta():
    """The all-reduce of a rowwise layer is a forward hook: wrapped, it must read the output
    with the delta added, so the hook moves to the ``LoRALinear``."""

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(6, 4, bias=False)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = Decoder()

        def get_decoder(self):
            return self.decoder

    model = Model()
    seen = []
    model.decoder.proj.register_forward_hook(lambda module, args, output: seen.append(output.clone()))
    context = LoRAContext()
    layer = wrap_linear_layers(model, context)["decoder.proj"]
    assert not layer.base_layer._forward_hooks and len(layer._forward_hooks) == 1
    a, b = torch.randn(2, 6), torch.randn(2, 4)
    layer.allocate(1, 2)
    layer.set_slot(0, (a, b))
    x = torch.randn(3, 6)
    context.segments = context.ops.build_segments(torch.tensor([0, -1, 0]), torch.device("cpu"))
    y = model.decoder.proj(x)
    expected = x @ model.decoder.proj.weight.T
    expected[[0, 2]] += x[[0, 2]] @ a.T @ b
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(seen[0], expected)


def test_lora_fields_of_a_step_round_trip():
    step = RunStep([0], [0], [7, 8], [], [2], lora_dropped=[3], lora_loads=[(1, 4, "mlp", "/a/mlp")],
                   lora_slots=[1], lora_pages=[(4, "mlp", "/a/mlp", [5, 9]), (2, "", "", [])])
    command, _ = unpack(pack(step))
    assert (command.lora_dropped, command.lora_loads, command.lora_slots) == ([3], [[1, 4, "mlp", "/a/mlp"]], [1])
    assert command.lora_pages == [[4, "mlp", "/a/mlp", [5, 9]], [2, "", "", []]]
    assert unpack(pack(EnableLoRA(4, 16)))[0] == EnableLoRA(4, 16)
    assert unpack(pack(EnableLoRAPages(3, 32)))[0] == EnableLoRAPages(3, 32)
    assert unpack(pack(RunStep([0], [0], [7], [])))[0].lora_slots is None


@pytest.mark.parametrize(("arch", "size", "merged"), [
    ("llama", 2, False), ("llama", 4, False), ("llama", 2, True), ("qwen3_moe", 2, False),
    pytest.param("qwen3_moe", 4, False, marks=pytest.mark.long_form)])
def test_shards_with_adapters_compute_the_whole_peft_models_logits(arch, size, merged, tp_model, adapters,
                                                                   peft_models):
    """Every adapter and the base model in one forward of a group's shards (threads, gloo):
    each row's logits are those of transformers + PEFT with that row's adapter."""
    path = tp_model(arch)
    loras = list(adapters(arch).values())
    rows = [None, *loras]
    prompts = torch.tensor(random_prompts([11] * len(rows), seed=size))
    expected = []
    with torch.inference_mode():
        for lora, prompt in zip(rows, prompts):
            expected.append(peft_models(arch, lora)(prompt[None]).logits[0])

    def work(group):
        loader = ShardLoader(group.rank, group.size, group.all_reduce)
        model = loader(path, torch.float32, "sdpa", False)
        if merged:
            assert merge_same_input_projections(model, lambda: model(prompts[:1]))
        layers = AdaptedLayers(model, len(loras), 16, weight_cuts=loader.cuts)
        for slot, lora in enumerate(loras):
            layers.write(slot, layers.read(lora))
        with torch.inference_mode(), layers.step([-1, *range(len(loras))], [prompts.shape[1]] * len(rows)):
            return model(prompts).logits

    for logits in run_ranks(size, work):
        for i, lora in enumerate(rows):
            torch.testing.assert_close(logits[i], expected[i], rtol=1e-4, atol=1e-4,
                                       msg=f"row of {lora.lora_name if lora else 'the base model'}")


# ---- the engine on a group of rank processes ---------------------------------------------------

ENGINE = {"enable_lora": True, "max_loras": 3, "max_cpu_loras": 3, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module", params=[pytest.param((2, False), id="2"),
                                        pytest.param((4, True), id="4-merged", marks=pytest.mark.long_form)])
def group(request, tp_model):
    """``(llm, steps)``: a llama group (of 2, or of 4 with q/k/v and gate/up merged) with 3 adapter
    slots and 3 host copies, and the ``RunStep``s rank 0 sent (what the other ranks' adapters
    followed)."""
    size, merged = request.param
    llm = make_engine(tp_model("llama"), size, merge_projections=merged, **ENGINE)
    assert bool(llm.engine.runner.local.merged_projections) == merged
    yield llm, recorded_steps(llm.engine.runner)
    llm.engine.runner.shutdown()


def recorded_steps(runner) -> list[RunStep]:
    """The ``RunStep``s rank 0's ``runner`` sends from now on (what the other ranks follow)."""
    steps, send = [], runner.send

    def recording(command):
        if isinstance(command, RunStep):
            steps.append(command)
        send(command)

    runner.send = recording
    return steps


@pytest.fixture(scope="module")
def one_rank(tp_model):
    return LLM(tp_model("llama"), device="cpu", dtype="float32", block_size=8, num_device_blocks=256,
               swap_space_gb=0.001, **ENGINE)


def generate(llm: LLM, prompts, loras) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    return [output.outputs[0].token_ids for output in outputs]


def check_exact(llm: LLM, prompts, loras, peft_greedy) -> list[list[int]]:
    tokens = generate(llm, prompts, loras)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        assert tokens[i] == peft_greedy("llama", lora, prompt), (
            f"prompt {i} ({len(prompt)} tokens) with {lora.lora_name if lora else 'the base model'} diverged")
    return tokens


@pytest.mark.slow
def test_a_group_generates_what_peft_and_one_rank_generate(group, one_rank, adapters, peft_greedy):
    """Four adapters (ranks 2 to 16, colwise and rowwise layers) and the base model in the same
    steps, with chunked prefill, on three slots and three host copies: adapters wait, take the
    least recently used slot and are read again, on every rank alike."""
    llm, steps = group
    loras = adapters("llama")
    prompts = random_prompts((9, 33, 2, 17, 60, 4, 12, 21, 6, 14, 40, 25), seed=21)
    which = [[None, *loras.values()][i % 5] for i in range(len(prompts))]
    tokens = check_exact(llm, prompts, which, peft_greedy)
    assert tokens == generate(one_rank, prompts, which)
    stats = llm.stats()["lora"]
    assert stats["num_slot_evictions"] > 0 and stats["num_host_evictions"] > 0, stats
    # What the other ranks were told: every slot write and every host copy dropped, and steps
    # that mix adapters with the base model.
    sent_loads = [load for step in steps for load in step.lora_loads or ()]
    assert len(sent_loads) == stats["num_slot_loads"]
    assert sum(len(step.lora_dropped or ()) for step in steps) == stats["num_host_evictions"]
    assert any(-1 in (step.lora_slots or ()) and len(set(step.lora_slots) - {-1}) >= 2 for step in steps)
    assert {(lora_int_id, name, path) for _, lora_int_id, name, path in sent_loads} == {
        (lora.lora_int_id, lora.lora_name, lora.lora_path) for lora in loras.values()}
    assert_idle(llm)


@pytest.mark.slow
def test_a_group_removes_replaces_and_refuses_adapters_as_one_rank_does(group, one_rank, adapters, peft_greedy,
                                                                        tp_model, tmp_path):
    """``remove_lora`` drops the adapter on every rank (its id rides the next step), and its name
    comes back with another id and other weights, exactly; an adapter above max_lora_rank is
    refused with the one-rank engine's error, and the group serves on."""
    llm, steps = group
    loras = adapters("llama")
    prompt = random_prompts([19], seed=22)
    check_exact(llm, prompt, [loras["attn"]], peft_greedy)
    assert llm.engine.remove_lora(loras["attn"].lora_int_id)
    del steps[:]
    replacement = LoRARequest("attn", 31, make_peft_adapter(tp_model("llama"), tmp_path / "attn-2", 6, 12,
                                                            ["k_proj", "o_proj", "up_proj"], seed=31))
    check_exact(llm, prompt * 2, [replacement, None], peft_greedy)
    assert steps[0].lora_dropped == [loras["attn"].lora_int_id]
    assert [load[1:3] for step in steps for load in step.lora_loads or ()] == [(31, "attn")]

    too_wide = LoRARequest("wide", 32, make_peft_adapter(tp_model("llama"), tmp_path / "wide", 32, 32, ["q_proj"]))
    errors = []
    for engine in (llm, one_rank):
        with pytest.raises(LoRAAdapterError, match="r=32 exceeds max_lora_rank=16") as refused:
            engine.generate(prompt, greedy(), use_tqdm=False, lora_request=too_wide)
        errors.append(str(refused.value))
    assert errors[0] == errors[1]
    check_exact(llm, prompt, [loras["out"]], peft_greedy)
    assert_idle(llm)
    assert_idle(one_rank)


@pytest.mark.slow
def test_a_group_keeps_adapters_in_the_same_pages_of_every_ranks_pool(tp_model, adapters, peft_greedy):
    """Unified paging on a group of 2: rank 0 picks an adapter's blocks, and every rank writes its
    cut of the adapter into the same blocks of its own KV cache. The outputs are PEFT's, before
    and after every adapter left its pages and came back into other blocks."""
    llm = make_engine(tp_model("llama"), 2, lora_paging="unified", max_model_len=128, **ENGINE)
    steps = recorded_steps(llm.engine.runner)
    try:
        loras = adapters("llama")
        prompts = random_prompts((9, 33, 2, 17, 21, 6, 40, 12), seed=25)
        which = [[None, *loras.values()][i % 5] for i in range(len(prompts))]
        check_exact(llm, prompts, which, peft_greedy)
        pages = llm.engine.lora.pages
        before = {adapter_id: list(entry.pages) for adapter_id, entry in pages.resident.items()}
        assert before
        # Every adapter leaves its pages; other data takes those blocks, so they come back elsewhere.
        pages.relieve(llm.engine.kv_manager.block_manager("local").device.num_blocks, protected=set())
        pool = llm.engine.kv_manager.block_manager("local")
        pool.reserve_pages("other", sum(len(p) for p in before.values()))
        check_exact(llm, prompts, which, peft_greedy)
        after = {adapter_id: list(entry.pages) for adapter_id, entry in pages.resident.items()}
        assert all(not set(after[a]) & set(before[a]) for a in after.keys() & before.keys())
        pool.release_pages("other")
        moves = [move for step in steps for move in step.lora_pages or ()]
        assert {move[0] for move in moves if move[3]} == {lora.lora_int_id for lora in loras.values()}
        assert sum(1 for move in moves if not move[3]) == pages.num_evictions > 0
        assert_idle(llm)
    finally:
        llm.engine.runner.shutdown()
