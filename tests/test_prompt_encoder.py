"""``PromptEncoder``: the Rust tokenizer directly only where it gives transformers' ids."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.cluster.serving.prompt_encoder import PromptEncoder


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return PromptEncoder(tokenizer)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(), st.lists(st.sampled_from(["<|endoftext|>", "<|im_start|>", " ", "\n", "a", "é", "🚀",
                                                           "Hello", " world", "<|", "|>"])).map("".join)),
       add_special_tokens=st.booleans())
def test_the_direct_path_gives_transformers_ids(tokenizer, encoder, text, add_special_tokens):
    assert encoder.is_direct
    assert encoder.encode(text, add_special_tokens) == tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_truncation_set_later_on_the_shared_tokenizer_goes_through_transformers(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    encoder = PromptEncoder(tokenizer)
    text = "the cache holds keys and values for every token"
    expected = tokenizer.encode(text)
    tokenizer.backend_tokenizer.enable_truncation(3)   # what a truncating call elsewhere leaves behind
    assert len(tokenizer.backend_tokenizer.encode(text).ids) == 3
    assert encoder.encode(text) == expected


def test_a_tokenizer_that_encodes_its_own_way_or_splits_special_tokens_is_never_bypassed(tiny_model):
    from transformers import AutoTokenizer

    path = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)

    class Shouting(type(tokenizer)):
        def prepare_for_tokenization(self, text, is_split_into_words=False, **kwargs):
            return text.upper(), kwargs

    shouting = Shouting.from_pretrained(path)
    assert not PromptEncoder(shouting).is_direct
    assert PromptEncoder(shouting).encode("hello") == shouting.encode("hello")

    splitting = AutoTokenizer.from_pretrained(path, split_special_tokens=True)
    encoder = PromptEncoder(splitting)
    assert not encoder.is_direct
    assert encoder.encode("a<|endoftext|>b") == splitting.encode("a<|endoftext|>b") != tokenizer.encode("a<|endoftext|>b")
