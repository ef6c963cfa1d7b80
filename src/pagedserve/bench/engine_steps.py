"""The engine's steps over a benchmark's window, served and offline, and what they explain.

An engine core serving streams can spend more CPU per token than the same engine offline
for two reasons: its steps carry fewer tokens (requests arrive over HTTP one by one, so the
batch fills over time and empties as streams end), or each step costs more (output
messages, the inbox, a CPU shared with the server's other processes). ``split_excess``
tells the two apart from the steps the engine counted:

- served: each worker's ``/stats`` (``num_steps``, ``num_generated_tokens``, the mean step
  times, the engine core's CPU by phase of its loop, and the requests' waits from their
  arrival at the engine to their first schedule and first token), read just before and just
  after the window;
- offline: ``LLMEngine.stats`` around ``LLM.generate``, and the process's CPU.

``counters`` reads one snapshot's cumulative figures; ``window`` differences two of them.
"""

from __future__ import annotations

import json
import urllib.request

# Cumulative figures a window differences (the step times rebuilt from their means).
COUNTERS = ("num_steps", "num_decode_steps", "num_generated_tokens", "step_s", "decode_step_s")
# The requests' waits at the engine, summed (absent from older stats: 0 then), and its preemptions.
WAIT_COUNTERS = ("num_scheduled_requests", "queue_seconds", "num_first_tokens", "first_token_seconds")
REQUEST_COUNTERS = WAIT_COUNTERS + ("num_preemptions",)


def counters(stats: dict) -> dict:
    """One engine's cumulative step figures from its stats (a worker's ``/stats`` entry or
    ``LLMEngine.stats()``); ``core_cpu_s`` by phase where the stats have it."""
    figures = {"num_steps": stats["num_steps"], "num_decode_steps": stats["num_decode_steps"],
               "num_generated_tokens": stats["num_generated_tokens"],
               "step_s": stats["mean_step_ms"] * stats["num_steps"] / 1e3,
               "decode_step_s": stats["mean_decode_step_ms"] * stats["num_decode_steps"] / 1e3}
    figures.update({name: stats.get(name, 0) for name in WAIT_COUNTERS})
    figures["num_preemptions"] = sum((stats.get("num_preemptions_by_mode") or {}).values())
    if "engine_core_cpu_seconds" in stats:
        figures["core_cpu_s"] = dict(stats["engine_core_cpu_seconds"])
    return figures


def served_counters(url: str, headers: dict | None = None, timeout_s: float = 30.0) -> dict:
    """The server's workers' step figures summed, from its ``/stats``."""
    request = urllib.request.Request(f"{url.rstrip('/')}/stats", headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        workers = json.load(response)["workers"]
    total = dict.fromkeys(COUNTERS + REQUEST_COUNTERS, 0.0)
    phases: dict[str, float] = {}
    for stats in workers.values():
        if "num_steps" not in stats:
            raise RuntimeError(f"a worker gave no step figures: {stats.get('error', stats)}")
        one = counters(stats)
        for name in total:
            total[name] += one[name]
        for phase, seconds in one.get("core_cpu_s", {}).items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return total | {"core_cpu_s": phases}


def window(before: dict, after: dict, cpu_s: float | None = None) -> dict:
    """The steps between two ``counters`` snapshots: how many, tokens per step, mean wall
    times, and the engine's CPU per step and per token. ``cpu_s``: the engine's CPU over the
    window where the snapshots have no phases (offline: the process's)."""
    delta = {name: after[name] - before[name] for name in COUNTERS}
    steps, tokens = delta["num_steps"], delta["num_generated_tokens"]
    phases = {phase: seconds - before.get("core_cpu_s", {}).get(phase, 0.0)
              for phase, seconds in after.get("core_cpu_s", {}).items()}
    if cpu_s is None:
        cpu_s = sum(phases.values())
    result = {"steps": int(steps), "decode_steps": int(delta["num_decode_steps"]), "tokens": int(tokens),
              "tokens_per_step": tokens / steps if steps else float("nan"),
              "step_ms": 1e3 * delta["step_s"] / steps if steps else float("nan"),
              "decode_step_ms": (1e3 * delta["decode_step_s"] / delta["num_decode_steps"]
                                 if delta["num_decode_steps"] else float("nan")),
              "cpu_s": cpu_s,
              "cpu_us_per_step": 1e6 * cpu_s / steps if steps else float("nan"),
              "cpu_us_per_token": 1e6 * cpu_s / tokens if tokens else float("nan")}
    if phases:
        result["phase_us_per_step"] = {phase: 1e6 * s / steps if steps else float("nan")
                                       for phase, s in phases.items()}
    waits = {name: after.get(name, 0) - before.get(name, 0) for name in REQUEST_COUNTERS}
    scheduled, first_tokens = waits["num_scheduled_requests"], waits["num_first_tokens"]
    # Each request's wait from its arrival at the engine: the engine's share of a TTFT.
    result.update({"requests": int(first_tokens), "preemptions": int(waits["num_preemptions"]),
                   "queue_ms": 1e3 * waits["queue_seconds"] / scheduled if scheduled else float("nan"),
                   "first_token_ms": (1e3 * waits["first_token_seconds"] / first_tokens
                                      if first_tokens else float("nan"))})
    return result


def split_excess(served: dict, offline: dict) -> dict:
    """The served engine's CPU per token over the offline engine's, in two parts that add up:

    - ``fewer_tokens_per_step``: the offline step's CPU spread over the served step's tokens,
      less the offline figure (what a batch that fills and empties over the run costs);
    - ``costlier_steps``: the served step's CPU over the offline step's, per served token.
    """
    per_step, per_token = offline["cpu_us_per_step"], offline["cpu_us_per_token"]
    fewer = per_step / served["tokens_per_step"] - per_token
    costlier = (served["cpu_us_per_step"] - per_step) / served["tokens_per_step"]
    return {"excess_us_per_token": served["cpu_us_per_token"] - per_token,
            "fewer_tokens_per_step_us": fewer, "costlier_steps_us": costlier}
