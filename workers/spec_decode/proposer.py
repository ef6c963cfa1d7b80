"""What the engine asks of a source of proposals (n-gram lookup; later, draft models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Proposes the tokens that may follow a sequence; the target model verifies them."""

    num_speculative_tokens: int

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int, max_num_tokens: int) -> list[int]:
        """At most ``max_num_tokens`` tokens to follow ``token_ids`` (prompt, then outputs; the
        first ``num_prompt_tokens`` are the prompt); none when there is nothing to propose."""
        ...
