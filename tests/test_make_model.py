"""Random-weight checkpoints from ``make_model`` load and behave like real ones."""

import hashlib
import os
import subprocess
import sys
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.devtools import model_factory
from pagedserve.devtools.model_factory import ARCHS, FACTORY_VERSION, SPECIAL_TOKENS, ensure_model, make_model

UNICODE_TEXT = "Héllo wörld! 日本語テキスト 🤖👍🏽\t tabs\n\nnew  lines ÀÉÎ Ωμέγα \u200b \x00 end "
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What time is it?"},
]


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """One tiny checkpoint per arch, seed 0, shared by the whole session."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_model(arch, "tiny", root / arch, seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_loads_and_runs(tiny_models, arch):
    path = tiny_models[arch]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer(["The river starts high in the hills."], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip_and_specials(tiny_models, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    text = unicodedata.normalize("NFC", UNICODE_TEXT)  # the qwen2 tokenizer NFC-normalises
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_all_archs_tokenize_alike(tiny_models):
    encodings = {arch: AutoTokenizer.from_pretrained(path)(UNICODE_TEXT).input_ids for arch, path in tiny_models.items()}
    assert encodings["llama"] != []
    for arch in ("qwen3", "mistral"):
        assert encodings[arch] == encodings["llama"]
    # Exact round trip, even for non-NFC text, where no normaliser is forced on us.
    decomposed = "e\u0301 cafe\u0301"
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    assert tokenizer.decode(tokenizer(decomposed).input_ids, skip_special_tokens=True) == decomposed


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_chat_template(tiny_models, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat time is it?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_greedy_generation_is_varied(tiny_models, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    outputs = []
    for prompt in ("Hello, how are you?", "The market opens at seven", "1 2 3 4 5", "Ωμέγα"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)
        new = out[0, ids.shape[1]:].tolist()
        assert len(new) == 20
        assert len(set(new)) >= 8, new
        assert min(new) >= len(SPECIAL_TOKENS), "special tokens have zero logits"
        outputs.append(tuple(new))
    assert len(set(outputs)) == len(outputs)


def test_same_seed_is_byte_identical_and_seed_matters(tiny_models, tmp_path):
    again = make_model("llama", "tiny", tmp_path / "again", seed=0)
    other = make_model("llama", "tiny", tmp_path / "other", seed=1)
    reference = tiny_models["llama"] / "model.safetensors"
    assert _sha256(again / "model.safetensors") == _sha256(reference)
    assert _sha256(again / "tokenizer.json") == _sha256(tiny_models["llama"] / "tokenizer.json")
    a = AutoModelForCausalLM.from_pretrained(again).state_dict()
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])


def test_global_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model("mistral", "tiny", tmp_path / "m", seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_parameter_count(arch):
    num_params = model_factory.count_parameters(arch, "small")
    assert 22_000_000 <= num_params <= 28_000_000, num_params
    config = model_factory.build_config(arch, "small")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (512, 1408, 8)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False


@pytest.mark.parametrize(("draft", "target"), [("tiny-draft", "tiny"), ("small-draft", "small")])
def test_draft_sizes_share_their_targets_tokenizer(draft, target, tiny_models, tmp_path):
    """A draft model (speculative decoding) must speak its target's vocabulary."""
    draft_config, target_config = (model_factory.build_config("llama", size) for size in (draft, target))
    assert draft_config.vocab_size == target_config.vocab_size
    assert draft_config.max_position_embeddings == target_config.max_position_embeddings
    assert model_factory.count_parameters("llama", draft) * 2 < model_factory.count_parameters("llama", target)
    if target == "tiny":
        path = make_model("llama", draft, tmp_path / draft, seed=0)
        assert _sha256(path / "tokenizer.json") == _sha256(tiny_models["llama"] / "tokenizer.json")


def test_an_eagle_head_has_vllms_layout(tmp_path):
    """One Llama layer of the target's width without its input norm, and fc over [embedding,
    hidden state]; no embeddings, LM head or tokenizer of its own."""
    from safetensors.torch import load_file

    path = make_model("qwen3", "tiny-eagle", tmp_path / "head", seed=0)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 128)
    assert {name.split(".")[0] for name in weights} == {"fc", "layers"}
    assert not any("input_layernorm" in name for name in weights)
    assert not (path / "tokenizer.json").exists()


def test_an_eagle3_head_has_vllms_layout(tmp_path):
    """fc over three of the target's hidden states, a midlayer over [embedding, hidden], norm,
    an LM head over a draft vocabulary of target ids (d2t, and t2d its reverse)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = make_model("llama", "tiny-eagle3", tmp_path / "head", seed=0)
    weights = load_file(str(path / "model.safetensors"))
    config = AutoConfig.from_pretrained(path)
    assert weights["fc.weight"].shape == (64, 192) and weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert weights["lm_head.weight"].shape == (config.draft_vocab_size, 64) == (512, 64)
    targets = torch.arange(512) + weights["d2t"]
    assert bool((targets.diff() > 0).all()) and int(targets.max()) < 1024
    assert torch.equal(weights["t2d"].nonzero().flatten(), targets)
    assert config.eagle_aux_hidden_state_layer_ids == [0, 1, 1]


def test_arch_specific_config():
    assert model_factory.build_config("qwen3", "tiny").head_dim == 16
    assert model_factory.build_config("mistral", "tiny").sliding_window is None
    assert model_factory.build_config("qwen2", "tiny").use_sliding_window is False


def test_bad_arguments_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_model("gpt2", "tiny", tmp_path)
    with pytest.raises(ValueError, match="size"):
        make_model("llama", "huge", tmp_path)
    with pytest.raises(ValueError, match="seed"):
        make_model("llama", "tiny", tmp_path, seed=-1)


def test_ensure_model_builds_once_and_is_concurrency_safe(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: ensure_model("qwen2", "tiny", seed=3), range(3)))
    expected = tmp_path / "cache" / "models" / f"qwen2-tiny-seed3-v{FACTORY_VERSION}"
    assert paths == [expected] * 3
    assert sorted(p.name for p in expected.parent.iterdir()) == [f"qwen2-tiny-seed3-v{FACTORY_VERSION}"]  # no temp dirs left
    mtime = os.stat(expected / "model.safetensors").st_mtime_ns
    assert ensure_model("qwen2", "tiny", seed=3) == expected
    assert os.stat(expected / "model.safetensors").st_mtime_ns == mtime
    explicit = ensure_model("qwen2", "tiny", cache_dir=tmp_path / "elsewhere", seed=3)
    assert explicit == tmp_path / "elsewhere" / f"qwen2-tiny-seed3-v{FACTORY_VERSION}"
    assert _sha256(explicit / "model.safetensors") == _sha256(expected / "model.safetensors")


def test_cli_make_model(tmp_path):
    out = tmp_path / "cli_model"
    cmd = [sys.executable, "-m", "pagedserve", "make-model", "--arch", "qwen3", "--size", "tiny", "--out", str(out), "--seed", "5"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3"


def test_cli_rejects_bad_arguments(tmp_path):
    from pagedserve.cluster.cli import main

    with pytest.raises(SystemExit) as info:
        main(["make-model", "--arch", "gpt2", "--out", str(tmp_path)])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["make-model", "--out", str(tmp_path), "--seed", "-3"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def test_chat_template_with_tools_round_trips(tiny_models):
    """Tools are rendered in the system turn; an assistant's tool calls render as the
    <tool_call> blocks the hermes parser reads back; tool results join a user turn."""
    import json

    from pagedserve.tool_parsers import HermesToolParser

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris, and the time?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|bos|><|im_start|>system\nBe brief.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [tool["function"] for tool in TOOLS]
    assert text.count("<|im_start|>system") == 1
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = HermesToolParser().parse(assistant)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    # Without tools the template is unchanged.
    plain = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert plain == ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
                     "<|im_start|>user\nWeather in Paris, and the time?<|im_end|>\n<|im_start|>assistant\n")
    # Tools without a system message get a system turn of their own.
    bare = tokenizer.apply_chat_template(messages[1:2], tools=TOOLS, tokenize=False)
    assert bare.startswith("<|bos|><|im_start|>system\n# Tools") and bare.count("<|im_start|>user\n") == 1
