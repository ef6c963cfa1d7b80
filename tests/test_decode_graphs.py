"""The padded static-buffer decode path that CUDA graphs replay, run eagerly on the CPU:
the same tokens as the eager path and as transformers, padded rows write no KV, and a
step it cannot take (mixed, too large, prompt logprobs) runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.workers.model.decode_graphs import default_graph_sizes
from pagedserve.workers.engine.engine_options import EngineOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]


def _padded_llm(tiny_model, arch="llama", sizes=(1, 2, 4, 8), **kwargs):
    llm = LLM(tiny_model(arch), device="cpu", dtype="float32", block_size=8, **kwargs)
    engine = llm.engine
    assert engine.runner.enable_decode_graphs(list(sizes), -(-engine.max_model_len // 8), capture=False)
    return llm


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_decode_gives_the_eager_and_transformers_tokens(arch, async_scheduling, tiny_model, hf_greedy):
    """Requests of different lengths finish at different steps, so the batch shrinks
    through several padded sizes; a batch larger than the largest size runs eagerly. With
    overlapped scheduling the padded inputs take the running step's ids on the device."""
    llm = _padded_llm(tiny_model, arch, sizes=(1, 2, 4, 8), num_device_blocks=256,
                      async_scheduling=async_scheduling)
    prompts = _prompts((5, 17, 30, 9, 41, 3, 22, 12, 8, 60, 33), seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for output, param in zip(outputs, params):
        assert output.outputs[0].token_ids == hf_greedy(arch, output.prompt_token_ids, param.max_tokens)
    stats = llm.stats()
    assert stats["num_padded_decode_steps"] > 0 and stats["num_padded_rows"] > 0
    assert stats["num_padded_decode_steps"] < stats["num_decode_steps"]  # 11 sequences: eager at first
    assert stats["num_graph_replays"] == 0  # CPU: the padded forward runs eagerly
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def test_padded_rows_write_no_kv_and_real_rows_write_their_slots(tiny_model):
    llm = _padded_llm(tiny_model, sizes=(4,), num_device_blocks=64, enable_prefix_caching=False)
    engine = llm.engine
    for i, prompt in enumerate(_prompts((6, 11, 3), seed=3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.step()  # the prefill, eager
    caches = engine.runner.kv_cache.device_caches
    before = [k.clone() for k, _ in caches]
    expected = set()
    for seq in engine.scheduler.running:
        position = seq.num_computed  # the one token this step computes
        expected.add(seq.block_table[position // 8] * 8 + position % 8)
    runs = engine.runner.decode_graphs.num_runs
    engine.step()
    assert engine.runner.decode_graphs.num_runs == runs + 1   # 3 sequences padded to 4
    for (k, _), old in zip(caches, before):
        changed = (k != old).flatten(2).any(-1).flatten().nonzero().squeeze(1).tolist()
        assert set(changed) == expected
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_steps_the_padded_path_cannot_take_run_eagerly(tiny_model, hf_greedy):
    """Prompt logprobs and mixed prefill/decode steps go the eager way, with the same
    tokens; n > 1 forks and preemption under a small pool too."""
    llm = _padded_llm(tiny_model, sizes=(2, 4), num_device_blocks=24, swap_space_gb=0.001)
    prompts = _prompts((40, 7, 25, 13), seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=20, n=2),
              SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=9)]
    outputs = llm.generate(prompts, params)
    for output, param in zip(outputs, params):
        reference = hf_greedy("llama", output.prompt_token_ids, param.max_tokens)
        assert [c.token_ids for c in output.outputs] == [reference] * param.n
    assert outputs[0].prompt_logprobs is not None and len(outputs[0].prompt_logprobs) == 40
    assert llm.stats()["num_padded_decode_steps"] > 0
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def test_graph_sizes():
    assert default_graph_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_graph_sizes(256)[-1] == 256 and default_graph_sizes(512)[-2:] == [496, 512]
    assert default_graph_sizes(3) == [1, 2, 3]
    assert EngineOptions(max_num_seqs=20, cuda_graph_sizes=[64, 1, 4]).graph_sizes() == [1, 4, 20]
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineOptions(cuda_graph_sizes=[0, 4])
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineOptions(cuda_graph_sizes=[])


def test_capture_needs_cuda(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=32, enforce_eager=True)
    with pytest.raises(ValueError, match="CUDA"):
        llm.engine.runner.enable_decode_graphs([1, 2], 4, capture=True)
    assert llm.engine.runner.decode_graphs is None


def test_block_copy_warm_up_changes_no_block(tiny_model):
    """What CUDA runs at load so that no copy kernel compiles inside a request: block 0
    onto itself, and out to the host pool and back."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=8, swap_space_gb=0.001)
    cache = llm.engine.runner.kv_cache
    for k, v in cache.device_caches:
        k.normal_(), v.normal_()
    before = [k.clone() for k, _ in cache.device_caches]
    llm.engine.runner.warm_up_kernels(1)
    assert all(torch.equal(k, old) for (k, _), old in zip(cache.device_caches, before))
    assert torch.equal(cache.host_caches[0][0][0], before[0][0])
    llm.check_integrity()
