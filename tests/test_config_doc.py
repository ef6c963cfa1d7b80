"""docs/configuration.md is the schema's own account of itself: generated, never stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.cluster import config_doc
from pagedserve.cluster.config import ClusterConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_schema_generates():
    assert PAGE.read_text(encoding="utf-8") == config_doc.render(), (
        "docs/configuration.md is stale: regenerate it with `make docs` "
        "(python -m pagedserve.cluster.config_doc docs/configuration.md) and commit it")


@pytest.mark.parametrize("path,model", config_doc._sections(ClusterConfig, ""),
                         ids=lambda value: value if isinstance(value, str) else "")
def test_every_key_says_what_it_means(path, model):
    undocumented = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not undocumented, (f"{path or 'top level'}: keys without a docstring under the field "
                              f"(it becomes their line in docs/configuration.md): {undocumented}")


def test_every_key_of_the_schema_has_a_row():
    page = config_doc.render()
    for path, model in config_doc._sections(ClusterConfig, ""):
        for name in model.model_fields:
            key = f"{path}.{name}" if path else name
            assert f"| `{key}` |" in page, f"{key} has no row"
