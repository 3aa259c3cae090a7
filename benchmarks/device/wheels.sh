#!/usr/bin/env bash
# Download, here, every wheel the device image (benchmarks/device/image-manifest.toml) lacks to run
# clef-runtime from its source tree (benchmarks/gpu_check.py, `clef serve`): the list is derived by
# benchmarks/device/closure.py (the import closure of the server, the engine and the check, minus the image, at
# versions that install together there, plus flash-linear-attention's pure-Python wheel). Never torch.
#
#   benchmarks/device/wheels.sh OUTDIR [--python-version X.Y]     (default 3.12, the device image's)
#
# On the machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site OUTDIR/*.whl and
# PYTHONPATH=src:.:/tmp/site (docs/gpu.md gives the one command). Exit status 2 for bad arguments, 1 when the
# list does not install together or takes more than 60 MiB.
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

(cd "$here" && PYTHONPATH="$here/src:$here${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m benchmarks.device.closure --wheels "$out" --python-version "$python_version")

# The fused kernels are Triton source compiled on the device: a platform wheel would not be the one we mean.
fla=("$out"/flash_linear_attention-*.whl)
if [ ! -e "${fla[0]}" ] || [[ "${fla[0]}" != *-py3-none-any.whl ]]; then
    echo "$0: flash-linear-attention must be carried as a pure-Python (py3-none-any) wheel: ${fla[*]}" >&2
    exit 1
fi
if ls "$out" | grep -q '^torch-'; then
    echo "$0: torch must never be carried (the device's own CUDA build is used)" >&2
    exit 1
fi

total=$(du -sm "$out" | cut -f1)
echo "$out: $(ls "$out" | wc -l) wheels, ${total} MiB"
if [ "$total" -gt 60 ]; then
    echo "$0: the wheels take ${total} MiB, more than the 60 MiB a device call can carry" >&2
    exit 1
fi
