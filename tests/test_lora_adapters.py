"""The server's adapters by name: configured ones keep their order's ids; a dynamic one is any
subdirectory of the dynamic directory holding an adapter's config, with an id every replica
derives alike, and nothing outside that directory can be named."""

from __future__ import annotations

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
