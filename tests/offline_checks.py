"""The check every offline-engine test ends with: ``assert_idle(llm)``."""

from __future__ import annotations


def assert_idle(llm) -> None:
    """No request left, no block held, accounting consistent (``llm``: an ``LLM``)."""
    llm.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_used_blocks() == 0, llm.stats()
    assert llm.engine.scheduler.num_unfinished == 0
