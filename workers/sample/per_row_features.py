"""The sampling features only some rows use, handled one row at a time.

The persistent batch flags such rows (``PER_ROW``); every other row samples and
finishes in tensor ops. Before a step samples, a flagged row's penalties, seeded
draw, logprobs request, tokens banned by ``min_tokens`` and grammar bitmask join
the step's ``SamplingBatch``; after it, its stop token ids, logprobs, KV export,
grammar and ``min_tokens`` follow the token it got.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Callable

from ..engine.kv_transfer import KVTransfer, export_kv
from ..engine.request import Sequence
from ..model.input_batch import BAD_WORDS, EXPORTS_KV, GRAMMAR, MIN_TOKENS, STOP_TOKEN_IDS, InputBatch
from ..outputs.detokenizer import FINISH_STOP
from ..outputs.request_output import SampleLogprobs
from .grammar import GrammarCompiler
from .sampler import SamplingBatch
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from ..model.model_runner import ModelRunner
    from ..tp.runner import TensorParallelRunner

logger = logging.getLogger(__name__)

# Sampling positions that end this step: position -> (finish reason, whether the
# sampled token itself decided it).
Ends = dict[int, tuple[str, bool]]


def bad_word_token_ids(tokenizer: Any, words: Seq[str]) -> list[list[int]]:
    """Each word's token sequences, as vLLM makes them: the word (left-stripped) alone,
    and after a space where that gives as many tokens and another first token (so the
    word is banned at the start of the text and mid-text alike)."""
    sequences: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if alone:   # no tokens: nothing to complete
            sequences.append(alone)
        if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return sequences


def bad_word_bans(output_token_ids: Seq[int], bad_words: list[list[int]]) -> list[int]:
    """The last token of each bad word whose tokens before it end the output so far."""
    bans = []
    num_outputs = len(output_token_ids)
    for word in bad_words:
        prefix = len(word) - 1
        if prefix <= num_outputs and (not prefix or output_token_ids[num_outputs - prefix:] == word[:prefix]):
            bans.append(word[-1])
    return bans


class PerRowFeatures:
    """The per-row work before and after a sample, for the positions of a step's
    sampling rows whose batch flags ask for it.

    Keeps what that work produces for the engine: the prompt KV of requests added
    with ``export_kv`` (``kv_exports``, by request id) and the time spent on
    grammars (``grammar_seconds``). ``grammar_compiler`` returns the engine's
    compiler (built on first use).
    """

    def __init__(self, batch: InputBatch, runner: ModelRunner | TensorParallelRunner,
                 eos_token_ids: list[int], grammar_compiler: Callable[[], GrammarCompiler]) -> None:
        self.batch = batch
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self._grammar_compiler = grammar_compiler
        self.kv_exports: dict[str, KVTransfer] = {}
        self.grammar_seconds = 0.0       # bitmask filling and matcher updates

    def add_to_batch(self, batch: SamplingBatch, seqs: list[Sequence], per_row: list[int],
                     flag_values: list[int]) -> None:
        """Fill ``batch``'s sparse entries of the ``per_row`` positions (their sequences
        in ``seqs``, their flags in ``flag_values``): one batched bitmask fill for the
        constrained ones."""
        for p in per_row:
            self.batch.add_per_row(batch, p, seqs[p], flag_values[p], self._banned_token_ids(seqs[p], flag_values[p]))
        grammar_positions = [p for p in per_row if flag_values[p] & GRAMMAR]
        if grammar_positions:
            self._add_token_bitmasks(seqs, grammar_positions, batch)

    def after_sampling(self, seqs: list[Sequence], token_ids: list[int],
                       logprobs: list[SampleLogprobs | None] | None, per_row: list[int],
                       flag_values: list[int], ends: Ends) -> None:
        """The per-row work that follows a token: stop token ids, logprobs, grammars, KV
        exports, min_tokens. Positions that end are added to ``ends``."""
        for p in per_row:
            seq, value = seqs[p], flag_values[p]
            request = seq.request
            if value & STOP_TOKEN_IDS and p not in ends and token_ids[p] in request.params.stop_token_ids:
                ends[p] = (FINISH_STOP, True)
            if logprobs is not None and logprobs[p] is not None:
                seq.logprobs.append(logprobs[p])
            if value & EXPORTS_KV and request.request_id not in self.kv_exports:
                self.kv_exports[request.request_id] = export_kv(
                    self.runner.kv_cache, seq.block_table, seq.num_computed, seq.token_ids)
            if value & GRAMMAR and p not in ends:
                reason = self.advance_grammar(seq, token_ids[p])
                if reason is not None:
                    ends[p] = (reason, False)
            if value & MIN_TOKENS and p not in ends:
                self.batch.refresh_flags(seq)

    def min_tokens_bans(self, params: SamplingParams) -> list[int]:
        """The tokens a sequence cannot sample before ``min_tokens`` outputs: EOS (unless
        ignored) and its stop token ids."""
        eos = [] if params.ignore_eos else self.eos_token_ids
        return [t for t in dict.fromkeys(eos + params.stop_token_ids) if t < self.runner.vocab_size]

    def _banned_token_ids(self, seq: Sequence, flags: int) -> list[int]:
        """EOS and stop tokens while fewer than ``min_tokens`` outputs exist, and the
        tokens that would complete a bad word."""
        request = seq.request
        params = request.params
        banned = []
        if flags & MIN_TOKENS and len(seq.output_token_ids) < params.min_tokens:
            banned = self.min_tokens_bans(params)
        if flags & BAD_WORDS:
            banned += bad_word_bans(seq.output_token_ids, request.bad_words_token_ids)
        return banned

    def _add_token_bitmasks(self, seqs: list[Sequence], positions: list[int], batch: SamplingBatch) -> None:
        """Fill the grammar bitmask of every constrained row (one batched call)."""
        start = time.perf_counter()
        compiler = self._grammar_compiler()
        bitmask = compiler.allocate_bitmask(len(positions))
        compiler.fill_bitmask([seqs[p].grammar for p in positions], bitmask)
        batch.bitmask_rows, batch.bitmask = positions, bitmask
        self.grammar_seconds += time.perf_counter() - start

    def draft_bitmasks(self, seq: Sequence, proposed: list[int]) -> torch.Tensor:
        """The grammar's masks at each position of a draft (speculative decoding): before the
        proposals, then after each of them (``len(proposed) + 1`` rows; the proposals must be
        ones the grammar accepts, ``GrammarMatcher.num_valid``). The matcher ends where it began."""
        start = time.perf_counter()
        compiler = self._grammar_compiler()
        grammar = seq.grammar
        bitmask = compiler.allocate_bitmask(len(proposed) + 1)
        for i, token_id in enumerate([*proposed, None]):
            compiler.fill_bitmask([grammar], bitmask[i:i + 1])
            if token_id is not None and not grammar.accept(token_id):
                grammar.rollback(i)
                raise ValueError(f"proposal {token_id} at position {i} is not one the grammar accepts")
        grammar.rollback(len(proposed))
        self.grammar_seconds += time.perf_counter() - start
        return bitmask

    def advance_grammar(self, seq: Sequence, token_id: int) -> str | None:
        """Move the sequence's grammar past ``token_id``: the finish reason if that ends
        it (its grammar is complete: "stop"; the token broke it: "abort", which the mask
        rules out), else None."""
        start = time.perf_counter()
        is_ok = seq.grammar.accept(token_id)
        self.grammar_seconds += time.perf_counter() - start
        if not is_ok:
            logger.error("request %s: token %d rejected by its grammar (%s); aborting the sequence",
                         seq.request.request_id, token_id, seq.grammar.error)
            return "abort"
        return FINISH_STOP if seq.grammar.is_finished else None
