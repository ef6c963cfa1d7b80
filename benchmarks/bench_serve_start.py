"""How long ``pagedserve serve`` takes to serve: from the command to its "is serving" line.

Each round starts ``python -m pagedserve serve`` (a private Ray, the default tiny model unless
``--model`` names one, HAProxy where installed) on ``--port``, reads its console until the
server says it is serving, then stops it as ``pagedserve stop`` does (SIGTERM; the stop's time is
not counted). Reported per round: the seconds to serving and each start-up stage's own seconds as
the console prints them (``[ok] STAGE (N s)``), so that a stage's share shows beside the whole;
then the median over the rounds. Compare builds by alternating runs of this script on one machine.

    python benchmarks/bench_serve_start.py [--rounds 3] [--model PATH] [--port 8141] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

from pagedserve.bench.served_process import stop_server

STAGE = re.compile(r"^\[ok\] (.+) \((\d+(?:\.\d+)?) s\)$")
READY = "is serving"


def one_start(model: str | None, port: int, timeout_s: float) -> dict:
    """One start to serving and its stop: the seconds to serving and each stage's seconds."""
    command = [sys.executable, "-m", "pagedserve", "serve", *([model] if model else []), "--port", str(port)]
    began = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stages: dict[str, float] = {}
    lines: list[str] = []
    ready_s = None
    try:
        for line in process.stdout:
            lines.append(line)
            match = STAGE.match(line.strip())
            if match:
                stages[match.group(1)] = float(match.group(2))
            if READY in line:
                ready_s = time.monotonic() - began
                break
            if time.monotonic() - began > timeout_s:
                break
    finally:
        stop_server(process)
    if ready_s is None:
        raise SystemExit("serve did not come up:\n" + "".join(lines[-30:]))
    return {"to_serving_s": round(ready_s, 2), "stages_s": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="a checkpoint directory or hub id (default: the built tiny model)")
    parser.add_argument("--port", type=int, default=8141)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        result = one_start(args.model, args.port, args.timeout_s)
        rounds.append(result)
        stages = "; ".join(f"{name}: {seconds:.1f} s" for name, seconds in result["stages_s"].items())
        print(f"round {index + 1}: serving after {result['to_serving_s']:.1f} s ({stages})", flush=True)
    print(f"median to serving: {statistics.median(r['to_serving_s'] for r in rounds):.1f} s over {len(rounds)} rounds")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rounds, file, indent=2)


if __name__ == "__main__":
    main()
