"""Every transformers decoder, exact at every length, and a clear refusal for the rest.

The architecture matrix: one tiny random checkpoint per config class
(``pagedserve.devtools.model_matrix``), its variants on (sliding windows of
16-32 tokens, alternating local/global layers, soft-caps, sinks, custom
scaling, Llama 3 RoPE, mixture of experts). Greedy outputs must be
token-identical to transformers ``generate(do_sample=False)`` in float32 on
CPU, with prompts plus outputs several windows long, shared prefixes longer
than the window, chunked prefill and a pool small enough to preempt. Every
engine ends idle, holding zero blocks, with its integrity check passing.
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_matrix import MATRIX, ensure_matrix_model, make_matrix_model
from pagedserve.workers.model.model_support import UnsupportedModelError
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIRST_ORDINARY_ID = 5
VOCAB_SIZE = 1024
MAX_TOKENS = 40
WINDOWED = [name for name, (_, variant) in MATRIX.items()
            if "sliding_window" in variant or "attn_logit_softcapping" in variant]


def random_prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("swap_space_gb", 0.001)
    return LLM(str(path), **kwargs)


# ---- the architecture matrix ----------------------------------------------------------

def matrix_workload(seed: int) -> list[list[int]]:
    """Prompts sharing a 56-token prefix (longer than every window), long ones, and short
    ones whose outputs run past the window (decode growth is what preempts when blocks
    leave the window: a windowed sequence's footprint stops growing once it is past it)."""
    prefix = random_prompts([56], seed)[0]
    tails = random_prompts((3, 17, 30, 1), seed + 1)
    return ([prefix + tail for tail in tails] + random_prompts((90, 121), seed + 2)
            + random_prompts((2, 5, 9, 4, 7, 3), seed + 3))


@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("index,name", list(enumerate(MATRIX)), ids=list(MATRIX))
def test_matrix_greedy_matches_transformers(index, name, merged, matrix_greedy):
    """Block sizes and preemption modes alternate across the matrix; every entry runs
    chunked prefill, prefix caching with hits past the window, and preemption (with
    out-of-window blocks freed where every layer is windowed); with its q/k/v and gate/up
    projections separate (the CPU's default) and merged (CUDA's)."""
    block_size = (8, 16)[index % 2]
    mode = ("recompute", "swap")[index // 2 % 2]
    llm = make_llm(ensure_matrix_model(name), block_size=block_size, preemption_mode=mode,
                   num_device_blocks=192 // block_size, max_num_batched_tokens=32,
                   enable_prefix_caching=True, merge_projections=merged)
    # Every family but phi3 (whose checkpoint already stores qkv_proj and gate_up_proj) has some to merge.
    assert bool(llm.engine.runner.merged_projections) == (merged and name != "phi3")
    prompts = matrix_workload(seed=index)
    for round_ in range(2):  # the second round hits the first one's cached blocks
        outputs = llm.generate(prompts, greedy())
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == matrix_greedy(name, prompt, MAX_TOKENS), (
                f"{name} round {round_}: prompt of {len(prompt)} tokens diverged")
        assert_idle(llm)
    stats = llm.stats()
    assert stats["num_preemptions_by_mode"][mode] > 0, stats
    assert stats["prefix_cache_hit_rate"] > 0, stats
    assert max(o.metrics.num_cached_tokens for o in outputs) > 56 - block_size
    assert stats["num_steps"] > sum(map(len, prompts)) // 32  # prompts were chunked
    # Every layer windowed (mistral, phi3, mixtral): blocks left the pool as windows moved.
    is_all_windowed = llm.engine.runner.attention.max_sliding_window is not None
    assert (stats["num_window_freed_blocks"] > 0) == is_all_windowed, stats


@pytest.mark.parametrize("swap_space_gb", [0.001, 0.0], ids=["host-cache", "no-host-cache"])
def test_blocks_out_of_every_window_are_freed_and_prefix_hits_stay_exact(swap_space_gb, matrix_greedy):
    """mistral (every layer windowed, 20 tokens): blocks leave the pool as the window moves;
    a later prompt sharing a prefix longer than the window hits only an unbroken chain from
    its first block, and stays token-identical: with a host cache the evicted blocks come
    back from the host; without one the chain's head is evicted first and the hit stops there."""
    llm = make_llm(ensure_matrix_model("mistral"), block_size=8, num_device_blocks=24,
                   max_num_batched_tokens=32, swap_space_gb=swap_space_gb)
    manager = llm.engine.kv_manager.block_manager(llm.engine.worker_id)
    assert manager.window is not None and manager.window.sliding_window == 20
    prefix = random_prompts([120], seed=50)[0]
    first = llm.generate([prefix], greedy())[0]
    assert first.outputs[0].token_ids == matrix_greedy("mistral", prefix, MAX_TOKENS)
    assert manager.counters.num_window_freed_blocks > 10
    others = random_prompts((70, 40, 60), seed=51)  # evict part of the prefix's chain
    llm.generate(others, greedy(8))
    prompts = [prefix + tail for tail in random_prompts((5, 13), seed=52)]
    outputs = llm.generate(prompts, greedy())
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == matrix_greedy("mistral", prompt, MAX_TOKENS)
        assert output.metrics.num_cached_tokens % 8 == 0
    # The first of them: from the host, or from the chain's unbroken head (here none);
    # the second hits what the first recomputed.
    hits = [output.metrics.num_cached_tokens for output in outputs]
    assert (hits[0] == 120) if swap_space_gb else (hits[0] < 120), hits
    assert_idle(llm)


def test_mixed_local_and_global_layers_keep_every_block(caplog):
    """gemma2 alternates windowed and global layers: the global ones need every position."""
    with caplog.at_level(logging.INFO):
        llm = make_llm(ensure_matrix_model("gemma2"), block_size=8, num_device_blocks=64)
    assert llm.engine.kv_manager.block_manager(llm.engine.worker_id).window is None
    assert "attend globally: blocks out of the windows are kept" in caplog.text
    llm.generate(random_prompts([60], seed=53), greedy(30))
    assert llm.stats().get("num_window_freed_blocks", 0) == 0
    assert_idle(llm)


@pytest.mark.parametrize("name", WINDOWED)
def test_matrix_variants_change_the_outputs(name, matrix_greedy, tmp_path):
    """The matrix tests can fail: without its window and soft-caps, transformers itself
    gives other tokens on the matrix workload."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ensure_matrix_model(name))
    plain = {}
    if getattr(config, "sliding_window", None):
        plain["sliding_window"] = 10_000
    if getattr(config, "attn_logit_softcapping", None):
        plain["attn_logit_softcapping"] = None
    path = make_matrix_model(name, tmp_path / name, **plain)
    prompts = matrix_workload(seed=list(MATRIX).index(name))
    assert any(matrix_greedy(name, p, MAX_TOKENS) != matrix_greedy(name, p, MAX_TOKENS, path=path)
               for p in prompts)


def test_probe_reads_each_layers_variant():
    """What the load-time probe records is what the configs ask for, layer by layer."""
    from pagedserve.workers.model.model_runner import ModelRunner

    expected = {
        "qwen2": [(None, None, False), (24, None, False)],
        "gemma2": [(16, 3.0, False), (None, 3.0, False)],
        "gpt_oss": [(18, None, True), (None, None, True)],
        "phi3": [(20, None, False), (20, None, False)],
        "llama": [(None, None, False), (None, None, False)],
    }
    for name, layers in expected.items():
        attention = ModelRunner(str(ensure_matrix_model(name)), "float32", "cpu").attention
        assert [(v.sliding_window, v.logit_softcap, v.has_sinks) for v in attention.layers] == layers
        assert attention.max_sliding_window == (20 if name == "phi3" else None)
    gemma2 = ModelRunner(str(ensure_matrix_model("gemma2")), "float32", "cpu").attention
    assert gemma2.layers[0].scale == pytest.approx(24 ** -0.5)  # query_pre_attn_scalar


def test_longrope_is_exact_up_to_its_switch_length(tmp_path, matrix_greedy, caplog):
    """Phi-3's longrope switches frequencies with the batch's longest sequence; the engine
    serves it up to that length and refuses a longer max_model_len."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    path = make_matrix_model("phi3", tmp_path / "longrope", rope_parameters=rope,
                             original_max_position_embeddings=128)
    with pytest.raises(ValueError, match="longrope.*max_model_len <= 128"):
        make_llm(path, max_model_len=256)
    with caplog.at_level(logging.WARNING):
        llm = make_llm(path, block_size=8, num_device_blocks=64)
    assert llm.engine.max_model_len == 128
    assert "longrope" in caplog.text
    prompts = random_prompts((60, 87), seed=40)
    outputs = llm.generate(prompts, greedy())
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == matrix_greedy("phi3", prompt, MAX_TOKENS, path=path)
    assert_idle(llm)


# ---- refusals -------------------------------------------------------------------------

def write_config(tmp_path, model_type: str, **fields):
    """A checkpoint directory holding only a config: refusals happen before weights load."""
    from transformers import AutoConfig

    path = tmp_path / model_type
    config = AutoConfig.for_model(model_type, **fields)
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type,fields,message", [
    ("qwen3_next", {}, r"'qwen3_next' has 'linear_attention' \(linear attention or Mamba"),
    ("falcon_h1", {}, r"'falcon_h1' has 'hybrid' \(attention and Mamba run in parallel\)"),
    ("mamba", {}, r"'mamba' has 'linear_attention'"),
    ("bart", {}, r"'bart' is an encoder-decoder"),
    ("gemma3", {}, r"'gemma3' is multimodal \(vision_config\)"),
    ("bloom", {}, r"'bloom' \(BloomForCausalLM\) computes attention without transformers' attention interface"),
    ("rwkv", {}, r"'rwkv' \(RwkvForCausalLM\) has recurrent state"),
    ("gemma3n_text", {}, r"'gemma3n_text' uses key/value states shared across layers"),
    ("llama4_text", {}, r"'llama4_text' has 'chunked_attention'"),
    ("vit", {}, r"'vit' .* is not a causal language model transformers knows"),
])
def test_refused_at_load_naming_feature_and_model_type(model_type, fields, message, tmp_path):
    path = write_config(tmp_path, model_type, **fields)
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(path), device="cpu")


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch",
                                                      "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="unknown architecture.*no_such_arch"):
        LLM(str(tmp_path), device="cpu")


def test_serve_refuses_before_starting_ray(tmp_path, monkeypatch):
    """``serve`` goes through the same check, before Ray or any worker starts."""
    import ray

    from pagedserve.cluster import bootstrap

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a model that must be refused")

    monkeypatch.setattr(ray, "init", no_ray)
    path = write_config(tmp_path, "qwen3_next")
    with pytest.raises(UnsupportedModelError, match="qwen3_next"):
        bootstrap.start({"model": {"path": str(path)}})


def test_a_checkpoint_with_code_of_its_own_runs_it_only_when_trusted(tiny_model, tmp_path, monkeypatch):
    """A checkpoint whose config.json maps its classes to its own files loads through them with
    ``trust_remote_code``, exactly as transformers runs it; without, it is refused, by ``serve``
    before Ray starts, naming the key and the flag."""
    import ray
    from transformers import AutoModelForCausalLM

    from pagedserve.cluster import bootstrap
    from pagedserve.cluster.config import ClusterConfig
    from remote_code_model import MODEL_CLASS, make_remote_code_model

    path = make_remote_code_model(tiny_model("llama"), tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        make_llm(path)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("Ray started for a refused model"))
    with pytest.raises(ValueError, match=r"model.trust_remote_code: true \(serve --trust-remote-code\)"):
        bootstrap.start({"model": {"path": str(path)}})
    trusted = ClusterConfig.model_validate({"model": {"path": str(path), "trust_remote_code": True}})
    bootstrap.check_model(trusted, str(path))   # its checks pass

    llm = make_llm(path, trust_remote_code=True, num_device_blocks=64)
    assert type(llm.engine.runner.model).__name__ == MODEL_CLASS
    prompts = random_prompts([5, 19, 33], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=True).eval()
    assert type(reference).__name__ == MODEL_CLASS
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
        assert list(output) == expected[0, len(prompt):].tolist()
    assert_idle(llm)


def test_window_the_engine_cannot_honour_is_refused(tmp_path):
    path = make_matrix_model("mistral", tmp_path / "zero-window", sliding_window=0)
    with pytest.raises(UnsupportedModelError, match="'mistral'.*sliding_window=0.*positive integer"):
        make_llm(path)


def test_layers_that_skip_the_attention_interface_are_refused(monkeypatch):
    """A layer whose attention never reaches the interface (as a Mamba layer would) is
    caught by the load-time probe."""
    from transformers.models.mistral import modeling_mistral

    original = modeling_mistral.MistralAttention.forward

    def layer_one_bypasses(self, hidden_states, *args, **kwargs):
        if self.layer_idx == 1:
            return torch.zeros_like(hidden_states), None
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_mistral.MistralAttention, "forward", layer_one_bypasses)
    with pytest.raises(UnsupportedModelError, match=r"'mistral': layers 1 do not attend"):
        make_llm(ensure_matrix_model("mistral"))


def test_attention_arguments_we_do_not_implement_are_refused(monkeypatch):
    from transformers.models.mistral import modeling_mistral

    original = modeling_mistral.MistralAttention.forward

    def chunked(self, *args, **kwargs):
        return original(self, *args, attention_chunk_size=8, **kwargs)

    monkeypatch.setattr(modeling_mistral.MistralAttention, "forward", chunked)
    with pytest.raises(UnsupportedModelError,
                       match="MistralAttention passes attention argument.*attention_chunk_size"):
        make_llm(ensure_matrix_model("mistral"))


def test_variant_the_kernel_backend_lacks_is_refused(monkeypatch):
    """A backend that does not implement a variant refuses the model at load, not mid-serving."""
    from pagedserve import kernels

    original = kernels.paged_attention

    def no_softcap(*args, logit_softcap=None, **kwargs):
        if logit_softcap is not None:
            raise NotImplementedError("no soft-cap here")
        return original(*args, logit_softcap=logit_softcap, **kwargs)

    monkeypatch.setattr(kernels, "paged_attention", no_softcap)
    with pytest.raises(UnsupportedModelError,
                       match="'gemma2' needs sliding window 16, attention logit soft-capping 3.0"):
        make_llm(ensure_matrix_model("gemma2"))
    make_llm(ensure_matrix_model("mistral"), num_device_blocks=16)  # windows alone still load



def _layer_one_calls_attention(q_heads=4, kv_heads=2, head_dim=16, value_dim=16, times=1, **call_kwargs):
    """A MistralAttention.forward whose layer 1 calls the attention interface as told (other
    shapes, twice, extra arguments); layer 0 is untouched."""
    from transformers.models.mistral import modeling_mistral
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = modeling_mistral.MistralAttention.forward

    def passed_on(kwargs):  # what MistralAttention.forward hands the interface
        return {k: v for k, v in kwargs.items()
                if k not in ("attention_mask", "position_embeddings", "past_key_values")}

    def forward(self, hidden_states, *args, **kwargs):
        if self.layer_idx != 1:
            return original(self, hidden_states, *args, **kwargs)
        seq = hidden_states.shape[1]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        for _ in range(times):
            attention(self, torch.zeros(1, q_heads, seq, head_dim), torch.zeros(1, kv_heads, seq, head_dim),
                      torch.zeros(1, kv_heads, seq, value_dim), None,
                      **{"dropout": 0.0, "scaling": self.scaling, **passed_on(kwargs), **call_kwargs})
        return torch.zeros_like(hidden_states), None

    return forward


@pytest.mark.parametrize("call,message", [
    (dict(is_causal=False), "asks for non-causal attention"),
    (dict(dropout=0.1), "asks for attention dropout 0.1"),
    (dict(softcap=-1.0), "passes softcap=-1.0; expected a positive number"),
    (dict(times=2), "layers 1 attend more or less than once"),
    (dict(q_heads=8, kv_heads=2), r"layers differ in \(heads, kv heads, head dim\)"),
    (dict(value_dim=8), "keys and values have different head sizes"),
], ids=["non-causal", "dropout", "bad-softcap", "attends-twice", "layer-shapes-differ", "mla-value-dim"])
def test_attention_calls_the_probe_cannot_honour_are_refused(call, message, monkeypatch):
    """Each attention-call refusal of the load-time probe, naming the model type."""
    from transformers.models.mistral import modeling_mistral

    monkeypatch.setattr(modeling_mistral.MistralAttention, "forward", _layer_one_calls_attention(**call))
    with pytest.raises(UnsupportedModelError, match="'mistral'.*" + message):
        make_llm(ensure_matrix_model("mistral"))


def test_attention_without_a_layer_index_is_refused(monkeypatch):
    from transformers.models.mistral import modeling_mistral

    original = modeling_mistral.MistralAttention.forward

    def no_index(self, *args, **kwargs):
        self.layer_idx = None
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_mistral.MistralAttention, "forward", no_index)
    with pytest.raises(UnsupportedModelError, match="'mistral': MistralAttention attends without a layer index"):
        make_llm(ensure_matrix_model("mistral"))


def test_a_conditional_generation_class_is_refused():
    """A config that maps to a *ForConditionalGeneration class (multimodal or encoder-decoder
    without the usual config markers) is refused by its class."""
    from pagedserve.workers.model.model_support import check_model_class

    fake = type("FooForConditionalGeneration", (), {"_supports_attention_backend": True})
    with pytest.raises(UnsupportedModelError, match="'foo' loads as FooForConditionalGeneration"):
        check_model_class(fake, "foo")


@pytest.mark.parametrize("name", ["gemma2", "cohere2", "granite"])
def test_logprobs_come_through_the_models_own_head(name):
    """Final soft-cap (Gemma 2), logit scale (Cohere) and logit divisor (Granite) apply to
    the logits pagedserve samples from and reports, as in transformers."""
    from transformers import AutoModelForCausalLM

    path = ensure_matrix_model(name)
    llm = make_llm(path, block_size=8, num_device_blocks=64)
    prompt = random_prompts([37], seed=50)[0]
    completion = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0].outputs[0]
    assert_idle(llm)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        result = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                output_logits=True, return_dict_in_generate=True)
    assert completion.token_ids == result.sequences[0, len(prompt):].tolist()
    for entry, logits in zip(completion.logprobs, result.logits):
        expected = torch.log_softmax(logits[0].float(), dim=-1)
        assert entry.logprob == pytest.approx(expected[entry.token_id].item(), abs=1e-4)
        assert [lp for _, lp in entry.top] == pytest.approx(expected.topk(2).values.tolist(), abs=1e-4)
