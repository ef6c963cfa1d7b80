"""Speculative decoding with an EAGLE head (``speculative_config`` method "eagle").

A random head accepts little, so its KV is checked another way: every proposal the engine
makes equals the greedy chain of the same head run densely (transformers' eager attention,
the whole sequence at once) on the target's hidden states from transformers. That holds only
if the head's paged KV is right at every position: written a step late, with the token after
each position, across chunked prefill, verification roll-backs, swaps and recompute. The
output is token-identical to transformers whatever the head proposes. Every engine's KV
accounting is checked after every step, and ends each test holding no block.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.spec_decode.config import SpeculativeConfig
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
MAX_TOKENS = 20


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def outputs_of(results) -> list[list[int]]:
    return [list(completion.token_ids) for result in results for completion in result.outputs]


def eagle_config(arch: str = "llama", method: str = "eagle", **kwargs) -> dict:
    size = "tiny-eagle3" if method == "eagle3" else "tiny-eagle"
    return {"method": method, "model": str(ensure_model(arch, size)), "num_speculative_tokens": K, **kwargs}


class DenseEagle:
    """The head and the target in transformers, eager attention, float32: the proposals the
    engine must make for a sequence of known tokens."""

    def __init__(self, arch: str, target_path: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
        head_path = ensure_model(arch, "tiny-eagle")
        config = AutoConfig.from_pretrained(head_path)
        config._attn_implementation = "eager"
        weights = load_file(str(head_path / "model.safetensors"))
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.fc.weight.data.copy_(weights["fc.weight"])
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.input_layernorm = torch.nn.Identity()
        self.layer.load_state_dict({name.removeprefix("layers.0."): tensor for name, tensor in weights.items()
                                    if name.startswith("layers.0.")}, strict=False)
        self.layer.eval()
        self.rotary = LlamaRotaryEmbedding(config)

    @torch.inference_mode()
    def proposals(self, token_ids: list[int], k: int) -> list[int]:
        embed = self.target.get_input_embeddings()
        ids = torch.tensor([token_ids])
        features = self.target.model(input_ids=ids[:, :-1]).last_hidden_state[0]   # positions 0..n-2
        inputs = self.fc(torch.cat([embed(ids[0, 1:]), features], dim=-1))          # (token i + 1, hidden i)
        proposed = []
        for _ in range(k):
            estimates = self._layer(inputs)
            estimate = estimates[-1]
            token = int(self.target.lm_head(estimate).argmax())
            proposed.append(token)
            inputs = torch.cat([inputs, self.fc(torch.cat([embed(torch.tensor(token)), estimate]))[None]])
        return proposed

    def _layer(self, inputs: torch.Tensor) -> torch.Tensor:
        num = inputs.shape[0]
        positions = torch.arange(num)[None]
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        return self.layer(inputs[None], attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rotary(inputs[None], positions))[0]


class DenseEagle3(DenseEagle):
    """EAGLE-3's head the same way: ``fc`` over the target's hidden states entering three of
    its layers, one midlayer over [input_layernorm(embedding), hidden_norm(hidden)], ``norm``,
    the head's LM head over its draft vocabulary and ``d2t``."""

    def __init__(self, arch: str, target_path: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        self.target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
        head_path = ensure_model(arch, "tiny-eagle3")
        config = AutoConfig.from_pretrained(head_path)
        config._attn_implementation = "eager"
        self.aux = config.eagle_aux_hidden_state_layer_ids
        weights = load_file(str(head_path / "model.safetensors"))
        hidden = config.hidden_size

        def linear(name: str) -> torch.nn.Linear:
            weight = weights[name]
            layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight.data.copy_(weight)
            return layer

        def norm(name: str) -> LlamaRMSNorm:
            layer = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            layer.weight.data.copy_(weights[name])
            return layer

        self.fc, self.lm_head, self.d2t = linear("fc.weight"), linear("lm_head.weight"), weights["d2t"]
        self.input_norm, self.hidden_norm = norm("midlayer.input_layernorm.weight"), norm("midlayer.hidden_norm.weight")
        self.post_norm, self.norm = norm("midlayer.post_attention_layernorm.weight"), norm("norm.weight")
        self.attention = LlamaAttention(config, 0).eval()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.attention, name, linear(f"midlayer.self_attn.{name}.weight"))
        self.mlp = LlamaMLP(config).eval()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self.mlp, name, linear(f"midlayer.mlp.{name}.weight"))
        self.rotary = LlamaRotaryEmbedding(config)

    @torch.inference_mode()
    def proposals(self, token_ids: list[int], k: int) -> list[int]:
        embed = self.target.get_input_embeddings()
        ids = torch.tensor([token_ids])
        states = self.target.model(input_ids=ids[:, :-1], output_hidden_states=True).hidden_states
        hidden = self.fc(torch.cat([states[i][0] for i in self.aux], dim=-1))    # positions 0..n-2
        embeddings = embed(ids[0, 1:])                                             # token i + 1
        proposed = []
        for _ in range(k):
            normed, residual = self._midlayer(embeddings, hidden)
            token = int(self.lm_head(normed[-1]).argmax())
            token += int(self.d2t[token])
            proposed.append(token)
            embeddings = torch.cat([embeddings, embed(torch.tensor([token]))])
            hidden = torch.cat([hidden, residual[-1:]])
        return proposed

    def _midlayer(self, embeddings: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = hidden.shape[0]
        positions = torch.arange(num)[None]
        mask = torch.full((num, num), float("-inf")).triu(1)[None, None]
        states = torch.cat([self.input_norm(embeddings), self.hidden_norm(hidden)], dim=-1)[None]
        attended, _ = self.attention(states, position_embeddings=self.rotary(hidden[None], positions),
                                     attention_mask=mask)
        residual = attended[0] + hidden
        residual = self.mlp(self.post_norm(residual)) + residual
        return self.norm(residual), residual


@pytest.fixture(scope="module")
def dense(tiny_model):
    cache: dict[tuple[str, str], DenseEagle] = {}

    def get(arch: str = "llama", method: str = "eagle") -> DenseEagle:
        if (arch, method) not in cache:
            kind = DenseEagle3 if method == "eagle3" else DenseEagle
            cache[arch, method] = kind(arch, tiny_model(arch))
        return cache[arch, method]

    return get


def recording(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Record each proposal with the tokens it follows."""
    proposer = llm.engine.speculator.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose_batch = type(proposer).propose_batch

    def record(seqs, max_num_tokens):
        proposals = propose_batch(proposer, seqs, max_num_tokens)
        seen.extend((list(seq.token_ids), proposal) for seq, proposal in zip(seqs, proposals) if proposal)
        return proposals

    proposer.propose_batch = record
    return seen


def make(tiny_model, arch: str = "llama", **kwargs) -> LLM:
    kwargs.setdefault("speculative_config", eagle_config(arch))
    llm = LLM(tiny_model(arch), device="cpu", dtype="float32", swap_space_gb=0.001,
              num_device_blocks=kwargs.pop("num_device_blocks", 256), **kwargs)
    llm.engine.step_hooks.append(llm.engine.check_integrity)
    return llm


@pytest.mark.parametrize(("method", "arch", "engine"), [
    ("eagle", "llama", {}),
    ("eagle", "qwen3", {"block_size": 4}),
    ("eagle", "llama", {"block_size": 8, "max_num_batched_tokens": 16}),   # chunked prefill, cut verifications
    ("eagle3", "llama", {}),
    ("eagle3", "qwen3", {"block_size": 8, "max_num_batched_tokens": 16}),
])
def test_every_proposal_is_the_dense_heads_and_the_output_is_exact(method, arch, engine, tiny_model, dense,
                                                                   hf_greedy):
    llm = make(tiny_model, arch, speculative_config=eagle_config(arch, method), **engine)
    seen = recording(llm)
    prompts = random_prompts((3, 9, 16, 17, 30), seed=1)
    outputs = outputs_of(llm.generate(prompts, greedy(), use_tqdm=False))
    assert outputs == [hf_greedy(arch, p, MAX_TOKENS) for p in prompts]
    assert len(seen) >= 10
    reference = dense(arch, method)
    for token_ids, proposal in seen:
        assert proposal == reference.proposals(token_ids, len(proposal)), token_ids
    assert_idle(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_heads_kv_survives_preemption(mode, tiny_model, dense, hf_greedy):
    """Swaps carry the head's KV with the target's; recompute rewrites it."""
    llm = make(tiny_model, block_size=8, num_device_blocks=14, preemption_mode=mode)
    seen = recording(llm)
    prompts = random_prompts((10, 35, 22, 40, 13, 30), seed=2)
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == [
        hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    assert llm.stats()["num_preemptions_by_mode"][mode] > 0
    reference = dense("llama")
    assert len(seen) >= 10
    for token_ids, proposal in seen:
        assert proposal == reference.proposals(token_ids, len(proposal)), token_ids
    assert_idle(llm)


def test_seeded_sampling_gives_the_tokens_of_decoding_without_speculation(tiny_model):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=MAX_TOKENS)
    prompts = random_prompts((6, 25), seed=3)
    base = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, num_device_blocks=128)
    llm = make(tiny_model)
    assert outputs_of(llm.generate(prompts, params, use_tqdm=False)) == outputs_of(
        base.generate(prompts, params, use_tqdm=False))
    assert llm.stats()["spec_decode_num_drafts"] > 0
    assert_idle(llm)


def test_the_heads_kv_is_counted_in_the_pool_budget(tiny_model):
    llm = make(tiny_model, num_device_blocks=None, kv_cache_memory_gb=0.01, max_num_seqs=8)
    head = llm.engine.draft
    head_bytes = head.cache.shape.bytes_per_block
    assert head_bytes == llm.engine.runner.kv_cache.shape.bytes_per_block // 2   # one layer of the target's two
    expected = int((0.01 * 2**30 - head.scratch_bytes(16, 8)) // (3 * head_bytes))
    assert llm.engine.pool_config.num_device_blocks == expected
    assert llm.stats()["spec_decode_draft_kv_bytes_per_block"] == head_bytes


def test_bad_heads_are_refused_by_name(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="mtp.*not supported yet"):
        SpeculativeConfig(method="mtp", model="/a/head", num_speculative_tokens=2)
    small_head = str(ensure_model("llama", "small-eagle"))   # width 512; tiny is 64
    with pytest.raises(ValueError, match="width 512"):
        make(tiny_model, speculative_config={"method": "eagle", "model": small_head, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not an EAGLE head"):   # a whole model is not a head
        make(tiny_model, speculative_config={"method": "eagle", "model": tiny_model("llama"),
                                             "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="aux hidden state layers"):   # vLLM's default layers need 4 or more
        make(tiny_model, speculative_config=eagle_config(method="eagle3") | {
            "model": str(ensure_model("llama", "tiny-eagle"))})


@pytest.mark.parametrize(("method", "option", "message"), [
    ("eagle3", "torch_compile", "eagle3.*torch_compile"),   # its hidden states are caught inside the forward
    ("eagle", "async_scheduling", "eagle.*async_scheduling"),   # it reads every step's hidden states
])
def test_options_an_eagle_head_cannot_run_with_are_refused(method, option, message):
    from pagedserve.cluster.config import ClusterConfig

    with pytest.raises(ValueError, match=message):
        ClusterConfig.model_validate({"model": {"path": "/models/x", "name": "x"},
                                      "engine": {option: True, "speculative_config": {
                                          "method": method, "model": "/heads/x", "num_speculative_tokens": 2}}})


def test_an_eagle_head_is_no_model_to_serve():
    """make-model builds EAGLE heads, but a server's built model must be a whole causal LM."""
    from pagedserve.cluster.config import ClusterConfig

    assert ClusterConfig.model_validate({"model": {"size": "tiny-draft"}}).model.size == "tiny-draft"
    for size in ("tiny-eagle", "small-eagle3"):
        with pytest.raises(ValueError, match="model.size"):
            ClusterConfig.model_validate({"model": {"size": size}})
