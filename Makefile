# Set-up and entry points. `make run` and `make test` install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-test run test test-all docs bench clean

# torch==2.13.0 is pinned first so a CPU machine takes the CPU build on disk
# instead of downloading a CUDA build; a GPU machine can install its own torch first.
# `install` takes what serving needs; `install-test` adds the test extras.
TORCH := $(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0

install:
	$(TORCH)
	$(PIP) install -e .

install-test:
	$(TORCH)
	$(PIP) install -e ".[test]"

run: install
	$(PYTHON) -m pagedserve serve

# `test`: every behaviour, short forms (what CI runs). `test-all`: adds the long forms
# (soak, chaos, fuzz) and the multi-node sweeps. Every run ends with the ten slowest tests
# (pyproject.toml's addopts).
# Both run TEST_WORKERS test processes (pytest-xdist), each taking whole modules, slowest
# first (tests/conftest.py's SLOWEST_MODULES): most modules wait on Ray clusters more than
# they compute, so two share this 2-core machine's cores. TEST_WORKERS=0 runs in one process.
# `-p no:benchmark`: pytest-benchmark, where some other package installed it, warns that
# xdist disables it; the suite does not use it.
TEST_WORKERS ?= 2
PYTEST := $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -p no:benchmark

test: install-test
	$(PYTEST)

test-all: install-test
	$(PYTEST) --long-form

# docs/configuration.md from the configuration schema (tests/test_config_doc.py checks it).
docs:
	$(PYTHON) -m pagedserve.cluster.config_doc docs/configuration.md

bench: install
	$(PYTHON) benchmarks/bench_kvmanager.py
