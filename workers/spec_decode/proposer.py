"""What the engine asks of a source of proposals: one sequence at a time (n-gram lookup), or
the step's sequences at once (a draft model, which runs one forward for all of them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..engine.request import Sequence as EngineSequence


class Proposer(Protocol):
    """Proposes the tokens that may follow a sequence; the target model verifies them."""

    num_speculative_tokens: int

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int, max_num_tokens: int) -> list[int]:
        """At most ``max_num_tokens`` tokens to follow ``token_ids`` (prompt, then outputs; the
        first ``num_prompt_tokens`` are the prompt); none when there is nothing to propose."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """Proposes for all of a step's proposing sequences at once."""

    num_speculative_tokens: int

    def propose_batch(self, seqs: list[EngineSequence], max_num_tokens: list[int]) -> list[list[int]]:
        """For each running sequence (its known tokens all computed but the last), at most
        ``max_num_tokens[i]`` tokens to follow them."""
        ...
