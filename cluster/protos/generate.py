"""Regenerate ``pagedserve_pb2.py``, ``pagedserve_pb2.pyi`` and ``pagedserve_pb2_grpc.py``.

Run after editing ``pagedserve.proto`` (needs ``grpcio-tools``)::

    python -m pagedserve.cluster.protos.generate

protoc derives Python module names from the .proto's path under its include
root, so the file is compiled from a temporary ``pagedserve/cluster/protos/``
tree: the messages then belong to ``pagedserve.cluster.protos.pagedserve_pb2``
(which pickling, and so Ray Serve's gRPC proxy, needs) and the servicer
module imports it by that name.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE_PATH = Path("pagedserve", "cluster", "protos")
OUTPUTS = ("pagedserve_pb2.py", "pagedserve_pb2.pyi", "pagedserve_pb2_grpc.py")


def generate() -> None:
    """Compile ``pagedserve.proto`` next to this file; raise RuntimeError if protoc fails."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        package_dir = Path(tmp, PACKAGE_PATH)
        package_dir.mkdir(parents=True)
        shutil.copy(HERE / "pagedserve.proto", package_dir / "pagedserve.proto")
        status = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                              f"--grpc_python_out={tmp}", str(PACKAGE_PATH / "pagedserve.proto")])
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status}")
        for name in OUTPUTS:
            shutil.copy(package_dir / name, HERE / name)


if __name__ == "__main__":
    generate()
    sys.exit(0)
