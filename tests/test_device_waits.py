"""Nothing on a step's path makes the host wait for the GPU, checked without one.

``DeviceWaitAudit`` (``pagedserve.devtools.device_waits``) records the calls that
would wait for a device: reads of its values and blocking copies to or from it.
Code whose device tensors live on ``meta`` is audited exactly (host tensors stay
on the CPU); a model's forward, which touches device tensors only, is audited on
the CPU with the Triton kernels it runs on CUDA (interpreted). On CUDA,
``tests/test_sampler.py`` checks the sampler with torch's own sync debug mode.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.device_waits import DeviceWaitAudit
from pagedserve.devtools.model_matrix import MATRIX, ensure_matrix_model
from pagedserve.workers.model.block_tables import BlockTableRows
from pagedserve.workers.model.kv_cache import CacheShape, KVCache
from pagedserve.workers.sample.sampler import PenaltyRow, Sampler, SamplingBatch, apply_constraints, apply_penalty_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 512


# ---- the audit itself ----------------------------------------------------------------------

def test_the_audit_finds_reads_of_the_watched_device_only():
    host = torch.arange(6)
    with DeviceWaitAudit("meta") as audit:
        host.nonzero(), bool(host.sum()), host.tolist(), int(host[2])  # host values: free
    assert audit.waits == []
    with DeviceWaitAudit("cpu") as audit:
        host.nonzero()
        bool(host.sum())
        host.tolist()
        host.sum().item()
        torch.unique(host)
        host.masked_select(host > 2)
    assert [w.op for w in audit.waits] == ["nonzero", "_local_scalar_dense", "tolist", "_local_scalar_dense", "_unique2",
                                           "masked_select"]
    assert all(w.kind == "read" for w in audit.waits)
    assert audit.waits[0].where.startswith(__name__)


def test_the_audit_finds_blocking_copies_between_the_host_and_the_device():
    host, device = torch.arange(4), torch.zeros(4, dtype=torch.int64, device="meta")
    with DeviceWaitAudit("meta") as audit:
        host.to("meta", non_blocking=True)
        device.copy_(host, non_blocking=True)
        device.to(torch.float16)
        device[1:3], device[host.new_tensor(1)]  # slices and a host scalar: no upload
    assert audit.waits == []
    with DeviceWaitAudit("meta") as audit:
        host.to("meta")
        host.to(device=torch.device("meta"), dtype=torch.int32)
        device.copy_(host)
        torch.tensor([1, 2], device="meta")
        device[[0, 2]]
        device[host[:2]] = 1
    assert [(w.kind, w.op) for w in audit.waits] == [("blocking copy", op) for op in (
        "to", "to", "copy_", "tensor", "__getitem__", "__setitem__")]
    assert len(audit.summary()) == 6


# ---- the sampler and the block tables (their device tensors on meta) ----------------------

def test_sampling_with_penalties_grammars_and_bans_never_waits():
    """Penalties, bitmask rows and banned tokens upload their indexes and values without
    blocking; before, each was a blocking copy (indexing with a list, ``torch.tensor`` on the
    device), and the repetition check read a device tensor."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2),
              SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(top_k=5, top_p=0.5), SamplingParams(temperature=1.2, min_p=0.1)]
    logits = torch.empty(len(params), VOCAB, device="meta")
    penalties = [PenaltyRow(0, [1, 2, 3], [4, 5, 5], 1.2, 0.0, 0.0), PenaltyRow(1, [7], [8, 8, 9], 1.0, 0.5, 0.3)]
    bitmask = torch.zeros(2, VOCAB // 32, dtype=torch.int32)
    with DeviceWaitAudit("meta") as audit:
        batch = SamplingBatch.from_params(params)
        Sampler(seed=0).sample_tokens(logits, batch)
        penalised = apply_penalty_rows(logits, penalties)
        constrained = apply_constraints(penalised, [1, 3], bitmask, [(0, [5, 6]), (2, [9])])
    assert audit.summary() == []
    assert constrained.shape == logits.shape and constrained.device.type == "meta"


def test_penalties_give_the_same_logits_as_before_on_the_host():
    """The penalties moved their arithmetic to the host: the same values as the formula."""
    logits = torch.randn(2, 16)
    rows = [PenaltyRow(0, [1, 2], [2, 3, 3], 1.5, 0.25, 0.5), PenaltyRow(1, [4], [5], 1.0, 0.0, 1.0)]
    got = apply_penalty_rows(logits, rows)
    expected = logits.clone()
    for token in (1, 2, 3):
        value = expected[0, token]
        expected[0, token] = value / 1.5 if value > 0 else value * 1.5
    expected[0, 2] -= 0.25 + 0.5
    expected[0, 3] -= 2 * 0.25 + 0.5
    expected[1, 5] -= 1.0
    assert torch.equal(got, expected)


def test_block_table_uploads_never_wait():
    """A device copy of the rows (CUDA's layout) takes each step's changes, new rows and
    growth without a blocking copy; before, every write of changed entries was one."""
    rows = BlockTableRows(torch.device("meta"), num_rows=2, num_columns=2)
    rng = random.Random(0)
    tables = {f"s{i}": [rng.randrange(100) for _ in range(rng.randrange(1, 9))] for i in range(6)}
    with DeviceWaitAudit("meta") as audit:
        for step in range(3):
            ids = list(tables)[step:]
            prepared = rows.prepare(ids, [tables[s] for s in ids], [0] * len(ids))
            assert prepared.block_tables.device.type == "meta"
            for table in tables.values():
                table.append(rng.randrange(100))
    assert audit.summary() == []
    assert rows.mirror.shape == rows.host.shape  # grown on the device too


# ---- the model's forward (device tensors only: audited on the CPU) ------------------------

def _triton_llm(name: str, **kwargs) -> LLM:
    """An engine that runs the Triton kernels CUDA runs (interpreted on the CPU)."""
    pytest.importorskip("triton")
    return LLM(str(ensure_matrix_model(name)), device="cpu", dtype="float32", block_size=16,
               num_device_blocks=64, kernel_backend="triton", merge_projections=True, **kwargs)


@pytest.mark.parametrize("name", list(MATRIX))
def test_the_forward_cuda_graphs_capture_never_reads_the_device(name):
    """The padded decode forward (what a CUDA graph captures, and replays without the host)
    of every matrix family. transformers' mask preprocessing read the position ids to look
    for packed sequences until pagedserve stopped registering a mask function."""
    llm = _triton_llm(name)
    runner = llm.engine.runner
    assert runner.enable_decode_graphs([4], -(-llm.engine.max_model_len // 16), capture=False)
    waits, logits = audited_padded_forward(runner.decode_graphs, 4)
    assert waits == []
    assert logits.shape == (4, runner.vocab_size)


def audited_padded_forward(graphs, size: int, within=contextlib.nullcontext):
    """``graphs``' padded forward of ``size`` rows, run eagerly on padding inside ``within()``:
    (the device waits it made, its logits)."""
    with torch.inference_mode():
        graphs._pad_only()
        with within(), DeviceWaitAudit("cpu") as audit:
            logits = graphs._forward(size)
    return audit.summary(), logits


def test_the_verification_forward_cuda_graphs_capture_never_reads_the_device():
    """The padded forward of a verification step (5 query rows a sequence: a CUDA graph's,
    when speculation verifies on graphs) reads nothing back from the device either."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _triton_llm("llama", speculative_config=spec)
    runner = llm.engine.runner
    max_blocks = -(-llm.engine.max_model_len // 16)
    assert runner.enable_decode_graphs([4], max_blocks, capture=False)
    assert runner.enable_verify_graphs([4], max_blocks, 5, capture=False)
    waits, logits = audited_padded_forward(runner.verify_graphs, 4)
    assert waits == []
    assert logits.shape == (4 * 5, runner.vocab_size)


def test_the_lora_forward_cuda_graphs_capture_never_reads_the_device():
    """A padded decode forward with adapter slots on static segments (what a CUDA graph of an
    engine with LoRA captures) reads nothing back from the device. (The segments' fill is host
    code on host tensors, which an audit of the CPU as the device cannot tell apart.)"""
    llm = _triton_llm("llama", enable_lora=True, max_loras=2, max_lora_rank=8)
    runner, layers = llm.engine.runner, llm.engine.lora.layers
    layers.enable_static_segments(4)
    assert runner.enable_decode_graphs([4], -(-llm.engine.max_model_len // 16), capture=False, lora=layers.context)
    context = layers.context
    waits, logits = audited_padded_forward(
        runner.decode_graphs, 4, within=lambda: context.using(context.static.fill(torch.tensor([0, -1, 1, 0]))))
    assert waits == []
    assert logits.shape == (4, runner.vocab_size)


def test_a_mixed_steps_forward_never_reads_the_device(monkeypatch):
    """A mixed step (a prefill chunk beside decoding sequences whose ids are still on the
    device) runs the decoder eagerly: on CUDA a read there would stop the host from running
    ahead of the device."""
    llm = _triton_llm("llama", async_scheduling=True, max_num_batched_tokens=16)
    runner = llm.engine.runner
    audits = []
    run_decoder, compute_logits = runner.run_decoder, runner.compute_logits

    def audited(function):
        def run(*args, **kwargs):
            with DeviceWaitAudit("cpu") as audit:
                result = function(*args, **kwargs)
            audits.append(audit)
            return result
        return run

    monkeypatch.setattr(runner, "run_decoder", audited(run_decoder))
    monkeypatch.setattr(runner, "compute_logits", audited(compute_logits))
    outputs = llm.generate([[5, 6, 7], list(range(10, 30))], SamplingParams(temperature=0, max_tokens=3))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    stats = llm.stats()
    assert stats["num_steps"] - stats["num_decode_steps"] >= 2  # the long prompt took two chunks
    assert len(audits) == 2 * stats["num_steps"]
    assert [line for audit in audits for line in audit.summary()] == []
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_overlapped_steps_never_block_on_uploads(padded, tiny_model):
    """Steps under overlapped scheduling (prefill chunks beside decoding sequences whose ids
    are still on the device), then steps with penalties, seeds, forks and a beam search: no
    step uploads its inputs with a blocking copy (before, the pending ids' positions were
    one in every mixed step, and forks and beams one each)."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=16, num_device_blocks=64,
              async_scheduling=True, max_num_batched_tokens=64)
    if padded:
        assert llm.engine.runner.enable_decode_graphs([1, 2, 4, 8], -(-llm.engine.max_model_len // 16),
                                                      capture=False)
    prompts = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((9, 40, 70, 3))]
    # Greedy and unseeded draws overlap; penalties and seeds make steps wait for their ids.
    overlapped = [SamplingParams(temperature=0.8 if i % 2 else 0.0, max_tokens=8, ignore_eos=True)
                  for i in range(len(prompts))]
    per_row = [SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=i,
                              repetition_penalty=1.3, frequency_penalty=0.2) for i in range(2)]
    per_row += [SamplingParams(n=2, temperature=0.8, max_tokens=8, ignore_eos=True),
                SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True)]
    with DeviceWaitAudit("cpu", reads=False) as audit:
        outputs = llm.generate(prompts, overlapped) + llm.generate(prompts, per_row)
    assert all(len(sample.token_ids) == 8 for o in outputs for sample in o.outputs)
    assert [len(o.outputs) for o in outputs[4:]] == [1, 1, 2, 2]
    stats = llm.stats()
    assert stats["num_steps"] - stats["num_decode_steps"] >= 2  # chunked prefill: mixed steps ran
    assert (stats.get("num_padded_decode_steps", 0) > 0) == padded
    assert audit.summary() == []
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


# ---- the KV cache's copies (copy-on-write, swap-in, imported blocks) ------------------------

def test_kv_cache_copies_on_the_step_never_wait():
    """Copy-on-write and swap-in run in a step; before, their block pairs were uploaded with
    blocking copies. (A swap-out waits by design: the host pool must hold the blocks.)"""
    shape = CacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(shape, num_device_blocks=8, num_host_blocks=4, device="meta")
    payload = torch.zeros(2, 2, 2, 4, 2, 8)
    with DeviceWaitAudit("meta") as audit:
        cache.execute_copies([], [(0, 1), (2, 5)], [(3, 4)])
        cache.write_blocks([6, 7], payload)
    assert audit.summary() == []


def test_triton_block_copies_never_wait():
    """The Triton block-copy launcher uploads its pairs and the caches' addresses without
    blocking, and a swap-in its indexes."""
    pytest.importorskip("triton")
    from pagedserve.kernels import triton_ops

    caches = [torch.randn(6, 4, 2, 8) for _ in range(4)]
    expected = [c.clone() for c in caches]
    for c in expected:
        c[[4, 5]] = c[[1, 2]]
    with DeviceWaitAudit("cpu", reads=False) as audit:
        triton_ops.copy_blocks(caches[:2], caches[2:], torch.tensor([[1, 4], [2, 5]]))
    assert audit.summary() == []
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))
    with DeviceWaitAudit("meta") as audit:
        triton_ops.swap_blocks(caches[0], torch.empty(6, 4, 2, 8, device="meta"), torch.tensor([[0, 3]]))
    assert audit.summary() == []
