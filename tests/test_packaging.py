"""What `make run` installs is enough to serve: no serving module needs a test or bench extra."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Imported only where triton is installed, which CUDA builds of torch bring with them.
CUDA_ONLY_MODULES = re.compile(r"pagedserve\.kernels\.triton_")

# Run in a fresh interpreter: a None entry in sys.modules makes a package read as not
# installed both to `import` (ModuleNotFoundError) and to importlib.util.find_spec (None).
IMPORT_ALL = """
import importlib, json, pkgutil, sys
for name in {absent}:
    sys.modules[name] = None
import pagedserve
names = ["pagedserve"]
for sub in {subpackages}:
    package = importlib.import_module("pagedserve." + sub)
    names.append(package.__name__)
    names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
failures = {{}}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures[name] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps({{"imported": names, "failures": failures}}))
"""


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_extras_are_not_base_dependencies():
    project = _project()
    base = {_requirement_name(r) for r in project["dependencies"]}
    for extra, requirements in project["optional-dependencies"].items():
        overlap = base & {_requirement_name(r) for r in requirements}
        assert not overlap, f"extra {extra!r} repeats base dependencies {sorted(overlap)}"


def test_every_serving_module_imports_without_the_extras():
    project = _project()
    base = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    absent = sorted(name.replace("-", "_") for name in extras - base)
    assert "pytest" in absent and "openai" in absent, absent
    subpackages = sorted(project_package.split(".")[1] for project_package in
                         tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
                         if project_package.count(".") == 1)
    code = IMPORT_ALL.format(absent=absent, subpackages=subpackages)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["imported"]) > 40, report["imported"]  # the walk found the whole tree
    failures = {name: why for name, why in report["failures"].items() if not CUDA_ONLY_MODULES.match(name)}
    assert not failures, failures


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_installs_without_test_extras_and_make_test_with_them():
    def dry_run(target: str) -> str:
        # --no-print-directory: under `make test` (as in CI) this is a sub-make, which would
        # otherwise print "make[1]: Entering directory ...".
        done = subprocess.run(["make", "--no-print-directory", "-n", target, "PYTHON=python3"],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return done.stdout

    run = dry_run("run")
    assert "pip install -e .\n" in run and "[" not in run.split("pagedserve serve")[0], run
    assert "pip install -e \".[test]\"" in dry_run("test")
