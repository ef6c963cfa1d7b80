"""The native parts of pagedserve, both for the central KV manager: the index's key set
(``kvmanager/_keyset.c``) and the event batch decoder (``kvmanager/_eventwire.c``).

Everything else is configured in pyproject.toml. The extensions are optional: where
they cannot be built, ``pagedserve.kvmanager.keyset`` falls back to a Python set and
``pagedserve.kvmanager.events.decode_batch`` decodes in Python.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
          "-Wno-cast-function-type"]

setup(ext_modules=[Extension(f"pagedserve.kvmanager.{name}", [f"kvmanager/{name}.c"], extra_compile_args=_FLAGS,
                             optional=True)
                   for name in ("_keyset", "_eventwire")])
