"""A request's text to token ids, at the tokenizers library's own cost where that gives the same ids.

transformers' ``tokenizer.encode`` on a fast tokenizer is the ``tokenizers`` (Rust)
tokenizer's ``encode`` behind several layers of Python (``encode_plus``, its
truncation and padding settings, a ``BatchEncoding``): 78 µs for a six-token prompt
against 16 µs for the Rust call alone, on a CPU where a server's whole request costs
about 2 ms. ``PromptEncoder`` calls the Rust tokenizer directly when transformers would
do nothing more:

- the tokenizer is transformers' ``TokenizersBackend`` (or a subclass that overrides
  none of the encoding methods), and splits no special tokens;
- the Rust tokenizer has no truncation or padding set (transformers would lift both);
- both give the same ids for probe texts (special tokens, spaces, other scripts) with
  and without special tokens, checked once at start.

Anything else goes through ``tokenizer.encode``, as before.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Methods of transformers' fast tokenizer that encoding runs; a subclass overriding any of
# them may do more than the Rust tokenizer does.
_ENCODING_METHODS = ("encode", "encode_plus", "_encode_plus", "_batch_encode_plus", "tokenize",
                     "prepare_for_tokenization", "set_truncation_and_padding", "__call__")
_PROBES = ("Hello there", "  leading and trailing spaces  ", "line one\nline two\n\n\ttab",
           "Ünïcödé — 漢字 and emoji 🚀", "1234567890 + 3.14159", "")


class PromptEncoder:
    """``encode(text, add_special_tokens=True)``: the token ids ``tokenizer.encode`` gives."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = _direct_backend(tokenizer)

    @property
    def is_direct(self) -> bool:
        """Whether texts go straight to the Rust tokenizer."""
        return self._backend is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        backend = self._backend
        # Something may set truncation or padding on the shared tokenizer later: transformers lifts them.
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _direct_backend(tokenizer):
    """The Rust tokenizer behind ``tokenizer`` if calling it gives ``encode``'s ids, else None."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend) or getattr(tokenizer, "split_special_tokens", False):
        return None
    cls = type(tokenizer)
    if any(getattr(cls, name, None) is not getattr(TokenizersBackend, name, None) for name in _ENCODING_METHODS):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None \
            or getattr(backend, "encode_special_tokens", False):
        return None
    probes = [*_PROBES, *(str(t) for t in tokenizer.all_special_tokens[:4]),
              f"before{tokenizer.eos_token or ''}after"]
    for text in probes:
        for add_special_tokens in (True, False):
            if backend.encode(text, add_special_tokens=add_special_tokens).ids != tokenizer.encode(
                    text, add_special_tokens=add_special_tokens):
                logger.info("prompts are encoded through transformers: the tokenizers library alone "
                            "gives other ids for %r", text)
                return None
    return backend
