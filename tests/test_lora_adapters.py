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
