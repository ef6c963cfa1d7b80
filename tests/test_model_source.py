"""Model sources: a directory (local or shared storage), or a hub id each node fetches itself.

There is no internet here, so the hub is ``tests/hub_mirror.py``: a local server of the hub's
HTTP API that huggingface_hub's real ``snapshot_download`` talks to (``HF_ENDPOINT``), gated
by a token. huggingface_hub reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` when it is imported, so
every fetch runs in a fresh process with its own environment, as on a fresh node.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_mirror import HubMirror, MirroredRepo
from remote_code_model import make_remote_code_model
from pagedserve.workers.model.model_source import ModelSource, ModelSourceError, is_hub_id

pytestmark = pytest.mark.timeout(600)

TOKEN = "hf_pagedserve_test_token"
GATED = "pagedserve-test/tiny-llama"        # needs TOKEN to download files
NO_WEIGHTS = "pagedserve-test/no-weights"   # config and tokenizer only
REMOTE_CODE = "pagedserve-test/remote-llama"   # classes of its own (tests/remote_code_model.py)
HOST = socket.gethostname()

_RESOLVE = """
import json, sys
from pagedserve.workers.model.model_source import ModelSource, ModelSourceError
source, weights = json.loads(sys.argv[1]), sys.argv[2] == "1"
try:
    print(json.dumps({"dir": ModelSource.from_dict(source).resolve(weights=weights)}))
except ModelSourceError as exc:
    print(json.dumps({"error": str(exc)}))
"""


# What a fresh node's environment decides for itself: its token, its hub, whether it is offline
# (huggingface_hub reads TRANSFORMERS_OFFLINE as HF_HUB_OFFLINE), whatever this machine sets.
NODE_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                  "HF_DATASETS_OFFLINE")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without ``NODE_VARIABLES``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in NODE_VARIABLES}
    env.update(extra)
    return env


def _resolve(source: ModelSource, env: dict[str, str], weights: bool = True) -> dict:
    """Resolve in a fresh process (a fresh node's huggingface_hub); {"dir": ...} or {"error": ...}."""
    start = time.time()
    done = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(source.to_dict()), "1" if weights else "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = time.time() - start
    return result


@pytest.fixture(scope="module")
def repos(tiny_model, tmp_path_factory):
    model_dir = Path(tiny_model("llama"))
    no_weights = tmp_path_factory.mktemp("no-weights")
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, no_weights / path.name)
    remote_code = make_remote_code_model(model_dir, tmp_path_factory.mktemp("remote-code"))
    return {GATED: MirroredRepo(model_dir, revisions=("main", "v1"), token=TOKEN),
            NO_WEIGHTS: MirroredRepo(no_weights), REMOTE_CODE: MirroredRepo(remote_code)}


@pytest.fixture
def mirror(repos):
    with HubMirror(repos) as running:
        yield running


# ---- classification and directories --------------------------------------------------------------
@pytest.mark.parametrize("reference, expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("gpt2", True), ("org/name.v2", True),
    ("/models/Qwen2.5-7B-Instruct", False), ("./models/x", False), ("../x", False), ("~/models/x", False),
    ("org/na--me", False), ("org/../x", False), ("a/b/c", False), ("org/name with space", False),
])
def test_hub_ids_and_paths_are_told_apart(reference, expected):
    assert is_hub_id(reference) is expected


def test_a_local_directory_resolves_to_itself(tiny_model):
    path = tiny_model("llama")
    assert ModelSource(path).resolve() == path


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "absent", "no such directory on node"),
    (lambda tmp: tmp, "no config.json"),
])
def test_a_bad_directory_names_the_node_and_the_reason(tmp_path, make, message):
    with pytest.raises(ModelSourceError, match=message) as error:
        ModelSource(str(make(tmp_path))).resolve()
    assert HOST in str(error.value)


def test_a_directory_without_weights_resolves_for_its_config_only(tiny_model, tmp_path):
    """The head reads a directory's config (``weights=False``); a worker, which loads the
    weights, is refused at once where there are none, naming the node."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model("llama")) / name, tmp_path)
    assert ModelSource(str(tmp_path)).resolve(weights=False) == str(tmp_path)
    with pytest.raises(ModelSourceError, match=r"holds no weights \(no \*\.safetensors or \*\.bin file\)") as error:
        ModelSource(str(tmp_path)).resolve()
    assert HOST in str(error.value)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")   # PyTorch's weights count too
    assert ModelSource(str(tmp_path)).resolve() == str(tmp_path)


def test_a_revision_on_a_directory_is_refused(tiny_model):
    with pytest.raises(ModelSourceError, match="revision"):
        ModelSource(tiny_model("llama"), revision="v1").resolve()


def test_the_token_never_shows_in_repr():
    assert TOKEN not in repr(ModelSource(GATED, token=TOKEN))


# ---- the hub, through huggingface_hub's real code ---------------------------------------------
def test_a_hub_id_is_fetched_with_the_token_at_a_revision(mirror, repos, tmp_path):
    env = _env(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"))
    for revision in (None, "v1", repos[GATED].commit):
        result = _resolve(ModelSource(GATED, revision=revision, token=TOKEN), env)
        assert "dir" in result, result
        fetched = Path(result["dir"])
        assert fetched.name == repos[GATED].commit  # huggingface_hub's cache: snapshots/<commit>
        for name, data in repos[GATED].files.items():
            assert (fetched / name).read_bytes() == data, name
    downloads = [r for r in mirror.requests if "/resolve/" in r[1]]
    assert downloads and all(auth == f"Bearer {TOKEN}" for _, _, auth in downloads)

    # The head node needs config and tokenizer only: no weights are fetched for it.
    head = _resolve(ModelSource(GATED, token=TOKEN), _env(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "head")),
                    weights=False)
    assert (Path(head["dir"]) / "config.json").is_file()
    assert not list(Path(head["dir"]).glob("*.safetensors"))

    # HF_TOKEN in the node's own environment serves too (huggingface_hub's default).
    result = _resolve(ModelSource(GATED), _env(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "own"),
                                               HF_TOKEN=TOKEN))
    assert "dir" in result, result


def test_a_hub_checkpoints_own_code_comes_with_its_config(mirror, repos, tmp_path):
    """The head node (config and tokenizer) and a worker (weights too) fetch the checkpoint's
    code with its config: transformers imports its classes from the same folder."""
    for weights in (False, True):
        result = _resolve(ModelSource(REMOTE_CODE), _env(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / str(weights))),
                          weights=weights)
        assert "dir" in result, result
        for name in ("configuration_remote_llama.py", "modeling_remote_llama.py"):
            assert (Path(result["dir"]) / name).read_bytes() == repos[REMOTE_CODE].files[name], (weights, name)


@pytest.mark.parametrize("source, reason", [
    (ModelSource(GATED), "gated repo: set HF_TOKEN"),
    (ModelSource(GATED, token="hf_wrong"), "gated repo: set HF_TOKEN"),
    (ModelSource("pagedserve-test/absent", token=TOKEN), "no such repo"),
    (ModelSource(GATED, revision="v9", token=TOKEN), "no such revision"),
    (ModelSource(NO_WEIGHTS), "holds no \\*.safetensors or \\*.bin weights"),
], ids=["no-token", "wrong-token", "unknown-repo", "unknown-revision", "no-weights"])
def test_a_hub_id_that_cannot_be_fetched_fails_fast_naming_node_and_reason(mirror, tmp_path, source, reason):
    result = _resolve(source, _env(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf")))
    assert "error" in result, result
    assert HOST in result["error"] and source.reference in result["error"]
    assert __import__("re").search(reason, result["error"]), result["error"]
    assert TOKEN not in result["error"]
    assert result["seconds"] < 60


def test_an_unreachable_hub_fails_fast(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    result = _resolve(ModelSource(GATED, token=TOKEN), _env(HF_ENDPOINT=closed, HF_HOME=str(tmp_path / "hf")))
    assert "hub is unreachable from this node" in result["error"] and HOST in result["error"]
    assert result["seconds"] < 60, result


def test_an_offline_node_uses_its_filled_cache(repos, tmp_path):
    cache = str(tmp_path / "hf")
    with HubMirror(repos) as mirror:
        fetched = _resolve(ModelSource(GATED, token=TOKEN), _env(HF_ENDPOINT=mirror.url, HF_HOME=cache))
    # The mirror is gone: an offline node resolves from its cache, by branch name ...
    offline = _resolve(ModelSource(GATED), _env(HF_HOME=cache, HF_HUB_OFFLINE="1"))
    assert offline.get("dir") == fetched["dir"], offline
    # ... and one whose cache lacks the revision says so.
    missing = _resolve(ModelSource(GATED, revision="v1"), _env(HF_HOME=cache, HF_HUB_OFFLINE="1"))
    assert "cache lacks this revision" in missing["error"] and HOST in missing["error"]


# ---- a cluster: every worker fetches on its own node; the driver passes its token ----------------
_CLUSTER = """
import json, os, sys, time
import ray
from pagedserve.cluster.bootstrap import start, WorkerStartError
from pagedserve.workers.sample.sampling_params import SamplingParams
from pagedserve.workers.model.model_source import ModelSourceError

repo, broken, worker_cache, reference_ids = sys.argv[1:5]
# The workers' environment has no token: only the driver's, passed along, opens the gated repo.
ray.init(num_cpus=2, include_dashboard=False, namespace="pagedserve",
         runtime_env={"env_vars": {"HF_TOKEN": "", "HF_HOME": worker_cache}})
out = {}
config = {"model": {"path": repo, "name": "tiny"}, "engine": {"num_device_blocks": 64, "swap_space_gb": 0.001},
          "workers": [{"count": 1, "num_cpus": 0.5}], "kv_manager_num_cpus": 0.1}
handle = start(config, ready_timeout_s=300)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
output = handle.generate_sync([json.loads(reference_ids)], params)[0]
out["tokens"] = list(output.outputs[0].token_ids)
out["worker_dir"] = ray.get(next(iter(handle.workers.values())).info.remote())["model"]
handle.shutdown()
started = time.time()
try:
    start({**config, "model": {"path": broken}}, ready_timeout_s=300)
except (WorkerStartError, ModelSourceError) as exc:
    out["error"], out["error_type"] = str(exc), type(exc).__name__
out["error_seconds"] = time.time() - started
print(json.dumps(out))
"""


@pytest.mark.distributed
def test_cluster_workers_fetch_the_hub_id_with_the_drivers_token(repos, tmp_path, tiny_model):
    from pagedserve.workers.offline.llm import LLM
    from pagedserve.workers.sample.sampling_params import SamplingParams

    prompt = [5, 17, 33, 48, 64, 90]
    expected = LLM(tiny_model("llama"), num_device_blocks=64, swap_space_gb=0.001).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    worker_cache = tmp_path / "worker-hf"
    with HubMirror(repos) as mirror:
        env = _env(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "driver-hf"), HF_TOKEN=TOKEN)
        done = subprocess.run([sys.executable, "-c", _CLUSTER, GATED, NO_WEIGHTS, str(worker_cache),
                               json.dumps(prompt)], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == list(expected)
    # The worker loaded from its own node's cache, not the driver's.
    assert result["worker_dir"].startswith(str(worker_cache)), result["worker_dir"]
    assert list(Path(result["worker_dir"]).glob("*.safetensors"))
    assert not list((tmp_path / "driver-hf").rglob("*.safetensors")), "the head fetched weights it never uses"
    # A worker that cannot get the weights ends start() at once, naming itself, its node and why.
    assert result.get("error_type") == "WorkerStartError", result
    assert "worker-0 could not start" in result["error"] and HOST in result["error"]
    assert "holds no *.safetensors or *.bin weights" in result["error"]
    assert result["error_seconds"] < 120, result


# ---- a checkpoint with code of its own ----------------------------------------------------------------
@pytest.mark.distributed
def test_a_cluster_serves_a_checkpoint_with_code_of_its_own_when_trusted(tiny_model, tmp_path):
    """``model.trust_remote_code``: the head's tokenizer and every worker's model load through
    the checkpoint's own code (a worker refuses the model without it), and serve what the
    offline engine makes of it."""
    from pagedserve.workers.offline.llm import LLM
    from pagedserve.workers.sample.sampling_params import SamplingParams
    from served_cluster import assert_idle, cluster_config, running_cluster

    path = str(make_remote_code_model(tiny_model("llama"), tmp_path))
    prompt = "The paged KV cache splits every sequence into blocks"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = {"num_device_blocks": 64, "swap_space_gb": 0.001}
    offline = LLM(path, trust_remote_code=True, **engine)
    expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    config = cluster_config(path, "remote", engine, num_workers=1)
    config["model"]["trust_remote_code"] = True
    with running_cluster(config, num_cpus=2) as cluster:
        output = cluster.handle.generate_sync([prompt], params)[0]   # a text prompt: the head's tokenizer
        assert_idle(cluster.handle)
    assert list(output.outputs[0].token_ids) == list(expected)
