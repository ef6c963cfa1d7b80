"""``hide_transformers_progress_bars`` (``workers/process/progress_bars.py``): transformers' own
bars go off in a serving process; the hub's download bars keep whatever setting they had."""

from __future__ import annotations

import pytest
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from transformers.utils import logging as transformers_logging

from pagedserve.workers.process.progress_bars import hide_transformers_progress_bars


@pytest.fixture
def bars_restored():
    transformers_on, hub_off = transformers_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    yield
    (transformers_logging.enable_progress_bar if transformers_on else transformers_logging.disable_progress_bar)()
    (disable_progress_bars if hub_off else enable_progress_bars)()


@pytest.mark.parametrize("hub_bars_on", [True, False])
def test_transformers_bars_go_off_and_the_hubs_keep_their_setting(bars_restored, hub_bars_on):
    transformers_logging.enable_progress_bar()
    (enable_progress_bars if hub_bars_on else disable_progress_bars)()
    hide_transformers_progress_bars()
    assert not transformers_logging.is_progress_bar_enabled()
    assert are_progress_bars_disabled() is not hub_bars_on
    # What ``from_pretrained`` draws its "Loading weights" bar with is now silent.
    assert type(transformers_logging.tqdm(range(3), desc="Loading weights")).__name__ == "EmptyTqdm"
