"""The server's adapters by name: configured ones keep their order's ids; a dynamic one is any
folder of the dynamic path (a directory, a URI, a hub repo) holding an adapter's config, with
an id every replica derives alike, and nothing outside that path can be named."""

from __future__ import annotations

import pytest

from pagedserve.cluster.config import LoRAModule
from pagedserve.cluster.lora_adapters import DYNAMIC_IDS_FROM, LoRAAdapters, dynamic_id


def _adapter(directory) -> str:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text("{}")
    return str(directory)


def test_configured_and_dynamic_adapters(tmp_path):
    dynamic = tmp_path / "dynamic"
    _adapter(dynamic / "sql")
    _adapter(dynamic / "v1.2_chat-x")
    (dynamic / "empty").mkdir()
    _adapter(tmp_path / "outside")
    adapters = LoRAAdapters([LoRAModule(name="a", path="/x/a"), LoRAModule(name="b", path="/x/b")], str(dynamic))
    assert [(r.lora_name, r.lora_int_id) for r in adapters.known().values()] == [("a", 1), ("b", 2)]
    sql = adapters.get("sql")
    assert sql.lora_path == str(dynamic / "sql") and sql.lora_int_id == dynamic_id("sql") >= DYNAMIC_IDS_FROM
    assert LoRAAdapters([], str(dynamic)).get("sql") == sql            # another replica: the same id
    assert adapters.get("v1.2_chat-x").lora_int_id != sql.lora_int_id
    assert "sql" in adapters.known()
    for name in ("empty", "missing", "../outside", "..", ".", "sql/..", "/etc", "a b", ""):
        assert adapters.get(name) is None, name
    assert not LoRAAdapters() and LoRAAdapters([], str(dynamic)) and adapters.get("sql") is not None


def test_runtime_adapters_come_as_the_controllers_set_and_never_shadow_configured_ones(tmp_path):
    from pagedserve.cluster.lora_adapters import RUNTIME_IDS_FROM, runtime_id
    from pagedserve.cluster.runtime_adapters import RuntimeAdapterRegistry

    dynamic = tmp_path / "dynamic"
    _adapter(dynamic / "sql")
    adapters = LoRAAdapters([LoRAModule(name="a", path="/x/a")], str(dynamic))
    registry = RuntimeAdapterRegistry(store=False)
    first, second = runtime_id(), runtime_id()
    assert RUNTIME_IDS_FROM <= min(first, second) and first != second
    assert registry.add("tenant", first, "/r/t") == (1, {"tenant": (first, "/r/t")})
    assert registry.add("tenant", second, "/r/u") is None                 # taken: nothing changes
    adapters.set_runtime(*registry.add("a", second, "/r/a"))
    assert adapters.get("tenant").lora_path == "/r/t" and adapters.source("tenant") == "runtime"
    assert adapters.get("a").lora_int_id == 1 and adapters.source("a") == "lora_modules"   # configured wins
    adapters.get("sql")
    assert list(adapters.known()) == ["a", "tenant", "sql"]
    assert adapters.source("sql") == "dynamic_lora_loading_path" and adapters.source("nope") is None
    version, remaining, removed_id = registry.remove("tenant")
    assert (version, removed_id, registry.remove("tenant")) == (3, first, None)
    adapters.set_runtime(1, {"tenant": (first, "/r/t")})                  # an older set changes nothing
    adapters.set_runtime(version, remaining)
    assert adapters.get("tenant") is None and adapters.runtime_version == 3
    only_runtime = LoRAAdapters()
    assert not only_runtime
    only_runtime.set_runtime(1, {"x": (first, "/r/x")})
    assert only_runtime and only_runtime.get("x").lora_int_id == first


def test_dynamic_adapters_under_a_uri_are_found_and_copied_once(tmp_path, monkeypatch):
    """A URI fsspec knows (here its in-memory filesystem; s3:// and gs:// need s3fs or gcsfs):
    an adapter is a folder holding ``adapter_config.json``, and the reading node copies its two
    files into its cache once."""
    import fsspec

    from pagedserve.workers.lora.adapter_source import AdapterSourceError, adapter_directory

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    memory = fsspec.filesystem("memory")
    memory.pipe({"/adapters/sql/adapter_config.json": b'{"r": 4}', "/adapters/sql/adapter_model.safetensors": b"w",
                 "/adapters/half/adapter_config.json": b"{}"})
    adapters = LoRAAdapters([], "memory://adapters")
    sql = adapters.get("sql")
    assert sql.lora_path == "memory://adapters/sql" and sql.lora_int_id == dynamic_id("sql")
    assert adapters.get("nope") is None and adapters.get("../adapters") is None
    directory = adapter_directory(sql.lora_path)
    assert (directory / "adapter_config.json").read_bytes() == b'{"r": 4}'
    memory.pipe({"/adapters/sql/adapter_config.json": b"changed"})
    assert adapter_directory(sql.lora_path) == directory                 # copied once
    assert (directory / "adapter_config.json").read_bytes() == b'{"r": 4}'
    with pytest.raises(AdapterSourceError, match="no adapter_model.safetensors under lora_path"):
        adapter_directory(adapters.get("half").lora_path)
    with pytest.raises(AdapterSourceError, match="nosuch:// paths need an fsspec filesystem"):
        LoRAAdapters([], "nosuch://bucket/adapters")
    memory.rm("/adapters", recursive=True)


_HUB_DYNAMIC = """
import json, sys
from pagedserve.cluster.lora_adapters import LoRAAdapters
from pagedserve.workers.lora.adapter_source import AdapterSourceError, adapter_directory
adapters = LoRAAdapters([], sys.argv[1])
try:
    sql = adapters.get("sql")
    print(json.dumps({"sql": sql.lora_path, "nope": adapters.get("nope"),
                      "files": sorted(p.name for p in adapter_directory(sql.lora_path).iterdir())}))
except AdapterSourceError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def test_dynamic_adapters_in_a_hub_repo_are_its_folders(tmp_path):
    """A hub repo (``org/repo`` or ``hf://org/repo``; here ``tests/hub_mirror.py``, with
    huggingface_hub's real code in a fresh process): an adapter is a folder of it, fetched
    alone; a hub that does not answer is an error naming why, not an unknown adapter."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from hub_mirror import HubMirror, MirroredRepo

    repo_dir = tmp_path / "repo"
    for name in ("sql", "chat"):
        _adapter(repo_dir / name)
        (repo_dir / name / "adapter_model.safetensors").write_bytes(b"weights")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env["HF_HOME"] = str(tmp_path / "hf")

    def run(root: str, endpoint: str) -> dict:
        done = subprocess.run([sys.executable, "-c", _HUB_DYNAMIC, root], env={**env, "HF_ENDPOINT": endpoint},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    with HubMirror({"pagedserve-test/adapters": MirroredRepo(repo_dir)}) as mirror:
        for root in ("pagedserve-test/adapters", "hf://pagedserve-test/adapters"):
            found = run(root, mirror.url)
            assert found == {"sql": "hf://pagedserve-test/adapters/sql", "nope": None,
                             "files": ["adapter_config.json", "adapter_model.safetensors"]}
        fetched = {path for method, path, _ in mirror.requests if method == "GET" and "/resolve/" in path}
        assert not any("/chat/" in path for path in fetched)               # only the adapter asked for
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    down = run("pagedserve-test/other", f"http://127.0.0.1:{port}")
    assert "dynamic_lora_loading_path 'pagedserve-test/other' cannot be read" in down["error"]
