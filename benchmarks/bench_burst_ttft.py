"""First tokens under a burst: 64 requests at once, served vs the offline engine.

Serves the small random Llama with one worker (``pagedserve serve``), sends the
burst with ``pagedserve bench serve --request-rate inf`` (streamed, TTFT
timed by the client), then runs the same requests (same seed: same prompts and
output lengths) through ``LLM.generate`` with the worker's engine settings and
one torch thread, as the worker actor has, where
TTFT is first token minus arrival. Prints both distributions and the served /
offline ratios at p50, p90 and max, and writes them as JSON.

With first-come-first-served chunked prefill the served first tokens should
spread like the offline ones; a serving path that stalls deliveries bunches
them late. Runs from any checkout that has these commands (used on 5634146^
and after it, for the burst-TTFT fix).

    python benchmarks/bench_burst_ttft.py [--port 8123] [--out artifacts/burst_ttft.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.bench.served_process import wait_ready

NUM_REQUESTS = 64


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": ordered[0], "p50": statistics.median(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]}


def served(port: int, workdir: Path) -> list[float]:
    """Client-side TTFTs of the burst against a fresh local Ray (never another one on the machine)."""
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--set", "model.size=small",
                               "--port", str(port), "--address", "local"], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        try:
            wait_ready(url, server, 600)
        except (RuntimeError, TimeoutError):
            log.flush()
            print((workdir / "server.log").read_text()[-3000:], file=sys.stderr)
            raise
        out = workdir / "serve.json"
        subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--url", url,
                        "--num-requests", str(NUM_REQUESTS), "--request-rate", "inf", "--no-progress",
                        "--seed", "0", "--out", str(out)], check=True)
        data = json.loads(out.read_text())
        failed = [r for r in data["requests"] if not r["success"]]
        if failed:
            raise RuntimeError(f"{len(failed)} served requests failed: {failed[0]['error']}")
        return [r["ttft_s"] for r in data["requests"]]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


def offline() -> list[float]:
    import torch

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.serve import ServeBenchConfig, make_prompts
    from pagedserve.cluster.config import load_config
    from pagedserve.devtools.model_factory import ensure_model

    torch.set_num_threads(1)  # as a worker actor runs (Ray sets OMP_NUM_THREADS to its 1 CPU)
    engine = load_config(None).engine  # the worker's engine settings (the embedded default)
    requests = make_prompts(ServeBenchConfig(url="http://unused", num_requests=NUM_REQUESTS, seed=0))
    llm = LLM(model=str(ensure_model("llama", "small")), block_size=engine.block_size,
              swap_space_gb=engine.swap_space_gb)
    outputs = llm.generate([prompt for prompt, _, _ in requests],
                           [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                            for _, _, max_tokens in requests], use_tqdm=False)
    return [o.metrics.time_to_first_token for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default="artifacts/burst_ttft.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedserve-burst-") as workdir:
        served_ttft = served(args.port, Path(workdir))
    offline_ttft = offline()
    result = {"served_s": quantiles(served_ttft), "offline_s": quantiles(offline_ttft),
              "served_ttft_s": served_ttft, "offline_ttft_s": offline_ttft}
    result["ratio_served_to_offline"] = {k: result["served_s"][k] / result["offline_s"][k]
                                         for k in ("p50", "p90", "max")}
    print(f"{'':>8} {'min':>7} {'p50':>7} {'p90':>7} {'max':>7}  (s)")
    for name in ("served", "offline"):
        q = result[f"{name}_s"]
        print(f"{name:>8} {q['min']:7.2f} {q['p50']:7.2f} {q['p90']:7.2f} {q['max']:7.2f}")
    r = result["ratio_served_to_offline"]
    print(f"served/offline: p50 {r['p50']:.2f}x, p90 {r['p90']:.2f}x, max {r['max']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
