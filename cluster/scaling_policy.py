"""How many workers an elastic group wants: Ray Serve's autoscaling rule, as plain code.

``ScalingPolicy.tick`` is called periodically with each worker's ongoing
requests (running plus queued on it) and returns what to do. The rule is
Serve's default policy with its names and meanings:

- desired = ceil(total ongoing / ``target_ongoing_requests``), within
  ``[min_replicas, max_replicas]``, where total ongoing is the mean of the
  ticks' totals over the last ``look_back_period_s``;
- the group grows to it only after more workers were wanted on every tick
  for ``upscale_delay_s``, and shrinks only after fewer were wanted for
  ``downscale_delay_s``; a tick that wants the current size resets both;
- a group outside its bounds (a worker died, the bounds changed) moves back
  inside at once.

Capacity is what exists or is on its way (ready plus starting workers);
draining workers are leaving, so their requests count as demand but they do
not count as capacity. Shrinking removes starting workers first (they hold
no requests), then the ready workers with the fewest ongoing requests (the
newest first among equals), so the least work has to move.

No Ray here: the caller owns the workers and the clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .config import AutoscalingConfig


@dataclass(frozen=True)
class ScalingDecision:
    """One tick's outcome: start ``num_to_start`` workers, stop or drain ``to_remove``."""

    num_desired: int                 # the group's size the load asks for (within bounds)
    num_current: int                 # ready plus starting workers when the tick ran
    num_to_start: int = 0
    # Starting workers to cancel and ready workers to drain, in that order.
    to_remove: tuple[str, ...] = ()

    @property
    def is_noop(self) -> bool:
        return self.num_to_start == 0 and not self.to_remove


class ScalingPolicy:
    """Serve's autoscaling decision for one worker group. Not thread-safe; one caller."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._upscale_since: float | None = None
        self._downscale_since: float | None = None
        self._totals: deque[tuple[float, float]] = deque()   # (tick time, total ongoing)

    def desired_replicas(self, total_ongoing: float) -> int:
        """ceil(total / target) within the bounds."""
        config = self.config
        wanted = math.ceil(total_ongoing / config.target_ongoing_requests - 1e-9)
        return min(config.max_replicas, max(config.min_replicas, wanted))

    def averaged_ongoing(self, now: float, total_ongoing: float) -> float:
        """The mean total over the ticks within ``look_back_period_s`` of ``now``, this one's
        included (with a window of 0, this one's alone)."""
        self._totals.append((now, total_ongoing))
        while self._totals[0][0] < now - self.config.look_back_period_s:
            self._totals.popleft()
        return sum(total for _, total in self._totals) / len(self._totals)

    def tick(self, now: float, ongoing: Mapping[str, float], starting: Collection[str] = (),
             draining: Collection[str] = ()) -> ScalingDecision:
        """Decide at time ``now`` (seconds, monotonic) given ``ongoing`` (ready and draining
        workers -> their ongoing requests, oldest worker first), the workers still
        ``starting`` and those ``draining`` (keys of ``ongoing``)."""
        draining = set(draining)
        ready = [w for w in ongoing if w not in draining]
        starting = list(starting)
        current = len(ready) + len(starting)
        desired = self.desired_replicas(self.averaged_ongoing(now, sum(ongoing.values())))
        config = self.config
        if current < config.min_replicas or current > config.max_replicas:
            target = min(config.max_replicas, max(config.min_replicas, current))
            self._upscale_since = self._downscale_since = None
        elif desired > current:
            self._downscale_since = None
            if self._upscale_since is None:
                self._upscale_since = now
            target = desired if now - self._upscale_since >= config.upscale_delay_s else current
        elif desired < current:
            self._upscale_since = None
            if self._downscale_since is None:
                self._downscale_since = now
            target = desired if now - self._downscale_since >= config.downscale_delay_s else current
        else:
            self._upscale_since = self._downscale_since = None
            target = current
        if target != current:
            # Acted on: the next change needs its own full delay.
            self._upscale_since = self._downscale_since = None
        if target >= current:
            return ScalingDecision(desired, current, num_to_start=target - current)
        return ScalingDecision(desired, current,
                               to_remove=self._pick_removals(current - target, ready, starting, ongoing))

    @staticmethod
    def _pick_removals(count: int, ready: list[str], starting: list[str],
                       ongoing: Mapping[str, float]) -> tuple[str, ...]:
        """Newest starting workers first, then ready ones with the fewest ongoing requests
        (the newest among equals)."""
        order = {w: i for i, w in enumerate(ready)}
        by_load = sorted(ready, key=lambda w: (ongoing[w], -order[w]))
        return tuple((list(reversed(starting)) + by_load)[:count])
