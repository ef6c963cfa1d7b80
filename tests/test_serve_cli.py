"""``pagedserve serve`` as vLLM and Ray users run it: vLLM's flags mapped onto the
configuration (``config show`` prints what they make), a private Ray unless an
address is named, and joining a running cluster by its address with the
cluster's token authentication (``serve``, ``status``, ``stop``).

The end-to-end test starts a Ray head of its own first (``fake_cluster.LocalRayHead``:
its own ports and temp dir, token auth with a token of the test's, never
``ray stop``) and runs the CLI as a user would, in subprocesses: a server joined to that
head and one on a private Ray, side by side on one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pagedserve.cluster.cli import build_parser, main
from served_cluster import ServeProcess

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _show(*args: str, capsys) -> dict:
    assert main(["config", "show", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


# ---- vLLM's command line ------------------------------------------------------------------------
def test_vllm_flags_set_the_configuration_and_win_over_file_and_set(tmp_path, capsys):
    file = tmp_path / "serve.yaml"
    file.write_text(yaml.safe_dump({"engine": {"block_size": 8, "max_num_seqs": 4},
                                    "server": {"port": 7000}, "model": {"name": "from-file"}}))
    config = _show(str(file), "--model", "Qwen/Qwen2.5-7B-Instruct", "--set", "engine.block_size=32",
                   "--block-size", "64", "--max-model-len", "8192", "--gpu-memory-utilization", "0.8",
                   "--dtype", "bfloat16", "--served-model-name", "qwen", "--no-enable-prefix-caching",
                   "--max-num-seqs", "128", "--port", "9001", "--host", "0.0.0.0", "--swap-space", "2",
                   "--tool-call-parser", "llama3_json", "-tp", "1", "--enforce-eager", "--no-async-scheduling",
                   "--cuda-graph-sizes", "1", "8", "64", "--stream-interval", "4", "--trust-remote-code",
                   "--chat-template", "{{ messages[0]['content'] }}", "--generation-config", "vllm",
                   "--override-generation-config", '{"temperature": 0.5, "top_k": 20}',
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
                   capsys=capsys)
    assert config["model"]["path"] == "Qwen/Qwen2.5-7B-Instruct" and config["model"]["name"] == "qwen"
    assert config["model"]["trust_remote_code"] is True
    engine = config["engine"]
    assert (engine["block_size"], engine["max_model_len"], engine["gpu_memory_utilization"]) == (64, 8192, 0.8)
    assert (engine["dtype"], engine["enable_prefix_caching"], engine["max_num_seqs"]) == ("bfloat16", False, 128)
    assert engine["swap_space_gb"] == 2.0 and engine["stream_interval"] == 4
    assert (engine["enforce_eager"], engine["async_scheduling"], engine["cuda_graph_sizes"]) == (True, False, [1, 8, 64])
    assert (config["server"]["port"], config["server"]["host"]) == (9001, "0.0.0.0")
    assert config["server"]["tool_call_parser"] == "llama3_json"
    assert config["server"]["chat_template"] == "{{ messages[0]['content'] }}"
    assert config["server"]["generation_config"] == "vllm"
    assert config["server"]["override_generation_config"] == {"temperature": 0.5, "top_k": 20}
    assert engine["speculative_config"] == {"method": "ngram", "model": None, "num_speculative_tokens": 3,
                                            "prompt_lookup_min": 4, "prompt_lookup_max": 4,
                                            "disable_by_batch_size": None}
    # Without flags, the file and --set stand.
    config = _show(str(file), "--set", "engine.max_num_seqs=16", capsys=capsys)
    assert (config["engine"]["block_size"], config["engine"]["max_num_seqs"]) == (8, 16)
    assert config["server"]["port"] == 7000 and config["model"]["name"] == "from-file"
    assert config["model"]["trust_remote_code"] is False


def test_serve_takes_the_model_positionally_like_vllm():
    args = build_parser().parse_args(["serve", "Qwen/Qwen2.5-7B-Instruct", "--tensor-parallel-size", "1",
                                      "--max-model-len", "8192", "--enable-prefix-caching", "--api-key", "k"])
    assert args.model == "Qwen/Qwen2.5-7B-Instruct" and args.max_model_len == 8192
    assert args.enable_prefix_caching is True and args.api_key == "k" and args.address is None


@pytest.fixture
def serve_port(tmp_path, monkeypatch):
    """A free port for an in-process ``serve`` that is refused, and server records of the
    test's own (``serve`` claims its port's record before it checks the model)."""
    from pagedserve.cluster import server_records
    from served_cluster import free_port

    monkeypatch.setattr(server_records, "records_dir", lambda: tmp_path / "servers")
    yield str(free_port())
    assert not list((tmp_path / "servers").glob("*.json")), "a refused serve left its record"


def test_tensor_parallel_size_sets_the_engine_option_and_serve_checks_the_model(serve_port, capsys):
    config = _show("--tensor-parallel-size", "2", capsys=capsys)
    assert config["engine"]["tensor_parallel_size"] == 2
    assert _show("-tp", "4", capsys=capsys)["engine"]["tensor_parallel_size"] == 4
    # The default model (tiny llama: 4 heads over 2 KV heads) splits in 2, not in 4.
    assert main(["serve", "-tp", "4", "--port", serve_port]) == 2  # refused before anything starts
    assert "has 2 key/value heads, which do not divide by 4" in capsys.readouterr().err


# The default model, tiny llama: 4 attention heads over 2 KV heads, 512 positions.
MODEL_MISFITS = [
    ({"engine": {"tensor_parallel_size": 5}}, "has 4 attention heads, which do not divide by 5"),
    ({"engine": {"tensor_parallel_size": 4}}, "has 2 key/value heads, which do not divide by 4"),
    ({"engine": {"max_model_len": 1024}}, "max_model_len 1024 is longer than this model computes exactly"),
    ({"workers": [{"count": 1, "num_cpus": 1}, {"count": 1, "num_cpus": 1, "engine": {"max_model_len": 600}}]},
     "max_model_len 600 is longer than this model computes exactly"),
]


def _config_file(tmp_path, config: dict) -> str:
    config = {"workers": [{"count": 1, "num_cpus": 1}], **config}
    file = tmp_path / "serve.yaml"
    file.write_text(yaml.safe_dump(config))
    return str(file)


def _refusal(console: str) -> str:
    """What ``serve`` said of a model it refused before anything started, less its first stage,
    which it names as failed."""
    from pagedserve.cluster.launcher import CHECK_STAGE

    stage, failed, *said = console.splitlines(keepends=True)
    assert stage == f"[..] {CHECK_STAGE}\n" and failed.startswith(f"[!!] {CHECK_STAGE}: failed after"), console
    return "".join(said)


@pytest.mark.parametrize(("config", "message"), MODEL_MISFITS)
def test_config_validate_refuses_a_model_misfit_as_serve_does(config, message, tiny_model, tmp_path, serve_port,
                                                             capsys):
    """Head counts against the tensor-parallel size, the context against the model's: the
    message ``serve`` gives before it starts anything."""
    tiny_model("llama")   # the default model: ``serve`` builds it where the cache lacks it, with progress bars
    capsys.readouterr()
    file = _config_file(tmp_path, config)
    assert main(["config", "validate", file]) == 1
    validated = capsys.readouterr().err
    assert message in validated
    assert main(["serve", "--config", file, "--port", serve_port]) == 2  # refused before anything starts
    assert _refusal(capsys.readouterr().err) == validated


def test_serve_refuses_a_directory_without_weights_before_starting_ray(tiny_model, tmp_path, serve_port, capsys):
    """A private Ray's workers load the model's directory on this machine: one that holds a
    config but no weights is refused in the first stage, where a worker would have failed to
    load it tens of seconds later. Joining a cluster, the head's copy need not hold them: each
    worker's node looks for its own."""
    import ray

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model("llama")) / name, tmp_path)
    capsys.readouterr()
    assert main(["serve", str(tmp_path), "--port", serve_port]) == 2
    said = _refusal(capsys.readouterr().err)
    assert said == (f"error: model.path {str(tmp_path)!r} on node {socket.gethostname()} holds no weights (no "
                    "*.safetensors or *.bin file): a directory must hold the checkpoint's weights on every node "
                    "that runs a worker\n"), said
    assert not ray.is_initialized()


def test_serve_refuses_a_directory_whose_tokenizer_does_not_load_before_any_worker(tiny_model, tmp_path, serve_port,
                                                                                    capsys):
    """A checkpoint copied without its tokenizer files: loaded beside Ray's start, as the
    workers' engines would load it, the tokenizer is refused with status 2 before the KV
    manager or any worker starts, where a worker used to fail on it seconds later."""
    import ray

    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model("llama")) / name, tmp_path)
    capsys.readouterr()
    assert main(["serve", str(tmp_path), "--port", serve_port]) == 2
    console = capsys.readouterr().err
    said = [line for line in console.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(f"error: the tokenizer of {tmp_path} cannot be loaded, as every "
                                                 "worker would load it (AutoTokenizer): the directory holds "
                                                 "none of tokenizer.json, tokenizer_config.json, "
                                                 "tokenizer.model, vocab.json; "), console
    assert console.index("[ok] starting a private Ray") < console.index(said[0]), console
    assert "KV manager" not in console and "[ok] stopping the private Ray" in console, console
    assert not ray.is_initialized()


def test_serve_refuses_a_model_class_it_cannot_serve_once_ray_has_started_and_before_any_worker(
        tmp_path, serve_port, capsys):
    """The check of the model's transformers class runs beside Ray's start: BLOOM's class
    computes attention without transformers' attention interface. ``serve`` says so with status
    2 once its private Ray is up, starts no KV manager or worker, and stops that Ray. The
    ingress's variables go with it (HAProxy's ports among them: servers this process starts
    later would inherit them, and collide)."""
    import ray
    from transformers import AutoConfig

    from pagedserve.cluster.serving import ingress

    before = {name: os.environ.get(name) for name in ingress.PREPARED_ENVS}

    AutoConfig.for_model("bloom").save_pretrained(tmp_path / "bloom")
    (tmp_path / "bloom" / "model.safetensors").write_bytes(b"")   # weights are looked for before Ray starts
    assert main(["config", "validate", str(_config_file(tmp_path, {"model": {"path": str(tmp_path / "bloom")}}))]) == 1
    validated = capsys.readouterr().err
    assert "(BloomForCausalLM) computes attention without transformers' attention interface" in validated
    assert main(["serve", str(tmp_path / "bloom"), "--port", serve_port]) == 2
    console = capsys.readouterr().err
    assert console.index("[ok] starting a private Ray") < console.index(validated.strip())
    assert "KV manager" not in console and "[ok] stopping the private Ray" in console, console
    assert not ray.is_initialized()
    assert {name: os.environ.get(name) for name in ingress.PREPARED_ENVS} == before


def test_config_validate_and_serve_refuse_a_checkpoints_own_code_unless_trusted(tiny_model, tmp_path, serve_port,
                                                                                 capsys):
    from remote_code_model import make_remote_code_model

    path = make_remote_code_model(tiny_model("llama"), tmp_path)
    capsys.readouterr()   # building a checkpoint the cache lacks writes progress bars to stderr
    file = _config_file(tmp_path, {"model": {"path": str(path)}})
    assert main(["config", "validate", file]) == 1
    refused = capsys.readouterr().err
    assert "holds code of its own" in refused and "model.trust_remote_code: true (serve --trust-remote-code)" in refused
    assert main(["serve", "--config", file, "--port", serve_port]) == 2  # refused before anything starts
    assert _refusal(capsys.readouterr().err) == refused
    trusted = _config_file(tmp_path, {"model": {"path": str(path), "trust_remote_code": True}})
    assert main(["config", "validate", trusted]) == 0
    assert capsys.readouterr().out.endswith("serve.yaml: valid\n")


def test_config_validate_and_serve_refuse_a_draft_model_that_cannot_propose(tiny_model, tmp_path, serve_port,
                                                                          capsys):
    """speculative_config's draft model or EAGLE head is read as the target is, before any
    worker starts: a draft of another vocabulary, of a shorter context, or with code of its own
    while that is not trusted; a head of another width, or an EAGLE-3 head whose aux layers the
    target lacks."""
    from local_frontend import with_context_length
    from remote_code_model import make_remote_code_model

    from pagedserve.devtools.model_factory import ensure_model

    def spec(draft: str, method: str = "draft_model", **model) -> str:
        return _config_file(tmp_path, {"model": model, "engine": {"speculative_config": {
            "method": method, "model": draft, "num_speculative_tokens": 2}}})

    short = with_context_length(tiny_model("llama"), tmp_path / "short", 256)
    own_code = str(make_remote_code_model(tiny_model("llama"), tmp_path))
    tiny_head = str(ensure_model("llama", "tiny-eagle"))
    drafts = ((str(ensure_model("llama", "small-draft")), "draft_model", "must share the target's vocabulary"),
              (short, "draft_model", "computes at most 256 tokens of context"),
              (own_code, "draft_model", "holds code of its own"),
              (str(ensure_model("llama", "small-eagle")), "eagle", "an EAGLE head of width 512"),
              (tiny_head, "eagle3", "aux hidden state layers"))   # vLLM's default layers need 4 or more
    capsys.readouterr()   # building a checkpoint the cache lacks writes progress bars to stderr
    for draft, method, words in drafts:
        file = spec(draft, method)   # one file, rewritten for each draft
        assert main(["config", "validate", file]) == 1
        refused = capsys.readouterr().err
        assert "speculative_config.model" in refused and words in refused, refused
        assert main(["serve", "--config", file, "--port", serve_port]) == 2  # refused before anything starts
        assert _refusal(capsys.readouterr().err) == refused
    for draft, method, model in ((tiny_model("llama"), "draft_model", {}),
                                 (own_code, "draft_model", {"trust_remote_code": True}),
                                 ("org/not-in-the-cache", "draft_model", {}), (tiny_head, "eagle", {})):
        assert main(["config", "validate", spec(draft, method, **model)]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.endswith("serve.yaml: valid\n")


def test_config_validate_reads_a_directory_or_the_hub_cache_without_weights(tiny_model, tmp_path, capsys):
    """A checkpoint directory's config, or a hub id's in the hub cache (no weights there, no
    network); a hub id the cache lacks is left to ``serve``, and said so."""
    directory = {"model": {"path": tiny_model("llama")}, "engine": {"tensor_parallel_size": 5}}
    capsys.readouterr()   # building a checkpoint the cache lacks writes progress bars to stderr
    assert main(["config", "validate", _config_file(tmp_path, directory)]) == 1
    expected = capsys.readouterr().err
    assert "has 4 attention heads, which do not divide by 5" in expected
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(Path(tiny_model("llama")) / "config.json", snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    hub = {"model": {"path": "org/tiny", "download_dir": str(tmp_path / "hub")}, "engine": {"tensor_parallel_size": 5}}
    assert main(["config", "validate", _config_file(tmp_path, hub)]) == 1
    assert capsys.readouterr().err == expected
    hub["engine"]["tensor_parallel_size"] = 2
    assert main(["config", "validate", _config_file(tmp_path, hub)]) == 0
    assert capsys.readouterr().out.endswith("serve.yaml: valid\n")
    hub["model"]["path"] = "org/absent"
    assert main(["config", "validate", _config_file(tmp_path, hub)]) == 0
    assert "the model was not checked: the config of 'org/absent' is not in this node's hub cache" in \
        capsys.readouterr().out


def test_lora_flags_set_the_adapters_and_the_engine(capsys):
    config = _show("--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8",
                   "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}',
                   capsys=capsys)
    engine = config["engine"]
    assert (engine["enable_lora"], engine["max_loras"], engine["max_lora_rank"], engine["max_cpu_loras"]) == \
        (True, 4, 32, 8)
    assert config["model"]["lora_modules"] == [{"name": "sql", "path": "/adapters/sql"},
                                               {"name": "chat", "path": "/adapters/chat"}]
    assert not config["model"]["allow_runtime_lora_updating"]
    assert _show("--enable-lora", "--allow-runtime-lora-updating", capsys=capsys)["model"]["allow_runtime_lora_updating"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--served-model-name", "a", "b"], "one name is served"),
    (["--lora-modules", "a=/x"], "model.lora_modules needs engine.enable_lora"),
    (["--set", "model.dynamic_lora_loading_path=/x"], "model.dynamic_lora_loading_path needs engine.enable_lora"),
    (["--allow-runtime-lora-updating"], "model.allow_runtime_lora_updating needs engine.enable_lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "adapter names must differ; repeated: a"),
    (["--enable-lora", "--lora-modules", "a:b=/x"], "an adapter name has no ':'"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"], "is the base model's name"),
    (["--block-size", "24"], "block_size must be a power of two"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
])
def test_flags_that_cannot_be_served_are_refused(flags, message, capsys):
    assert main(["config", "show", *flags]) == 1
    assert message in capsys.readouterr().err
    assert main(["serve", *flags]) == 2  # refused before anything starts
    assert message in capsys.readouterr().err


def test_bench_serve_takes_vllm_bench_serve_flags():
    args = build_parser().parse_args([
        "bench", "serve", "--backend", "vllm", "--base-url", "http://127.0.0.1:8123", "--endpoint",
        "/v1/completions", "--model", "m", "--dataset-name", "random", "--num-prompts", "7",
        "--random-input-len", "100", "--random-output-len", "20", "--random-range-ratio", "0.5",
        "--request-rate", "4", "--max-concurrency", "3", "--seed", "5", "--ignore-eos", "--disable-tqdm",
        "--save-result", "--result-dir", "/tmp", "--result-filename", "r.json"])
    from pagedserve.bench.cli import serve_bench_config

    config = serve_bench_config(args)
    assert config.url == "http://127.0.0.1:8123" and config.num_requests == 7 and config.model == "m"
    assert (config.input_len.low, config.input_len.high, config.input_len.kind) == (50, 150, "uniform")
    assert (config.output_len.low, config.output_len.high) == (10, 30)
    assert config.request_rate == 4 and config.max_concurrency == 3 and config.seed == 5 and config.ignore_eos
    args = build_parser().parse_args(["bench", "serve", "--host", "127.0.0.2", "--port", "9000",
                                      "--random-input-len", "64", "--random-range-ratio", "0"])
    config = serve_bench_config(args)
    assert config.url == "http://127.0.0.2:9000" and config.input_len.kind == "fixed"
    assert config.input_len.mean == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--endpoint", "/v1/embeddings"])


def test_serve_starting_beside_the_workers_hands_its_error_and_its_end_to_the_caller(monkeypatch):
    """``serve`` starts Serve on a thread while the workers load; the caller waits for it before
    deploying or tearing down, and gets what its start raised."""
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.serving import deployment

    release = threading.Event()

    def start_serve(config, quiet):
        if not release.wait(10):
            raise AssertionError("never released")
        raise RuntimeError("no controller")

    monkeypatch.setattr(deployment, "start_serve", start_serve)
    monkeypatch.setattr(deployment.ray_compat, "serve_controller", lambda: None)   # no Ray here
    starting = deployment.ServeStart(ClusterConfig()).begin()
    with pytest.raises(TimeoutError, match="did not start within 0.2 s"):
        starting.wait(0.2)
    release.set()
    with pytest.raises(RuntimeError, match="no controller"):
        starting.wait(10)
    assert starting.found_running is False   # Serve was not there before: the teardown may shut it down


def test_a_joined_clusters_serve_is_shut_down_only_when_no_other_application_runs_on_it(monkeypatch, capsys):
    """The teardown's last Serve stage on a shared cluster where this server started Serve: shut
    it down when only pagedserve's application was there (or none), else leave it and say why;
    nothing to do where its start failed before the controller was up."""
    from types import SimpleNamespace

    from ray import serve

    from pagedserve.cluster import launcher, ray_compat
    from pagedserve.cluster.serving.deployment import APP_NAME

    shut: list[float] = []
    monkeypatch.setattr(ray_compat, "shutdown_serve", lambda timeout_s: shut.append(timeout_s) or True)
    monkeypatch.setattr(ray_compat, "serve_controller", lambda: None)   # Serve's start failed early
    launcher._shut_down_serve_unless_used()
    assert shut == []
    monkeypatch.setattr(ray_compat, "serve_controller", lambda: "the controller")
    for apps in ({}, {APP_NAME: "DELETING"}):
        monkeypatch.setattr(serve, "status", lambda apps=apps: SimpleNamespace(applications=apps))
        launcher._shut_down_serve_unless_used()
    assert shut == [launcher.SERVE_SHUTDOWN_TIMEOUT_S] * 2
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={APP_NAME: "DELETING", "b": 1, "a": 1}))
    launcher._shut_down_serve_unless_used()
    assert len(shut) == 2
    assert "Ray Serve stays up: it runs other applications (a, b)" in capsys.readouterr().out


# ---- a private Ray, or a named one with its token ------------------------------------------------
def _cli(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _complete(port: int) -> int:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(model="tiny-cli", prompt="Hello", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    return completion.usage.completion_tokens


def _streamed_equals_whole(port: int) -> bool:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    request = {"model": "tiny-cli", "prompt": "Hello", "max_tokens": 12, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**request).choices[0].text
    pieces = [chunk.choices[0].text for chunk in client.completions.create(**request, stream=True) if chunk.choices]
    return len(pieces) > 1 and "".join(pieces) == whole


def _descendant_commands(pid: int) -> list[str]:
    """The command lines of ``pid``'s descendants (a private Ray's processes are)."""
    from pagedserve.workers.process.processes import descendants

    commands = []
    for child in descendants(pid):
        try:
            commands.append((Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except OSError:
            continue
    return commands


def _from_a_driver(address: str, env: dict, code: str) -> str:
    """Run ``code`` in a driver of its own (``ray`` and ``ray_compat`` imported), connected to the
    cluster at ``address``; its stdout."""
    script = ("import ray\nfrom pagedserve.cluster import ray_compat\n"
              f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n{code}ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _kill_serve_controller(record: dict, env: dict) -> None:
    """End a server's Serve controller for good."""
    _from_a_driver(record["ray_address"], {**env, "RAY_AUTH_MODE": record["ray_auth_mode"] or "disabled"},
                   "ray.kill(ray_compat.serve_controller(), no_restart=True)\n"
                   "import time\nwhile ray_compat.serve_controller() is not None: time.sleep(0.2)\n")


def _serve_runs(address: str, env: dict) -> bool:
    """Whether Ray Serve's controller runs on the cluster at ``address``."""
    printed = _from_a_driver(address, env, "print(ray_compat.serve_controller() is not None)\n")
    return printed.strip().splitlines()[-1] == "True"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_private_ray_by_default_a_named_cluster_with_its_token_and_two_servers_on_one_machine(tmp_path,
                                                                                                tiny_model):
    """Two ``serve`` on one machine, with one cache folder (as one user has): one joins a running
    cluster by its address (its token comes along), the other starts a private Ray although
    that cluster is the one Ray would find. A third on a taken port is refused at once;
    ``stop`` without a port refuses and lists both. The joined one stops cleanly and leaves its
    cluster as it found it (up, without Ray Serve), as does one whose workers cannot be placed
    there; the private one serves on after that cluster stops, and once its Serve
    controller is gone it is stopped by its port within the bound, all its processes with it."""
    from fake_cluster import LocalRayHead
    from pagedserve.cluster.launcher import KILL_WAIT_S
    from pagedserve.workers.process.processes import descendants, is_running
    from served_cluster import free_port

    token = secrets.token_hex(32)
    other = LocalRayHead(tmp_path / "ray", head_cpus=4,
                         env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}).start()
    base = {key: value for key, value in os.environ.items()
            if key not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")   # the servers' records, both
    records = tmp_path / "cache" / "servers"
    model = ["--served-model-name", "tiny-cli", "--set", "workers.0.num_cpus=1",
             "--set", "engine.num_device_blocks=64", "--set", "engine.swap_space_gb=0.001"]
    servers: list[ServeProcess] = []
    discovery = Path(f"/tmp/psdisc-{other.port}")  # short: Ray's socket paths live under it
    try:
        # Both start at once, so that their start-ups overlap.
        # 1. Joined by its address: the token comes along (RAY_AUTH_MODE unset, as Ray leaves
        #    it for an address it finds).
        joining = {**base, "RAY_AUTH_TOKEN": token}
        joined_driver = {**joining, "RAY_AUTH_MODE": "token"}   # a bare ray.init needs the mode said
        port = free_port()
        server = ServeProcess([tiny_model("llama"), "--address", other.address, "--port", str(port), *model],
                              joining)
        servers.append(server)
        # 2. No address: a private Ray, although another runs and is the one Ray would find
        #    (``ray.init()`` reads the last cluster's address from <RAY_TMPDIR>/ray, where it
        #    is written here); the other one stopping takes nothing with it.
        (discovery / "ray").mkdir(parents=True, exist_ok=True)
        (discovery / "ray" / "ray_current_cluster").write_text(other.address)
        private = {**base, "RAY_TMPDIR": str(discovery)}
        private_port = free_port()
        while private_port == port:
            private_port = free_port()
        # Its API behind Serve's HAProxy ingress: server.ingress "auto" (the default) sets Serve's
        # environment before this private Ray starts, HAProxy being installed.
        private_server = ServeProcess([tiny_model("llama"), "--port", str(private_port), *model], private)
        servers.append(private_server)
        server.wait_serving()
        private_server.wait_serving()
        assert sorted(path.name for path in records.glob("*.json")) == sorted(
            f"{p}.json" for p in (port, private_port))

        # A third on a taken port is refused at once; `stop` without a port names both and stops neither.
        began = time.monotonic()
        third = _cli("serve", tiny_model("llama"), "--port", str(port), *model, env=private, timeout=120)
        assert third.returncode == 2, third.stdout + third.stderr
        assert f"port {port} is taken by pagedserve (pid {server.process.pid}" in third.stderr
        assert "starting a private Ray" not in third.stdout + third.stderr
        assert time.monotonic() - began < 60
        refused = _cli("stop", env=private)
        assert refused.returncode == 1, refused.stderr
        assert all(f"port {p}" in refused.stderr for p in (port, private_port)), refused.stderr
        assert all(s.process.poll() is None for s in servers)

        # The joined one. That cluster's nodes started without Serve's HAProxy variables: "auto"
        # takes the proxy actor, and says why.
        said = [line for line in server.output if line.strip().startswith("ingress")]
        assert said and said[0].split()[1:3] == ["Serve's", "proxy"], server.output
        assert "run without RAY_SERVE_ENABLE_HA_PROXY=1" in said[0]
        assert _complete(port) == 4
        # HAProxy asked of that cluster is refused with what to do, before any worker starts.
        refused = _cli("serve", tiny_model("llama"), "--address", other.address, "--port", str(free_port()),
                       "--set", "server.ingress=haproxy", *model,
                       env={**joining, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache-refused")})
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2, output
        assert "error: server.ingress 'haproxy': this Ray cluster's processes run without" in refused.stderr, output
        assert "Traceback" not in output and "starting the KV manager" not in output, output
        status = _cli("status", "--address", other.address, "--json", env=joining)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["model"] == "tiny-cli"
        stop = _cli("stop", "--port", str(port), "--timeout", "120", env=joining, timeout=180)
        assert stop.returncode == 0 and stop.stderr == "", stop.stderr + "".join(server.output[-30:])
        assert f"stopped pagedserve on port {port}" in stop.stdout
        assert server.process.wait(timeout=60) == 0
        assert not [line for line in server.output if "Task " in line and " failed" in line], server.output
        assert other.pids(), "the joined cluster must outlive the server"
        # It found that cluster without Ray Serve, and leaves it so; so does one whose workers cannot start.
        assert "[ok] shutting down the Ray Serve this server started" in server.ended_output(), server.output
        assert not _serve_runs(other.address, joined_driver)
        unplaced = _cli("serve", tiny_model("llama"), "--address", other.address, "--port", str(free_port()),
                        *model, "--set", "workers.0.num_gpus=1", env=joining)
        assert unplaced.returncode == 1, unplaced.stdout + unplaced.stderr
        assert "error:" in unplaced.stderr and "GPU" in unplaced.stderr, unplaced.stderr
        assert "[ok] shutting down the Ray Serve this server started" in unplaced.stdout + unplaced.stderr
        assert not _serve_runs(other.address, joined_driver)

        # The private one serves on after the cluster it did not join stops.
        server, port = private_server, private_port
        said = [line for line in server.output if line.strip().startswith("ingress")]
        assert said and said[0].split()[1] == "HAProxy" and "auto" in said[0], server.output
        # Its processes run with Serve's throughput mode set one setting at a time: its controller's
        # INFO block about the mode stays off the console.
        assert not [line for line in server.output if "Throughput optimized" in line], server.output
        state = json.loads((records / f"{port}.json").read_text())
        assert state["ray_address"] != other.address and state["is_private_ray"] and state["ingress"] == "haproxy"
        other.stop()
        assert other.pids() == []
        time.sleep(2)
        assert server.process.poll() is None, "".join(server.output)
        assert _complete(port) == 4
        assert _streamed_equals_whole(port)
        # HAProxy took those requests (Serve keeps a proxy actor too, only as its fallback).
        commands = _descendant_commands(server.process.pid)
        assert any(Path(c.split(" ")[0]).name == "haproxy" for c in commands), commands
        status = _cli("status", "--json", env=private)   # the only server left: no port needed
        assert status.returncode == 0 and json.loads(status.stdout)["model"] == "tiny-cli", status.stderr

        # Its Serve controller ends; its stop is bounded, forced if need be.
        _kill_serve_controller(state, private)
        tree = descendants(server.process.pid)
        began = time.monotonic()
        stop = _cli("stop", "--port", str(port), "--timeout", "1", env=private)
        elapsed = time.monotonic() - began
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "waiting up to 1 s" in stop.stdout and f"stopped pagedserve on port {port}" in stop.stdout
        assert elapsed < 1 + KILL_WAIT_S + 15, elapsed     # the bound, the kill, and a Python start-up
        assert not any(is_running(pid) for pid in [server.process.pid, *tree])
        assert not list(records.glob("*.json"))
        print(f"\nstop of a server without its Serve controller, bound 1 s: {elapsed:.1f} s, "
              f"{'killed' if 'did not exit' in stop.stderr else 'exited by itself'}")
    finally:
        for server in servers:
            server.kill()
        other.stop()
        shutil.rmtree(discovery, ignore_errors=True)


def _py_spy_dump(pid: int) -> str:
    """Every thread's Python stack in ``pid`` (``py-spy dump``), or why there is none."""
    if shutil.which("py-spy") is None:
        return "(py-spy is not installed)"
    dumped = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return dumped.stdout + dumped.stderr


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, stage", [(signal.SIGINT, "starting a private Ray"),
                                        (signal.SIGINT, "starting the KV manager"),
                                        (signal.SIGTERM, "starting the KV manager")])
def test_ctrl_c_or_sigterm_while_starting_tears_down_what_started_without_a_traceback(tmp_path, tiny_model, sig,
                                                                                     stage):
    """SIGINT (Ctrl-C) while Ray starts (held until ``ray.init`` returns: one interrupted inside
    it left a half-started Ray, and the process crashed as it exited), or SIGINT or SIGTERM
    (``pagedserve stop``) while the workers load (Serve starting beside them; SIGTERM aborted the
    process there, in Ray's native handler): every stage started is torn down, Serve's after its
    start, and the server exits with 128 + the signal and no traceback; so too where it
    inherited SIGINT ignored (a shell script's background job, or a test run started as one)."""
    from served_cluster import free_port

    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONFAULTHANDLER"] = "1"   # a crash names where it happened
    server = ServeProcess([tiny_model("llama"), "--port", str(free_port()), "--set", "workers.0.num_cpus=1"], env,
                          sigint_ignored=True)
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith(f"[..] {stage}") for line in server.output):
            assert server.process.poll() is None and time.monotonic() < deadline, "".join(server.output)
            time.sleep(0.1)
        server.process.send_signal(sig)
        try:
            assert server.process.wait(timeout=120) == 128 + sig, "".join(server.output)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve did not end within 120 s of {sig.name}; its console:\n" + "".join(server.output)
                        + "\nits threads:\n" + _py_spy_dump(server.process.pid))
    finally:
        server.kill()
    console = server.ended_output()
    said = "interrupted" if sig == signal.SIGINT else "stopped (SIGTERM)"
    assert "Traceback" not in console and f"{said} while starting; stopping..." in console, console
    assert "failed after" not in console, console   # the interrupted stage says so
    if stage != "starting a private Ray":   # held until ray.init returned, which then ended its stage
        assert any(line.startswith(f"[!!] {stage}") and ": interrupted after" in line
                   for line in console.splitlines()), console
    assert "[ok] starting a private Ray" in console and "[ok] stopping the private Ray" in console, console
    assert ("[ok] shutting down Ray Serve" in console) == (stage != "starting a private Ray"), console
    assert not list((tmp_path / "cache" / "servers").glob("*.json"))   # its record went with it



@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_model_check_is_the_first_stage_and_a_signal_there_ends_the_server_at_once(tmp_path, tiny_model, sig):
    """Seconds of imports come before the model's config is read: the console names that
    stage first, not after them. SIGINT (where it was inherited ignored, as a script's
    background job has it) or SIGTERM during it ends the server with 128 + the signal, the
    stage said interrupted, no traceback and its record gone; no Ray was started."""
    from pagedserve.cluster.launcher import CHECK_STAGE
    from served_cluster import free_port

    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    server = ServeProcess([tiny_model("llama"), "--port", str(free_port())], env, sigint_ignored=True)
    try:
        deadline = time.monotonic() + 60
        while not server.output:
            assert server.process.poll() is None and time.monotonic() < deadline, "".join(server.output)
            time.sleep(0.02)
        assert server.output[0] == f"[..] {CHECK_STAGE}\n", server.output
        server.process.send_signal(sig)
        assert server.process.wait(timeout=60) == 128 + sig, "".join(server.output)
    finally:
        server.kill()
    console = server.ended_output()
    said = "interrupted" if sig == signal.SIGINT else "stopped (SIGTERM)"
    lines = console.splitlines()
    assert len(lines) == 3 and lines[1].startswith(f"[!!] {CHECK_STAGE}: interrupted after "), console
    assert lines[2] == f"{said} while starting", console
    assert not list((tmp_path / "cache" / "servers").glob("*.json"))   # its record went with it


# ---- servers on one machine: a record per port, stop by port, a bounded stop ---------------------
@pytest.fixture
def own_records(tmp_path, monkeypatch):
    """This test's server records (``PAGEDSERVE_CACHE_DIR``), and processes standing in for
    servers: ``spawn(ignore_term=False)`` starts one (with a child of its own)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    started: list[subprocess.Popen] = []
    script = ("import signal, subprocess, sys, time\n"
              "if sys.argv[1] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "subprocess.Popen(['sleep', '300'])\nprint('up', flush=True)\ntime.sleep(300)\n")

    def spawn(ignore_term: bool = False) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", script, "1" if ignore_term else "0"],
                                   stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "up\n"
        started.append(process)
        threading.Thread(target=process.wait, daemon=True).start()   # reaped as a shell would
        return process

    yield spawn
    from pagedserve.workers.process.processes import descendants

    for process in started:
        for pid in [*descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _record(port: int, pid: int, **fields):
    from pagedserve.workers.process.processes import started_at
    from pagedserve.cluster.server_records import ServerRecord

    record = ServerRecord(port=port, pid=pid, host="127.0.0.1", state="serving",
                          pid_started=started_at(pid), model="tiny-cli", **fields)
    record.save()
    return record


def test_a_record_per_port_and_stale_records_go(own_records):
    from pagedserve.cluster import server_records

    dead = subprocess.Popen(["true"])
    dead.wait()
    _record(8101, dead.pid)                                    # its process is gone
    live = own_records()
    _record(8102, live.pid)
    reused = _record(8103, live.pid)                           # a pid that belongs to another process now
    reused.pid_started = (reused.pid_started or 0) + 1
    reused.save()
    assert [record.port for record in server_records.running()] == [8102]
    assert sorted(p.name for p in server_records.records_dir().glob("*.json")) == ["8102.json"]
    with pytest.raises(server_records.PortTaken, match=f"pid {live.pid}.*'pagedserve stop --port 8102'"):
        server_records.claim(8102, "127.0.0.1")
    mine = server_records.claim(8101, "127.0.0.1")            # the stale one is taken over
    assert mine.pid == os.getpid() and [r.port for r in server_records.running()] == [8101, 8102]
    server_records.release(mine)
    assert [r.port for r in server_records.running()] == [8102]


def test_stop_names_what_it_stops_and_refuses_to_guess(own_records, capsys):
    from pagedserve.cluster.launcher import stop_server

    first, second = own_records(), own_records()
    _record(8201, first.pid)
    _record(8202, second.pid)
    assert main(["stop"]) == 1
    err = capsys.readouterr().err
    assert "2 pagedserve servers run on this machine" in err and "--port" in err and "--all" in err
    assert "port 8201" in err and "port 8202" in err and first.poll() is None and second.poll() is None
    assert main(["stop", "--port", "8203"]) == 1
    assert "no pagedserve server runs on port 8203" in capsys.readouterr().err
    assert main(["stop", "--port", "8202"]) == 0
    out = capsys.readouterr().out
    assert f"stopping pagedserve on port 8202 (pid {second.pid}, 'tiny-cli', private Ray)" in out
    assert "stopped pagedserve on port 8202" in out and first.poll() is None
    assert stop_server(port=None) == 0 and "port 8201" in capsys.readouterr().out   # the only one left
    assert main(["stop"]) == 1 and "no pagedserve server is running" in capsys.readouterr().err


def test_stop_kills_a_server_that_outlives_its_bound(own_records, capsys):
    from pagedserve.cluster.launcher import KILL_WAIT_S
    from pagedserve.workers.process.processes import descendants, is_running

    stuck = own_records(ignore_term=True)
    _record(8301, stuck.pid, stage="shutting down Ray Serve")
    tree = descendants(stuck.pid)
    assert tree
    began = time.monotonic()
    assert main(["stop", "--all", "--timeout", "1"]) == 0
    elapsed = time.monotonic() - began
    captured = capsys.readouterr()
    assert elapsed < 1 + KILL_WAIT_S, elapsed
    assert "waiting up to 1 s" in captured.out and "shutting down Ray Serve" in captured.out
    assert "did not exit within 1 s" in captured.err and f"the {len(tree)} processes under it" in captured.err
    assert "stopped pagedserve on port 8301" in captured.out
    assert not any(is_running(pid) for pid in [stuck.pid, *tree])
    from pagedserve.cluster import server_records

    assert server_records.records_dir().is_dir() and not list(server_records.records_dir().glob("*.json"))


def test_serve_refuses_a_taken_port_before_starting_ray(own_records, tiny_model):
    import socket

    from served_cluster import free_port

    holder = own_records()
    _record(8401, holder.pid)
    env = dict(os.environ)   # with own_records' PAGEDSERVE_CACHE_DIR
    refused = _cli("serve", tiny_model("llama"), "--port", "8401", env=env, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"port 8401 is taken by pagedserve (pid {holder.pid}" in refused.stderr
    assert "pagedserve stop --port 8401" in refused.stderr
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        refused = _cli("serve", tiny_model("llama"), "--port", str(port), env=env, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"HTTP port {port} on 127.0.0.1 is in use by another program" in refused.stderr
    assert "Ray" not in refused.stdout + refused.stderr   # refused before Ray started
    from pagedserve.cluster import server_records

    assert [record.port for record in server_records.running()] == [8401]   # the holder's record stays
