#!/usr/bin/env bash
# The device image, emulated here: a venv of exactly image-manifest.toml's versions (on this machine's CPU torch
# from /opt/wheels, the one version not the manifest's; the CUDA-only packages, triton and nvidia-*, left out),
# then what docs/gpu.md's one command does: wheels.sh, the offline install, an import smoke of the server, and
# gpu_check.py --smoke on the CPU. Needs PyPI; the venv is kept in VENV for the next run.
#
#   benchmarks/device/emulate.sh [VENV]      (default /tmp/clef-device-image; PYTHON picks the interpreter)
#
# IMAGE_OVERRIDES="name==version ..." replaces manifest versions that do not exist for PYTHON (numpy 2.5 has
# no CPython 3.11 wheel, and this machine's only CPU torch is for 3.11): say so wherever the result is quoted.
set -euo pipefail

here="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-/tmp/clef-device-image}"
base_python="${PYTHON:-python3}"
tools="${TOOLS_PYTHON:-$here/.venv/bin/python}"
[ -x "$tools" ] || tools="$(command -v python3)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ ! -x "$venv/bin/python" ]; then
    "$base_python" -m venv "$venv"
    "$tools" - "$here/benchmarks/device/image-manifest.toml" > "$work/image.txt" <<'PY'
import sys, tomllib
present = tomllib.load(open(sys.argv[1], "rb"))["present"]
for name, version in present.items():
    # torch: this machine's CPU build; triton and nvidia-*: CUDA only.
    if name != "torch" and name != "triton" and not name.startswith("nvidia-"):
        print(f"{name}=={version}")
PY
    # The CPU build of torch for this Python, never a CUDA build from the index: TORCH_WHEEL, else the one in
    # /opt/wheels (this machine's); the torch version is the only one that is not the manifest's (2.11).
    tag="cp$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
    wheel="${TORCH_WHEEL:-$(ls /opt/wheels/torch-*+cpu-"$tag"-*.whl 2>/dev/null | sort -V | tail -1)}"
    if [ -z "$wheel" ]; then
        echo "$0: no CPU torch wheel for $tag: set TORCH_WHEEL=path/to/torch-*+cpu-$tag-*.whl" >&2
        exit 2
    fi
    "$venv/bin/python" -m pip install -q --no-deps "$wheel"
    for override in ${IMAGE_OVERRIDES:-}; do
        sed -i "/^${override%%==*}==/d" "$work/image.txt"; echo "$override" >> "$work/image.txt"
    done
    "$venv/bin/python" -m pip install -q --no-deps -r "$work/image.txt"
fi
python_version="$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
echo "image: Python $python_version, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"

PYTHON="$tools" "$here/benchmarks/device/wheels.sh" "$work/whl" --python-version "$python_version"
# The one device call itself (check.sh), on the CPU: the import smoke, the check and its negative control.
PYTHON="$venv/bin/python" CLEF_CACHE_DIR="$work/cache" "$here/benchmarks/device/check.sh" "$work/out" "$work/whl" \
    --device cpu --smoke
echo "emulated image: passed (the check passed and its self-test failed it, as it must)"
