"""Requests and their sequences, as the engine core holds them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.kvmanager import prefix_extra_key

from ..lora.lora_request import LoRARequest
from ..outputs.request_output import RequestMetrics, SampleLogprobs
from ..outputs.sequence_stream import SequenceStream
from ..outputs.stream_batch import StreamTarget
from ..sample.grammar import CompiledGrammar, GrammarMatcher
from ..sample.sampling_params import SamplingParams


class SequenceStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt plus generated tokens.

    The engine's thread owns everything here but ``stream``, which belongs to the
    output processor (the text and deltas its caller has seen). ``append_token``
    adds a sampled token; ``token_ids``, ``output_token_ids`` and ``logprobs`` only
    ever grow (outputs hold prefixes of them).
    """

    seq_id: str
    request: "Request"
    sample_index: int
    token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    # The KV manager's view as of the last step: tokens with KV, and where.
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    is_swapped: bool = False
    # The sampled tokens (token_ids past the prompt).
    output_token_ids: list[int] = field(default_factory=list)
    # Why the engine ended it (None while it runs).
    finish_reason: str | None = None
    # Where the output stands in the request's grammar (structured outputs only).
    grammar: GrammarMatcher | None = None
    # Its row in the engine's persistent batch while it runs (-1: none).
    batch_row: int = -1
    # Its sampling row in the step still running, whose id its pending token takes.
    pending_source: int = -1
    # Its stream, as the output processor follows it.
    stream: SequenceStream | None = None
    # Tokens proposed to follow ``token_ids`` this step (speculative decoding), verified by it.
    proposed_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding's back-off: its drafts in a row that kept nothing, and the output
    # count before which it proposes no more.
    num_rejected_drafts: int = 0
    proposes_from_output: int = 0
    # Positions whose draft model KV is in its blocks (the draft computes the rest when it proposes).
    num_draft_computed: int = 0

    def __post_init__(self) -> None:
        self.output_token_ids = self.token_ids[self.num_prompt_tokens:]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    order: int = 0  # tie-breaker: submission order
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    is_aborted: bool = False
    export_kv: bool = False
    kv_transfer: object | None = None  # a KVTransfer to write on admission
    num_transferred_tokens: int = 0    # tokens whose KV ``kv_transfer`` holds
    grammar: CompiledGrammar | None = None
    # params.bad_words as token sequences (``bad_word_token_ids``), tokenized when added.
    bad_words_token_ids: list[list[int]] | None = None
    # Prompt logprobs by position (the first is None), while params.prompt_logprobs
    # asks for them; complete once there is one per prompt token.
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # "stream": an output at every step with news; "final": one output, at the end.
    output_kind: str = "stream"
    # Given (an output channel's request, in the engine core), its news goes into its channel's
    # ``StreamBatch`` rows rather than outputs.
    stream_target: StreamTarget | None = None
    # The output processor delivered its final output (its own flag: the engine may not know yet).
    is_final_streamed: bool = False
    # Beam search (params.use_beam_search): its live beams and hypotheses; its running
    # beams are ``seqs``.
    beam_group: Any = None   # a ``beam_groups.BeamGroup``, which only the beam search reads
    # Its sequence may move to another worker when preempted (one sample, no KV export, no
    # beam search): decided once, when the request is built.
    is_migratable: bool = False
    # Its LoRA adapter (None: the base model).
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))

    @property
    def is_finished(self) -> bool:
        """Aborted, or all ``n`` samples exist (they fork at the first token) and finished."""
        if self.is_aborted:
            return True
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    @property
    def prefix_cache_key(self) -> str | None:
        """The extra key of its blocks' hashes: blocks are shared only among requests of the
        same cache salt and adapter."""
        return prefix_extra_key(self.params.cache_salt, self.lora_request.cache_key if self.lora_request else None)

    @property
    def follows_text(self) -> bool:
        """Whether its text is decoded token by token (else once, at its end): streamed,
        or needed to find its stop strings."""
        return self.output_kind != "final" or bool(self.params.stop)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)
