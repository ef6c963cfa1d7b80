"""The default workload of ``bench_engine_gpu.py`` served over HTTP, against ``LLM.generate``.

Three parts, each in processes of their own so that the GPU is free for the next:

1. offline: ``bench_engine_gpu.py --contenders pagedserve`` on the workload (256 prompts of
   128-1,024 tokens, 256 output tokens each, EOS ignored, llama-1b in bf16 by default): its
   output tok/s and decode step;
2. served: ``pagedserve serve`` with the same checkpoint and engine options (one worker, the
   default ingress), then the same prompts and lengths streamed from ``/v1/completions``, all
   at once (``pagedserve bench serve``'s client), with every server process's CPU read
   (``--cpu-per-token``'s probe);
3. the report: served over offline output tok/s, TTFT and ITL percentiles, ITL p99 over the
   offline decode step, and CPU per streamed token by process.

    python benchmarks/bench_served_gpu.py [--size 1b] [--device cuda] [--json PATH]
    python benchmarks/bench_served_gpu.py --device cpu --size tiny --num-requests 16 \\
        --min-prompt 16 --max-prompt 64 --output-len 32          # a smoke run on the CPU
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
                    "--json", path], check=True)
    with open(path) as f:
        return json.load(f)


def engine_options(args) -> dict:
    """The engine options of ``bench_engine_gpu.py``'s pagedserve contender."""
    options = {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}
    if args.kv_cache_gb:
        options["kv_cache_memory_gb"] = args.kv_cache_gb
    return options


def write_config(path: str, args, port: int, workdir: str) -> str:
    """The served run's configuration: the checkpoint, the engine options, one worker."""
    import yaml

    config = {"model": {"path": path}, "engine": engine_options(args),
              "workers": [{"count": 1, **({"num_gpus": 1} if args.device.startswith("cuda") else {})}],
              "server": {"port": port}}
    config_path = os.path.join(workdir, "served.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    return config_path


def run_served(args, path: str, prompts: list[list[int]], workdir: str) -> dict:
    from pagedserve.bench.serve import CpuPerTokenConfig, ServeBenchConfig, run_benchmark

    port = args.port
    server = start_server(["--config", write_config(path, args, port, workdir)], port,
                          os.path.join(workdir, "serve.log"), timeout_s=START_TIMEOUT_S)
    try:
        config = ServeBenchConfig(url=f"http://127.0.0.1:{port}", num_requests=len(prompts),
                                  num_warmups=min(len(prompts), 32), seed=args.seed + 2,
                                  request_timeout_s=1800.0, max_duration_s=1800.0)
        requests = [(prompt, len(prompt), args.output_len) for prompt in prompts]
        return run_benchmark(config, show_progress=False, cpu=CpuPerTokenConfig(server_pid=server.pid),
                             requests=requests)
    finally:
        stop_server(server)


def report(offline: dict, served: dict) -> dict:
    pagedserve = offline["results"][bench_engine_gpu.LABELS["pagedserve"]]
    offline_tps = pagedserve["output_tok_per_s"]
    decode_ms = pagedserve.get("decode_step_ms")
    cpu = served.get("cpu_per_token") or {}
    return {
        "offline_output_tok_s": offline_tps, "served_output_tok_s": served["output_throughput"],
        "served_over_offline": served["output_throughput"] / offline_tps,
        "offline_decode_step_ms": decode_ms,
        "ttft_ms": {q: served[f"p{q}_ttft_ms"] for q in (50, 90, 99)},
        "itl_ms": {q: served[f"p{q}_itl_ms"] for q in (50, 90, 99)},
        "itl_p99_over_offline_step": served["p99_itl_ms"] / decode_ms if decode_ms else None,
        "cpu_us_per_token": {name: group["us_per_token"] for name, group in (cpu.get("groups") or {}).items()},
        "server_cpu_us_per_token": (cpu.get("server_total") or {}).get("us_per_token"),
        "completed": served["completed"], "failed": served["failed"], "errors": served.get("errors"),
    }


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
    args = bench_engine_gpu.parse_args(argv)
    args.port = port
    from transformers import AutoConfig

    from pagedserve.bench.replay import resolve_model

    path = resolve_model(args.model, args.arch, args.size)
    model_config = AutoConfig.from_pretrained(path)
    prompts, _ = bench_engine_gpu.make_prompts(args, model_config.vocab_size,
                                                getattr(model_config, "max_position_embeddings", 2048))
    with tempfile.TemporaryDirectory(prefix="served-gpu-") as workdir:
        log(f"offline: {len(prompts)} prompts, {args.output_len} output tokens each")
        offline = run_offline([*argv, "--model", path], workdir)
        log("served: starting pagedserve serve")
        served = run_served(args, path, prompts, workdir)
        if served["failed"]:
            log(f"{served['failed']} requests failed: {served.get('errors')}")
        result = report(offline, served)
    print(json.dumps(result, indent=2), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"report": result, "offline": offline, "served": served}, indent=2))
    return 0 if not served["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
