"""The ``pagedserve`` command line: one argparse subcommand per action.

Adding a subcommand takes two functions and one line:

* ``_add_<name>_parser(subparsers)`` creates the subparser, declares its
  arguments and calls ``parser.set_defaults(run=_run_<name>)``;
* ``_run_<name>(args) -> int`` does the work and returns the exit status;
* append ``_add_<name>_parser`` to ``_PARSER_BUILDERS``.

Import heavy modules inside ``_run_*`` so that ``pagedserve --help`` and
argument errors stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pagedserve.argtypes import json_object, lora_module, non_negative_float, non_negative_int, port, positive_float, positive_int
from pagedserve.devtools.model_factory import ARCHS, MODEL_SIZES, SIZES


def _add_make_model_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight checkpoint (offline) in transformers format",
        description=(
            "Write config.json, model.safetensors, generation_config.json and a "
            "byte-level BPE tokenizer with a ChatML chat template into OUT. "
            "The same arch/size/seed always gives identical weights."
        ),
    )
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model family (default: llama)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny (~0.2M params), small (~25M), 1b (~852M, for GPU benchmarks), tiny-draft / small-draft (draft models of tiny and small for speculative decoding), or tiny-eagle / small-eagle and tiny-eagle3 / small-eagle3 (EAGLE and EAGLE-3 heads for them)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="weight seed (default: 0)")
    parser.set_defaults(run=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from pagedserve.devtools.model_factory import make_model

    out_dir = make_model(args.arch, args.size, args.out, seed=args.seed)
    print(out_dir)
    return 0


DEMO_PROMPTS = (
    "The paged KV cache splits every sequence into fixed-size blocks, so",
    "The paged KV cache splits every sequence into fixed-size blocks, and",
    "Serving a language model means",
    "Once upon a time",
)


def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="offline generation with the paged engine (the default demo)",
        description=("Generate for a few prompts through the paged engine and print the text, "
                     "per-request metrics and KV cache statistics. Without --model it builds "
                     "the random-weight tiny model into the cache directory first."),
    )
    parser.add_argument("--model", help="checkpoint directory or hub id (default: built tiny model)")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="arch of the built model")
    parser.add_argument("--size", choices=MODEL_SIZES, default="tiny", help="size of the built model")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: demo prompts)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    # Engine options: unset ones take the engine's defaults (workers/engine/engine_options.py).
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--num-device-blocks", type=int)
    parser.add_argument("--swap-space-gb", type=float)
    parser.add_argument("--device", help="cpu or cuda (default: cuda if present)")
    parser.set_defaults(run=_run_generate)


GENERATE_ENGINE_OPTIONS = ("block_size", "num_device_blocks", "swap_space_gb", "device")


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams
    from pagedserve.devtools.model_factory import ensure_model

    model = args.model or str(ensure_model(args.arch, args.size))
    try:
        given = {name: getattr(args, name) for name in GENERATE_ENGINE_OPTIONS}
        llm = LLM(model, **{name: value for name, value in given.items() if value is not None})
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, n=args.n, ignore_eos=True)
        outputs = llm.generate(list(args.prompt or DEMO_PROMPTS), params)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for output in outputs:
        print(f"prompt: {output.prompt!r}")
        for completion in output.outputs:
            print(f"  [{completion.index}] {completion.text!r} ({completion.finish_reason})")
        m = output.metrics
        print(f"  {m.num_prompt_tokens} prompt tokens ({m.num_cached_tokens} from the prefix cache), "
              f"{m.num_generated_tokens} generated, TTFT {m.time_to_first_token * 1e3:.0f} ms")
    stats = llm.stats()
    print(f"KV cache: {stats['num_device_blocks']} device blocks of {stats['block_size']} tokens, "
          f"{stats['device_blocks_cached']} cached for reuse, prefix hit rate "
          f"{stats['prefix_cache_hit_rate']:.0%}, {stats['num_steps']} engine steps")
    llm.check_integrity()
    return 0


def _add_config_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="validate or show a configuration",
        description="Check a pagedserve YAML file against the schema, or print the effective "
                    "configuration (defaults, then the file, then --set overrides).")
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    validate = actions.add_parser("validate", help="check FILE, and the model against it as 'serve' does (its "
                                                   "config only: a directory's, the hub cache's); exit 1 with "
                                                   "every problem listed")
    validate.add_argument("file")
    show = actions.add_parser(
        "show", help="print the merged effective configuration as YAML",
        description="The configuration 'serve' would run with the same FILE, --set and flags: "
                    "defaults, then the file, then --set, then the flags.")
    show.add_argument("file", nargs="?")
    show.add_argument("--model", help="checkpoint directory or hub id (model.path; 'serve' takes it as MODEL)")
    _add_config_sources(show, with_file=False)
    parser.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    import yaml

    from pagedserve.cluster.config import load_config

    try:
        if args.config_action == "validate":
            config = load_config(args.file)
        else:
            config = load_config(args.file, _overrides(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.config_action == "validate":
        status = _validate_model(args.file, config)
        if status == 0:
            _warn_local_shortfall(config)
        return status
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _validate_model(file: str, config) -> int:
    """The model checks ``serve`` makes (its config's before it starts anything, its class's beside
    Ray's start), on the model's config as this node has it without weights or the network
    (``bootstrap.cached_model_config``)."""
    from pagedserve.cluster.bootstrap import cached_model_config, check_model_fits

    try:
        model_config = cached_model_config(config.model)
        if model_config is not None:
            check_model_fits(config, model_config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if model_config is None:
        print(f"{file}: valid; the model was not checked: the config of {config.model.path!r} is not in "
              "this node's hub cache ('serve' fetches it and checks the model before it starts)")
    else:
        print(f"{file}: valid")
    return 0


def _warn_local_shortfall(config) -> None:
    """Warn (stderr) when a private Ray on this machine cannot hold the configuration's workers."""
    from pagedserve.cluster import ray_compat
    from pagedserve.cluster.capacity import format_resources, local_shortfall

    machine = ray_compat.local_node_resources()
    problems = local_shortfall(config, machine)
    if problems:
        print(f"warning: a private Ray on this machine ({format_resources(machine, machine)}) cannot start "
              "these workers ('serve' would stop, naming them); a cluster joined with --address may:\n  "
              + "\n  ".join(problems), file=sys.stderr)


# vLLM's `vllm serve` flags and the configuration keys they set (a flag wins over the file and --set).
VLLM_ENGINE_FLAGS = (
    ("--max-model-len", "engine.max_model_len", positive_int, "context length (prompt plus output)"),
    ("--gpu-memory-utilization", "engine.gpu_memory_utilization", positive_float,
     "fraction of GPU memory for weights, activations and KV cache (default 0.9)"),
    ("--max-num-seqs", "engine.max_num_seqs", positive_int, "sequences per engine step (default 256)"),
    ("--max-num-batched-tokens", "engine.max_num_batched_tokens", positive_int, "tokens per engine step"),
    ("--block-size", "engine.block_size", positive_int, "tokens per KV block (default 16)"),
    ("--swap-space", "engine.swap_space_gb", non_negative_float, "host swap space per worker, GiB"),
    ("--seed", "engine.seed", non_negative_int, "the engines' sampler seed (default: random)"),
    ("--stream-interval", "engine.stream_interval", positive_int,
     "a stream's tokens go out every N tokens (default 1; its first token and finish at once)"),
    ("--max-loras", "engine.max_loras", positive_int, "LoRA adapters one engine step may use (default 1)"),
    ("--max-lora-rank", "engine.max_lora_rank", positive_int, "the highest LoRA rank served (default 16)"),
    ("--max-cpu-loras", "engine.max_cpu_loras", positive_int,
     "LoRA adapters a worker keeps in host memory (default: max-loras)"),
)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def _add_config_sources(parser: argparse.ArgumentParser, with_file: bool = True) -> None:
    """``--config``/``--set`` and vLLM's engine and server flags, shared by ``serve`` and ``config show``."""
    if with_file:
        parser.add_argument("--config", metavar="FILE", help="YAML configuration (default: the embedded default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key by its dotted path, e.g. engine.block_size=32 (repeatable)")
    vllm = parser.add_argument_group("vLLM's flags (each sets its configuration key and wins over the file)")
    vllm.add_argument("--served-model-name", nargs="+", metavar="NAME",
                      help="the model id clients send (model.name; one name)")
    vllm.add_argument("--revision", help="hub revision: branch, tag or commit (model.revision)")
    vllm.add_argument("--download-dir", help="hub download cache on every node (model.download_dir)")
    vllm.add_argument("--trust-remote-code", action="store_true", default=None,
                      help="run the checkpoint's own code (its config.json's auto_map) on every node, for a "
                           "checkpoint you trust (model.trust_remote_code)")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=positive_int,
                      help="GPUs (ranks) per model replica (engine.tensor_parallel_size; a worker group's "
                           "workers[].tensor_parallel_size wins); the model's head counts must divide by it")
    vllm.add_argument("--dtype", choices=DTYPES, help="weights and activations (engine.dtype; default auto)")
    for flag, key, kind, text in VLLM_ENGINE_FLAGS:
        vllm.add_argument(flag, type=kind, help=f"{text} ({key})")
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                      help="reuse cached prompt prefixes (engine.enable_prefix_caching; default on)")
    vllm.add_argument("--enforce-eager", action="store_true", default=None,
                      help="every step eager: no CUDA graphs and, unless set, no torch.compile "
                           "(engine.enforce_eager)")
    vllm.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                      help="plan step n + 1 while step n runs (engine.async_scheduling; default on with CUDA)")
    vllm.add_argument("--cuda-graph-sizes", type=positive_int, nargs="+", metavar="N",
                      help="decode batch sizes captured as CUDA graphs (engine.cuda_graph_sizes)")
    vllm.add_argument("--speculative-config", type=json_object, metavar="JSON",
                      help="speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4}' (engine.speculative_config)")
    vllm.add_argument("--enable-lora", action="store_true", default=None,
                      help="serve LoRA adapters on the base model (engine.enable_lora)")
    vllm.add_argument("--lora-modules", nargs="+", type=lora_module, metavar="NAME=PATH",
                      help="LoRA adapters clients select by NAME as 'model': NAME=PATH, or vLLM's JSON form "
                           "'{\"name\": ..., \"path\": ...}' (model.lora_modules; needs --enable-lora)")
    vllm.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                      help="open /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING; model.allow_runtime_lora_updating; needs --enable-lora)")
    vllm.add_argument("--tool-call-parser", help="how 'auto' tool choice reads calls (server.tool_call_parser)")
    vllm.add_argument("--reasoning-parser", help="split a reasoning model's thinking from its answer: deepseek_r1, "
                                                 "qwen3 or openai_gptoss (server.reasoning_parser)")
    vllm.add_argument("--generation-config", metavar="auto|vllm|FOLDER",
                      help="sampling defaults for fields a request leaves out: the model's generation_config.json "
                           "(auto), none (vllm), or a folder's (server.generation_config)")
    vllm.add_argument("--override-generation-config", type=json_object, metavar="JSON",
                      help="sampling defaults that win over the generation config's, e.g. '{\"temperature\": 0.5}' "
                           "(server.override_generation_config)")
    vllm.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                      help="a Jinja chat template in place of the tokenizer's: a file, or the template itself "
                           "(server.chat_template)")
    vllm.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted for vLLM's command lines: 'auto' tool choice is always on here")
    vllm.add_argument("--host", help="HTTP host (server.host; default 127.0.0.1, loopback only: other "
                                     "interfaces, e.g. 0.0.0.0, only when set explicitly)")
    vllm.add_argument("--port", type=port, help="HTTP port (server.port)")
    vllm.add_argument("--grpc-port", type=port, help="gRPC port (server.grpc_port; default: off)")
    vllm.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (server.api_key, or "
                                        "$PAGEDSERVE_API_KEY)")


class FlagError(ValueError):
    """A flag's value cannot be served (the message names the flag)."""


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides, then the flags' own (so a flag wins over ``--set`` and the file)."""
    overrides = list(args.overrides)
    model = getattr(args, "model", None) or getattr(args, "model_flag", None)
    if model:
        overrides.append(f"model.path={_yaml_text(model)}")
    names = args.served_model_name or []
    if len(names) > 1:
        raise FlagError(f"--served-model-name: one name is served, got {len(names)} ({', '.join(names)})")
    if names:
        overrides.append(f"model.name={_yaml_text(names[0])}")
    if args.tensor_parallel_size is not None:
        overrides.append(f"engine.tensor_parallel_size={args.tensor_parallel_size}")
    for attribute, key in (("revision", "model.revision"), ("download_dir", "model.download_dir"),
                           ("dtype", "engine.dtype"), ("tool_call_parser", "server.tool_call_parser"),
                           ("reasoning_parser", "server.reasoning_parser"),
                           ("chat_template", "server.chat_template"), ("generation_config", "server.generation_config"),
                           ("host", "server.host")):
        value = getattr(args, attribute)
        if value is not None:
            overrides.append(f"{key}={_yaml_text(value)}")
    for flag, key, _, _ in VLLM_ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides.append(f"{key}={value}")
    for attribute in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "enable_lora"):
        if getattr(args, attribute) is not None:
            overrides.append(f"engine.{attribute}={str(getattr(args, attribute)).lower()}")
    if args.cuda_graph_sizes:
        overrides.append(f"engine.cuda_graph_sizes=[{', '.join(map(str, args.cuda_graph_sizes))}]")
    if args.speculative_config is not None:
        overrides.append(f"engine.speculative_config={json.dumps(args.speculative_config)}")  # YAML reads JSON
    if args.override_generation_config is not None:
        overrides.append(f"server.override_generation_config={json.dumps(args.override_generation_config)}")
    if args.lora_modules:
        overrides.append(f"model.lora_modules={json.dumps(args.lora_modules)}")
    for attribute in ("trust_remote_code", "allow_runtime_lora_updating"):
        if getattr(args, attribute):
            overrides.append(f"model.{attribute}=true")
    for attribute in ("port", "grpc_port"):
        if getattr(args, attribute) is not None:
            overrides.append(f"server.{attribute}={getattr(args, attribute)}")
    for attribute in ("log_requests", "store_responses"):
        if getattr(args, attribute, False):
            overrides.append(f"server.{attribute}=true")
    return overrides


def _yaml_text(value: str) -> str:
    """``value`` as a YAML string scalar, so that ``--set``'s parsing keeps it a string."""
    return json.dumps(value)


def _add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API (and gRPC) on Ray Serve",
        description=("Start a private Ray (or join --address / $RAY_ADDRESS), the KV manager and the workers "
                     "the config asks for, and the Ray Serve application; print the endpoints and block "
                     "until Ctrl-C or SIGTERM ('pagedserve stop'). With no arguments: one CPU worker and the "
                     "tiny model (built on first start). Takes vLLM's flags: 'pagedserve serve MODEL "
                     "--max-model-len 8192' as 'vllm serve' would."),
    )
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="checkpoint directory or hub id (model.path; default: the built tiny model)")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", help=argparse.SUPPRESS)
    _add_config_sources(parser)
    parser.add_argument("--log-requests", action="store_true",
                        help="log prompts and completions (config server.log_requests; default: off)")
    parser.add_argument("--store-responses", action="store_true",
                        help="keep the Responses API's responses for retrieval and previous_response_id "
                             "(server.store_responses, vLLM's VLLM_ENABLE_RESPONSES_API_STORE; default: off)")
    parser.add_argument("--address", metavar="RAY_ADDRESS",
                        help="join this Ray cluster ('auto': the one running on this machine; default: "
                             "$RAY_ADDRESS if set, else a private Ray that stops with the server)")
    parser.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import os

    from pagedserve.cluster.config import load_config
    from pagedserve.cluster.launcher import serve_forever

    try:   # serve_forever refuses a taken port, then a model the workers cannot serve
        config = load_config(args.config, _overrides(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api_key = args.api_key or config.server.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    if api_key:
        config.server.api_key = api_key  # not through --set: a key must stay a string
    return serve_forever(config, address=args.address or os.environ.get("RAY_ADDRESS") or None)


def _add_status_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="show workers, pools, prefix-cache hit rates and queues of the running server",
        description=("Join the Ray cluster and ask the running pagedserve application for its stats. "
                     "Without --address: the cluster of the server on --port (or of the only one "
                     "'pagedserve serve' runs on this machine), else 'auto'."))
    parser.add_argument("--address", metavar="RAY_ADDRESS", help="the Ray cluster to query")
    parser.add_argument("--port", type=port, help="the server's HTTP port, when several run here")
    parser.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    parser.set_defaults(run=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from pagedserve.cluster.launcher import fetch_status, format_status

    try:
        stats = fetch_status(args.address, port=args.port)
    except Exception as exc:  # no cluster, no app: say so rather than a traceback
        print(f"error: no running pagedserve server found: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, default=str) if args.json else format_status(stats))
    return 0


STOP_TIMEOUT_S = 60.0   # launcher.STOP_TIMEOUT_S (not imported: 'pagedserve --help' stays fast)


def _add_stop_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "stop", help="stop a server 'pagedserve serve' started on this machine",
        description=("Send SIGTERM to the 'pagedserve serve' on --port (or to every one, --all; with one "
                     "running, to it), print each stage of its shutdown, and after --timeout kill it and "
                     "every process under it (its private Ray's). With several running and neither "
                     "flag, list them and stop none."))
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--port", type=port, help="the server's HTTP port")
    target.add_argument("--all", dest="stop_all", action="store_true", help="every server on this machine")
    parser.add_argument("--timeout", type=positive_float, default=STOP_TIMEOUT_S,
                        help=f"seconds to wait before killing it (default {STOP_TIMEOUT_S:g})")
    parser.set_defaults(run=_run_stop)


def _run_stop(args: argparse.Namespace) -> int:
    from pagedserve.cluster.launcher import stop_server

    return stop_server(args.timeout, port=args.port, stop_all=args.stop_all)


def _add_bench_parser(subparsers) -> None:
    # ``bench`` has its own subcommands; they live with the benchmarks (cheap to import).
    from pagedserve.bench.cli import add_bench_parser

    add_bench_parser(subparsers)


# One entry per subcommand; each adds its subparser to the given subparsers.
_PARSER_BUILDERS = (_add_make_model_parser, _add_generate_parser, _add_config_parser,
                    _add_serve_parser, _add_status_parser, _add_stop_parser, _add_bench_parser)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving built around a paged KV cache.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in _PARSER_BUILDERS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen subcommand, return its exit status.

    Bad arguments print usage and exit with status 2 (argparse's convention).
    """
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
