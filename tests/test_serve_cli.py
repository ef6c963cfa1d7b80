"""``pagedserve serve`` as vLLM and Ray users run it: vLLM's flags mapped onto the
configuration (``config show`` prints what they make), a private Ray unless an
address is named, and joining a running cluster by its address with the
cluster's token authentication (``serve``, ``status``, ``stop``).

The end-to-end test starts a Ray head of its own first (``fake_cluster.LocalRayHead``:
its own ports and temp dir, token auth with a token of the test's, never
``ray stop``) and runs the CLI as a user would, in subprocesses.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
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
                   "--cuda-graph-sizes", "1", "8", "64", capsys=capsys)
    assert config["model"]["path"] == "Qwen/Qwen2.5-7B-Instruct" and config["model"]["name"] == "qwen"
    engine = config["engine"]
    assert (engine["block_size"], engine["max_model_len"], engine["gpu_memory_utilization"]) == (64, 8192, 0.8)
    assert (engine["dtype"], engine["enable_prefix_caching"], engine["max_num_seqs"]) == ("bfloat16", False, 128)
    assert engine["swap_space_gb"] == 2.0
    assert (engine["enforce_eager"], engine["async_scheduling"], engine["cuda_graph_sizes"]) == (True, False, [1, 8, 64])
    assert (config["server"]["port"], config["server"]["host"]) == (9001, "0.0.0.0")
    assert config["server"]["tool_call_parser"] == "llama3_json"
    # Without flags, the file and --set stand.
    config = _show(str(file), "--set", "engine.max_num_seqs=16", capsys=capsys)
    assert (config["engine"]["block_size"], config["engine"]["max_num_seqs"]) == (8, 16)
    assert config["server"]["port"] == 7000 and config["model"]["name"] == "from-file"


def test_serve_takes_the_model_positionally_like_vllm():
    args = build_parser().parse_args(["serve", "Qwen/Qwen2.5-7B-Instruct", "--tensor-parallel-size", "1",
                                      "--max-model-len", "8192", "--enable-prefix-caching", "--api-key", "k"])
    assert args.model == "Qwen/Qwen2.5-7B-Instruct" and args.max_model_len == 8192
    assert args.enable_prefix_caching is True and args.api_key == "k" and args.address is None


def test_tensor_parallel_size_sets_the_engine_option_and_serve_checks_the_model(capsys):
    config = _show("--tensor-parallel-size", "2", capsys=capsys)
    assert config["engine"]["tensor_parallel_size"] == 2
    assert _show("-tp", "4", capsys=capsys)["engine"]["tensor_parallel_size"] == 4
    # The default model (tiny llama: 4 heads over 2 KV heads) splits in 2, not in 4.
    assert main(["serve", "-tp", "4"]) == 2  # refused before anything starts
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


@pytest.mark.parametrize(("config", "message"), MODEL_MISFITS)
def test_config_validate_refuses_a_model_misfit_as_serve_does(config, message, tmp_path, capsys):
    """Head counts against the tensor-parallel size, the context against the model's: the
    message ``serve`` gives before it starts anything."""
    file = _config_file(tmp_path, config)
    assert main(["config", "validate", file]) == 1
    validated = capsys.readouterr().err
    assert message in validated
    assert main(["serve", "--config", file]) == 2  # refused before anything starts
    assert capsys.readouterr().err == validated


def test_config_validate_reads_a_directory_or_the_hub_cache_without_weights(tiny_model, tmp_path, capsys):
    """A checkpoint directory's config, or a hub id's in the hub cache (no weights there, no
    network); a hub id the cache lacks is left to ``serve``, and said so."""
    directory = {"model": {"path": tiny_model("llama")}, "engine": {"tensor_parallel_size": 5}}
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


@pytest.mark.parametrize(("flags", "message"), [
    (["--served-model-name", "a", "b"], "one name is served"),
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
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(commands.get(child, ""))
        todo.extend(children.get(child, []))
    return found


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_private_ray_by_default_and_a_named_cluster_with_its_token(tmp_path, tiny_model):
    from fake_cluster import LocalRayHead
    from served_cluster import free_port

    token = secrets.token_hex(32)
    other = LocalRayHead(tmp_path / "ray", head_cpus=4,
                         env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}).start()
    base = {key: value for key, value in os.environ.items()
            if key not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")  # its own serve.json
    model = ["--served-model-name", "tiny-cli", "--set", "workers.0.num_cpus=1",
             "--set", "engine.num_device_blocks=64", "--set", "engine.swap_space_gb=0.001"]
    servers: list[ServeProcess] = []
    discovery = Path(f"/tmp/psdisc-{other.port}")  # short: Ray's socket paths live under it
    try:
        # Both servers start at once (each its own state file, PAGEDSERVE_CACHE_DIR), so that
        # their start-ups overlap; each is then checked in turn.
        # 1. Joined by its address: the token comes along (RAY_AUTH_MODE unset, as Ray leaves
        #    it for an address it finds); status and stop work; the cluster stays up after.
        joining = {**base, "RAY_AUTH_TOKEN": token, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache-joining")}
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
        # That cluster's nodes started without Serve's HAProxy variables: "auto" takes the proxy
        # actor, and says why.
        said = [line for line in server.output if line.strip().startswith("ingress")]
        assert said and said[0].split()[1:3] == ["Serve's", "proxy"], server.output
        assert "run without RAY_SERVE_ENABLE_HA_PROXY=1" in said[0]
        assert _complete(port) == 4
        status = _cli("status", "--address", other.address, "--json", env=joining)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["model"] == "tiny-cli"
        stop = _cli("stop", "--timeout", "120", env=joining, timeout=180)
        assert stop.returncode == 0, stop.stderr + "".join(server.output[-30:])
        assert server.process.wait(timeout=60) == 0
        assert other.pids(), "the joined cluster must outlive the server"

        # 2. The private one.
        server, port = private_server, private_port
        server.wait_serving()
        said = [line for line in server.output if line.strip().startswith("ingress")]
        assert said and said[0].split()[1] == "HAProxy" and "auto" in said[0], server.output
        state = json.loads((tmp_path / "cache" / "serve.json").read_text())
        assert state["ray_address"] != other.address
        other.stop()
        assert other.pids() == []
        time.sleep(2)
        assert server.process.poll() is None, "".join(server.output)
        assert _complete(port) == 4
        assert _streamed_equals_whole(port)
        # HAProxy took those requests (Serve keeps a proxy actor too, only as its fallback).
        commands = _descendant_commands(server.process.pid)
        assert any(Path(c.split(" ")[0]).name == "haproxy" for c in commands), commands
        status = _cli("status", "--json", env=private)
        assert status.returncode == 0, status.stderr
        stop = _cli("stop", "--timeout", "120", env=private, timeout=180)
        assert stop.returncode == 0, stop.stderr + "".join(server.output[-30:])
        assert server.process.wait(timeout=60) == 0
    finally:
        for server in servers:
            server.kill()
        other.stop()
        shutil.rmtree(discovery, ignore_errors=True)
