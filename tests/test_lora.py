"""LoRA adapters: exact against transformers + PEFT, batched in one step, keyed in the
prefix cache, kept in slots and host memory by recency, and refused with a reason when
they cannot be served.

The adapters are PEFT's own checkpoints of the tiny models, with random non-zero A and B
(PEFT initialises B to zeros, which would hide every mistake). Greedy outputs must be
token-identical to transformers + PEFT with the request's adapter loaded (float32, CPU),
in batches that mix four adapters of different ranks (one rsLoRA) and the base model
(llama, qwen3, mistral; a mixture of experts with attention adapters),
with chunked prefill, prefix caching and preemption. Every engine ends idle, holding zero
blocks, with its integrity check passing.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.kvmanager import prefix_extra_key
from pagedserve.workers.lora.peft_adapter import LoRAAdapterError
from pagedserve.workers.lora.punica import build_segments, lora_expand, lora_shrink
from greedy_reference import GreedyReference
from offline_checks import assert_idle
from peft_adapters import adapter_sets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE = 1024
MAX_TOKENS = 24
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target_modules, use_rslora): attention, MLP and both, ranks 2 to 16.
ADAPTERS = {
    "attn": (8, 16, ["q_proj", "v_proj"], False),
    "mlp": (4, 8, MLP, False),
    "all": (16, 32, ATTENTION + MLP, True),
    "out": (2, 4, ["o_proj", "down_proj"], False),
}
# A mixture of experts' experts are not linear layers (PEFT's LoRA stops there): attention only.
MOE_ADAPTERS = {
    "attn": (8, 16, ["q_proj", "v_proj"], False),
    "kv": (4, 8, ["k_proj", "v_proj"], False),
    "all": (16, 32, ATTENTION, True),
    "out": (2, 4, ["o_proj"], False),
}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """``adapters(arch) -> {name: LoRARequest}`` of ``ADAPTERS``, built once per arch."""
    return adapter_sets(tiny_model, lambda arch: tmp_path_factory.mktemp(f"lora-{arch}"),
                        lambda arch: MOE_ADAPTERS if arch.endswith("_moe") else ADAPTERS, first_seed=1)


@pytest.fixture(scope="module")
def peft_greedy(tiny_model):
    """``peft_greedy(arch, lora_request, prompt, max_tokens) -> list[int]``: transformers + PEFT
    ``generate(do_sample=False)`` with the adapter loaded (None: the base model), float32, one
    prompt, no padding (``greedy_reference``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(model_key: tuple):
        arch, lora_path = model_key
        model = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32)
        return PeftModel.from_pretrained(model, lora_path) if lora_path else model

    reference = GreedyReference(load)
    return lambda arch, lora, prompt, max_tokens: reference((arch, lora.lora_path if lora else None), prompt,
                                                            max_tokens)


def random_prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def make_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("swap_space_gb", 0.001)
    kwargs.setdefault("enable_lora", True)
    return LLM(path, **kwargs)


def mixed_workload(loras: dict[str, LoRARequest], seed: int) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Prompts of every adapter and of the base model, interleaved; some share a 40-token
    prefix across adapters (the prefix cache must keep them apart) and within one."""
    prefix = random_prompts([40], seed)[0]
    shared = [prefix + tail for tail in random_prompts((3, 11, 7, 19, 5), seed + 1)]
    own = random_prompts((9, 33, 2, 17, 26, 4, 12, 21, 6, 14), seed + 2)
    prompts = shared + own
    which = [None, *loras.values()]
    return prompts, [which[i % len(which)] for i in range(len(prompts))]


def check_exact(llm: LLM, arch: str, prompts, loras, peft_greedy) -> list:
    outputs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    for i, (prompt, lora, output) in enumerate(zip(prompts, loras, outputs)):
        expected = peft_greedy(arch, lora, prompt, MAX_TOKENS)
        assert output.outputs[0].token_ids == expected, (
            f"{arch}: prompt {i} ({len(prompt)} tokens) with {lora.lora_name if lora else 'the base model'} diverged")
    return outputs


@pytest.mark.parametrize("arch,merged", [("llama", False), ("llama", True), ("qwen3", False), ("mistral", False),
                                         ("qwen3_moe", False)],
                         ids=["llama", "llama-merged", "qwen3", "mistral", "qwen3_moe"])
def test_mixed_adapters_match_transformers_and_peft(arch, merged, tiny_model, adapters, peft_greedy):
    """Four adapters and the base model in the same steps, with chunked prefill, prefix hits
    and a pool small enough to preempt; a second round hits the first one's cached blocks."""
    loras = adapters(arch)
    llm = make_llm(tiny_model(arch), max_loras=4, num_device_blocks=14, block_size=8, max_num_batched_tokens=48,
                   preemption_mode="recompute", merge_projections=merged)
    assert bool(llm.engine.runner.merged_projections) == merged
    prompts, which = mixed_workload(loras, seed=3)
    for _ in range(2):
        outputs = check_exact(llm, arch, prompts, which, peft_greedy)
        assert_idle(llm)
    stats = llm.stats()
    assert stats["num_preemptions_by_mode"]["recompute"] > 0, stats
    assert max(o.metrics.num_cached_tokens for o in outputs) >= 40 - 8
    assert stats["lora"]["num_slot_loads"] == 4 and stats["lora"]["num_slot_evictions"] == 0, stats["lora"]
    # The adapters change what is generated: each differs from the base model on the same prompt.
    prompt = prompts[0]
    base = peft_greedy(arch, None, prompt, MAX_TOKENS)
    assert all(peft_greedy(arch, lora, prompt, MAX_TOKENS) != base for lora in loras.values())


def test_one_step_mixes_every_adapter(tiny_model, adapters, peft_greedy):
    """A decode step holds every adapter and the base model at once (no step per adapter)."""
    loras = adapters("llama")
    llm = make_llm(tiny_model("llama"), max_loras=4)
    seen = []
    run_step = llm.engine.lora.run_step

    def recording(step_loras, num_tokens):
        seen.append({lora.lora_name if lora else None for lora in step_loras})
        return run_step(step_loras, num_tokens)

    llm.engine.lora.run_step = recording
    prompts = random_prompts((5, 9, 13, 3, 8, 11, 6, 2, 10, 7), seed=5)
    which = [[None, *loras.values()][i % 5] for i in range(len(prompts))]
    check_exact(llm, "llama", prompts, which, peft_greedy)
    assert {None, *loras} in seen
    assert_idle(llm)


def test_prefix_cache_blocks_are_keyed_by_adapter(tiny_model, adapters, peft_greedy):
    """One adapter's cached prompt serves the same adapter again, never another adapter nor
    the base model (and the base model's never an adapter)."""
    loras = adapters("llama")
    llm = make_llm(tiny_model("llama"), max_loras=2, block_size=8)
    prompt = random_prompts([50], seed=9)[0]

    def cached(lora):
        [output] = check_exact(llm, "llama", [prompt], [lora], peft_greedy)
        return output.metrics.num_cached_tokens

    assert cached(loras["attn"]) == 0
    assert cached(loras["attn"]) == 48
    assert cached(loras["mlp"]) == 0
    assert cached(None) == 0
    assert cached(None) == 48
    assert cached(loras["all"]) == 0
    assert cached(loras["mlp"]) == 48
    assert_idle(llm)


def test_prefix_keys_of_salts_and_adapters_never_collide():
    keys = [prefix_extra_key(salt, name) for salt in (None, "s", "\x00lora\x00a", "\x00salt\x00s", "\x00")
            for name in (None, "a", "s")]
    assert len(set(keys)) == len(keys)
    assert prefix_extra_key(None) is None and prefix_extra_key("tenant") == "tenant"  # salts keep their keys


def test_adapters_past_max_loras_wait_and_take_the_least_recently_used_slot(tiny_model, adapters, peft_greedy):
    """Three adapters on one slot: requests of a second adapter wait until the first one's are
    done (no step ever holds two), every output stays exact; with max_cpu_loras 1 the host
    keeps one adapter, reading the others again when they come back."""
    loras = adapters("llama")
    llm = make_llm(tiny_model("llama"), max_loras=1, max_cpu_loras=1)
    steps = []
    run_step = llm.engine.lora.run_step

    def recording(step_loras, num_tokens):
        steps.append({lora.lora_name for lora in step_loras if lora})
        return run_step(step_loras, num_tokens)

    llm.engine.lora.run_step = recording
    prompts = random_prompts((7, 12, 5, 9, 15, 4), seed=11)
    order = [loras["attn"], loras["mlp"], None, loras["out"], loras["attn"], loras["mlp"]]
    check_exact(llm, "llama", prompts, order, peft_greedy)
    assert max(len(names) for names in steps) == 1
    stats = llm.stats()["lora"]
    assert stats["num_slot_evictions"] >= 2 and stats["num_host_evictions"] >= 2, stats
    check_exact(llm, "llama", prompts[:1], [loras["attn"]], peft_greedy)
    assert llm.stats()["lora"]["num_adapter_reads"] > 3
    assert_idle(llm)


def test_a_beam_search_uses_its_adapter(tiny_model, adapters):
    """Forked samples and beams of a request run with its adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pagedserve import BeamSearchParams

    lora = adapters("llama")["all"]
    llm = make_llm(tiny_model("llama"))
    prompt = random_prompts([9], seed=13)[0]
    [result] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8), lora_request=lora)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32),
                                      lora.lora_path).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                                  do_sample=False, max_new_tokens=8, early_stopping=False)
    assert result.sequences[0].tokens == expected[0].tolist()
    assert_idle(llm)


# ---- refusals --------------------------------------------------------------------------------
def write_adapter(directory, config: dict | str | None = None, tensors: dict | None = None) -> str:
    """A PEFT-layout directory written by hand: ``config`` (a dict, or raw text) and ``tensors``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (directory / "adapter_config.json").write_text(text)
    if tensors is not None:
        save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


def q_proj_weights(rank: int = 4, in_features: int = 64, out_features: int = 64, layer: int = 0) -> dict:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.randn(rank, in_features),
            f"{prefix}.lora_B.weight": torch.randn(out_features, rank)}


def lora_config(**fields) -> dict:
    return {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **fields}


REFUSED = {
    "dora": (lora_config(use_dora=True), q_proj_weights(), "DoRA"),
    "rank": (lora_config(r=32), q_proj_weights(rank=32), "r=32 exceeds max_lora_rank=16"),
    "missing-target": (lora_config(target_modules=["q_proj", "c_attn"]), q_proj_weights(),
                       r"target modules \['c_attn'\] are not in this model"),
    "absent-module": (lora_config(), q_proj_weights(layer=7), r"model.layers.7.self_attn.q_proj, which is not in"),
    "not-a-linear": (lora_config(target_modules=["embed_tokens"]),
                     {"base_model.model.model.embed_tokens.lora_A.weight": torch.randn(4, 1024),
                      "base_model.model.model.embed_tokens.lora_B.weight": torch.randn(64, 4)},
                     "not a linear layer of the decoder"),
    "base-mismatch": (lora_config(base_model_name_or_path="other/model"), q_proj_weights(in_features=128),
                      r"base model mismatch: model.layers.0.self_attn.q_proj maps 64 -> 64 features, "
                      r"the adapter's 128 -> 64 \(the adapter's base model: other/model\)"),
    "rank-disagrees": (lora_config(r=8), q_proj_weights(rank=4), "not of rank r=8"),
    "half-pair": (lora_config(), {k: v for k, v in q_proj_weights().items() if "lora_A" in k}, "not lora_B"),
    "bias": (lora_config(bias="all"), q_proj_weights(), "trains biases"),
    "other-peft": (lora_config(peft_type="IA3"), q_proj_weights(), "peft_type is 'IA3'"),
    "malformed-json": ("{not json", q_proj_weights(), "malformed adapter_config.json"),
    "no-alpha": ({"r": 4, "target_modules": ["q_proj"]}, q_proj_weights(), "lora_alpha must be a number"),
    "no-config": (None, q_proj_weights(), "no adapter_config.json"),
    "no-weights": (lora_config(), None, "no adapter_model.safetensors"),
    "nan": (lora_config(), {k: v * float("nan") for k, v in q_proj_weights().items()}, "NaN"),
    "odd-key": (lora_config(), {**q_proj_weights(), "base_model.model.model.norm.weight": torch.ones(64)},
                "not a LoRA A or B weight"),
}


@pytest.fixture(scope="module")
def lora_llm(tiny_model):
    return make_llm(tiny_model("llama"), max_loras=2)


@pytest.mark.parametrize("case", list(REFUSED))
def test_adapters_that_cannot_be_served_are_refused_naming_why(case, lora_llm, tmp_path):
    """Refused when the request is added, with a ValueError naming the reason; nothing of
    the batch runs, and the engine serves on."""
    config, tensors, message = REFUSED[case]
    bad = LoRARequest(f"bad-{case}", 100, write_adapter(tmp_path / case, config, tensors))
    prompts = random_prompts((5, 6), seed=1)
    with pytest.raises(LoRAAdapterError, match=message):
        lora_llm.generate(prompts, greedy(4), use_tqdm=False, lora_request=[None, bad])
    assert_idle(lora_llm)
    assert lora_llm.stats()["num_steps"] == 0


def test_unknown_adapter_and_identity_conflicts_are_refused(lora_llm, adapters, tmp_path):
    loras = adapters("llama")
    prompt = random_prompts([5], seed=2)
    with pytest.raises(LoRAAdapterError, match="no adapter directory"):
        lora_llm.generate(prompt, greedy(4), use_tqdm=False, lora_request=LoRARequest("x", 50, str(tmp_path / "none")))
    attn = loras["attn"]
    with pytest.raises(LoRAAdapterError, match="lora_int_id 1 is adapter 'attn'"):
        lora_llm.generate(prompt * 2, greedy(4), use_tqdm=False,
                          lora_request=[attn, LoRARequest("renamed", 1, attn.lora_path)])
    with pytest.raises(LoRAAdapterError, match="lora_name 'attn' is lora_int_id 1"):
        lora_llm.generate(prompt * 2, greedy(4), use_tqdm=False,
                          lora_request=[attn, LoRARequest("attn", 9, attn.lora_path)])
    with pytest.raises(ValueError, match="2 prompts but 1 lora requests"):
        lora_llm.generate(prompt * 2, greedy(4), use_tqdm=False, lora_request=[attn])
    assert_idle(lora_llm)


def test_a_lora_request_needs_enable_lora(tiny_model, adapters):
    llm = make_llm(tiny_model("llama"), enable_lora=False)
    with pytest.raises(ValueError, match="'attn' needs an engine with enable_lora=True"):
        llm.generate(random_prompts([4], seed=0), greedy(4), use_tqdm=False, lora_request=adapters("llama")["attn"])
    assert_idle(llm)


@pytest.mark.parametrize("fields,message", [
    (("", 1, "p"), "lora_name"), (("a\x00b", 1, "p"), "lora_name"), (("a", 0, "p"), "lora_int_id"),
    (("a", True, "p"), "lora_int_id"), (("a", 1, ""), "lora_path"),
])
def test_lora_request_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*fields)


# ---- the batched products ------------------------------------------------------------------
@pytest.mark.parametrize("slots", [
    [0, 1, 2, 3] * 4,                     # a decode batch spread over the slots: weights read in place
    [2, -1, 2, 0, -1, 2, 2, 2, 2, 0, 5],  # uneven, with gaps and base tokens: weights gathered per group
    [-1, -1, 3],
    [1] * 7,
])
def test_shrink_and_expand_equal_each_tokens_own_product(slots):
    generator = torch.Generator().manual_seed(len(slots))
    num_slots, rank, in_features, out_features = 6, 4, 12, 10
    lora_a = torch.randn(num_slots, rank, in_features, generator=generator, dtype=torch.float64)
    lora_b = torch.randn(num_slots, rank, out_features, generator=generator, dtype=torch.float64)
    x = torch.randn(len(slots), in_features, generator=generator, dtype=torch.float64)
    y = torch.randn(len(slots), out_features, generator=generator, dtype=torch.float64)
    expected = y.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += x[t] @ lora_a[slot].T @ lora_b[slot]
    segments = build_segments(torch.tensor(slots), torch.device("cpu"))
    lora_expand(y, lora_shrink(x, lora_a, segments), lora_b, segments)
    torch.testing.assert_close(y, expected)
    assert segments.slot_bits == sum(1 << s for s in set(slots) if s >= 0)
    assert segments.num_groups * segments.group_size <= 2 * sum(s >= 0 for s in slots) + num_slots
    assert build_segments(torch.tensor([-1, -1]), torch.device("cpu")) is None


def test_adapters_added_and_removed_by_hand_and_a_name_reused_for_other_weights(tiny_model, adapters, peft_greedy):
    """vLLM's ``add_lora`` / ``remove_lora`` / ``list_loras``: an adapter is checked and read before
    any request names it; a removed one is forgotten, its slot freed, and its name may come back
    with another id and other weights, whose outputs are that adapter's and which never meets the
    first one's cached blocks. An adapter in use is not removed."""
    loras = adapters("llama")
    llm = make_llm(tiny_model("llama"), max_loras=2, block_size=8)
    engine = llm.engine
    prompt = random_prompts([50], seed=11)[0]
    first = LoRARequest("tenant", 101, loras["attn"].lora_path)
    assert engine.add_lora(first) and engine.list_loras() == {101}
    assert engine.stats()["lora"]["num_adapter_reads"] == 1
    with pytest.raises(LoRAAdapterError, match="no adapter directory"):
        engine.add_lora(LoRARequest("missing", 102, first.lora_path + "-none"))
    assert engine.list_loras() == {101}

    def run(lora):
        [output] = check_exact(llm, "llama", [prompt], [lora], peft_greedy)
        return output.metrics.num_cached_tokens

    assert run(first) == 0 and run(first) == 48
    assert engine.stats()["lora"]["num_adapter_reads"] == 1     # read once, by add_lora
    with pytest.raises(LoRAAdapterError, match="lora_name 'tenant' is lora_int_id 101"):
        engine.add_lora(LoRARequest("tenant", 103, loras["mlp"].lora_path))
    assert engine.remove_lora(101) and engine.list_loras() == set()
    assert not engine.remove_lora(101)
    assert engine.stats()["lora"]["slot_adapters"] == [None, None]
    second = LoRARequest("tenant", 103, loras["mlp"].lora_path)   # the same name, other weights
    assert run(second) == 0                                      # the first one's blocks are not its own
    assert run(second) == 48

    # In use: not removed, and served to the end.
    engine.add_request("busy", prompt, SamplingParams(temperature=0.0, max_tokens=4), lora_request=second)
    assert not engine.remove_lora(103) and engine.list_loras() == {103}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(103)
    assert_idle(llm)


# One fresh process (a node that never read the adapters) asks for each path in turn; a line each.
_HUB_ADAPTER = """
import json, sys
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.workers.lora.peft_adapter import LoRAAdapterError
model, paths, prompt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model, device="cpu", dtype="float32", swap_space_gb=0.001, enable_lora=True, max_lora_rank=16)
params = SamplingParams(temperature=0.0, max_tokens=8)
for number, path in enumerate(paths, 1):
    try:
        lora = LoRARequest(f"hub{number}", number, path)
        [output] = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        print(json.dumps({"tokens": list(output.outputs[0].token_ids)}), flush=True)
    except LoRAAdapterError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
"""


def _fetch_in_a_fresh_process(model: str, paths: list[str], prompt: list[int], env: dict) -> list[dict]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _HUB_ADAPTER, model, json.dumps(paths), json.dumps(prompt)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(paths):]]


def test_a_hub_id_as_lora_path_is_fetched_by_the_reading_node(tiny_model, adapters, tmp_path):
    """vLLM's ``lora_path`` may be a hub id: the engine fetches the adapter's two files into its
    node's hub cache (here from ``tests/hub_mirror.py``, huggingface_hub's real download code in a
    fresh process) and serves what the same adapter serves from its directory; an id the hub does
    not have is refused naming the node and the reason."""
    from hub_mirror import HubMirror, MirroredRepo

    lora = adapters("llama")["attn"]
    prompt = random_prompts([9], seed=13)[0]
    [local] = make_llm(tiny_model("llama"), max_lora_rank=16).generate([prompt], greedy(8), use_tqdm=False,
                                                                      lora_request=lora)
    repo = "pagedserve-test/tiny-llama-attn-lora"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    with HubMirror({repo: MirroredRepo(Path(lora.lora_path))}) as mirror:
        env.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"))
        fetched, missing = _fetch_in_a_fresh_process(tiny_model("llama"), [repo, "pagedserve-test/no-such-adapter"],
                                                     prompt, env)
    assert fetched == {"tokens": list(local.outputs[0].token_ids)}
    assert "cannot be fetched on node" in missing["error"] and "RepositoryNotFound" in missing["error"]


def test_a_uri_or_a_hub_repos_folder_as_lora_path_serves_what_the_directory_does(tiny_model, adapters, tmp_path,
                                                                                  monkeypatch):
    """``file://`` (any fsspec URI) and ``hf://org/repo/folder`` (a dynamic adapter of a hub repo):
    the engine reads the same adapter, copied or fetched, and serves the same tokens."""
    import shutil

    from hub_mirror import HubMirror, MirroredRepo

    lora = adapters("llama")["attn"]
    prompt = random_prompts([9], seed=14)[0]
    llm = make_llm(tiny_model("llama"), max_lora_rank=16)
    [local] = llm.generate([prompt], greedy(8), use_tqdm=False, lora_request=lora)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    [by_uri] = llm.generate([prompt], greedy(8), use_tqdm=False,
                            lora_request=LoRARequest("uri", 7, Path(lora.lora_path).as_uri()))
    assert by_uri.outputs[0].token_ids == local.outputs[0].token_ids
    assert_idle(llm)
    shutil.copytree(lora.lora_path, tmp_path / "repo" / "attn")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    with HubMirror({"pagedserve-test/adapters": MirroredRepo(tmp_path / "repo")}) as mirror:
        env.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"))
        fetched, missing = _fetch_in_a_fresh_process(
            tiny_model("llama"), ["hf://pagedserve-test/adapters/attn", "hf://pagedserve-test/adapters/none"], prompt,
            env)
    assert fetched == {"tokens": list(local.outputs[0].token_ids)}
    assert "has no adapter in folder 'none'" in missing["error"]


def test_adapters_speculate_exactly(tiny_model, adapters, peft_greedy):
    """With ``speculative_config``: each verifying sequence's k + 1 positions run with its
    adapter (one chunk of the step's segments), so every adapter's and the base model's greedy
    tokens are transformers + PEFT's, with proposals that are partly wrong."""
    from pagedserve.bench.scripted_proposer import ScriptedProposer

    loras = adapters("llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_llm(tiny_model("llama"), max_loras=4, max_lora_rank=16, speculative_config=ngram)
    prompts, which = mixed_workload(loras, seed=19)
    reference = {tuple(p): peft_greedy("llama", lora, p, MAX_TOKENS) for p, lora in zip(prompts, which)}
    llm.engine.speculator.proposer = ScriptedProposer(reference, 4, None, llm.engine.runner.vocab_size, seed=5)
    check_exact(llm, "llama", prompts, which, peft_greedy)
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert_idle(llm)


@pytest.mark.parametrize("paging", ["slots", "unified"])
def test_padded_decode_steps_run_the_adapters_on_static_segments(paging, tiny_model, adapters, peft_greedy):
    """What CUDA graphs capture with LoRA, run on the CPU through the Triton kernels
    (interpreted): decode steps padded on static buffers, the adapters' products on segments
    of fixed shapes (every layer's slots allocated first, or with unified paging its page
    tables; tiles past a step's own covering nothing), every adapter's and the base model's
    tokens those of transformers + PEFT."""
    pytest.importorskip("triton")
    loras = adapters("llama")
    llm = make_llm(tiny_model("llama"), max_loras=4, max_lora_rank=16, kernel_backend="triton", block_size=8,
                   num_device_blocks=96, max_model_len=128, lora_paging=paging)
    engine = llm.engine
    layers = engine.lora.layers
    layers.enable_static_segments(8)
    assert layers.num_allocated == len(layers) and layers.context.static is not None
    assert engine.runner.enable_decode_graphs([2, 4, 8], -(-engine.max_model_len // 8), capture=False,
                                              lora=layers.context)
    prompts = random_prompts((3, 9, 5, 2, 7), seed=23)
    which = [None, *loras.values()][:len(prompts)]
    max_tokens = [2, 4, 3, 3, 2]   # decode steps of 5, 3 and 1 sequences, padded to 8, 4 and 2
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False, lora_request=which)
    for prompt, lora, n, output in zip(prompts, which, max_tokens, outputs):
        assert output.outputs[0].token_ids == peft_greedy("llama", lora, prompt, n), lora
    stats = llm.stats()
    assert stats["num_padded_decode_steps"] > 0 and stats["num_padded_rows"] > 0, stats
    assert layers.context.static.num_fills == stats["num_padded_decode_steps"]
    assert stats["lora"]["lora_paging"] == paging
    assert_idle(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("paging", ["slots", "unified"])
def test_lora_decode_steps_replay_cuda_graphs_on_cuda(paging, tiny_model, adapters):
    """On CUDA an engine with LoRA captures its decode steps (the default): in float32, every
    adapter's and the base model's tokens are those of the same engine run eagerly, and the
    graphs replayed; with the adapters in slots or in pages of the KV pool."""
    loras = adapters("llama")
    prompts, which = mixed_workload(loras, seed=29)

    def run(**options):
        llm = LLM(tiny_model("llama"), device="cuda", dtype="float32", enable_lora=True, max_loras=4,
                  max_lora_rank=16, num_device_blocks=256, swap_space_gb=0.001, cuda_graph_sizes=[1, 2, 4, 8, 16],
                  max_model_len=128, lora_paging=paging, **options)
        outputs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=which)
        assert_idle(llm)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.stats()

    graphed, stats = run()
    eager, _ = run(enforce_eager=True)
    assert graphed == eager
    assert stats["num_cuda_graphs"] == 5 and stats["num_graph_replays"] > 0, stats


def test_a_profiled_kv_budget_leaves_room_for_every_slot(tiny_model, adapters, peft_greedy):
    """Slots are allocated as adapters first target each layer, after the pools are sized: a
    KV budget from the GPU's profile (``_size_pools``) keeps ``max_slot_bytes`` out, which is
    what the slots come to once an adapter of every layer is in."""
    loras = adapters("llama")
    llm = make_llm(tiny_model("llama"), max_loras=2, max_lora_rank=16)
    layers = llm.engine.lora.layers
    assert layers.num_allocated == 0
    check_exact(llm, "llama", random_prompts([7], seed=17), [loras["all"]], peft_greedy)   # every linear
    assert layers.num_allocated == len(layers)
    allocated = sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in layers.by_name.values())
    assert allocated == layers.max_slot_bytes == llm.engine._lora_slot_bytes() > 0
    assert_idle(llm)


# ---- unified paging: adapters in pages of the KV pool ------------------------------------------
def paged_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("max_model_len", 128)
    return make_llm(path, lora_paging="unified", **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen3_moe"])
def test_adapters_in_kv_pages_match_transformers_and_peft(arch, tiny_model, adapters, peft_greedy):
    """Four adapters and the base model with their weights in pages of the KV pool, which
    cannot hold every adapter and every sequence at once: adapters leave their pages for the
    sequences' KV and come back through the swap path, sequences wait for their adapter's
    pages, and every output is transformers + PEFT's."""
    loras = adapters(arch)
    llm = paged_llm(tiny_model(arch), max_loras=2, num_device_blocks=60, max_num_batched_tokens=48,
                    preemption_mode="recompute")
    prompts, which = mixed_workload(loras, seed=5)
    for _ in range(2):
        check_exact(llm, arch, prompts, which, peft_greedy)
        assert_idle(llm)
    stats = llm.stats()["lora"]
    assert stats["lora_paging"] == "unified"
    assert stats["num_page_evictions"] > 0 and stats["num_page_swap_ins"] > len(loras), stats
    pages = llm.engine.lora.pages
    pool = llm.engine.kv_manager.stats("local")
    assert pool["device_blocks_adapter_pages"] == pages.num_pages + 1   # and the page of zeros
    assert pool["device_blocks_used"] == pool["device_blocks_adapter_pages"]


def test_idle_adapters_give_their_pages_to_a_sequence_that_needs_them(tiny_model, adapters, hf_greedy):
    """Memory moves from adapters to sequences on demand: with every adapter in pages and
    idle, a base-model prompt needing most of the pool is admitted once the least recently
    used adapters have given their pages back."""
    loras = adapters("llama")
    llm = paged_llm(tiny_model("llama"), max_loras=4, num_device_blocks=60)
    order = list(loras.values())
    llm.generate([[7, 8, 9]] * len(order), greedy(2), use_tqdm=False, lora_request=order)
    pages = llm.engine.lora.pages
    assert set(pages.resident) == {lora.lora_int_id for lora in order}
    free = llm.engine.kv_manager.block_manager("local").num_lendable_pages
    prompt = random_prompts([100], seed=9)[0]   # 13 blocks of 8 with its tokens
    assert free < 13 < free + pages.num_pages
    output = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_greedy("llama", prompt, 4)
    assert 0 < pages.num_evictions < len(order)
    evicted = [lora.lora_int_id for lora in order if lora.lora_int_id not in pages.resident]
    assert evicted == [lora.lora_int_id for lora in order[:len(evicted)]]   # least recently used first
    assert_idle(llm)


def test_an_adapter_takes_pages_by_its_rank_and_one_that_cannot_fit_is_refused(tiny_model, adapters):
    """A rank-4 cut of an adapter takes half the pages of the rank-8 whole (S-LoRA: memory by
    rank, not by max_lora_rank). An adapter whose pages and a sequence of max_model_len could
    never share the pool is refused up front, naming the pages it needs."""
    import dataclasses

    loras = adapters("llama")
    llm = paged_llm(tiny_model("llama"), max_loras=2, num_device_blocks=64, max_model_len=256)
    manager = llm.engine.lora
    whole = manager.layers.read(loras["attn"])
    half = dataclasses.replace(whole, rank=4, weights={name: (a[:4], b[:4]) for name, (a, b) in whole.weights.items()})
    pack = manager.pages.pack
    assert pack(whole, manager.layers.layer_of).num_pages == 2 * pack(half, manager.layers.layer_of).num_pages
    llm.engine.add_lora(loras["attn"])
    with pytest.raises(LoRAAdapterError, match=r"'all' \(rank 16\) needs \d+ pages of the KV pool.*lends at most"):
        llm.engine.add_lora(loras["all"])
    assert [lora.lora_name for lora in manager.list()] == ["attn"]


def test_adapter_pages_hold_each_row_where_its_tables_say_and_evict_the_least_recently_used():
    """``AdapterPages`` on a real pool and KV cache: an adapter swapped in reads back, through a
    linear's page tables, exactly its weights (zeros past its rank); eviction takes the least
    recently used adapter not protected, gives its pages back and says so; an adapter the pool
    cannot lend pages for even then changes nothing but those evictions."""
    from pagedserve.kvmanager import BlockManager
    from pagedserve.workers.lora.adapter_pages import AdapterPages
    from pagedserve.workers.lora.peft_adapter import LoRAAdapter
    from pagedserve.workers.model.kv_cache import CacheShape, KVCache

    shape = CacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # chunks of 64
    pool = BlockManager(10, block_size=4, watermark=0.0)
    pages = AdapterPages(pool, KVCache(shape, 10, 0, torch.device("cpu")), min_features=24, sequence_blocks=2)
    assert pages.geometry.piece == 16 and pool.num_pages == 1
    layer_of = {"layers.0.q": 0, "layers.1.q": 1, "layers.1.down": 1}
    features = {"layers.0.q": (24, 40), "layers.1.q": (24, 40), "layers.1.down": (40, 24)}
    generator = torch.Generator().manual_seed(3)

    def adapter(name: str, rank: int, targets) -> LoRAAdapter:
        weights = {t: (torch.randn(rank, features[t][0], generator=generator),
                       torch.randn(rank, features[t][1], generator=generator)) for t in targets}
        return LoRAAdapter(LoRARequest(name, 1, "/nowhere"), rank, 1.0, weights)

    first = adapter("first", 3, ["layers.0.q", "layers.1.down"])
    images = {1: pages.pack(first, layer_of), 2: pages.pack(adapter("second", 4, list(layer_of)), layer_of),
              3: pages.pack(adapter("third", 2, ["layers.1.q"]), layer_of)}
    evicted = []
    pages.on_evict = evicted.append
    resident = pages.swap_in(1, images[1], protected=set())
    for name in layer_of:
        lora_a, lora_b = pages.weights(layer_of[name], num_slots=2, max_rank=5, in_features=features[name][0],
                                       out_features=features[name][1])
        slot_tables = resident.pieces.get(name)
        if slot_tables is not None:
            rank = slot_tables[0].shape[0]
            lora_a.table[1, :rank], lora_b.table[1, :rank] = slot_tables
        a, b = lora_a.gather(None, 2), lora_b.gather(None, 2)
        assert not a[0].any() and not b[0].any()            # slot 0: on the zero page
        if name in first.weights:                           # slot 1: the adapter, zeros past its rank
            expected_a, expected_b = first.weights[name]
            assert torch.equal(a[1, :3], expected_a) and torch.equal(b[1, :3], expected_b)
            assert not a[1, 3:].any() and not b[1, 3:].any()
        else:
            assert not a[1].any() and not b[1].any()
    pages.swap_in(2, images[2], protected=set())
    assert pages.touch(1) and list(pages.resident) == [2, 1]
    assert pool.num_pages == 1 + pages.num_pages == 1 + images[1].num_pages + images[2].num_pages
    free_before = pool.num_lendable_pages
    assert images[3].num_pages > free_before             # the third needs an eviction: the second is LRU
    pages.swap_in(3, images[3], protected=set())
    assert evicted == [2] and list(pages.resident) == [1, 3]
    pool.reserve_pages("other", pool.num_lendable_pages)  # the pool's KV takes every free block
    assert pages.swap_in(2, images[2], protected={1, 3}) is None and list(pages.resident) == [1, 3]
    assert pages.relieve(images[1].num_pages, protected={3}) == [1] and evicted == [2, 1]
    pool.release_pages("other")
    pages.evict(3)
    assert pool.num_pages == 1 and pages.num_pages == 0
    pool.check_integrity()
