"""Offline random-weight checkpoints in the standard transformers format.

``make_model`` writes ``config.json``, ``generation_config.json``,
``model.safetensors`` and a byte-level BPE tokenizer (``tokenizer.json``,
``tokenizer_config.json``, chat template) into a directory, so that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load it with no network access.  The weights are random, but scaled so that
greedy decoding wanders over many tokens instead of repeating one.

``ensure_model`` builds such a checkpoint once into a cache directory and
returns its path; concurrent callers (threads or processes) are safe.

Shapes (the same for every architecture):

===========  ======  ============  ======  =====  ========  =====  =======  ==========
size         hidden  intermediate  layers  heads  kv heads  vocab  max pos  parameters
===========  ======  ============  ======  =====  ========  =====  =======  ==========
tiny         64      176           2       4      2         1024   512      ~0.2M
tiny-tp      128     352           2       8      4         1024   512      ~0.6M
small        512     1408          8       8      2         2048   2048     ~24.7M
1b           2048    5632          16      16     4         32000  4096     ~852M
tiny-draft   32      88            1       2      1         1024   512      ~0.08M
small-draft  128     352           2       4      2         2048   2048     ~0.9M
===========  ======  ============  ======  =====  ========  =====  =======  ==========

``tiny-draft`` and ``small-draft`` are draft models for speculative decoding
(``speculative_config`` method "draft_model"): the tokenizer and vocabulary of
``tiny`` and ``small``, with fewer and narrower layers.

``tiny-eagle``, ``tiny-tp-eagle`` and ``small-eagle`` are EAGLE heads (method
"eagle") for ``tiny``, ``tiny-tp`` and ``small`` targets of any architecture, in the layout vLLM loads: one Llama
decoder layer of the target's width without its input norm, and ``fc``, which
maps a token's embedding and the target's hidden state at the position before
it to the layer's input; the target's embeddings and LM head are shared. There
is no tokenizer (the target's is used).

``tiny-eagle3`` and ``small-eagle3`` are EAGLE-3 heads (method "eagle3") in the
layout vLLM loads: ``fc`` over the target's hidden states entering three of its
layers, one ``midlayer`` attending over [embedding, hidden] (2 x the width),
``norm``, and an LM head over a draft vocabulary of half the target's, mapped to
target ids by ``d2t``.

``tiny-tp`` is ``tiny`` with head counts that divide by 2 and 4 (tensor-parallel
tests). ``qwen3_moe`` is a mixture of experts: every layer routes each token to
2 of 4 experts of width ``intermediate // 4`` rounded up to a multiple of 32
(about as many MLP parameters as the dense architectures, half of them active
per token; a width that splits in 2 and 4 into whole 16-byte rows).

``1b`` is for GPU benchmarks (a float32 checkpoint of 3.4 GB); its tokenizer's
merges past what the built-in corpus yields are learned from made-up words.

Embeddings are *not* tied to the LM head: with random weights a tied head
mostly predicts the token it was fed, which makes greedy output degenerate.
The model's vocab size equals the tokenizer's, so every id a model can emit
decodes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# torch and transformers are imported inside the functions that use them, so
# that reading ARCHS/SIZES (the CLI's argument choices) stays cheap.

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
SIZES = ("tiny", "tiny-tp", "small", "1b", "tiny-draft", "small-draft", "tiny-eagle", "tiny-tp-eagle",
         "small-eagle", "tiny-eagle3", "small-eagle3")
# EAGLE heads (speculative decoding) and the size of the target each one is for.
EAGLE_TARGETS = {"tiny-eagle": "tiny", "tiny-tp-eagle": "tiny-tp", "small-eagle": "small"}
EAGLE3_TARGETS = {"tiny-eagle3": "tiny", "small-eagle3": "small"}
# The sizes that are whole causal LMs (a server may serve them): not the EAGLE heads.
MODEL_SIZES = tuple(size for size in SIZES if size not in EAGLE_TARGETS and size not in EAGLE3_TARGETS)
# The target layers whose incoming hidden states an EAGLE-3 head reads (vLLM's default for a
# Llama of L layers, 2, L // 2 and L - 3, needs L >= 4: tiny has 2).
EAGLE3_AUX_LAYERS = {"tiny": [0, 1, 1], "small": [2, 4, 5]}

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Ids 0..4, in this order, in every tokenizer built here.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML with Hermes/Qwen-style tools: the tools' JSON in the system turn, assistant
# calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks (parsed back
# by the "hermes" tool-call parser), tool results as <tool_response> blocks in a user
# turn. Content may be a string or a list of text parts; arguments a dict or JSON text.
CHAT_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is none %}{% elif content is string %}{{ content }}"
    "{% else %}{{ content | map(attribute='text') | join('') }}{% endif %}"
    "{% endmacro %}"
    "{{ bos_token }}"
    "{% set system_first = messages and messages[0]['role'] in ('system', 'developer') %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if system_first %}{{ text(messages[0]['content']) }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = message['role'] %}"
    "{% if loop.first and system_first and tools %}"
    "{% elif role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ text(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif role == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "<|im_start|>assistant\n{{ text(message['content']) }}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if (message['content'] is not none and message['content']) or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": {{ call['name'] | tojson }}, \"arguments\": "
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ 'system' if role == 'developer' else role }}\n{{ text(message['content']) }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Bumped whenever what make_model writes changes: cached checkpoints are keyed by it.
FACTORY_VERSION = 2
_MARKER_FILE = "pagedserve_model.json"


@dataclass(frozen=True)
class ModelShape:
    """Transformer dimensions shared by all architectures of one size."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SHAPES = {
    "tiny": ModelShape(64, 176, 2, 4, 2, 1024, 512),
    "tiny-tp": ModelShape(128, 352, 2, 8, 4, 1024, 512),
    "small": ModelShape(512, 1408, 8, 8, 2, 2048, 2048),
    # Draft models (speculative decoding) for tiny and small: their vocabulary and tokenizer.
    "tiny-draft": ModelShape(32, 88, 1, 2, 1, 1024, 512),
    "small-draft": ModelShape(128, 352, 2, 4, 2, 2048, 2048),
    "1b": ModelShape(2048, 5632, 16, 16, 4, 32000, 4096),
}

# Init scales, chosen so random logits vary across positions (std 0.02, the
# transformers default, gives near-uniform logits and repetitive greedy output).
_EMBED_STD = 1.0
_LOGIT_STD = 3.0  # lm_head std is this / sqrt(hidden): logits of std ~3
_BIAS_STD = 0.02

# A small original English corpus; the BPE merges are learned from it.
_CORPUS = """\
The river starts as a thin stream high in the hills, where snow melts slowly
through the spring. By the time it reaches the town it is wide and brown, and
children throw stones from the old stone bridge to see who can make the biggest
splash. In summer the water drops and long banks of pebbles appear, warm under
the afternoon sun.

A good loaf of bread needs only flour, water, salt and time. Mix the dough,
let it rest for an hour, fold it a few times, and leave it overnight in a cool
place. In the morning, shape it gently, bake it in a very hot oven, and wait
until it has cooled before cutting it. The crust should crackle as it cools.

Computers store numbers as patterns of bits. A byte holds eight bits, which is
enough for two hundred and fifty six different values. Text is stored by
giving every character a number; modern systems use Unicode, which covers
letters from almost every writing system in the world, as well as symbols,
arrows, and emoji.

The library on the corner opened more than a hundred years ago. Its shelves
reach the ceiling, and a wooden ladder on wheels slides along them. People come
to read newspapers, to borrow novels, to study for exams, or simply to sit in a
quiet room on a rainy day. The librarian knows most of the visitors by name.

When you plan a long walk, check the weather first, carry more water than you
think you will need, and tell someone where you are going. Wear shoes that you
have worn before. Stop to eat before you feel hungry, and turn back early if
the clouds begin to gather over the mountain.

Memory in a serving system is divided into fixed blocks. Each request receives
blocks as it grows, and returns them when it finishes. Because blocks are small
and equal in size, there is almost no wasted space, and many more requests can
share the same device at once. A table maps each position to its block.

Birds begin to sing before sunrise. First a single robin, then a blackbird,
then a whole chorus of sparrows and finches in the hedges. By the time the
light is full, most of them have gone quiet again, busy looking for seeds,
insects and worms in the wet grass of the meadow.

The market opens at seven on Saturday mornings. Farmers bring apples, pears,
potatoes, onions, carrots, cheese, eggs and honey. There is a stall that sells
hot coffee and another that sells flowers. By noon the best things are gone,
and the traders start to pack their vans and drive home.

Learning to play an instrument takes patience. Practise a little every day
rather than a lot once a week. Play slowly at first, listen carefully to each
note, and only speed up when the passage feels easy. Record yourself now and
then; you will hear mistakes that you miss while playing.

Winter in the north is long and dark. The sun rises late, hangs low over the
forest for a few hours, and sets again in the middle of the afternoon. People
light candles in their windows, ski across frozen lakes, and gather in warm
kitchens to cook soup, knit sweaters, tell stories, and wait for the spring.

A careful engineer writes down what a function promises before writing the
function itself. Which inputs are allowed? What happens when the caller passes
something invalid? Does it raise an error, return nothing, or quietly guess?
Tests should check each promise, including the awkward corners: empty lists,
negative counts, duplicate keys, very large values, and concurrent callers.

Our neighbour keeps bees at the bottom of her garden. Every July she lifts the
heavy frames out of the hives, brushes off the bees, slices away the wax caps,
and spins the honeycomb in a metal drum. Golden honey pours through a sieve
into jars, which she labels by hand and gives away to friends and relatives.

Trains leave the central station every fifteen minutes during the day. Express
services stop only at major towns, while local trains call at every village
along the valley. Tickets can be bought online, from machines on the platform,
or from the conductor, although buying on board usually costs slightly more.

Photography is mostly about light. Early morning and late evening give soft,
golden shadows; cloudy days give even, gentle colours that suit portraits.
Harsh midday sunshine flattens landscapes. Experiment with exposure, focus and
framing, and remember that the best camera is often the one in your pocket.

The museum's newest exhibition explores ancient navigation: star charts, wooden
compasses, knotted ropes for measuring speed, and maps drawn on animal skins.
Visitors can climb aboard a reconstructed sailing ship, steer by the stars in a
darkened planetarium, and learn how sailors crossed oceans without satellites.

Jokes, quotes and odd words: "Why did the scarecrow win an award? Because he
was outstanding in his field." Quick brown foxes jump over lazy dogs. Zebras,
yaks, quokkas, jellyfish, walruses, axolotls and kiwis. Oxygen, hydrogen,
nitrogen, carbon. Monday, Tuesday, Wednesday, Thursday, Friday, Sunday.
January, February, March, April, May, June, July, August, September, October,
November, December. North, south, east, west. Red, orange, yellow, green, blue,
indigo, violet, black, white, grey, pink, purple, brown.

Questions and answers: What time is it? It is half past three. Where are you
going? I am going to the station to meet my sister. How long will it take?
About twenty minutes if the traffic is light. Would you like some tea? Yes,
please, with milk and no sugar. Thank you very much!

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 128 256 512 1024
2048 4096 2024-01-15 3.14159 42% $19.99 (a + b) * c = d; x[i] = y[j] + 1;
def main(): return {"key": "value", "list": [1, 2, 3]} # comment
"""


def build_tokenizer(vocab_size: int, model_max_length: int | None = None):
    """Train a byte-level BPE of exactly ``vocab_size`` entries on the built-in corpus.

    Returns a ``PreTrainedTokenizerFast`` whose special tokens are
    ``SPECIAL_TOKENS`` at ids 0..4 (pad, bos, eos, ``<|im_start|>``,
    ``<|im_end|>``), which prepends BOS on ``encode`` and carries a ChatML
    chat template.  Any unicode string round-trips through
    ``encode``/``decode(skip_special_tokens=True)``.

    The pre-tokenizer is the one ``Qwen2Tokenizer`` hard-codes, because
    ``AutoTokenizer`` always loads a qwen2 checkpoint's tokenizer through that
    class: then every arch encodes text identically, except that the qwen2
    one also NFC-normalises its input (as real Qwen2 does).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # An upper-cased copy gives capitals merges of their own and enough
    # distinct pairs to reach a few thousand tokens.
    lines = (_CORPUS + _CORPUS.upper()).splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        # A large vocab: learn the remaining merges from made-up words (the sizes the corpus
        # covers keep exactly the tokenizer they always had).
        tokenizer.train_from_iterator(lines + _made_up_lines(2 * vocab_size), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"built-in corpus yields only {tokenizer.get_vocab_size()} tokens, "
            f"fewer than the requested vocab_size={vocab_size}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        add_bos_token=True,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def _made_up_lines(num_words: int, words_per_line: int = 12) -> list[str]:
    """``num_words`` seeded random lower-case words of 4 to 12 letters, as lines of text."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 12))) for _ in range(num_words)]
    return [" " + " ".join(words[i:i + words_per_line]) + "\n" for i in range(0, num_words, words_per_line)]


def build_config(arch: str, size: str):
    """Return the transformers config for ``arch`` at ``size`` (no weights)."""
    _check_arch_size(arch, size)
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    shape = SHAPES[size]
    common = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        dtype="float32",
    )
    if arch == "llama":
        config = LlamaConfig(**common, attention_bias=False, head_dim=shape.head_dim)
    elif arch == "qwen2":  # q/k/v projections always carry a bias
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=shape.head_dim, attention_bias=False, use_sliding_window=False)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=shape.head_dim, attention_bias=False, use_sliding_window=False,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                moe_intermediate_size=-(-shape.intermediate_size // 4 // 32) * 32, decoder_sparse_step=1,
                                mlp_only_layers=[])
    else:
        config = MistralConfig(**common, head_dim=shape.head_dim, sliding_window=None)
    return config


def count_parameters(arch: str, size: str) -> int:
    """Number of parameters of ``arch`` at ``size``, counted on the meta device (fast)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(arch, size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def make_model(arch: str, size: str, out_dir, seed: int = 0) -> Path:
    """Write a random-weight float32 checkpoint of ``arch``/``size`` into ``out_dir``.

    Creates ``out_dir`` if needed and overwrites the checkpoint files in it.
    The same ``(arch, size, seed)`` always gives a byte-identical
    ``model.safetensors``; a different seed gives different weights.
    Returns ``out_dir`` as a ``Path``.
    """
    _check_arguments(arch, size, seed)
    if size in EAGLE_TARGETS:
        return make_eagle_head(EAGLE_TARGETS[size], out_dir, seed, marker={"arch": arch, "size": size})
    if size in EAGLE3_TARGETS:
        return make_eagle3_head(EAGLE3_TARGETS[size], out_dir, seed, marker={"arch": arch, "size": size})
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = build_config(arch, size)
    tokenizer = build_tokenizer(config.vocab_size, config.max_position_embeddings)

    # Built on the meta device, then given storage: transformers' own random init, which
    # _init_weights overwrites anyway, took half of the 1b build. Non-persistent buffers
    # (RoPE frequencies) are left unset; they are not saved, and the model is only saved.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the caller's global RNG untouched
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    _init_weights(model, seed)
    model.eval()

    generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, SPECIAL_TOKENS.index(IM_END_TOKEN)],
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.generation_config = generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {"arch": arch, "size": size, "seed": seed, "factory_version": FACTORY_VERSION}
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def make_eagle_head(target_size: str, out_dir, seed: int = 0, marker: dict | None = None) -> Path:
    """Write a random EAGLE head for a ``target_size`` target into ``out_dir``: ``config.json``
    (a one-layer Llama of the target's shape) and ``model.safetensors`` with ``fc.weight``
    ([hidden, 2 * hidden]) and ``layers.0.*`` less ``input_layernorm`` (EAGLE's layout)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    shape = SHAPES[target_size]
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=1, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, hidden_act="silu", rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attention_bias=False, architectures=["LlamaForCausalLM"], dtype="float32")
    with torch.random.fork_rng(devices=[]):
        head = torch.nn.Module()
        head.fc = torch.nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=False)
        head.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, 0)])
        del head.layers[0].input_layernorm
    _init_weights(head, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file({name: param.detach().contiguous() for name, param in head.named_parameters()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    marker = {**(marker or {"size": f"{target_size}-eagle"}), "seed": seed, "factory_version": FACTORY_VERSION}
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def make_eagle3_head(target_size: str, out_dir, seed: int = 0, marker: dict | None = None) -> Path:
    """Write a random EAGLE-3 head for a ``target_size`` target into ``out_dir``: ``config.json``
    (``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` with
    ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` and ``t2d`` (EAGLE-3's layout)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    shape = SHAPES[target_size]
    hidden, draft_vocab = shape.hidden_size, shape.vocab_size // 2
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=hidden, intermediate_size=shape.intermediate_size,
        num_hidden_layers=1, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, hidden_act="silu", rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attention_bias=False, architectures=["LlamaForCausalLMEagle3"], dtype="float32",
        draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=EAGLE3_AUX_LAYERS[target_size])
    with torch.random.fork_rng(devices=[]):
        head = torch.nn.Module()
        head.fc = torch.nn.Linear(3 * hidden, hidden, bias=False)
        layer = head.midlayer = torch.nn.Module()
        layer.input_layernorm = LlamaRMSNorm(hidden)
        layer.hidden_norm = LlamaRMSNorm(hidden)
        layer.self_attn = LlamaAttention(config, 0)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, name,
                    torch.nn.Linear(2 * hidden, getattr(layer.self_attn, name).out_features, bias=False))
        layer.post_attention_layernorm = LlamaRMSNorm(hidden)
        layer.mlp = LlamaMLP(config)
        head.norm = LlamaRMSNorm(hidden)
        head.lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False)
    _init_weights(head, seed)
    tensors = {name: param.detach().contiguous() for name, param in head.named_parameters()}
    # The draft vocabulary: a seeded choice of target ids, in order; d2t[d] = target id - d.
    chosen = torch.randperm(shape.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    tensors["d2t"] = chosen - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(shape.vocab_size, dtype=torch.bool).index_fill_(0, chosen, True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    marker = {**(marker or {"size": f"{target_size}-eagle3"}), "seed": seed, "factory_version": FACTORY_VERSION}
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def default_cache_dir() -> Path:
    """Folder holding cached checkpoints: ``$PAGEDSERVE_CACHE_DIR/models``, else ``~/.cache/pagedserve/models``."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "pagedserve"
    return base / "models"


def ensure_model(arch: str = "llama", size: str = "tiny", cache_dir=None, seed: int = 0) -> Path:
    """Return the path of a cached ``arch``/``size``/``seed`` checkpoint, building it if absent.

    The checkpoint lives at ``cache_dir/{arch}-{size}-seed{seed}-v{FACTORY_VERSION}`` (``cache_dir``
    defaults to ``default_cache_dir()``).  It is built in a temporary sibling
    folder and renamed into place, so a returned path is always complete, and
    concurrent callers in different processes all get the same checkpoint.
    """
    _check_arguments(arch, size, seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{arch}-{size}-seed{seed}-v{FACTORY_VERSION}"
    return build_once(final, _MARKER_FILE, lambda tmp: make_model(arch, size, tmp, seed=seed))


def long_context_copy(max_positions: int, arch: str = "llama", size: str = "tiny") -> Path:
    """A temporary copy of the cached ``arch``/``size`` checkpoint whose config allows
    ``max_positions`` positions (RoPE, random weights: nothing learned depends on the
    context length). The caller removes it."""
    source = ensure_model(arch, size)
    target = Path(tempfile.mkdtemp(prefix="pagedserve-long-"))
    for item in source.iterdir():
        if item.is_file():
            shutil.copy(item, target / item.name)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (target / "config.json").write_text(json.dumps(config))
    return target


def build_once(final: Path, marker_file: str, build: Callable[[Path], object]) -> Path:
    """Return ``final``, built first unless it holds ``marker_file``: ``build(folder)`` writes a
    temporary sibling folder that is then renamed into place, so a returned path is always
    complete and concurrent callers in different processes all get the same checkpoint."""
    if (final / marker_file).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker_file).is_file():
                raise
            # Another caller finished first; its checkpoint is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _init_weights(model, seed: int) -> None:
    """Fill every parameter from a seeded generator, in name order, independent of transformers' init."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        param = params[name]
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, _BIAS_STD, generator=generator)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, _EMBED_STD, generator=generator)
            elif name.endswith("lm_head.weight"):
                param.normal_(0.0, _LOGIT_STD * param.shape[1] ** -0.5, generator=generator)
                # Zero logits for special tokens: greedy decoding never picks
                # them, so random text runs to max_tokens instead of stopping.
                param[: len(SPECIAL_TOKENS)] = 0.0
            elif param.dim() == 2:  # linear [out, in]: unit-variance outputs for unit-variance inputs
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
            elif param.dim() == 3:  # stacked experts [experts, out, in]: as linear, per expert
                param.normal_(0.0, param.shape[2] ** -0.5, generator=generator)
            else:
                raise RuntimeError(f"no init rule for parameter {name} of shape {tuple(param.shape)}")


def _check_arch_size(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")


def _check_arguments(arch: str, size: str, seed: int) -> None:
    _check_arch_size(arch, size)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
