"""The elastic group's scaling rule (Serve's default policy), with a hand-driven clock."""

from __future__ import annotations

import pytest

from pagedserve.cluster.config import AutoscalingConfig, ConfigError, load_config
from pagedserve.cluster.scaling_policy import ScalingPolicy


def policy(**overrides) -> ScalingPolicy:
    settings = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2,
                "upscale_delay_s": 10, "downscale_delay_s": 30, "look_back_period_s": 0, **overrides}
    return ScalingPolicy(AutoscalingConfig(**settings))


def test_desired_is_ceil_of_load_over_target_within_bounds():
    p = policy()
    assert [p.desired_replicas(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert policy(target_ongoing_requests=0.5).desired_replicas(1.5) == 3
    assert policy(min_replicas=2).desired_replicas(0) == 2


def test_upscale_waits_for_the_delay_of_continuous_demand():
    p = policy()
    load = {"w0": 6}
    assert p.tick(0, load).is_noop
    assert p.tick(9.9, load).is_noop
    decision = p.tick(10, load)
    assert decision.num_to_start == 2 and decision.num_desired == 3 and not decision.to_remove
    # The new workers count as capacity while they start: nothing more is asked for.
    assert p.tick(11, load, starting=["w1", "w2"]).is_noop
    assert p.tick(100, load, starting=["w1", "w2"]).is_noop


def test_a_tick_at_the_current_size_resets_the_delay():
    p = policy()
    assert p.tick(0, {"w0": 6}).is_noop
    assert p.tick(8, {"w0": 2}).is_noop  # demand went away: the clock restarts
    assert p.tick(9, {"w0": 6}).is_noop
    assert p.tick(18, {"w0": 6}).is_noop
    assert p.tick(19, {"w0": 6}).num_to_start == 2


def test_upscale_delay_zero_acts_at_once_and_each_change_needs_its_own_delay():
    p = policy(upscale_delay_s=0)
    assert p.tick(0, {"w0": 3}).num_to_start == 1
    p = policy()
    assert p.tick(0, {"w0": 4}).is_noop
    assert p.tick(10, {"w0": 4}).num_to_start == 1
    # More demand right after acting: a fresh delay, not the old one.
    assert p.tick(11, {"w0": 4, "w1": 4}).is_noop
    assert p.tick(20, {"w0": 4, "w1": 4}).is_noop
    assert p.tick(21, {"w0": 4, "w1": 4}).num_to_start == 2


def test_downscale_drains_the_least_loaded_newest_first_after_its_delay():
    p = policy()
    load = {"w0": 1, "w1": 0, "w2": 1, "w3": 0}
    assert p.tick(0, load).is_noop
    assert p.tick(29, load).is_noop
    decision = p.tick(30, load)
    assert decision.num_desired == 1
    assert decision.to_remove == ("w3", "w1", "w2")
    assert decision.num_to_start == 0


def test_downscale_cancels_starting_workers_before_draining_ready_ones():
    p = policy(downscale_delay_s=0)
    decision = p.tick(0, {"w0": 0, "w1": 2}, starting=["w2", "w3"])
    assert decision.to_remove == ("w3", "w2", "w0")


def test_draining_workers_count_as_demand_not_as_capacity():
    p = policy(upscale_delay_s=0, downscale_delay_s=0)
    # w1 drains with 4 requests that move to w0: 5 ongoing want 3 workers, 1 exists.
    decision = p.tick(0, {"w0": 1, "w1": 4}, draining=["w1"])
    assert decision.num_current == 1 and decision.num_to_start == 2
    # A draining worker is never picked again.
    decision = policy(downscale_delay_s=0).tick(0, {"w0": 0, "w1": 0, "w2": 0}, draining=["w2"])
    assert decision.to_remove == ("w1",)


def test_outside_the_bounds_moves_back_at_once():
    p = policy(min_replicas=2)
    assert p.tick(0, {"w0": 0}).num_to_start == 1  # one died: no delay to replace it
    assert policy(max_replicas=2).tick(0, {"w0": 9, "w1": 9, "w2": 9}).to_remove == ("w2",)


def test_fluctuating_demand_never_scales():
    p = policy(upscale_delay_s=5, downscale_delay_s=5)
    for t in range(0, 60, 2):
        load = {"w0": 6, "w1": 0} if t % 4 == 0 else {"w0": 0, "w1": 0}
        assert p.tick(t, load).is_noop, t


def test_the_load_is_the_mean_of_the_ticks_within_the_look_back_period():
    p = policy(look_back_period_s=10)
    assert [p.averaged_ongoing(t, n) for t, n in [(0, 8), (5, 2), (10, 2)]] == [8, 5, 4]
    assert p.averaged_ongoing(16, 2) == 2   # the ticks at 0 and 5 are out of the window
    assert policy().averaged_ongoing(0, 8) == 8 and policy().averaged_ongoing(1, 2) == 2


def _closed_loop(p: ScalingPolicy, seconds: float, load_at) -> list[tuple[float, str, tuple[str, ...]]]:
    """Tick every 0.5 s: one ready worker ``w0`` with ``load_at(t)`` requests, and two more
    starting (none becomes ready); what was decided, as (time, "start" or "remove", workers)."""
    events, starting, names = [], ["w1", "w2"], iter(f"w{i}" for i in range(3, 100))
    for step in range(int(seconds * 2)):
        t = step / 2
        decision = p.tick(t, {"w0": load_at(t)}, starting=starting)
        if decision.to_remove:
            events.append((t, "remove", decision.to_remove))
            starting = [w for w in starting if w not in decision.to_remove]
        if decision.num_to_start:
            started = tuple(next(names) for _ in range(decision.num_to_start))
            events.append((t, "start", started))
            starting += started
    return events


def test_a_dip_shorter_than_the_look_back_period_cancels_no_starting_worker():
    """Eight closed-loop clients keep three workers wanted; on a loaded machine the ready worker
    held two of them for three seconds while the others waited between requests. Counted tick
    by tick, that dip outlasts a short downscale delay and cancels the workers still starting;
    averaged over the look-back period, it is a dip."""
    def dip(t: float) -> int:
        return 2 if 10 <= t < 13 else 8

    settings = {"max_replicas": 3, "target_ongoing_requests": 3, "downscale_delay_s": 1}
    # Counted tick by tick: cancelled after the delay, started again after the upscale delay.
    assert _closed_loop(policy(**settings), 30, dip) == [(11.0, "remove", ("w2", "w1")),
                                                        (23.0, "start", ("w3", "w4"))]
    assert _closed_loop(policy(look_back_period_s=10, **settings), 30, dip) == []


def test_load_that_stays_low_shrinks_the_group_once_the_mean_has_fallen():
    p = policy(max_replicas=3, target_ongoing_requests=3, downscale_delay_s=1, look_back_period_s=10)
    events = _closed_loop(p, 30, lambda t: 8 if t < 10 else 2)
    # The mean over 10 s falls to 6 (two workers' worth) about 3.3 s after the drop and to 3 (one
    # worker's) about 8.3 s after it; each removal then waits for the delay.
    assert [(kind, names) for _, kind, names in events] == [("remove", ("w2",)), ("remove", ("w1",))], events
    assert 13 <= events[0][0] <= 15 and 18 <= events[1][0] <= 20.5, events


@pytest.mark.parametrize("block, key", [
    ({"look_back_period_s": -1}, "look_back_period_s"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"upscale_delay_s": -1}, "upscale_delay_s"),
    ({"downscale_delay_s": -0.5}, "downscale_delay_s"),
    ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
    ({"max_replica": 3}, "max_replica"),
    ({"min_replicas": 0}, "min_replicas"),
])
def test_bad_autoscaling_blocks_are_config_errors_naming_the_key(tmp_path, block, key):
    path = tmp_path / "bad.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"workers": [{"autoscaling": block}]}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "workers.0.autoscaling" in str(info.value) and key in str(info.value)
