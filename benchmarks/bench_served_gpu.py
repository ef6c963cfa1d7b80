"""The default workload of ``bench_engine_gpu.py`` served over HTTP, against ``LLM.generate``.

Three parts, each in processes of their own so that the GPU is free for the next:

1. offline: ``bench_engine_gpu.py --contenders pagedserve`` on the workload (256 prompts of
   128-1,024 tokens, 256 output tokens each, EOS ignored, llama-1b in bf16 by default): its
   output tok/s, decode step, and the engine's own inter-token latency (``--token-times``);
2. served, once per ``--num-replicas`` entry (``auto``: the configuration's default; ``1,auto``
   puts one ingress replica beside the default): ``pagedserve serve`` with the same checkpoint
   and engine options (one worker, the default ingress), then the same prompts and lengths
   streamed from ``/v1/completions``, all at once (``pagedserve bench serve``'s client), after a
   warm-up burst of as many requests (other prompts, the same lengths), with
   every server process's CPU read (``--cpu-per-token``'s probe) and the worker's ``/stats``
   read before and after (after the warm-up): the engine's decode step while served, and its
   engine core's CPU by phase of its loop;
3. the report, per served run: served over offline output tok/s, TTFT and ITL percentiles, ITL
   p99 over the offline decode step and over the engine's own ITL p99, the served decode step
   over the offline one, CPU per streamed token by process, and the mean TTFT against the
   replica's share of it (with one replica: its TTFT histogram in ``/metrics``) and the
   engine's (arrival at the engine to first token), and the served batch's size.

    python benchmarks/bench_served_gpu.py [--size 1b] [--device cuda] [--num-replicas 1,auto]
        [--event-loop asyncio|uvloop] [--json PATH]
    python benchmarks/bench_served_gpu.py --device cpu --size tiny --num-requests 16 \\
        --min-prompt 16 --max-prompt 64 --output-len 32          # a smoke run on the CPU
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_engine_gpu  # noqa: E402  (this folder's workload and its flags)

from pagedserve.bench.served_process import start_server, stop_server  # noqa: E402

START_TIMEOUT_S = 900.0


def log(message: str) -> None:
    print(f"[bench_served_gpu] {message}", flush=True)


def run_offline(argv: list[str], workdir: str) -> dict:
    path = os.path.join(workdir, "offline.json")
    subprocess.run([sys.executable, str(HERE / "bench_engine_gpu.py"), *argv, "--contenders", "pagedserve",
                    "--token-times", "--json", path], check=True)
    with open(path) as f:
        return json.load(f)


def engine_options(args) -> dict:
    """The engine options of ``bench_engine_gpu.py``'s pagedserve contender."""
    options = {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}
    if args.kv_cache_gb:
        options["kv_cache_memory_gb"] = args.kv_cache_gb
    return options


def write_config(path: str, args, port: int, workdir: str, num_replicas: int | None) -> str:
    """The served run's configuration: the checkpoint, the engine options, one worker, and
    ``num_replicas`` ingress replicas (None: the default) on ``args.event_loop`` (None: the default)."""
    import yaml

    server = {"port": port, **({"num_replicas": num_replicas} if num_replicas is not None else {}),
              **({"event_loop": args.event_loop} if args.event_loop else {})}
    config = {"model": {"path": path}, "engine": engine_options(args),
              "workers": [{"count": 1, **({"num_gpus": 1} if args.device.startswith("cuda") else {})}],
              "server": server}
    config_path = os.path.join(workdir, "served.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    return config_path


def worker_figures(url: str) -> dict:
    """The one worker's ``/stats`` entry."""
    with urllib.request.urlopen(f"{url}/stats", timeout=60) as response:
        workers = json.load(response)["workers"]
    return next(iter(workers.values()))


def replica_first_tokens(url: str) -> tuple[float, float]:
    """The replica's TTFT histogram (from a request's arrival at the replica to its first token
    there): its (sum in seconds, count), from ``/metrics``. A scrape reaches one replica: with
    one replica, the whole server's."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        text = response.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "pagedserve_time_to_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def engine_while_served(before: dict, after: dict) -> dict:
    """The engine's steps between two ``worker_figures``: the mean decode step, and the engine
    core's CPU per step by phase of its loop (µs)."""
    num_steps = after["num_steps"] - before["num_steps"]
    num_decode = after["num_decode_steps"] - before["num_decode_steps"]
    decode_ms = (after["mean_decode_step_ms"] * after["num_decode_steps"]
                 - before["mean_decode_step_ms"] * before["num_decode_steps"])
    cpu_before, cpu_after = before.get("engine_core_cpu_seconds") or {}, after.get("engine_core_cpu_seconds") or {}
    return {"num_steps": num_steps, "num_decode_steps": num_decode,
            "decode_step_ms": decode_ms / num_decode if num_decode else None,
            "core_cpu_us_per_step": {phase: 1e6 * (seconds - cpu_before.get(phase, 0.0)) / max(num_steps, 1)
                                     for phase, seconds in cpu_after.items()}}


def run_served(args, path: str, prompts: list[list[int]], workdir: str, num_replicas: int | None) -> dict:
    from pagedserve.bench.serve import CpuPerTokenConfig, ServeBenchConfig, run_benchmark, run_load, warmup_config

    port = args.port
    url = f"http://127.0.0.1:{port}"
    server = start_server(["--config", write_config(path, args, port, workdir, num_replicas)], port,
                          os.path.join(workdir, "serve.log"), timeout_s=START_TIMEOUT_S)
    try:
        # The warm-up is a whole burst (other prompts, the same lengths): a burst that needs new
        # connections to the replica is taken in slowly (docs/benchmarks.md, "A burst on new connections").
        config = ServeBenchConfig(url=url, num_requests=len(prompts), num_warmups=len(prompts),
                                  seed=args.seed + 2, request_timeout_s=1800.0, max_duration_s=1800.0)
        asyncio.run(run_load(warmup_config(config)))
        before = worker_figures(url)
        first_before = replica_first_tokens(url) if num_replicas == 1 else None
        requests = [(prompt, len(prompt), args.output_len) for prompt in prompts]
        served = run_benchmark(dataclasses.replace(config, num_warmups=0), show_progress=False,
                               cpu=CpuPerTokenConfig(server_pid=server.pid), requests=requests)
        served["engine"] = engine_while_served(before, worker_figures(url))
        if first_before is not None:   # one replica: its TTFT histogram is the server's
            first_after = replica_first_tokens(url)
            count = first_after[1] - first_before[1]
            served["replica_ttft_ms_mean"] = 1e3 * (first_after[0] - first_before[0]) / count if count else None
        return served
    finally:
        stop_server(server)


def report(offline: dict, served: dict) -> dict:
    pagedserve = offline["results"][bench_engine_gpu.LABELS["pagedserve"]]
    offline_tps = pagedserve["output_tok_per_s"]
    decode_ms = pagedserve.get("decode_step_ms")
    offline_itl = pagedserve.get("itl_ms") or {}
    served_decode_ms = served["engine"]["decode_step_ms"]
    cpu = served.get("cpu_per_token") or {}
    steps = (served.get("engine_steps") or {}).get("served") or {}
    return {
        "offline_output_tok_s": offline_tps, "served_output_tok_s": served["output_throughput"],
        "served_over_offline": served["output_throughput"] / offline_tps,
        "offline_decode_step_ms": decode_ms,
        "served_decode_step_ms": served_decode_ms,
        "served_over_offline_decode_step": served_decode_ms / decode_ms if decode_ms and served_decode_ms else None,
        "ttft_ms": {q: served[f"p{q}_ttft_ms"] for q in (50, 90, 99)},
        "itl_ms": {q: served[f"p{q}_itl_ms"] for q in (50, 90, 99)},
        "tpot_ms": {q: served[f"p{q}_tpot_ms"] for q in (50, 90, 99)},
        "itl_p99_over_offline_step": served["p99_itl_ms"] / decode_ms if decode_ms else None,
        # The engine's own ITL on the workload (offline): the floor of the served ITL.
        "offline_itl_ms": {q: offline_itl.get(f"p{q}") for q in (50, 90, 99)},
        "itl_p99_over_offline_itl_p99": (served["p99_itl_ms"] / offline_itl["p99"]
                                         if offline_itl.get("p99") else None),
        "cpu_us_per_token": {name: group["us_per_token"] for name, group in (cpu.get("groups") or {}).items()},
        "server_cpu_us_per_token": (cpu.get("server_total") or {}).get("us_per_token"),
        "engine_core_cpu_us_per_step": served["engine"]["core_cpu_us_per_step"],
        # TTFT taken apart (means): the client's; the replica's, from a request's arrival there to
        # its first token there (in a run of --num-replicas 1 only); the engine's, from its arrival
        # at the engine to its first schedule and its first token. And the served engine's batch
        # (fewer tokens a step than offline where requests reached it late).
        "ttft_ms_mean": served["mean_ttft_ms"], "replica_ttft_ms_mean": served.get("replica_ttft_ms_mean"),
        "engine_first_token_ms_mean": steps.get("first_token_ms"), "engine_queue_ms_mean": steps.get("queue_ms"),
        "served_tokens_per_step": steps.get("tokens_per_step"), "preemptions": steps.get("preemptions"),
        "completed": served["completed"], "failed": served["failed"], "errors": served.get("errors"),
    }


def parse_replicas(text: str) -> list[int | None]:
    """``--num-replicas``: a comma-separated list of counts, ``auto`` for the default."""
    return [None if item == "auto" else int(item) for item in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    port = 8000
    if "--port" in argv:
        at = argv.index("--port")
        port = int(argv[at + 1])
        del argv[at:at + 2]
    json_path = None
    if "--json" in argv:
        at = argv.index("--json")
        json_path = argv[at + 1]
        del argv[at:at + 2]
    replicas: list[int | None] = [None]
    if "--num-replicas" in argv:
        at = argv.index("--num-replicas")
        replicas = parse_replicas(argv[at + 1])
        del argv[at:at + 2]
    event_loop = None   # the replicas' loop (server.event_loop); None: the configuration's default
    if "--event-loop" in argv:
        at = argv.index("--event-loop")
        event_loop = argv[at + 1]
        del argv[at:at + 2]
        if event_loop not in ("asyncio", "uvloop"):
            raise SystemExit(f"--event-loop: asyncio or uvloop, not {event_loop!r}")
    args = bench_engine_gpu.parse_args(argv)
    args.port = port
    args.event_loop = event_loop
    from transformers import AutoConfig

    from pagedserve.bench.replay import resolve_model

    path = resolve_model(args.model, args.arch, args.size)
    model_config = AutoConfig.from_pretrained(path)
    prompts, _ = bench_engine_gpu.make_prompts(args, model_config.vocab_size,
                                                getattr(model_config, "max_position_embeddings", 2048))
    runs = []
    with tempfile.TemporaryDirectory(prefix="served-gpu-") as workdir:
        log(f"offline: {len(prompts)} prompts, {args.output_len} output tokens each")
        offline = run_offline([*argv, "--model", path], workdir)
        for num_replicas in replicas:
            label = "default" if num_replicas is None else str(num_replicas)
            log(f"served: starting pagedserve serve, ingress replicas: {label}")
            served = run_served(args, path, prompts, workdir, num_replicas)
            if served["failed"]:
                log(f"{served['failed']} requests failed: {served.get('errors')}")
            runs.append({"num_replicas": label, "report": report(offline, served), "served": served})
            print(json.dumps({"num_replicas": label, **runs[-1]["report"]}, indent=2), flush=True)
            if json_path:   # after each run: a step stopped at its limit keeps the runs it finished
                Path(json_path).write_text(json.dumps({"offline": offline, "runs": runs}, indent=2))
    return 0 if not any(run["served"]["failed"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
