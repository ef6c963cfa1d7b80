"""Keep the source tree's package folders from shadowing installed distributions.

``pagedserve.kernels``, ``.workers``, ``.cluster`` and ``.kvmanager`` live in top-level
folders of the source tree. Wherever the tree's root is on ``sys.path`` (``python -m``
from the checkout, and every Ray worker of a driver started there, since Ray adds the
driver's directory to its workers' paths), ``import kernels`` finds the folder instead of
an installed ``kernels`` distribution. transformers (>= 5.25) imports that distribution
when it is installed, and fails on the folder.

``install()`` puts a finder first on ``sys.meta_path``: a top-level import of one of those
names looks past the tree's root, and takes the installed distribution where there is
one. Where there is none, the import goes on as before. A process that imports ``kernels``
before ``pagedserve`` reaches the folder itself, whose ``__init__`` calls ``step_aside()``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

SOURCE_FOLDERS = ("kernels", "workers", "cluster", "kvmanager")


def _resolved(entry: str) -> str:
    return os.path.realpath(entry or os.getcwd())


class SourceTreeShadowFinder(importlib.abc.MetaPathFinder):
    """Finds the installed distribution of a name that the source tree's folder shadows."""

    def __init__(self, tree_root: Path):
        self.tree_root = os.path.realpath(tree_root)

    def find_spec(self, fullname, path=None, target=None):
        if path is not None or fullname not in SOURCE_FOLDERS:
            return None
        entries = [entry for entry in sys.path if isinstance(entry, str)]
        if not any(_resolved(entry) == self.tree_root for entry in entries):
            return None
        elsewhere = [entry for entry in entries if _resolved(entry) != self.tree_root]
        return importlib.machinery.PathFinder.find_spec(fullname, elsewhere, target)


def source_tree_root() -> Path | None:
    """The checkout's root when pagedserve runs from its source tree, else None."""
    root = Path(__file__).resolve().parents[2]
    if (root / "kernels" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` once, when running from the source tree."""
    root = source_tree_root()
    if root is None or any(isinstance(finder, SourceTreeShadowFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, SourceTreeShadowFinder(root))


def step_aside(name: str) -> str:
    """Called by a source folder's ``__init__`` when it was imported as top-level ``name``.

    Where an installed distribution of that name exists, it replaces the folder in
    ``sys.modules`` (the import then returns it). Returns the package that the folder's own
    relative imports should resolve in: ``pagedserve.<name>``.
    """
    root = source_tree_root()
    spec = SourceTreeShadowFinder(root).find_spec(name) if root is not None else None
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return f"pagedserve.{name}"
