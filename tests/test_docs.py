"""The README and docs/ stay short enough to read and point at things that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for line in page.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_readme_is_read_in_ten_minutes():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; details belong in docs/ (limit 300)"


def test_readme_keeps_the_command_ci_runs():
    assert "make test" in (ROOT / "README.md").read_text(encoding="utf-8"), \
        ".ci/run runs `make test`, the README's test command"


FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
DOC_IMPORT = re.compile(r"^[ \t]*(from[ \t]+pagedserve[\w.]*[ \t]+import[ \t]+(?:\([^)]*\)|[^\n]*)"
                        r"|import[ \t]+pagedserve[\w.]*[^\n]*)", re.M)


def documented_imports() -> list[tuple[str, str]]:
    """(page, statement) for every ``from pagedserve... import ...`` or ``import pagedserve...``
    in the pages' code blocks."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text(encoding="utf-8")):
            found += [(str(page.relative_to(ROOT)), statement) for statement in DOC_IMPORT.findall(block)]
    return found


def test_the_docs_show_imports():
    statements = [statement for _, statement in documented_imports()]
    assert any("import LLM" in statement for statement in statements), statements


@pytest.mark.parametrize("page, statement", documented_imports(), ids=lambda value: value.split("#")[0].strip())
def test_every_documented_import_works(page, statement):
    """Each public name the docs show imports from where they show it."""
    import ast
    import importlib

    for node in ast.parse(statement).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(module, alias.name):  # a submodule not yet loaded
                importlib.import_module(f"{node.module}.{alias.name}")

