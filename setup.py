"""The native part of pagedserve: the central KV index's key set (``kvmanager/_keyset.c``).

Everything else is configured in pyproject.toml. The extension is optional: where
it cannot be built, ``pagedserve.kvmanager.keyset`` falls back to a Python set.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pagedserve.kvmanager._keyset", ["kvmanager/_keyset.c"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
                             optional=True)])
