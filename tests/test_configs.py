"""Every YAML in configs/: pagedserve files against the schema, launcher files with Ray's validator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pagedserve.cluster.config import ClusterConfig, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LAUNCHER_FILES = sorted(CONFIGS.glob("cluster-*.yaml"))
PAGEDSERVE_FILES = sorted(set(CONFIGS.glob("*.yaml")) - set(LAUNCHER_FILES))


def test_the_expected_files_exist():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"default.yaml", "disaggregated.yaml", "cluster-aws.yaml", "cluster-gcp.yaml",
            "cluster-onprem.yaml"} <= names


@pytest.mark.parametrize("path", PAGEDSERVE_FILES, ids=lambda p: p.name)
def test_pagedserve_files_match_the_schema(path):
    config = load_config(path)
    assert isinstance(config, ClusterConfig)


def test_default_file_is_the_embedded_default():
    assert load_config(CONFIGS / "default.yaml").model_dump() == ClusterConfig().model_dump()


def test_disaggregated_file_is_disaggregated():
    assert load_config(CONFIGS / "disaggregated.yaml").is_disaggregated


def _ray_validate(config: dict) -> None:
    from pagedserve.cluster.ray_compat import validate_launcher_config

    validate_launcher_config(config)


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_files_pass_rays_validator(path):
    config = yaml.safe_load(path.read_text())
    _ray_validate(config)
    commands = " ".join(config["head_start_ray_commands"])
    assert "pagedserve serve --address auto --config" in commands
    assert any("pip install" in c for c in config["setup_commands"])
    if config["provider"]["type"] == "local":
        assert "available_node_types" not in config  # the local provider must not set them
    else:
        gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
        assert gpu_types, "a cloud launcher file needs GPU worker nodes"
    # The config the head node serves must itself be valid.
    served = commands.split("--config", 1)[1].split()[0].replace("~/pagedserve/", "")
    load_config(CONFIGS.parent / served)


# What each launcher's GPU nodes carry: (GPU memory in GB, compute capability). The on-prem file
# names no instance type; its header asks for GPUs of 24 GB or more.
GPU_OF_LAUNCHER = {"cluster-aws.yaml": (24, (8, 6)),     # g5.2xlarge: A10G
                   "cluster-aws-70b.yaml": (80, (8, 0)),  # p4de.24xlarge: 8 x A100 80 GB
                   "cluster-gcp.yaml": (16, (7, 5)),     # nvidia-tesla-t4
                   "cluster-onprem.yaml": (24, (8, 0))}
# Parameter counts of the models the launchers serve (from their model cards).
HUB_MODEL_PARAMS = {"Qwen/Qwen2.5-7B-Instruct": 7.62e9, "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
                    "meta-llama/Llama-3.3-70B-Instruct": 70.6e9}
# Parameters every tensor-parallel rank holds whole (embeddings and LM head).
HUB_MODEL_REPLICATED_PARAMS = {"meta-llama/Llama-3.3-70B-Instruct": 2 * 128256 * 8192}


def _served_config(launcher: dict) -> Path:
    commands = " ".join(launcher["head_start_ray_commands"])
    return CONFIGS.parent / commands.split("--config", 1)[1].split()[0].replace("~/pagedserve/", "")


def _provisioned_dirs(launcher: dict) -> list[str]:
    """Directories a launcher file puts on every node: its file mounts' targets."""
    return [target.rstrip("/") for target in launcher.get("file_mounts", {})]


def model_path_problem(path: str | None, launchers: list[dict]) -> str | None:
    """Why a shipped config's ``model.path`` would not exist on a cluster's nodes, or None."""
    from pagedserve.workers.model.model_source import is_hub_id

    if path is None or is_hub_id(path):
        return None  # a model built on first start, or a hub id every node fetches
    for launcher in launchers:
        for target in _provisioned_dirs(launcher):
            if path == target or path.startswith(target + "/"):
                return None
    return f"{path} is neither a hub id nor under a directory the launcher files provision"


def test_every_model_path_is_a_hub_id_or_provisioned_by_a_launcher():
    launchers = [yaml.safe_load(path.read_text()) for path in LAUNCHER_FILES]
    problems = {path.name: model_path_problem(load_config(path).model.path, launchers) for path in PAGEDSERVE_FILES}
    assert not {name: problem for name, problem in problems.items() if problem}
    # The rule itself: a bare path is refused, one under a file mount's target is not.
    mounted = [{"file_mounts": {"/mnt/models": "./models"}}]
    assert model_path_problem("/models/Qwen2.5-7B-Instruct", mounted) is not None
    assert model_path_problem("/mnt/models/Qwen2.5-7B-Instruct", mounted) is None
    assert model_path_problem("Qwen/Qwen2.5-7B-Instruct", []) is None


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_each_launcher_serves_a_model_that_fits_its_gpu(path):
    from pagedserve.kernels.gpu_targets import check_dtype
    from pagedserve.workers.model.model_runner import resolve_dtype

    memory_gb, capability = GPU_OF_LAUNCHER[path.name]
    served = load_config(_served_config(yaml.safe_load(path.read_text())))
    params = HUB_MODEL_PARAMS[served.model.path]
    # The dtype a worker picks there (auto: bf16 only with native bf16), and that the kernels accept it.
    if served.engine.dtype in (None, "auto"):
        dtype = torch.bfloat16 if capability >= (8, 0) else torch.float16
    else:
        dtype = resolve_dtype(served.engine.dtype, torch.device("cpu"))
    check_dtype(capability, dtype)
    # A worker of N ranks: each GPU holds 1/N of the layers plus the parameters every rank keeps whole.
    ranks = max(group.tensor_parallel_size or served.engine.tensor_parallel_size for group in served.workers)
    replicated = HUB_MODEL_REPLICATED_PARAMS.get(served.model.path, 0) if ranks > 1 else 0
    weights_gb = ((params - replicated) / ranks + replicated) * dtype.itemsize / 1e9
    usable_gb = memory_gb * served.engine.gpu_memory_utilization
    assert weights_gb <= 0.75 * usable_gb, f"{served.model.path}: {weights_gb:.1f} GB of weights on {memory_gb} GB"
    if capability < (8, 0):
        assert served.engine.dtype in (None, "auto", "float16", "fp16", "half"), "no bf16 on this GPU"


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_each_launcher_installs_this_checkout_and_passes_the_token(path):
    launcher = yaml.safe_load(path.read_text())
    assert launcher["file_mounts"]["~/pagedserve"] == "."
    assert "python3 -m pip install -e ~/pagedserve" in launcher["setup_commands"]
    assert {".git", ".venv"} <= set(launcher["rsync_exclude"])
    serve = next(c for c in launcher["head_start_ray_commands"] if "pagedserve serve" in c)
    # HF_TOKEN (and PAGEDSERVE_API_KEY) from the checkout's .env reach `pagedserve serve`, which
    # passes the token on to every worker.
    assert serve.index(". ~/pagedserve/.env") < serve.index("pagedserve serve") and "set -a" in serve
    assert ".env" in (CONFIGS.parent / ".gitignore").read_text().split()


def test_rays_validator_rejects_a_broken_launcher_file():
    config = yaml.safe_load((CONFIGS / "cluster-aws.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["bogus_field"] = 1
    with pytest.raises(Exception):
        _ray_validate(config)


@pytest.mark.parametrize("overrides, path_in_error", [
    (["engine.blocksize=8"], "engine.blocksize"),
    (["workers.0.role=gpu"], "workers.0.role"),
    (["server.port=-1"], "server.port"),
    (["engine.preemption_mode=drop"], "engine.preemption_mode"),
    (["workers.0.engine.num_device_blocks=0"], "num_device_blocks"),
    (["router.prefix_weight=-1"], "router.prefix_weight"),
    (["engine.seed=-1"], "engine.seed"),
    (["health_check_period_s=0"], "health_check_period_s"),
    (["health_check_period_s=5", "step_timeout_s=2"], "health_check_period_s"),
])
def test_bad_values_are_rejected_naming_the_key(overrides, path_in_error):
    with pytest.raises(ValueError, match=path_in_error.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, key, message", [
    (["workers.0.autoscaling={min_replicas: 3, max_replicas: 2}"], "workers.0.autoscaling", "min_replicas"),
    (["workers.0.autoscaling={max_replicas: 2, upscale_delay_s: -1}"], "workers.0.autoscaling.upscale_delay_s", ""),
    (["workers.0.autoscaling={max_replicas: 2, downscale_delay_s: -0.5}"], "workers.0.autoscaling.downscale_delay_s", ""),
    (["workers.0.autoscaling={max_replicas: 2, initial_replicas: 1}"], "workers.0.autoscaling.initial_replicas", ""),
    (["workers.0.autoscaling={max_replicas: 2, target_ongoing_requests: 0}"],
     "workers.0.autoscaling.target_ongoing_requests", ""),
    (["workers.0.autoscaling={min_replicas: 0, max_replicas: 2}"], "workers.0.autoscaling.min_replicas", ""),
    (["workers.0.count=2", "workers.0.autoscaling={max_replicas: 2}"], "workers.0", "count .*autoscaling"),
    (["model.revision=v1"], "model", "revision needs model.path"),
])
def test_bad_autoscaling_and_model_blocks_name_the_key(overrides, key, message):
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*" + message):
        load_config(None, overrides)


def test_autoscaling_takes_serves_names_and_defaults_and_fixed_counts_keep_working(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("workers:\n  - autoscaling: {min_replicas: 1, max_replicas: 3}\n    num_gpus: 1\n"
                    "  - count: 2\n")
    elastic, fixed = load_config(path).workers
    assert (elastic.min_workers, elastic.max_workers, elastic.count) == (1, 3, None)
    serve_defaults = __import__("ray.serve.config", fromlist=["AutoscalingConfig"]).AutoscalingConfig()
    for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "look_back_period_s"):
        assert getattr(elastic.autoscaling, key) == getattr(serve_defaults, key), key
    assert (fixed.min_workers, fixed.max_workers, fixed.autoscaling) == (2, 2, None)
    assert load_config(None).workers[0].min_workers == 1
    # What `config show` prints validates again as the same configuration.
    config = load_config(path)
    assert ClusterConfig.model_validate(config.model_dump()) == config


def test_disaggregation_needs_both_roles():
    with pytest.raises(ValueError, match="prefill and decode"):
        load_config(None, ["workers.0.role=prefill"])


def test_bad_yaml_and_non_mapping_are_clear_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("engine: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(scalar)


def test_engine_seed_defaults_to_fresh_per_engine_and_an_explicit_one_is_kept():
    assert load_config(None, []).engine.seed is None
    assert load_config(None, ["engine.seed=7"]).engine.to_engine_config("m").seed == 7


def test_overrides_apply_over_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  block_size: 8\nworkers:\n  - count: 2\n")
    config = load_config(path, ["engine.block_size=32", "workers.0.num_cpus=0.5"])
    assert config.engine.block_size == 32
    assert config.workers[0].count == 2 and config.workers[0].num_cpus == 0.5


def test_config_cli_validate_and_show(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {blocksize: 3}\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "pagedserve", "config", *args],
                                       capture_output=True, text=True)
    ok = run("validate", str(CONFIGS / "default.yaml"))
    assert ok.returncode == 0 and "valid" in ok.stdout
    failed = run("validate", str(bad))
    assert failed.returncode == 1 and "engine.blocksize" in failed.stderr
    shown = run("show", "--set", "engine.block_size=32")
    assert shown.returncode == 0
    assert yaml.safe_load(shown.stdout)["engine"]["block_size"] == 32


# ---- binding: loopback unless set explicitly -----------------------------------------------------
def test_the_default_and_every_pagedserve_file_bind_loopback():
    assert ClusterConfig().server.host == "127.0.0.1"
    for path in PAGEDSERVE_FILES:
        assert load_config(path).server.host in ("127.0.0.1", "localhost", "::1"), path.name


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_files_bind_other_interfaces_only_explicitly(path):
    config = yaml.safe_load(path.read_text())
    for command in config["head_start_ray_commands"]:
        if "pagedserve serve" in command:
            served = command.split("--config", 1)[1].split()[0].replace("~/pagedserve/", "")
            if load_config(CONFIGS.parent / served).server.host != "0.0.0.0":
                assert "--host 0.0.0.0" in command or "--host" not in command


def test_serve_cli_binds_loopback_unless_told(monkeypatch):
    from pagedserve.cluster import cli, launcher

    seen = {}

    def serve_forever(config, address=None) -> int:
        seen["config"] = config
        return 0

    monkeypatch.setattr(launcher, "serve_forever", serve_forever)
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    assert cli.main(["serve"]) == 0
    assert seen.pop("config").server.host == "127.0.0.1"
    cli.main(["serve", "--host", "0.0.0.0", "--log-requests", "--store-responses"])
    config = seen.pop("config")
    assert config.server.host == "0.0.0.0" and config.server.log_requests and config.server.store_responses
    assert not ClusterConfig().server.log_requests and ClusterConfig().server.metrics_require_api_key
    assert not ClusterConfig().server.store_responses


def test_argument_types_have_one_definition():
    from pagedserve import argtypes as cli
    from pagedserve.bench import cli as bench_cli

    assert bench_cli.positive_int is cli.positive_int and bench_cli.positive_float is cli.positive_float
    assert bench_cli.non_negative_int is cli.non_negative_int
    for parse, bad in ((cli.positive_int, "0"), (cli.positive_float, "nan"), (cli.non_negative_int, "-1"),
                       (cli.positive_int, "x"), (cli.port, "65536")):
        with pytest.raises(Exception):
            parse(bad)
    assert cli.positive_float("inf") == float("inf") and cli.non_negative_int("0") == 0


# ---- the fake-provider autoscaling cluster (tests and demos on one machine) ----------------------
FAKE_CLUSTER = CONFIGS / "fake-autoscaling"


def test_fake_autoscaler_file_passes_rays_validator_as_the_autoscaler_reads_it():
    from pagedserve.cluster.ray_compat import validate_autoscaler_config

    config = yaml.safe_load((FAKE_CLUSTER / "cluster.yaml").read_text())
    validate_autoscaler_config(config)  # what the head's autoscaler runs: the schema, no defaults added
    assert config["provider"]["type"] == "fake_multinode"
    for flag in ("use_node_id_as_ip", "disable_node_updaters", "disable_launch_config_check"):
        assert config["provider"][flag] is True, flag
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert config["head_node_type"] == "ray.head.default" and not head["resources"].get("GPU")
    (gpu_type,) = [t for t in types.values() if t["resources"].get("GPU")]
    assert {k: gpu_type["resources"][k] for k in ("CPU", "GPU")} == {"CPU": 1, "GPU": 1}
    assert (gpu_type["min_workers"], gpu_type["max_workers"]) == (0, 3)
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands",
                "initialization_commands", "head_setup_commands", "worker_setup_commands"):
        assert config[key] == [], key
    broken = {**config, "available_node_types": {**types, "gpu_worker": {**gpu_type, "bogus_field": 1}}}
    with pytest.raises(Exception, match="bogus_field"):
        validate_autoscaler_config(broken)


def test_fake_cluster_serve_files_fit_its_gpu_nodes():
    gpu_type = yaml.safe_load((FAKE_CLUSTER / "cluster.yaml").read_text())["available_node_types"]["gpu_worker"]
    elastic = load_config(FAKE_CLUSTER / "serve.yaml").workers
    fixed = load_config(FAKE_CLUSTER / "serve-fixed.yaml").workers
    assert [(g.min_workers, g.max_workers, g.count) for g in elastic] == [(1, 3, None)]
    assert [(g.min_workers, g.max_workers, g.count) for g in fixed] == [(1, 1, 1)]
    for group in (*elastic, *fixed):  # one worker per fake GPU node
        assert (group.num_gpus, group.num_cpus) == (gpu_type["resources"]["GPU"], gpu_type["resources"]["CPU"])
    assert elastic[0].max_workers == gpu_type["max_workers"]
    for name in ("serve.yaml", "serve-fixed.yaml"):  # a model built on first start: nothing to fetch
        config = load_config(FAKE_CLUSTER / name)
        assert config.model.path is None and config.model.size == "tiny" and config.server.host == "127.0.0.1"


def test_a_groups_engine_options_keep_their_types_through_the_overrides(recwarn):
    """A group's engine overrides are validated into options whose nested configs stay models
    (a dict in their place made every dump warn and skip their serializer)."""
    from pagedserve.cluster.worker_pool import group_engine_config, group_engine_options

    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    config = ClusterConfig.model_validate({
        "model": {"path": "/models/x", "name": "x"}, "engine": {"speculative_config": ngram},
        "workers": [{"count": 1, "engine": {"max_num_seqs": 8}}, {"count": 1, "tensor_parallel_size": 2}]})
    for group in config.workers:
        options = group_engine_options(config, group)
        assert type(options.speculative_config).__name__ == "SpeculativeConfig"
        engine = group_engine_config(config, group, "/models/x")
        assert engine["speculative_config"]["num_speculative_tokens"] == 3
    assert group_engine_options(config, config.workers[0]).max_num_seqs == 8
    assert group_engine_config(config, config.workers[1], "/models/x")["distributed_executor_backend"] == "ray"
    assert not [w for w in recwarn if "Pydantic" in type(w.message).__name__ or "serializ" in str(w.message)]


def test_speculates_reads_the_engine_and_each_groups_override():
    """What the frontend refuses beam search by: some worker group runs speculative decoding."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert not ClusterConfig().speculates
    assert ClusterConfig(engine={"speculative_config": ngram}).speculates
    assert not ClusterConfig(engine={"speculative_config": ngram},
                             workers=[{"engine": {"speculative_config": None}}]).speculates
    assert ClusterConfig(workers=[{"count": 1}, {"count": 1, "engine": {"speculative_config": ngram}}]).speculates
