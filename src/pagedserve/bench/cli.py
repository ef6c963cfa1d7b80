"""Arguments of ``pagedserve bench <allocators|prefix|serve|offline|kv-scale>``.

Only argparse and the shared argument types of ``pagedserve.argtypes`` are
imported here; each ``_run_*`` imports its benchmark module (torch,
transformers, matplotlib) when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from pagedserve.argtypes import non_negative_float, non_negative_int, port, positive_float, positive_int

SIZES = ("tiny", "small")
DISTRIBUTIONS = ("lognormal", "uniform", "fixed")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--plot-dir", metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--seed", type=non_negative_int, default=None, help="workload seed (default: 0)")


def _add_model_arguments(parser: argparse.ArgumentParser, threads: bool = True) -> None:
    parser.add_argument("--model", help="checkpoint directory or hub id (default: the built random model)")
    parser.add_argument("--arch", default=None, help="arch of the built model (default: llama)")
    parser.add_argument("--size", choices=SIZES, default=None,
                        help="size of the built model (default: the preset's; see docs/benchmarks.md)")
    parser.add_argument("--num-requests", type=positive_int, default=None)
    parser.add_argument("--quick", action="store_true", help="a smaller run (under 3 minutes on 2 CPU cores)")
    if threads:
        parser.add_argument("--num-threads", type=non_negative_int, default=None,
                            help="torch threads for every engine (default: 1, which stays fast when other "
                                 "processes share the cores; 0: torch's default)")


def _add_length_arguments(parser: argparse.ArgumentParser, name: str, what: str) -> None:
    parser.add_argument(f"--{name}-len-mean", type=positive_float, default=None, help=f"mean {what} length")
    parser.add_argument(f"--{name}-len-min", type=positive_int, default=None)
    parser.add_argument(f"--{name}-len-max", type=positive_int, default=None)
    parser.add_argument(f"--{name}-len-dist", choices=DISTRIBUTIONS, default=None,
                        help="length distribution (default: lognormal)")


def _length(args: argparse.Namespace, name: str, default):
    """The preset's ``LengthDist`` with any of ``--<name>-len-*`` applied."""
    changes = {field: getattr(args, f"{name}_len_{arg}") for field, arg in
               (("mean", "mean"), ("low", "min"), ("high", "max"), ("kind", "dist"))}
    changes = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(default, **changes) if changes else default


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The options among ``names`` given on the command line (not None), by name."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _common_changes(args: argparse.Namespace) -> dict:
    return _given(args, "model", "arch", "size", "num_requests", "seed", "num_threads")


def _finish(args, data: dict, text: str) -> int:
    print(text)
    if args.out:
        print(f"wrote {args.out}")
    if args.plot_dir:
        print(f"plots in {args.plot_dir}")
    return 0


# ---- allocators --------------------------------------------------------------------------
def _add_allocators_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "allocators", help="contiguous vs paged vs paged+prefix on one KV budget, and fragmentation",
        description=("Run one mixed workload with shared prefixes under the contiguous, paged and "
                     "paged+prefix allocators on the same engine and number of device blocks; report "
                     "time-averaged KV utilisation, max concurrent sequences, preemptions, p99 latency "
                     "and output throughput beside the seed's table; then simulate external "
                     "fragmentation under random alloc/free."))
    _add_model_arguments(parser)
    _add_output_arguments(parser)
    parser.add_argument("--num-device-blocks", type=positive_int, default=None)
    parser.add_argument("--block-size", type=positive_int, default=None)
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="the length contiguous reserves per sequence (default: 1024; 512 with --quick)")
    parser.add_argument("--request-rate", type=positive_float, default=None,
                        help="Poisson arrivals, requests/s (default: inf, all at once)")
    parser.add_argument("--allocator", action="append", choices=("contiguous", "paged", "paged+prefix"),
                        help="run only these (repeatable; default: all three)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="runs per allocator, round robin; rows are per-metric medians "
                             "(default: 1; 3 with --quick)")
    parser.add_argument("--fragmentation-trials", type=non_negative_int, default=None,
                        help="seeds of the fragmentation simulation (0 skips it)")
    _add_length_arguments(parser, "prompt", "unique prompt part")
    _add_length_arguments(parser, "output", "output")
    parser.set_defaults(run=_run_allocators)


def _run_allocators(args: argparse.Namespace) -> int:
    from . import allocators

    base = allocators.QUICK_CONFIG if args.quick else allocators.DEFAULT_CONFIG
    changes = {**_common_changes(args), **_given(args, "num_device_blocks", "block_size", "max_model_len",
                                                   "request_rate", "repeats", "fragmentation_trials")}
    if args.allocator:
        changes["allocators"] = tuple(dict.fromkeys(args.allocator))
    changes["prompt_len"] = _length(args, "prompt", base.prompt_len)
    changes["output_len"] = _length(args, "output", base.output_len)
    config = dataclasses.replace(base, **changes)
    run_fragmentation = config.fragmentation_trials > 0
    data = allocators.run_benchmark(config, out=args.out, plot_dir=args.plot_dir,
                                    show_progress=not args.no_progress, run_fragmentation=run_fragmentation)
    return _finish(args, data, allocators.format_results(data, config))


# ---- prefix ------------------------------------------------------------------------------
def _add_prefix_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "prefix", help="TTFT with and without prefix caching on a shared system prompt",
        description=("Requests share a system prompt (default 1,024 tokens) and add a unique suffix "
                     "(64 tokens). Reports TTFT with prefix caching off and on, and the hit rate against "
                     "the theoretical maximum; the target is a 5x faster TTFT."))
    _add_model_arguments(parser)
    _add_output_arguments(parser)
    parser.add_argument("--prefix-len", type=positive_int, default=None)
    parser.add_argument("--suffix-len", type=positive_int, default=None)
    parser.add_argument("--max-tokens", type=positive_int, default=None)
    parser.add_argument("--max-model-len", type=positive_int, default=None)
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="requests in flight (default: 1, so TTFT is the prefill alone)")
    parser.set_defaults(run=_run_prefix)


def _run_prefix(args: argparse.Namespace) -> int:
    from . import prefix

    base = prefix.QUICK_CONFIG if args.quick else prefix.DEFAULT_CONFIG
    changes = {**_common_changes(args), **_given(args, "prefix_len", "suffix_len", "max_tokens", "max_model_len",
                                                   "max_concurrency")}
    config = dataclasses.replace(base, **changes)
    data = prefix.run_benchmark(config, out=args.out, plot_dir=args.plot_dir, show_progress=not args.no_progress)
    return _finish(args, data, prefix.format_results(data))


# ---- serve -------------------------------------------------------------------------------
def _add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="online load against an OpenAI-compatible server (vllm bench serve's metrics)",
        description=("Stream /v1/completions requests with Poisson arrivals (or a fixed concurrency) and "
                     "report request and output-token throughput, TTFT, TPOT, ITL and end-to-end latency "
                     "(mean, median, p90, p99) and errors, under vllm bench serve's names. Takes "
                     "vllm bench serve's main flags (--base-url, --num-prompts, --random-input-len, ...)."))
    parser.add_argument("--url", "--base-url", dest="url",
                        help="server base URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="server host when no --base-url (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="server port when no --base-url (default 8000)")
    parser.add_argument("--backend", choices=("vllm", "openai"), default="openai",
                        help="vllm bench serve's backends that stream /v1/completions (both the same here)")
    parser.add_argument("--endpoint", choices=("/v1/completions",), default="/v1/completions")
    parser.add_argument("--model", "--served-model-name", dest="model",
                        help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=positive_int, default=64)
    parser.add_argument("--request-rate", type=positive_float, default=math.inf,
                        help="requests/s, Poisson (default: inf, all at once)")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="vllm's arrival shape; only 1.0 (Poisson) here")
    parser.add_argument("--max-concurrency", type=positive_int, default=None)
    parser.add_argument("--dataset-name", choices=("random",), default="random",
                        help="random token-id prompts (vllm's 'random' dataset)")
    parser.add_argument("--random-input-len", type=positive_int, default=None,
                        help="prompt tokens, uniform in [N(1-R), N(1+R)] with R = --random-range-ratio")
    parser.add_argument("--random-output-len", type=positive_int, default=None, help="output tokens, likewise")
    parser.add_argument("--random-range-ratio", type=non_negative_float, default=0.0,
                        help="spread of the random lengths, in [0, 1) (default 0: fixed lengths)")
    parser.add_argument("--prompt-format", choices=("token-ids", "text"), default="token-ids")
    parser.add_argument("--vocab-size", type=positive_int, default=1000, help="range of random prompt ids")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--ignore-eos", action="store_true", help="generate every output token (the default here)")
    eos.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a request early")
    parser.add_argument("--max-duration", type=positive_float, default=600.0,
                        help="seconds after which no new request starts")
    parser.add_argument("--request-timeout", type=positive_float, default=300.0)
    parser.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY if set)")
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON into --result-dir")
    parser.add_argument("--result-dir", default=".", help="with --save-result (default: the current directory)")
    parser.add_argument("--result-filename", default=None,
                        help="with --save-result (default: <backend>-<rate>qps-<model>-<time>.json)")
    parser.add_argument("--disable-tqdm", dest="no_progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--num-warmups", type=non_negative_int, default=None,
                        help="untimed requests first, other prompts of the same lengths (default: 4 with "
                             "--cpu-per-token, else 0)")
    cpu = parser.add_argument_group(
        "CPU per token (the server's processes on this machine, read with psutil; needs pagedserve[bench])")
    cpu.add_argument("--cpu-per-token", action="store_true",
                     help="report the CPU time of each of the server's processes (by role: Serve replica, "
                          "proxy actor, HAProxy, each worker and engine core, controllers, KV manager, "
                          "Ray's daemons) over the timed load, per streamed output token, and the client's")
    cpu.add_argument("--server-pid", type=positive_int, default=None,
                     help="the server's root process (default: the 'pagedserve serve' its state file records)")
    cpu.add_argument("--offline-baseline", action="store_true",
                     help="then run the same requests through LLM.generate (one torch thread) in a process "
                          "of its own: serving adds = the server's CPU per token less the engine's")
    cpu.add_argument("--offline-rounds", type=positive_int, default=None,
                     help="the offline call's timed rounds, one after another in its process; their median "
                          "is the baseline (default: 3)")
    cpu.add_argument("--offline-cpus", type=_cpu_list, default=None,
                     help="the offline run on these CPUs only, comma-separated (a served run whose engine core "
                          "was pinned: the same CPU)")
    cpu.add_argument("--offline-model", default=None,
                     help="the offline run's checkpoint (default: the served one the state file records, "
                          "with its engine options; else the built tiny model)")
    _add_length_arguments(parser, "input", "prompt")
    _add_length_arguments(parser, "output", "output")
    _add_output_arguments(parser)
    parser.set_defaults(run=_run_serve)


def _random_length(args: argparse.Namespace, name: str, default):
    """vllm's ``--random-<name>-len`` with ``--random-range-ratio``, else ``--<name>-len-*``."""
    from .workload import LengthDist

    mean = getattr(args, f"random_{name}_len")
    if mean is None:
        return _length(args, name, default)
    ratio = args.random_range_ratio
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    if ratio == 0:
        return LengthDist(mean=mean, low=mean, high=mean, kind="fixed")
    return LengthDist(mean=mean, low=max(1, round(mean * (1 - ratio))), high=round(mean * (1 + ratio)),
                      kind="uniform")


def serve_bench_config(args: argparse.Namespace):
    """The ``ServeBenchConfig`` of ``bench serve``'s arguments; ValueError naming a bad one."""
    import os

    from . import serve

    if args.burstiness != 1.0:
        raise ValueError(f"--burstiness {args.burstiness}: only Poisson arrivals (1.0) are supported")
    defaults = serve.ServeBenchConfig(url="http://placeholder")
    return serve.ServeBenchConfig(
        url=args.url or f"http://{args.host}:{args.port}", model=args.model, num_requests=args.num_requests,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        input_len=_random_length(args, "input", defaults.input_len),
        output_len=_random_length(args, "output", defaults.output_len), prompt_format=args.prompt_format,
        vocab_size=args.vocab_size, ignore_eos=not args.no_ignore_eos, max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        seed=args.seed or 0,
        num_warmups=args.num_warmups if args.num_warmups is not None else 4 if args.cpu_per_token else 0)


def cpu_per_token_config(args: argparse.Namespace):
    """The ``CpuPerTokenConfig`` of ``bench serve``'s arguments, None without ``--cpu-per-token``."""
    from . import serve

    if not args.cpu_per_token:
        for flag in ("server_pid", "offline_model"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --cpu-per-token")
        if args.offline_baseline:
            raise ValueError("--offline-baseline needs --cpu-per-token")
    for flag in ("offline_rounds", "offline_cpus"):
        if getattr(args, flag) is not None and not args.offline_baseline:
            raise ValueError(f"--{flag.replace('_', '-')} needs --offline-baseline")
    if not args.cpu_per_token:
        return None
    rounds = {} if args.offline_rounds is None else {"offline_rounds": args.offline_rounds}
    return serve.CpuPerTokenConfig(server_pid=args.server_pid, offline=args.offline_baseline,
                                   offline_model=args.offline_model, offline_cpus=args.offline_cpus, **rounds)


def _cpu_list(text: str) -> tuple[int, ...]:
    """``--offline-cpus``: CPU numbers, comma-separated."""
    try:
        cpus = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPU numbers separated by commas, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"expected CPU numbers of 0 or more, got {text!r}")
    return cpus


def _result_path(args: argparse.Namespace, config) -> str | None:
    if args.out or not args.save_result:
        return args.out
    import datetime
    from pathlib import Path

    name = args.result_filename or (f"{args.backend}-{config.request_rate:g}qps-"
                                    f"{(config.model or 'model').replace('/', '-')}-"
                                    f"{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    return str(Path(args.result_dir) / name)


def _run_serve(args: argparse.Namespace) -> int:
    from . import serve

    try:
        config = serve_bench_config(args)
        cpu = cpu_per_token_config(args)
        if cpu is not None:   # the server is found before any load is sent
            from .process_cpu import find_server_root

            find_server_root(config.url, cpu.server_pid)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out = _result_path(args, config)
    data = serve.run_benchmark(config, out=args.out, plot_dir=args.plot_dir, show_progress=not args.no_progress,
                               cpu=cpu)
    _finish(args, data, serve.format_results(data))
    return 0 if data["completed"] else 1


# ---- offline -----------------------------------------------------------------------------
def _add_offline_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "offline", help="offline throughput against transformers generate and generate_batch",
        description=("Output tokens/s of LLM.generate beside transformers generate (static batches) and "
                     "generate_batch on the same checkpoint and requests, with MFU against a matmul rate "
                     "measured in the same run. Default workload: ShareGPT-like log-normal lengths."))
    _add_model_arguments(parser)
    _add_output_arguments(parser)
    parser.add_argument("--static-batch", type=positive_int, default=None, help="default: 16")
    parser.add_argument("--skip-transformers", action="store_true")
    _add_length_arguments(parser, "prompt", "prompt")
    _add_length_arguments(parser, "output", "output")
    parser.set_defaults(run=_run_offline)


def _run_offline(args: argparse.Namespace) -> int:
    from . import offline

    base = offline.QUICK_CONFIG if args.quick else offline.DEFAULT_CONFIG
    changes = _common_changes(args)
    if args.static_batch is not None:
        changes["static_batch"] = args.static_batch
    changes["skip_transformers"] = args.skip_transformers
    changes["prompt_len"] = _length(args, "prompt", base.prompt_len)
    changes["output_len"] = _length(args, "output", base.output_len)
    config = dataclasses.replace(base, **changes)
    data = offline.run_benchmark(config, out=args.out, plot_dir=args.plot_dir, show_progress=not args.no_progress)
    return _finish(args, data, offline.format_results(data))


# ---- kv-scale ----------------------------------------------------------------------------
def _add_kv_scale_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "kv-scale", help="central KV manager cost per worker-step, N simulated workers on local Ray",
        description=("Drive N simulated workers (the real worker-side KV code, no model) against the real "
                     "central KV manager actor on a local Ray cluster, several per process, each at R "
                     "steps/s, with shared prefixes, decode growth, finishes and pool pressure that forces "
                     "preemptions. Reports central CPU and bytes per worker-step, blocking calls per step, "
                     "event lag p99, workers supported at 50 steps/s = 1e6 / (50 * central CPU us per "
                     "worker-step), preemptions by mode and integrity."))
    parser.add_argument("--workers", type=positive_int, default=32, help="simulated workers N (default: 32)")
    parser.add_argument("--batch", type=positive_int, default=256, help="running sequences per worker B")
    parser.add_argument("--context", type=positive_int, default=4096, help="mean context length L, tokens")
    parser.add_argument("--steps-per-s", type=positive_float, default=50.0, help="steps/s per worker R")
    parser.add_argument("--seconds", type=positive_float, default=20.0, help="measured seconds S")
    parser.add_argument("--workers-per-process", type=positive_int, default=16)
    parser.add_argument("--flush-ms", type=positive_float, default=20.0,
                        help="each worker publishes its KV events this often, in simulated time (every "
                             "round(flush_ms * R / 1000) steps, whatever this machine's pace; default: 20, the "
                             "cluster's kv_events.max_batch_age_s: every step at 50 steps/s; 60: the message "
                             "rate of --publish-on-tick at pace)")
    parser.add_argument("--replay", action="store_true",
                        help="each worker records its KV code's steps before the window (unpaced) and replays "
                             "their pool changes at the pace in it, through the real event log, publisher, "
                             "relays and central manager: the pace on a machine too small to run the KV code "
                             "at it (preemptions are decided locally while recording, so nothing migrates)")
    parser.add_argument("--publish-on-tick", action="store_true",
                        help="workers publish as the cluster's kv_events.publish_on_tick has them: drained "
                             "and sent just before each --relay-flush-ms tick of wall time (--flush-ms unused)")
    parser.add_argument("--pressure-per-s", type=float, default=0.2,
                        help="per worker, random requests sized to take the pool's free room (default: 0.2)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--transport", choices=("zmq", "ray"), default="zmq",
                        help="workers' KV events: over ZeroMQ (the cluster's default) or one Ray actor call "
                             "per batch (default: zmq)")
    parser.add_argument("--workers-per-node", type=non_negative_int, default=8,
                        help="simulated workers per node: each node's workers publish through one KV event "
                             "relay actor (--transport zmq), N / K relays in all; 0: no relays, every worker "
                             "straight to the central manager (default: 8)")
    parser.add_argument("--relay-flush-ms", type=positive_float, default=60.0,
                        help="relays forward what their workers sent, one message each, at every multiple "
                             "of this much wall time, and the central manager drains just after (default: "
                             "60, the cluster's kv_events.relay_flush_s)")
    parser.add_argument("--central-cpus", type=non_negative_int, nargs="+", metavar="CPU",
                        help="pin the central KV manager's process to these CPUs and every other process "
                             "of the run (simulated workers, Ray's own) to the rest, as a central manager "
                             "on its own host would run (Linux; default: no pinning)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.set_defaults(run=_run_kv_scale)


def _run_kv_scale(args: argparse.Namespace) -> int:
    from . import kv_scale

    if args.pressure_per_s < 0:
        raise SystemExit("--pressure-per-s must be >= 0")
    config = kv_scale.KVScaleConfig(
        num_workers=args.workers, batch=args.batch, context=args.context, steps_per_s=args.steps_per_s,
        seconds=args.seconds, workers_per_process=args.workers_per_process,
        publish_on_tick=args.publish_on_tick, replay=args.replay, flush_interval_s=args.flush_ms / 1e3,
        pressure_per_s=args.pressure_per_s, seed=args.seed, transport=args.transport,
        central_cpus=tuple(args.central_cpus or ()),
        workers_per_node=args.workers_per_node if args.transport == "zmq" else 0,
        relay_flush_s=args.relay_flush_ms / 1e3)
    result = kv_scale.run_kv_scale(config, out=args.json)
    print(kv_scale.format_results(result))
    if args.json:
        print(f"wrote {args.json}")
    return 0 if result["integrity_ok"] else 1


_BENCH_BUILDERS = (_add_allocators_parser, _add_prefix_parser, _add_serve_parser, _add_offline_parser,
                   _add_kv_scale_parser)


def add_bench_parser(subparsers) -> None:
    """Add ``bench`` and its subcommands to the top-level ``subparsers``."""
    parser = subparsers.add_parser(
        "bench", help="benchmarks: allocators, prefix caching, online serving, offline throughput, KV scale",
        description="Benchmarks that write JSON (--out) and PNG plots (--plot-dir).")
    bench_subparsers = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for add_parser in _BENCH_BUILDERS:
        add_parser(bench_subparsers)
