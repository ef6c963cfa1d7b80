# Set-up and entry points. `make run` and `make test` install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install run test test-all bench clean

# torch==2.13.0 is pinned first so a CPU machine takes the CPU build on disk
# instead of downloading a CUDA build; a GPU machine can install its own torch first.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"

run: install
	$(PYTHON) -m pagedserve serve

test: install
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) benchmarks/bench_kvmanager.py
