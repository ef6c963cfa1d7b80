"""What a test module of Triton kernels needs to run them in Triton's interpreter on a CPU.

Triton picks interpreter or compiler when it is first imported, so such a module sets
TRITON_INTERPRET=1 before importing it; when another module imported triton earlier in the
same process (transformers does), its kernel tests are skipped there and run again in a
fresh interpreter process instead (``interpreter_guard``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FRESH_PROCESS_ENV = "PAGEDSERVE_TRITON_FRESH_PROCESS"


def can_interpret_kernels() -> bool:
    """Whether this process runs pagedserve's kernels in the interpreter: TRITON_INTERPRET=1
    when triton was first imported, and when the kernels were (False when they disagree)."""
    from pagedserve.kernels import triton_ops

    try:
        return triton_ops._interpreting()
    except RuntimeError:   # TRITON_INTERPRET set between importing triton and the kernels
        return False


def interpreter_guard(test_file: str, is_runnable_here: bool):
    """(an autouse fixture that skips a kernel test this process cannot run, the test that runs
    ``test_file`` again in a fresh process where it can); assign both to module globals."""
    is_fresh_process = os.environ.get(FRESH_PROCESS_ENV) == "1"

    @pytest.fixture(autouse=True)
    def kernels_runnable(request):
        if is_runnable_here or request.node.name == "test_in_fresh_interpreter_process":
            return
        if is_fresh_process:
            pytest.fail("triton was imported before TRITON_INTERPRET=1 even in a fresh process (a conftest?)")
        pytest.skip("triton was imported before TRITON_INTERPRET=1; covered by test_in_fresh_interpreter_process")

    @pytest.mark.skipif(is_runnable_here, reason="this process can run the kernels itself")
    def test_in_fresh_interpreter_process():
        environment = {**os.environ, "TRITON_INTERPRET": "1", FRESH_PROCESS_ENV: "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)]
        result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(test_file))))
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

    return kernels_runnable, test_in_fresh_interpreter_process
