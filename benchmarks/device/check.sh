#!/usr/bin/env bash
# The one device call, run from the repository root on the lent GPU machine (docs/gpu.md): install the carried
# wheels (benchmarks/device/wheels.sh) offline beside the machine's own torch, fail in seconds if anything does
# not import, then benchmarks/gpu_check.py, then its negative control, which must fail.
#
#   benchmarks/device/check.sh OUT WHEELS [gpu_check arguments...]     (default: --device cuda)
#
# Writes OUT/gpu-check.json and .md (the check) and OUT/self-test.json and .md (the negative control). Exit 0
# only if the check passed (its exit 0) and the self-test was caught (its exit 1); 2 for bad arguments.
# PYTHON picks the interpreter (default python3: the machine's, with its CUDA torch); SELF_TEST_REQUESTS the
# negative control's requests (8). WHEELS may be empty where the interpreter has everything (the test suite).
# emulate.sh runs this same script on an emulated image with `--device cpu --smoke`.
set -uo pipefail

[ $# -ge 2 ] || { echo "usage: $0 OUT WHEELS [gpu_check arguments...]" >&2; exit 2; }
out="$1"; wheels="$2"; shift 2
[ -d "$wheels" ] || { echo "$0: WHEELS $wheels is not a folder (benchmarks/device/wheels.sh makes it)" >&2; exit 2; }
arguments=("$@")
[ ${#arguments[@]} -gt 0 ] || arguments=(--device cuda)
python="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")/../.." && pwd)"
site="$(mktemp -d)"
mkdir -p "$out"

started=$SECONDS
shopt -s nullglob
carried=("$wheels"/*.whl)
if [ ${#carried[@]} -gt 0 ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${carried[@]}" \
        || { echo "$0: the carried wheels did not install" >&2; exit 1; }
fi
echo "carried: ${#carried[@]} wheels"
export PYTHONPATH="$here/src:$here:$site" HF_HUB_OFFLINE=1 CLEF_CACHE_DIR="${CLEF_CACHE_DIR:-/tmp/clef-cache}"
cd "$here"

# The import smoke: every module the server, the engine and the check import, from the carried closure, and
# the versions in place (a package the image shadows, or one that is too new for it, fails here in seconds).
"$python" - <<'PY' || { echo "$0: import smoke failed" >&2; exit 1; }
import importlib.metadata as metadata
import torch
import clef_runtime.server.app  # noqa: F401  (FastAPI, pydantic, mcp, ...)
import clef_runtime.engine.clef  # noqa: F401  (transformers' Qwen3.5)
import benchmarks.gpu_check  # noqa: F401
from clef_runtime.model.fused import fused_kernels_status

names = ("torch", "transformers", "huggingface-hub", "tokenizers", "flash-linear-attention", "mcp", "fastapi")
versions = {}
for name in names:
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        versions[name] = None
print("import smoke:", versions, "cuda:", torch.cuda.is_available(), "fused:", fused_kernels_status()["packages"])
PY
echo "import smoke: $((SECONDS - started)) s"

"$python" -m benchmarks.gpu_check "${arguments[@]}" --json "$out/gpu-check.json"
check=$?
# The negative control: one layer 10% wrong must fail the gates (exit 1; 0 would be a check that cannot
# fail, anything else a crash). Its release step is skipped: it measures speed, not correctness.
"$python" -m benchmarks.gpu_check "${arguments[@]}" --self-test --requests "${SELF_TEST_REQUESTS:-8}" \
    --json "$out/self-test.json" \
    > "$out/self-test.log" 2>&1
self_test=$?
rm -rf "$site"
echo "gpu_check: exit $check (must be 0); --self-test: exit $self_test (must be 1); $((SECONDS - started)) s"
[ "$check" -eq 0 ] && [ "$self_test" -eq 1 ]
