"""q/k/v and gate/up merged into one matmul each: the weights shared, not copied; a forward
that does not project one input with a group is left unmerged; the compiled decoder runs
one matmul per group, without a graph break or a recompile. The model families' greedy
outputs, merged, are checked against transformers in ``test_models``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.workers.model.merged_projections import MergedPiece, merge_same_input_projections
from pagedserve.workers.model.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_pieces_are_views_of_the_merged_weights(tiny_model):
    separate = ModelRunner(tiny_model("llama"), dtype="float32", device="cpu", merge_projections=False)
    merged = ModelRunner(tiny_model("llama"), dtype="float32", device="cpu", merge_projections=True)
    assert separate.merged_projections == [] and len(merged.merged_projections) == 2 * merged.num_layers
    assert merged.num_parameters == separate.num_parameters
    attention = merged.model.model.layers[0].self_attn
    pieces = [attention.q_proj, attention.k_proj, attention.v_proj]
    assert all(isinstance(p, MergedPiece) for p in pieces)
    storage = attention.merged_q_k_v_weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == storage for p in pieces)
    reference = separate.model.model.layers[0].self_attn
    x = torch.randn(5, attention.q_proj.in_features)
    merged_output = F.linear(x, attention.merged_q_k_v_weight)
    for name, piece in zip(("q_proj", "k_proj", "v_proj"), pieces):
        expected = getattr(reference, name)(x)
        assert torch.equal(piece(x), expected)  # an input the group did not project: computed alone
        start = sum(p.out_features for p in pieces[:pieces.index(piece)])
        # One matmul against three: the CPU's kernel for each shape may sum in another order.
        torch.testing.assert_close(merged_output[:, start:start + piece.out_features], expected)


def test_each_groups_old_weights_are_freed_as_it_is_merged(tiny_model, monkeypatch):
    """The load's peak grows by one group's weights, not by every group's: when a group is
    merged, the old weights of every group merged before it are gone."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    from pagedserve.workers.model import merged_projections

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    old = [weakref.ref(module.weight) for module in model.modules() if type(module) is torch.nn.Linear
           and module is not model.lm_head]
    assert len(old) == 7 * model.config.num_hidden_layers
    seen = []  # (old weights alive before a merge, weights merged before it)
    merge = merged_projections._merge
    merged_so_far = 0

    def watched_merge(module, names):
        nonlocal merged_so_far
        gc.collect()
        alive = sum(ref() is not None for ref in old)
        group = merge(module, names)
        if group is not None:
            seen.append((alive, merged_so_far))
            merged_so_far += len(names)
        return group

    monkeypatch.setattr(merged_projections, "_merge", watched_merge)
    ids = torch.randint(5, 500, (1, 9))
    merge_same_input_projections(model, lambda: model(ids))
    assert len(seen) == 2 * model.config.num_hidden_layers
    assert all(alive == len(old) - merged for alive, merged in seen), seen
    gc.collect()
    assert sum(ref() is not None for ref in old) == len(old) - merged_so_far  # o_proj and down_proj


class _Attention(torch.nn.Module):
    """q/k/v projections whose forward ``order`` and ``inputs`` are chosen by the test."""

    def __init__(self, calls: str) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, n) for n in (8, 4, 4))
        self.calls = calls

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        other = hidden_states + 1
        outputs = {"q": self.q_proj(hidden_states), "k": self.k_proj(hidden_states)}
        if self.calls == "v on another input":
            outputs["v"] = self.v_proj(other)
        elif self.calls == "all three":
            outputs["v"] = self.v_proj(hidden_states)
        return torch.cat(list(outputs.values()), dim=-1)


@pytest.mark.parametrize("calls", ["all three", "v on another input", "no v"])
def test_a_forward_off_the_pattern_is_left_unmerged(calls):
    torch.manual_seed(0)
    module = _Attention(calls)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = module(x)
        merged = merge_same_input_projections(module, lambda: module(x))
        after = module(x)
    assert merged == ([": q_proj+k_proj+v_proj"] if calls == "all three" else [])
    if calls == "all three":  # one matmul for three: equal up to the order of a kernel's sums
        torch.testing.assert_close(after, before)
    else:  # taken back whole: the Linears, the class's forward, no buffer
        assert torch.equal(after, before)
        assert all(type(getattr(module, n)) is torch.nn.Linear for n in ("q_proj", "k_proj", "v_proj"))
        assert "forward" not in vars(module) and not list(module.buffers())


def test_a_forward_that_fails_merged_runs_unmerged_and_says_why(caplog):
    torch.manual_seed(0)
    module = _Attention("all three")
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = module(x)

        def failing_probe():
            module(x)
            raise RuntimeError("the merged forward broke\nsecond line")

        with caplog.at_level("WARNING", logger="pagedserve.workers.model.merged_projections"):
            assert merge_same_input_projections(module, failing_probe) == []
        assert torch.equal(module(x), before)
    assert "the merged forward broke" in caplog.text and "second line" not in caplog.text
    assert all(type(getattr(module, n)) is torch.nn.Linear for n in ("q_proj", "k_proj", "v_proj"))
    assert "forward" not in vars(module) and not list(module.buffers())


def _compiled_matmuls(model: torch.nn.Module, ids: list[torch.Tensor]) -> tuple[int, int]:
    """(matmuls in the compiled forward graph, graphs compiled) over calls on ``ids``."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def count(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return graph

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=count), dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for batch in ids:
            compiled(batch)
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    return sum(node.target in matmuls for node in graphs[0].graph.nodes), len(graphs)


def test_the_compiled_decoder_runs_one_matmul_per_group(tiny_model):
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    ids = [torch.randint(5, 500, (1, n)) for n in (7, 12, 30)]
    counts = {}
    for merged in (False, True):
        torch._dynamo.reset()
        model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        if merged:
            merge_same_input_projections(model, lambda: model(ids[0]))
        counts[merged] = _compiled_matmuls(model.model, ids)
    torch._dynamo.reset()
    layers = model.config.num_hidden_layers
    # q, k, v, o, gate, up, down -> qkv, o, gate_up, down; one graph for all three lengths.
    assert counts == {False: (7 * layers, 1), True: (4 * layers, 1)}, counts
