#!/usr/bin/env bash
# Downloads, here, the wheels benchmarks/gpu_suite.sh needs on a GPU device machine that reaches no registry
# (Python 3.12, x86-64; torch, transformers, peft, aiohttp and pillow are there already), at the versions this
# checkout's .venv runs, and cuts them into parts small enough to travel beside the working tree (a device call
# carries 64 MiB in all, the tree included; Ray's wheel alone is 79 MB):
#   .whl-parts/part-NN   one tar of every wheel, cut in PARTS pieces (default: as few as fit)
#   .whl-parts/COUNT     how many parts there are
# Each device call carries one part and COUNT and runs `bash benchmarks/gpu_suite.sh`, which keeps the parts in
# /tmp (kept while the machine is warm) and runs once it holds them all. Git-ignored (.gitignore).
# Usage: bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any --quiet)
# The application's own needs missing there, then Ray Serve's.
NAMES=(diffusers fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection python-multipart
       ray jsonschema jsonschema-specifications referencing rpds-py opencensus opencensus-context google-api-core
       googleapis-common-protos proto-plus colorful aiohttp-cors virtualenv distlib platformdirs watchfiles
       prometheus_client smart-open wrapt)
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
for name in "${NAMES[@]}"; do
  "${PIP[@]}" -d "$download" "$name==$(version "$name")"
done
tar cf "$download/wheels.tar" -C "$download" $(cd "$download" && ls ./*.whl)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( 60 * 2**20 - tree ))  # what one call has left beside the tree, with 4 MiB to spare
size=$(stat -c %s "$download/wheels.tar")
parts=${PARTS:-$(( (size + room - 1) / room ))}
rm -rf .whl-parts && mkdir .whl-parts
split -n "$parts" -d "$download/wheels.tar" .whl-parts/part-
echo "$parts" > .whl-parts/COUNT
echo "$(du -sh "$download/wheels.tar" | cut -f1) of wheels in $parts parts (tree $((tree / 2**20)) MiB):"
ls -la .whl-parts
