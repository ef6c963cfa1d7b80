#!/usr/bin/env bash
# The wheels gpu_checks.sh's machine lacks (Python 3.12, manylinux x86_64), in the layout its
# header describes: Ray's wheel split in two parts (.whl/parts/, with its sha256) and the others
# in two halves (.whl/deps1 with every wheel the engine imports, .whl/deps2), so that each of two
# device calls carries under 64 MiB:
#   call 1: .whl/parts/*.part-aa, .whl/parts/*.sha256, .whl/deps1
#   call 2: .whl/parts/*.part-ab, .whl/deps2
#
#   bash benchmarks/gpu_wheels.sh        # from the repository's root; needs pip and a registry
#
# The machine's image already has the common scientific and web packages; HAVE lists those that
# pip would otherwise fetch here as dependencies (grpcio and protobuf are fetched anyway: the
# committed gRPC stubs need recent ones).
set -euo pipefail
RAY=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
HAVE="aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs certifi charset_normalizer click filelock
      frozenlist h11 idna jinja2 markupsafe msgpack multidict numpy packaging prometheus_client propcache pyyaml
      requests six typing_extensions urllib3 uvloop wrapt yarl"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/all .whl/parts .whl/deps1 .whl/deps2
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d .whl/all "ray[serve]==2.60.0" "pydantic>=2.11" fastapi "llguidance>=1.9.1" pyzmq jsonschema \
    "protobuf>=7.35.1" "grpcio>=1.85.1"
for name in $HAVE; do rm -f .whl/all/"$name"-*.whl; done
split -b 40m ".whl/all/$RAY" ".whl/parts/$RAY.part-"
(cd .whl/all && sha256sum "$RAY") | sed "s#  #  .whl/#" > ".whl/parts/$RAY.sha256"
rm ".whl/all/$RAY"
# The engine's own imports go to deps1, so that call 1's steps (no Ray) run; then the rest by size,
# largest first, each to the lighter half (part-ab travels with deps2).
python3 - <<'PY'
import os, shutil
ENGINE = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "pyzmq", "llguidance",
          "jsonschema", "jsonschema_specifications", "referencing", "rpds_py")
files = sorted(os.listdir(".whl/all"), key=lambda f: -os.path.getsize(f".whl/all/{f}"))
parts = sorted(os.listdir(".whl/parts"))
size = {"deps1": os.path.getsize(f".whl/parts/{parts[0]}"), "deps2": os.path.getsize(f".whl/parts/{parts[1]}")}
for f in sorted(files, key=lambda f: f.split("-")[0] not in ENGINE):
    half = "deps1" if f.split("-")[0] in ENGINE else min(size, key=size.get)
    size[half] += os.path.getsize(f".whl/all/{f}")
    shutil.move(f".whl/all/{f}", f".whl/{half}/{f}")
for half, total in size.items():
    print(f"call with {half}: {total / 2**20:.1f} MiB of wheels (the working tree travels too)")
PY
rmdir .whl/all
