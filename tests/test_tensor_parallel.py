"""Tensor parallelism: a model split across ranks must compute what the whole model computes.

Greedy outputs of TP = 2 and TP = 4 groups (gloo, float32, CPU) must be
token-identical to transformers ``generate(do_sample=False)`` for llama,
qwen3, mistral and a mixture of experts (qwen3_moe), through prefix-cache
hits, preemption by swap and by recompute, an abort in the middle of a
stream, and KV moved between groups of different sizes. Models whose plan or
head counts do not allow a split are refused with the reason. That whole
check runs for each family at one group size (four ranks for the mixture of
experts, two for the others) and at both under ``--long-form``.

The plan, shard and channel tests run their ranks as threads of this process
(each with its own gloo process group); the engine tests start real rank
processes, as ``LLM(..., tensor_parallel_size=N)`` does.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.engine.kv_transfer import export_kv
from pagedserve.workers.tp.dispatch import BroadcastChannel, GroupBrokenError, PipeChannel
from pagedserve.workers.tp.group import TensorParallelGroup, host_store
from pagedserve.workers.tp.messages import KVCopies, RunStep, WriteBlocks, pack, unpack
from pagedserve.workers.tp.load import ShardLoader, load_sliced, shard_model
from pagedserve.workers.tp.plan import SliceSpec, TensorParallelError, check_tensor_parallel, shard_slice
from greedy_reference import GreedyReference
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ("llama", "qwen3", "mistral", "qwen3_moe")
# By default each family runs at one size: the dense ones in groups of two, the mixture of experts
# in a group of four (its groups of two run in test_overlapped_scheduling_..., a dense group of four
# in test_kv_moves_between_groups_...); every pair runs under --long-form. An engine test costs a
# start of every rank (torch and transformers imported in each) on 2 cores: 10-26 s.
SHORT_FORM_SIZES = {"llama": 2, "qwen3": 2, "mistral": 2, "qwen3_moe": 4}
ARCH_SIZES = [pytest.param(arch, size, marks=[] if SHORT_FORM_SIZES[arch] == size else [pytest.mark.long_form])
              for arch in ARCHS for size in (2, 4)]
FIRST_ORDINARY_ID = 5
VOCAB_SIZE = 1024


def random_prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def tp_model():
    """``tp_model(arch) -> str``: the tiny checkpoint whose head counts divide by 2 and 4."""
    return lambda arch: str(ensure_model(arch, "tiny-tp"))


@pytest.fixture(scope="module")
def reference(tp_model):
    """``reference(arch, prompt, max_tokens)``: transformers' greedy tokens (memoised)."""
    from transformers import AutoModelForCausalLM

    return GreedyReference(lambda arch: AutoModelForCausalLM.from_pretrained(tp_model(arch), dtype=torch.float32))


# How long a group's ranks may take together: a hung rank fails the test, it does not pass as None.
RANK_TIMEOUT_S = 120


def run_ranks(size: int, work) -> list:
    """``work(group)`` on each rank of a group whose ranks are threads of this process."""
    # transformers resolves its lazy top-level names on first use, and two threads doing that
    # at once can see a half-built module ("cannot import name 'AutoConfig'"). Rank processes
    # never share a module, so resolve them here, before the threads start.
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    store, rendezvous = host_store(size, "127.0.0.1")
    results, errors = [None] * size, []

    def rank_main(rank: int) -> None:
        try:
            group = TensorParallelGroup(rendezvous, rank, torch.device("cpu"), store if rank == 0 else None)
            results[rank] = work(group)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"ranks {hung} of {size} still ran after {RANK_TIMEOUT_S} s"
    return results


# ---- plans: refused at config validation, with the reason ---------------------------------

def test_head_counts_that_do_not_divide_are_refused(tp_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(ensure_model("llama", "tiny")))   # 4 heads over 2 KV heads
    check_tensor_parallel(config, 2)
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size 4: model type 'llama' has 2 "
                                                  r"key/value heads, which do not divide by 4"):
        check_tensor_parallel(config, 4)
    config = AutoConfig.from_pretrained(tp_model("llama"))
    with pytest.raises(TensorParallelError, match="8 attention heads, which do not divide by 3"):
        check_tensor_parallel(config, 3)


def test_models_without_a_plan_we_implement_are_refused():
    from transformers import CONFIG_MAPPING

    with pytest.raises(TensorParallelError, match="'stablelm' has no tensor-parallel plan in transformers"):
        check_tensor_parallel(CONFIG_MAPPING["stablelm"](), 2)
    with pytest.raises(TensorParallelError, match="'colwise_gather_output' .*which pagedserve does not implement"):
        check_tensor_parallel(CONFIG_MAPPING["phi3"](num_attention_heads=8, num_key_value_heads=4), 2)
    check_tensor_parallel(CONFIG_MAPPING["stablelm"](), 1)   # one rank needs no plan


def test_split_widths_must_divide(tp_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tp_model("qwen3_moe"))
    config.moe_intermediate_size = 90
    with pytest.raises(TensorParallelError, match="moe_intermediate_size 90 does not divide by 4"):
        check_tensor_parallel(config, 4)
    config.moe_intermediate_size = 88
    with pytest.raises(TensorParallelError, match="experts 22 wide per rank; .* a multiple of 8"):
        check_tensor_parallel(config, 4)
    config.moe_intermediate_size = 96
    check_tensor_parallel(config, 4)


def test_engine_refuses_before_starting_ranks(tiny_model):
    with pytest.raises(TensorParallelError, match="do not divide by 4"):
        LLM(tiny_model("llama"), tensor_parallel_size=4, device="cpu", num_device_blocks=16)


def test_the_cluster_refuses_a_group_whose_size_the_model_cannot_take(tiny_model, tp_model):
    from pagedserve.cluster.bootstrap import check_model
    from pagedserve.cluster.config import ClusterConfig

    config = ClusterConfig.model_validate({"workers": [{"count": 1}, {"count": 1, "tensor_parallel_size": 4}]})
    with pytest.raises(TensorParallelError, match="has 2 key/value heads, which do not divide by 4"):
        check_model(config, tiny_model("llama"))
    check_model(config, tp_model("llama"))
    with pytest.raises(ValueError, match="needs resources per rank"):
        ClusterConfig.model_validate({"workers": [{"tensor_parallel_size": 2, "num_cpus": 0}]})


def test_shard_slice_splits_fused_halves_alike():
    fused = torch.arange(8).reshape(8, 1)          # [gate 0..3; up 4..7]
    assert shard_slice(fused, 0, 0, 2, num_parts=2).flatten().tolist() == [0, 1, 4, 5]
    assert shard_slice(fused, 0, 1, 2, num_parts=2).flatten().tolist() == [2, 3, 6, 7]
    assert shard_slice(fused, 0, 1, 2).flatten().tolist() == [4, 5, 6, 7]


# ---- shards: the split model computes the whole model's logits ------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("size", [2, 4])
def test_sharded_forward_matches_whole_model_with_two_all_reduces_per_layer(arch, size, tp_model):
    from transformers import AutoModelForCausalLM

    path = tp_model(arch)
    ids = torch.tensor([random_prompts([12], seed=1)[0]])
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        expected = whole(ids).logits

    def work(group: TensorParallelGroup):
        model = ShardLoader(group.rank, group.size, group.all_reduce)(path, torch.float32, "sdpa", False)
        decoder = model.get_decoder()
        attention = decoder.layers[0].self_attn
        local_heads = attention.k_proj.weight.shape[0] // attention.head_dim
        with torch.inference_mode():
            logits = model(ids).logits
        return logits, group.num_all_reduces, local_heads

    for logits, num_all_reduces, local_heads in run_ranks(size, work):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert num_all_reduces == 2 * whole.config.num_hidden_layers   # after attention, after the MLP
        assert local_heads == whole.config.num_key_value_heads // size


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rank_reads_only_its_slices_and_gets_what_cutting_the_whole_model_gives(arch, tp_model, tiny_model):
    """Dense checkpoints (tensor names = parameter names) are read slice by slice; the shard equals
    the whole model cut down, RoPE buffers included, and so do the cuts reported (which a rank's
    adapters follow). qwen2's q/k/v biases are cut with their heads."""
    from transformers import AutoModelForCausalLM

    path = tp_model(arch) if arch == "llama" else tiny_model(arch)
    size = 2

    def work(group: TensorParallelGroup):
        loaded = load_sliced(path, torch.float32, "sdpa", False, group.rank, size, group.all_reduce)
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        return loaded, whole, shard_model(whole, group.rank, size, group.all_reduce)

    for loaded, whole, whole_cuts in run_ranks(size, work):
        assert loaded is not None
        sliced, cuts = loaded
        assert cuts == whole_cuts and cuts["model.layers.0.self_attn.o_proj.weight"].dim == 1
        expected = dict(whole.named_parameters()) | dict(whole.named_buffers())
        got = dict(sliced.named_parameters()) | dict(sliced.named_buffers())
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name


def test_checkpoints_converted_on_load_are_loaded_whole_then_cut(tp_model):
    def work(group: TensorParallelGroup):
        return load_sliced(tp_model("qwen3_moe"), torch.float32, "sdpa", False, group.rank, 2, group.all_reduce)

    assert run_ranks(2, work) == [None, None]     # experts stored one by one, fused by transformers


def test_a_rowwise_bias_is_added_once():
    spec = SliceSpec(0, 1, 1, 2, is_summed_bias=True)
    bias = torch.ones(4)
    assert torch.equal(spec.cut(bias), torch.zeros(4))
    assert torch.equal(SliceSpec(0, 1, 0, 2, is_summed_bias=True).cut(bias), bias)


# ---- messages and channels ----------------------------------------------------------------

def test_commands_round_trip_with_their_copies():
    step = RunStep([0, 3], [5, 0], [11, 12, 13], [(3, [7, 8], 0)], [1, 2])
    copies = [KVCopies([(1, 2)], [], [(4, 5)]), KVCopies([], [(2, 9)], [])]
    command, batches = unpack(pack(step, copies))
    assert command == RunStep([0, 3], [5, 0], [11, 12, 13], [[3, [7, 8], 0]], [1, 2])
    assert [(b.swap_out, b.swap_in, b.copy_on_write) for b in batches] == [
        ([[1, 2]], [], [[4, 5]]), ([], [[2, 9]], [])]
    assert unpack(pack(WriteBlocks([1], [2, 2, 1, 4, 2, 8], "bfloat16")))[0].dtype == "bfloat16"


@pytest.mark.parametrize("kind", ["pipe", "broadcast"])
def test_channels_deliver_in_order_including_long_commands(kind):
    messages = [b"x", bytes(range(256)) * 40, b"", os.urandom(100_000)]   # one frame, several, none

    def work(group: TensorParallelGroup):
        if kind == "broadcast":
            channel = BroadcastChannel(group)
        else:
            channel = PipeChannel.writer(group) if group.rank == 0 else PipeChannel.reader(group)
            group.barrier()
        try:
            if group.rank == 0:
                for message in messages:
                    channel.send(message)
                return None
            return [channel.receive() for _ in messages]
        finally:
            channel.close()

    received = run_ranks(3, work)
    assert received[1] == messages and received[2] == messages


def test_pipe_channel_reports_a_rank_that_is_gone():
    def work(group: TensorParallelGroup):
        channel = PipeChannel.writer(group) if group.rank == 0 else PipeChannel.reader(group)
        group.barrier()
        if group.rank == 1:
            channel.close()                      # rank 1 leaves
            group.barrier()
            return None
        group.barrier()
        with pytest.raises(GroupBrokenError, match="rank is gone"):
            channel.send(b"step")
        channel.close()
        return True

    assert run_ranks(2, work)[0] is True


# ---- the engine on a group of rank processes ----------------------------------------------

def make_engine(path: str, size: int, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("num_device_blocks", 256)
    kwargs.setdefault("swap_space_gb", 0.001)
    return LLM(path, tensor_parallel_size=size, device="cpu", dtype="float32",
               distributed_executor_backend="mp", **kwargs)


def rank_block_bytes(path: str, size: int, block_size: int = 8) -> int:
    """Bytes of one float32 block of one rank's pool (its share of the KV heads)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return 2 * config.num_hidden_layers * block_size * (config.num_key_value_heads // size) * config.head_dim * 4


def assert_matches(outputs, arch: str, max_tokens: int, reference) -> None:
    for output in outputs:
        expected = reference(arch, output.prompt_token_ids, max_tokens)
        assert output.outputs[0].token_ids == expected, (
            f"{arch}: {output.request_id} (prompt of {len(output.prompt_token_ids)}) diverged")


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "size"), ARCH_SIZES)
def test_greedy_matches_transformers_through_prefix_hits_preemption_and_abort(arch, size, tp_model, reference):
    path = tp_model(arch)
    # 24 blocks of 8 tokens: one sequence always fits, all of them at once never do; the host
    # pool holds 6 blocks, so some preemptions swap and, once it is full, others recompute.
    llm = make_engine(path, size, num_device_blocks=24, swap_space_gb=6 * rank_block_bytes(path, size) / 2**30)
    try:
        assert llm.engine.pool_config.num_host_blocks == 6
        max_tokens = 20
        shared = random_prompts([24], seed=3)[0]
        prompts = [shared + tail for tail in random_prompts((5, 17, 30, 9), seed=4)]
        prompts += random_prompts((40, 13, 52, 26), seed=5)
        outputs = llm.generate(prompts, greedy(max_tokens))
        assert_matches(outputs, arch, max_tokens, reference)
        preemptions = llm.stats()["num_preemptions_by_mode"]
        assert preemptions["swap"] > 0 and preemptions["recompute"] > 0, preemptions
        assert sum(o.metrics.num_cached_tokens for o in outputs) > 0      # the shared prefix hit
        assert_idle(llm)

        # An abort in the middle of the streams: the others go on, exactly.
        engine = llm.engine
        for i, prompt in enumerate(prompts[:4]):
            engine.add_request(f"abort-{i}", prompt, greedy(max_tokens))
        finished = {}
        for step in range(200):
            if step == 6:
                assert engine.abort_request("abort-1")
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            if not engine.has_unfinished_requests() and len(finished) == 4:
                break
        assert finished["abort-1"].outputs[0].finish_reason == "abort"
        assert_matches([finished[f"abort-{i}"] for i in (0, 2, 3)], arch, max_tokens, reference)
        assert_idle(llm)
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_speculative_decoding_verifies_on_every_rank(tp_model, reference):
    """n-gram speculation on a group of 2: the proposer runs on rank 0's driver, every rank
    computes the k + 1 positions of a draft, and greedy output equals transformers'."""
    path = tp_model("llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_engine(path, 2, speculative_config=ngram)
    try:
        max_tokens = 40
        outputs = llm.generate(random_prompts((8, 20, 13, 31), seed=41), greedy(max_tokens))
        assert_matches(outputs, "llama", max_tokens, reference)
        stats = llm.stats()
        assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
        assert_idle(llm)
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_a_draft_model_runs_whole_on_rank_0(tp_model, reference):
    """A draft model beside a group of 2: it runs whole on rank 0 (here the target itself, so
    every proposal is right), its KV in the pool's blocks on rank 0 only; through swaps, greedy
    output equals transformers' and every proposal is accepted."""
    path = tp_model("llama")
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = make_engine(path, 2, speculative_config=draft, num_device_blocks=24,
                      swap_space_gb=12 * rank_block_bytes(path, 2) / 2**30)
    try:
        max_tokens = 24
        outputs = llm.generate(random_prompts((8, 40, 20, 13, 31, 27), seed=43), greedy(max_tokens))
        assert_matches(outputs, "llama", max_tokens, reference)
        stats = llm.stats()
        assert stats["num_preemptions_by_mode"]["swap"] > 0
        assert stats["spec_decode_num_draft_tokens"] > 0
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
        assert_idle(llm)
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_an_eagle_head_runs_on_rank_0_with_whole_hidden_states(tp_model, reference):
    """An EAGLE head beside a group of 2 runs on rank 0, on whole hidden states (the
    all-reduces) with whole embeddings and LM head: greedy output equals transformers', and
    every proposal equals the one the same head makes beside the model on one device."""
    path = tp_model("llama")
    head = {"method": "eagle", "model": str(ensure_model("llama", "tiny-tp-eagle")), "num_speculative_tokens": 3}
    prompts = random_prompts((8, 26, 13), seed=44)
    max_tokens = 20
    proposals = {}
    for size in (1, 2):
        llm = make_engine(path, size, speculative_config=head)
        proposer = llm.engine.speculator.proposer
        seen, propose_batch = [], type(proposer).propose_batch

        def record(seqs, limits, proposer=proposer, seen=seen, propose_batch=propose_batch):
            made = propose_batch(proposer, seqs, limits)
            seen.extend((tuple(seq.token_ids), tuple(p)) for seq, p in zip(seqs, made) if p)
            return made

        proposer.propose_batch = record
        try:
            assert_matches(llm.generate(prompts, greedy(max_tokens)), "llama", max_tokens, reference)
            assert_idle(llm)
        finally:
            if size > 1:
                llm.engine.runner.shutdown()
        proposals[size] = sorted(seen)
    assert proposals[1] and proposals[2] == proposals[1]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_overlapped_scheduling_hands_the_running_steps_ids_to_every_rank(arch, tp_model, reference):
    """With async_scheduling, a step's input ids are the running step's samples, still on rank 0's
    device: they reach the other ranks by a broadcast over the model group, and outputs stay exact
    (through preemption too). Projections merged, as on CUDA: each rank merges its own slices."""
    path = tp_model(arch)
    llm = make_engine(path, 2, num_device_blocks=24, swap_space_gb=6 * rank_block_bytes(path, 2) / 2**30,
                      async_scheduling=True, merge_projections=True)
    runner = llm.engine.runner
    assert runner.local.merged_projections and runner.spec.merge_projections
    assert llm.stats()["num_merged_projections"] == len(runner.local.merged_projections)
    send, num_pending = runner.send, []

    def counting_send(command):
        num_pending.append(bool(getattr(command, "pending", None)))
        send(command)

    runner.send = counting_send
    try:
        assert llm.engine.async_scheduling
        max_tokens = 20
        prompts = random_prompts((40, 13, 52, 26, 9, 33), seed=12)
        outputs = llm.generate(prompts, greedy(max_tokens))
        assert_matches(outputs, arch, max_tokens, reference)
        assert sum(num_pending) > 10, "steps should take their ids from the running step"
        assert sum(llm.stats()["num_preemptions_by_mode"].values()) > 0
        assert_idle(llm)
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need Triton's interpreter")
def test_a_group_warms_its_triton_kernels_up_at_load_on_every_rank(tp_model, reference):
    """With Triton, load runs forwards that compile the attention kernels (``warm_up_kernels``):
    every rank runs them at once, as their all-reduces need; then the group is exact."""
    pytest.importorskip("triton")
    llm = make_engine(tp_model("llama"), 2, kernel_backend="triton")
    try:
        max_tokens = 4
        assert_matches(llm.generate(random_prompts((5, 19), seed=3), greedy(max_tokens)), "llama", max_tokens,
                       reference)
        assert_idle(llm)
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_an_abort_that_arrives_while_a_step_runs(tp_model, reference):
    """The engine thread steps the group on its own; an abort sent from the event loop lands while
    steps run and is applied between two of them: that stream ends "abort", the others exactly."""
    import asyncio

    from pagedserve.workers.offline.async_engine import AsyncLLMEngine

    llm = make_engine(tp_model("qwen3"), 2)
    engine = AsyncLLMEngine(llm.engine)
    max_tokens = 24
    prompts = random_prompts((12, 30, 7, 21), seed=11)

    async def stream(i: int, prompt: list[int]):
        last = None
        async for output in engine.generate(prompt, greedy(max_tokens), request_id=f"a{i}"):
            last = output
            if i == 1 and len(output.outputs[0].token_ids) == 3:
                assert engine.abort("a1")
        return last

    async def run_all():
        return await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts)))

    try:
        outputs = asyncio.run(run_all())
        assert outputs[1].outputs[0].finish_reason == "abort"
        assert 3 <= len(outputs[1].outputs[0].token_ids) < max_tokens
        assert_matches([outputs[i] for i in (0, 2, 3)], "qwen3", max_tokens, reference)
        assert engine.submit(lambda e: e.num_used_blocks()).result(timeout=60) == 0
        engine.submit(lambda e: e.check_integrity()).result(timeout=60)
    finally:
        engine.shutdown()
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_kv_moves_between_groups_of_different_sizes(tp_model, reference):
    """A sequence migrated mid-stream from a TP = 2 group goes on, exactly, on a TP = 4 group
    and on one device: a transfer holds every head, gathered from one group's ranks and split
    across the other's."""
    path = tp_model("llama")
    source = make_engine(path, 2)
    targets = {"tp4": make_engine(path, 4),
               "single": LLM(path, device="cpu", dtype="float32", block_size=8, num_device_blocks=256,
                             swap_space_gb=0.001)}
    try:
        max_tokens = 16
        for i, prompt in enumerate(random_prompts((21, 40), seed=7)):
            engine = source.engine
            engine.add_request(f"src{i}", prompt, greedy(max_tokens))
            while len(engine.requests[f"src{i}"].seqs[0].output_token_ids) < 5:
                engine.step()
            seq = engine.requests[f"src{i}"].seqs[0]
            transfer = export_kv(engine.runner.kv_cache, seq.block_table, seq.num_computed, seq.token_ids)
            assert transfer.payload.shape[4] == 4      # every KV head of the model
            done = list(seq.output_token_ids)
            engine.abort_request(f"src{i}")
            engine.step()
            for name, target in targets.items():
                target.engine.add_request(f"dst{i}", prompt, greedy(max_tokens), kv_transfer=transfer,
                                          output_token_ids=done)
                final = None
                while target.engine.has_unfinished_requests():
                    for output in target.engine.step():
                        final = output
                assert final.outputs[0].token_ids == reference("llama", prompt, max_tokens), name
        for llm in (source, *targets.values()):
            assert_idle(llm)
    finally:
        source.engine.runner.shutdown()
        targets["tp4"].engine.runner.shutdown()


@pytest.mark.slow
def test_a_rank_that_dies_breaks_the_group(tp_model):
    llm = make_engine(tp_model("llama"), 2)
    try:
        llm.generate([random_prompts([8], seed=9)[0]], greedy(4))
        ranks = llm.engine.runner.ranks
        ranks.processes[0].kill()
        ranks.processes[0].join(timeout=30)
        for _ in range(100):
            if ranks.is_broken():
                break
            threading.Event().wait(0.1)
        with pytest.raises(GroupBrokenError, match="rank of the tensor-parallel group is gone"):
            llm.generate([random_prompts([8], seed=10)[0]], greedy(4))
    finally:
        llm.engine.runner.shutdown()


def _exit_after_closing_descriptors(code: int) -> None:
    """Close every descriptor (the parent's sentinel fires), then exit a moment later: the
    window in which the process is gone to its sentinel but cannot yet be reaped, widened."""
    os.closerange(3, 65536)
    time.sleep(1.0)
    os._exit(code)


class _ExitingLauncher:
    """Starts rank 1 as a process that exits at once, before it reaches the group's store."""

    def launch(self, spec):
        import multiprocessing

        from pagedserve.workers.tp.launch import ProcessRanks

        process = multiprocessing.get_context("spawn").Process(target=_exit_after_closing_descriptors,
                                                               args=(3,), daemon=True)
        process.start()
        return ProcessRanks([process])


def test_a_rank_that_ends_before_joining_fails_the_start_instead_of_hanging(tp_model):
    """Rank 0's process groups would wait for a missing rank without end (the control group's
    timeout is unbounded): the start fails, naming the rank's exit, as soon as it ends."""
    from pagedserve.workers.tp.group import RankNeverJoined
    from pagedserve.workers.tp.runner import TensorParallelRunner

    began = time.monotonic()
    with pytest.raises(RankNeverJoined, match=r"rank process \d+ ended \(exit code 3\) before it joined"):
        TensorParallelRunner(tp_model("llama"), 2, _ExitingLauncher(), device="cpu")
    assert time.monotonic() - began < RANK_TIMEOUT_S


def test_ranks_that_do_not_arrive_in_time_fail_the_start():
    import datetime

    from pagedserve.workers.tp.group import RankNeverJoined, await_ranks, joined_key

    store, _ = host_store(3, "127.0.0.1")
    store.set(joined_key(2), b"1")
    with pytest.raises(RankNeverJoined, match="ranks 1 of 3 did not join the tensor-parallel group within 0 s"):
        await_ranks(store, 3, lambda: None, datetime.timedelta(seconds=0.2))
    store.set(joined_key(1), b"1")
    await_ranks(store, 3, lambda: None, datetime.timedelta(seconds=0.2))
