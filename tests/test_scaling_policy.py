"""The elastic group's scaling rule (Serve's default policy), with a hand-driven clock."""

from __future__ import annotations

import pytest

from pagedserve.cluster.config import AutoscalingConfig, ConfigError, load_config
from pagedserve.cluster.scaling_policy import ScalingPolicy


def policy(**overrides) -> ScalingPolicy:
    settings = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2,
                "upscale_delay_s": 10, "downscale_delay_s": 30, **overrides}
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


@pytest.mark.parametrize("block, key", [
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
