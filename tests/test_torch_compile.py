"""The decode forward through torch.compile, attention the opaque custom op
``pagedserve::paged_attention``: the same tokens as transformers, no graph break in any
family's decoder, and a clear fallback or refusal where it cannot run.

One engine compiles with inductor (what CUDA runs); the model families compile with the
``aot_eager`` backend, which traces, functionalizes and runs the same graph as inductor
sees it without generating code, in seconds instead of a minute each.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch._dynamo.utils import counters

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_matrix import ensure_matrix_model
from pagedserve.workers.model import attention
from pagedserve.workers.model.decode_graphs import DecodeGraphs
from pagedserve.workers.engine.engine_options import EngineOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and counts its own graph breaks."""
    import torch._dynamo

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]


def test_inductor_compiled_decode_gives_the_transformers_tokens(tiny_model, hf_greedy):
    """``torch_compile`` on the CPU: every decode step of up to 4 sequences runs the
    compiled padded forward, overlapped with sampling, and the mixed steps (prefills joining
    decodes) run the same compiled forward unpadded. Everything compiled at load: the
    requests compile nothing."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=8, num_device_blocks=96,
              max_num_seqs=4, cuda_graph_sizes=[4], torch_compile=True, async_scheduling=True,
              merge_projections=True)  # as on CUDA
    assert llm.engine.runner.merged_projections
    graphs_at_load = counters["stats"]["unique_graphs"]
    prompts = _prompts((5, 17, 30, 9, 41, 3), seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 4 * i) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for output, param in zip(outputs, params):
        assert output.outputs[0].token_ids == llm_reference(hf_greedy, output, param)
    stats = llm.stats()
    assert stats["decode_compiled"] and 0 < stats["num_padded_decode_steps"] < stats["num_steps"], stats
    assert graphs_at_load >= 1 and counters["stats"]["unique_graphs"] == graphs_at_load
    assert not counters["graph_break"], dict(counters["graph_break"])
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def llm_reference(hf_greedy, output, param):
    return hf_greedy("llama", output.prompt_token_ids, param.max_tokens)


# Soft-caps and alternating sliding windows (gemma2), sinks with windows (gpt_oss), experts
# and q/k norms (qwen3_moe): the variants the op passes on, and the layers around it that
# differ most from llama's.
# Each family compiles once in the short form, and each way of projecting in at least one
# family (merged is what CUDA runs); the other three pairs are long-form variants.
FAMILIES = ["gemma2", "gpt_oss", "qwen3_moe"]
SHORT_FORM = {("gemma2", False), ("gpt_oss", True), ("qwen3_moe", True)}


@pytest.mark.parametrize("name,merged", [
    pytest.param(name, merged, id=f"{name}-{'merged' if merged else 'separate'}",
                 marks=[] if (name, merged) in SHORT_FORM else [pytest.mark.long_form])
    for name in FAMILIES for merged in (False, True)])
def test_families_compile_whole_and_give_the_transformers_tokens(name, merged, matrix_greedy):
    path = str(ensure_matrix_model(name))
    llm = LLM(path, device="cpu", dtype="float32", block_size=8, num_device_blocks=128, swap_space_gb=0.001,
              merge_projections=merged)
    runner = llm.engine.runner
    runner.decode_graphs = DecodeGraphs(runner, [2, 8], -(-llm.engine.max_model_len // 8), capture=False,
                                        torch_compile=True, compile_backend="aot_eager")
    graphs_at_load = counters["stats"]["unique_graphs"]
    prompts = _prompts((5, 17, 30, 9, 41, 60), seed=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == matrix_greedy(name, prompt, 24), f"{name}: {len(prompt)} tokens"
    assert runner.decode_graphs.num_runs > 0
    assert graphs_at_load >= 1 and counters["stats"]["unique_graphs"] == graphs_at_load
    assert not counters["graph_break"], dict(counters["graph_break"])
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def test_a_forward_that_fails_to_compile_runs_uncompiled_and_says_why(tiny_model, hf_greedy, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: refuse)
    with caplog.at_level(logging.WARNING, logger="pagedserve.workers.model.model_runner"):
        llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=64,
                  cuda_graph_sizes=[2], torch_compile=True)
    assert "run uncompiled" in caplog.text and "no compiler here" in caplog.text
    assert "second line" not in caplog.text
    prompts = _prompts((7, 12), seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy("llama", prompt, 8)
    stats = llm.stats()
    assert not stats["decode_compiled"] and stats["num_padded_decode_steps"] > 0, stats


def test_compile_is_off_by_default_on_the_cpu(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=32)
    assert llm.engine.runner.decode_graphs is None


def test_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="torch_compile runs on one rank"):
        EngineOptions(torch_compile=True, tensor_parallel_size=2)
    assert EngineOptions(torch_compile=False, tensor_parallel_size=2).torch_compile is False


def test_the_custom_op_outside_its_context_says_so():
    """Outside ``attention_context`` the op refuses; inside, it attends with the context's
    metadata; the context ends with its block, one that raised too."""
    q = torch.zeros(1, 2, 4)

    def attend():
        return torch.ops.pagedserve.paged_attention(q, q[:, :1], q[:, :1], 0, None, None, None, None)

    with pytest.raises(RuntimeError, match="attention_context"):
        attend()
    with pytest.raises(AttributeError):  # it took the context's metadata, which is none
        with attention.attention_context(object()):
            attend()
    with pytest.raises(RuntimeError, match="attention_context"):
        attend()
