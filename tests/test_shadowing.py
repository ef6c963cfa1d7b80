"""The source tree's package folders do not shadow installed distributions of the same name."""

import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import shadowing

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, sys
sys.path[:0] = [{root!r}, {site!r}]
{preamble}
import kernels
print(kernels.__file__)
"""


def _imported_kernels(tmp_path: Path, preamble: str) -> str:
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    code = PROBE.format(root=str(ROOT), site=str(site), preamble=preamble)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    return run.stdout.strip()


def test_importing_kernels_before_pagedserve_gets_the_installed_package(tmp_path):
    # The folder's __init__ steps aside: without it, the folder itself is imported.
    origin = _imported_kernels(tmp_path, "")
    assert origin == str(tmp_path / "site" / "kernels" / "__init__.py")


def test_importing_pagedserve_lets_the_installed_package_through(tmp_path):
    origin = _imported_kernels(tmp_path, "import pagedserve")
    assert origin == str(tmp_path / "site" / "kernels" / "__init__.py")


def test_without_an_installed_package_the_import_goes_on_as_before(tmp_path):
    # -S: no site-packages, so no installed ``kernels`` either; pagedserve comes from src/.
    code = (
        f"import sys, importlib.util; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'src')!r}]; import pagedserve; "
        "print(importlib.util.find_spec('kernels').origin)"
    )
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == str(ROOT / "kernels" / "__init__.py")


def test_pagedserve_kernels_is_still_the_tree_folder():
    import pagedserve.kernels

    assert Path(pagedserve.kernels.__file__) == ROOT / "kernels" / "__init__.py"


@pytest.mark.parametrize("name", ["pagedserve.kernels", "json", "kernels.layout"])
def test_the_finder_leaves_other_names_alone(name):
    finder = shadowing.SourceTreeShadowFinder(ROOT)
    assert finder.find_spec(name, None if "." not in name else []) is None


def test_the_finder_is_installed_once():
    shadowing.install()
    shadowing.install()
    assert sum(isinstance(f, shadowing.SourceTreeShadowFinder) for f in sys.meta_path) == 1
