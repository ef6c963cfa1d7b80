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


# Docs describe the software and its measurements (by date, machine, commit and command),
# never how the work on them went.
NARRATION = re.compile(
    r"\b(?:this|that|the next|next|the last|last|an earlier|earlier|the previous|previous|another|a later"
    r"|the same) sessions?\b|\bsession's\b|\b(?:we|our|ours|my|mine)\b|(?-i:\bI\b)(?![/-])"
    r"|\b(?:this|the) change's\b|\bthis change\b|\b(?:last|latest) run\b|\bthe review's\b", re.I)
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)


def narration(text: str) -> list[str]:
    """The narrating phrases of ``text``'s prose (code blocks and spans left out), in context."""
    prose = CODE.sub(lambda match: " " * len(match.group()), text)
    return [prose[max(0, m.start() - 30):m.end() + 30].replace("\n", " ") for m in NARRATION.finditer(prose)]


def test_the_narration_check_finds_what_it_is_for():
    found = narration("12:43-13:19 in this session's quiet runs; as we tried, the last session's log; `my.yaml`")
    assert len(found) == 3, found
    assert narration("```\nthe last session\n```\nRay's session directory, I/O, sequence i") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_docs_do_not_narrate(page):
    phrases = narration(page.read_text(encoding="utf-8"))
    assert not phrases, f"{page.relative_to(ROOT)} narrates how the work went: {phrases}"
