"""CPU that serving adds per streamed token, by process, over a matrix of loads and settings.

For each ingress, output transport, concurrency and stream interval: a fresh ``pagedserve serve`` (the tiny
model, one worker, a private Ray), then ``pagedserve bench serve --cpu-per-token
--offline-baseline`` (every server process's CPU over the timed load, by role, per streamed
token, and the same requests through ``LLM.generate`` in a process of its own), then the
server stopped. Prints one row per run and writes every run's JSON to ``--out``.

With ``--floor``, each run at stream interval 1 is followed by Serve's floor on the same
ingress (``bench_serve_floor.py``: pre-rendered chunks, no engine) paced to the run's token
rate, the same load (streams, tokens, waves, length ratio), with one CPU kept busy as the
run's engine core keeps one: the row adds the floor's CPU per token and what serving adds
over it.

Each row also has the idle server's CPU by process (``--idle-s`` seconds with no load, after
the run), and what it comes to per token at the run's rate: the part of the CPU a token that
is paid by the second (heartbeats, health and load polls, Ray's and Serve's daemons), so falls
per token as the token rate rises. And the engine's steps, served and offline (``bench.engine_steps``): tokens a
step, CPU a step, and the served engine core's excess per token split into fewer tokens a
step and costlier steps. Last, per setting with a floor, the median and the range of what
serving adds over it across the rounds (``--rounds``): one round's ratio on a shared VM can
stray by a third from the next one's.

    python benchmarks/bench_serving_cpu.py [--streams 64,256] [--intervals 1,4,16]
                                           [--ingresses haproxy,proxy] [--transports zmq]
                                           [--tokens 256] [--rounds 1] [--floor]
                                           [--waves 1] [--length-ratio 0] [--pin-engine-core]

By default each run is one burst: ``--streams`` requests at once, all of the same lengths, so
the engine's batch fills as the burst is admitted and empties at its end. ``--waves 4
--length-ratio 0.5`` measures a sustained load instead: four times as many requests, at most
``--streams`` at once, of lengths that differ so that streams end apart (the offline baseline
then holds as many requests at once as the load did). ``--pin-engine-core`` gives the engine
core a CPU of its own, as a GPU host's cores allow (``pagedserve.bench.cpu_pinning``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pagedserve.bench.cpu_pinning import pin_engine_cores, split_cpus
from pagedserve.bench.process_cpu import ServerCpuProbe, find_server_root
from pagedserve.bench.served_process import start_server, stop_server

ALL_CPUS = os.sched_getaffinity(0)   # this process's, before --pin-engine-core narrows them
IDLE_SETTLE_S = 2.0   # after the load, before the idle window: streams' last writes and closes


def idle_cpu(server_pid: int, port: int, seconds: float) -> dict:
    """Each group of the idle server's processes' CPU, in cores, over ``seconds`` with no load."""
    probe = ServerCpuProbe(find_server_root(f"http://127.0.0.1:{port}", server_pid))
    time.sleep(IDLE_SETTLE_S)
    with probe.measure() as window:
        time.sleep(seconds)
    groups = window.result(1)["groups"]
    return {label: group["cpu_s"] / seconds for label, group in groups.items()}


def run_one(ingress: str, transport: str, streams: int, interval: int, tokens: int, port: int,
            workdir: str, idle_s: float = 0.0, waves: int = 1, length_ratio: float = 0.0,
            engine_cpus: set[int] | None = None) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    name = f"{ingress}-{transport}-{streams}-{interval}"
    server = start_server(["--set", f"server.ingress={ingress}", "--set", f"output_transport={transport}",
                           "--stream-interval", str(interval)], port, os.path.join(workdir, f"serve-{name}.log"), env)
    out = os.path.join(workdir, f"bench-{name}.json")
    try:
        if engine_cpus is not None:   # the rest of the server inherited this process's other CPUs
            pin_engine_cores(server.pid, engine_cpus)
        done = subprocess.run(
            [sys.executable, "-m", "pagedserve", "bench", "serve", "--port", str(port), "--request-rate", "inf",
             "--num-requests", str(streams * waves), "--max-concurrency", str(streams),
             "--random-input-len", "16", "--random-output-len", str(tokens),
             "--random-range-ratio", str(length_ratio), "--seed", "0", "--cpu-per-token", "--offline-baseline",
             *(["--offline-cpus", ",".join(map(str, sorted(engine_cpus)))] if engine_cpus else []),
             "--no-progress", "--out", out], env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        with open(out) as f:
            data = json.load(f)
        if idle_s > 0:
            data["idle_cores"] = idle_cpu(server.pid, port, idle_s)
        return data
    finally:
        stop_server(server)


def run_floor(ingress: str, streams: int, tokens: int, tok_s: float, pin: bool = False, waves: int = 1,
              length_ratio: float = 0.0) -> dict:
    """``bench_serve_floor.py``'s row for the same load (``waves``, ``length_ratio``) paced to
    ``tok_s``, one CPU busy (with ``pin``, the busy process on the engine's CPU and the floor on
    the others)."""
    floor = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_serve_floor.py")
    done = subprocess.run([sys.executable, floor, "--ingress", ingress, "--streams", str(streams), "--tokens",
                           str(tokens), "--tok-s", str(round(tok_s)), "--busy-cpus", "1", "--waves", str(waves),
                           "--length-ratio", str(length_ratio), *(["--pin"] if pin else [])],
                          capture_output=True, text=True, timeout=1800,
                          preexec_fn=lambda: os.sched_setaffinity(0, ALL_CPUS))   # it pins its own
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"the floor failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(rows[-1])


def _engine_row(steps: dict) -> dict:
    """Tokens a step and CPU a step, served and offline, and the served engine core's excess
    per token split into fewer tokens a step and costlier steps (``bench.engine_steps``)."""
    served, offline, split = steps["served"], steps["offline"], steps["split"]
    return {"tokens_per_step": [round(served["tokens_per_step"], 1), round(offline["tokens_per_step"], 1)],
            "cpu_us_per_step": [round(served["cpu_us_per_step"]), round(offline["cpu_us_per_step"])],
            "decode_step_ms": [round(served["decode_step_ms"], 2), round(offline["decode_step_ms"], 2)],
            "core_phase_us_per_step": {p: round(us) for p, us in served.get("phase_us_per_step", {}).items()},
            "excess_us": round(split["excess_us_per_token"], 1),
            "fewer_tokens_per_step_us": round(split["fewer_tokens_per_step_us"], 1),
            "costlier_steps_us": round(split["costlier_steps_us"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--intervals", default="1,4,16")
    parser.add_argument("--ingresses", default="haproxy,proxy")
    parser.add_argument("--transports", default="zmq", help="output_transport values, alternating within a round")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default="artifacts/serving_cpu.json")
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="after each run, the idle server's CPU by process over this long (0: skip)")
    parser.add_argument("--waves", type=int, default=1,
                        help="requests: this many times --streams, at most --streams at once (1: one burst)")
    parser.add_argument("--length-ratio", type=float, default=0.0,
                        help="prompt and output lengths uniform within this ratio of their means (vLLM's "
                             "--random-range-ratio): with --waves, streams end apart and the batch stays full")
    parser.add_argument("--pin-engine-core", action="store_true",
                        help="the engine core and the offline baseline on a CPU of their own, the rest of the "
                             "server and the load client on the others (the floor's busy process on the "
                             "engine's CPU, the floor on the others)")
    parser.add_argument("--floor", action="store_true",
                        help="after each run at stream interval 1, Serve's floor paced to its token rate")
    args = parser.parse_args()
    engine_cpus = None
    if args.pin_engine_core:   # what this process starts inherits the other CPUs
        engine_cpus, other_cpus = split_cpus()
        os.sched_setaffinity(0, other_cpus)
    runs = []
    with tempfile.TemporaryDirectory(prefix="serving-cpu-") as workdir:
        for round_index in range(args.rounds):
            for streams in map(int, args.streams.split(",")):
                for interval in map(int, args.intervals.split(",")):
                    for ingress, transport in itertools.product(args.ingresses.split(","),
                                                                args.transports.split(",")):
                        data = run_one(ingress, transport, streams, interval, args.tokens, args.port, workdir,
                                       args.idle_s, args.waves, args.length_ratio, engine_cpus)
                        cpu = data["cpu_per_token"]
                        groups = {name: round(g["us_per_token"], 1) for name, g in cpu["groups"].items()}
                        row = {"round": round_index + 1, "ingress": ingress, "transport": transport,
                               "streams": streams,
                               "stream_interval": interval, "output_tok_s": round(data["output_throughput"]),
                               "server_us": round(cpu["server_total"]["us_per_token"], 1),
                               "offline_us": round(data["offline"]["us_per_token"], 1),
                               "serving_adds_us": round(cpu["serving_adds_us_per_token"], 1),
                               "groups": groups, "failed": data["failed"]}
                        if "idle_cores" in data:
                            idle = data["idle_cores"]
                            row["idle_cores"] = round(sum(idle.values()), 3)
                            # What the idle server's CPU alone comes to per token at the run's rate.
                            row["idle_us"] = {label: round(cores / data["output_throughput"] * 1e6, 1)
                                              for label, cores in idle.items()}
                            row["idle_us_total"] = round(sum(row["idle_us"].values()), 1)
                        if "split" in data.get("engine_steps", {}):
                            row["engine_steps"] = _engine_row(data["engine_steps"])
                        if args.floor and interval == 1:
                            floor = run_floor(ingress, streams, args.tokens, data["output_throughput"],
                                              args.pin_engine_core, args.waves, args.length_ratio)
                            row["floor"] = {"output_tok_s": floor["output_tok_s"], "server_us": floor["server_us"],
                                            "groups": floor["groups"]}
                            row["adds_over_floor"] = round(cpu["serving_adds_us_per_token"] / floor["server_us"], 2)
                        print(json.dumps(row), flush=True)
                        runs.append({"row": row, "data": data})
    for line in summarize_ratios([run["row"] for run in runs]):
        print(line, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=2)


def summarize_ratios(rows: list[dict]) -> list[str]:
    """Per setting, what serving adds over the floor across the rounds: the median and the range.
    One round's ratio on a shared VM can stray by a third from the next one's."""
    ratios: dict[tuple, list[float]] = {}
    for row in rows:
        if "adds_over_floor" in row:
            key = (row["ingress"], row["transport"], row["streams"], row["stream_interval"])
            ratios.setdefault(key, []).append(row["adds_over_floor"])
    return [f"{ingress}, {transport}, {streams} streams, interval {interval}: serving adds "
            f"{statistics.median(values):.2f}x the floor (median of {len(values)}; {min(values):.2f}-{max(values):.2f})"
            for (ingress, transport, streams, interval), values in ratios.items()]


if __name__ == "__main__":
    main()
