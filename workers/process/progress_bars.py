"""transformers' own progress bars, off in the processes that serve.

In an engine core, or a tensor-parallel rank above 0, the per-tensor "Loading weights" bar of
``from_pretrained`` reaches the console through the worker actor's log, which Ray forwards line
by line: every update of the bar arrives as one line of carriage returns once the load is over,
where ``pagedserve serve``'s stage line already says that the workers load their model (and a
rank's bar repeats rank 0's). The offline ``LLM``, in the user's own process, keeps it.
"""

from __future__ import annotations


def hide_transformers_progress_bars() -> None:
    """Turn transformers' progress bars off in this process; the hub's download bars keep
    their setting (transformers' switch turns both off)."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    hub_bars_were_off = are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    if not hub_bars_were_off:
        enable_progress_bars()
