"""How long each engine step keeps the device, and how long the device waits between steps.

On CUDA, ``record_step_device_times(engine)`` puts a CUDA event on the current stream just
before each forward the engine runs, and another when the engine's step returns (its
sampler launched). Once the run is synchronised, ``summarize_step_device_times`` reads:

- a step's device span, from its first event to its second: its forward (a graph replay,
  or an eager or compiled forward), the K/V writes and the sampler; in a step launched op
  by op, also the device's waits on those launches;
- the gap before a step, from the previous step's second event to its first: the device
  idle, waiting for the host to launch the step (about 0 when the host runs ahead, as
  overlapped scheduling lets it).

Both are summed by step kind: decode steps (every sequence computes one token) and steps
with a prompt chunk. A device-bound run has spans that add up to nearly its wall time;
a host-bound one, gaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

DECODE, MIXED = "decode", "with a prompt chunk"


@dataclass
class StepDeviceTimes:
    """Per step: its kind and its (start, end) events, in launch order."""

    kinds: list[str] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)

    def spans_and_gaps(self) -> tuple[list[float], list[float | None]]:
        """Device seconds per step, and the idle seconds before it (None for the first);
        once the device has run every step (synchronised)."""
        spans = [start.elapsed_time(end) * 1e-3 for start, end in self.events]
        gaps = [None] + [self.events[i - 1][1].elapsed_time(self.events[i][0]) * 1e-3
                         for i in range(1, len(self.events))]
        return spans, gaps


def record_step_device_times(engine, new_event: Callable[[], Any] | None = None) -> StepDeviceTimes | None:
    """Record the device time of every step ``engine`` runs from now on: None off CUDA.
    ``new_event`` makes an event with ``record()`` and ``elapsed_time(later)`` in ms (a
    timing ``torch.cuda.Event`` by default)."""
    if new_event is None:
        import torch

        if engine.runner.device.type != "cuda":
            return None
        new_event = partial(torch.cuda.Event, enable_timing=True)
    runner = engine.runner
    times = StepDeviceTimes()
    execute = runner.execute
    started: list = []

    def recording(model_input, *args, **kwargs):
        if not started:  # the step's forward (one a step)
            event = new_event()
            event.record()
            started.append(event)
            times.kinds.append(DECODE if model_input.is_decode_only else MIXED)
        return execute(model_input, *args, **kwargs)

    def after_step() -> None:
        if started:
            end = new_event()
            end.record()
            times.events.append((started.pop(), end))

    runner.execute = recording
    engine.step_hooks.append(after_step)
    return times


def summarize_step_device_times(kinds: list[str], spans: list[float], gaps: list[float | None],
                                wall_seconds: float) -> dict:
    """Per step kind: steps, device seconds in all and per step, idle seconds before those
    steps; and the run's device-busy and idle fractions of ``wall_seconds``."""
    by_kind: dict[str, dict] = {}
    for kind, span, gap in zip(kinds, spans, gaps):
        entry = by_kind.setdefault(kind, {"steps": 0, "device_seconds": 0.0, "idle_before_seconds": 0.0})
        entry["steps"] += 1
        entry["device_seconds"] += span
        entry["idle_before_seconds"] += gap or 0.0
    for entry in by_kind.values():
        entry["device_ms_per_step"] = 1e3 * entry["device_seconds"] / entry["steps"]
        entry["idle_ms_per_step"] = 1e3 * entry["idle_before_seconds"] / entry["steps"]
    device, idle = sum(spans), sum(gap or 0.0 for gap in gaps)
    return {"wall_seconds": wall_seconds, "device_seconds": device, "idle_between_steps_seconds": idle,
            "device_fraction": device / wall_seconds if wall_seconds else 0.0,
            "idle_fraction": idle / wall_seconds if wall_seconds else 0.0, "kinds": by_kind}


def format_step_device_times(summary: dict) -> str:
    lines = [f"steps held the device {summary['device_seconds']:.3f} s of {summary['wall_seconds']:.3f} s "
             f"({summary['device_fraction']:.1%}); it idled between steps "
             f"{summary['idle_between_steps_seconds']:.3f} s "
             f"({summary['idle_fraction']:.1%}); the rest is before the first step and after the last"]
    for kind, entry in summary["kinds"].items():
        lines.append(f"  {entry['steps']:5d} steps {kind}: {entry['device_ms_per_step']:.2f} ms of device each, "
                     f"{entry['idle_ms_per_step']:.2f} ms idle before each")
    return "\n".join(lines)
