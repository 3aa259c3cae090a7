#!/usr/bin/env bash
# The device image, emulated here: a venv of exactly image-manifest.toml's versions (on this machine's CPU torch,
# whatever /opt/wheels or the index gives for PYTHON; the CUDA-only packages, triton and nvidia-*, left out),
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
    "$venv/bin/python" -m pip install -q torch
    for override in ${IMAGE_OVERRIDES:-}; do
        sed -i "/^${override%%==*}==/d" "$work/image.txt"; echo "$override" >> "$work/image.txt"
    done
    "$venv/bin/python" -m pip install -q --no-deps -r "$work/image.txt"
fi
python_version="$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
echo "image: Python $python_version, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"

PYTHON="$tools" "$here/benchmarks/device/wheels.sh" "$work/whl" --python-version "$python_version"
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$work"/whl/*.whl
cd "$here"
export PYTHONPATH="$here/src:$here:$work/site" HF_HUB_OFFLINE=1 CLEF_CACHE_DIR="$work/cache"
"$venv/bin/python" -c "import clef_runtime.server.app, transformers; print('import smoke: transformers', transformers.__version__)"
"$venv/bin/python" -m benchmarks.gpu_check --device cpu --smoke --json "$work/gpu-check.json"
echo "emulated image: passed"
