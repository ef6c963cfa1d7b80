"""Fault injection for tests: refused unless ``PAGEDSERVE_ENABLE_FAULT_INJECTION=1`` is set in
the process's environment (a worker's, and so its engine core's)."""

from __future__ import annotations

import os

FAULT_INJECTION_ENV = "PAGEDSERVE_ENABLE_FAULT_INJECTION"


def check_fault_injection() -> None:
    """Raise ``PermissionError`` unless fault injection is on in this process."""
    if os.environ.get(FAULT_INJECTION_ENV) != "1":
        raise PermissionError(f"fault injection is off; set {FAULT_INJECTION_ENV}=1 to enable it")
