"""Model benchmark: ``decide`` latency on the tiny and the medium model, split into encode / backbone / head /
answer time, and the backbone's tokens/s as a fraction of this machine's fp32 GEMM rate measured in the same
run. Each figure sits beside the reference-way baseline that `benchmarks/engine_bench.py` implements.

This is the ``gemm`` + ``latency`` part of ``benchmarks/engine_bench.py``; each model runs in a fresh process
(clean peak RSS, no allocator state carried over).

    python benchmarks/bench_model.py                          # tiny + medium, default mode
    python benchmarks/bench_model.py --models medium --quick
    python benchmarks/bench_model.py --out benchmarks/results/model.json

Not a test: the numbers depend on the machine and on whatever else runs on it (the load average is
recorded with every figure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def run_model(model: str, mode: str, work_dir: Path) -> dict[str, Any]:
    """Run ``engine_bench.py --sections gemm latency`` on ``model`` in a subprocess; returns its JSON."""
    out = work_dir / f"model-{model}.json"
    command = [sys.executable, str(REPO / "benchmarks" / "engine_bench.py"), "--model", model]
    command += [
        "--sections",
        "gemm",
        "latency",
        "--json",
        str(out),
        "--markdown",
        str(out.with_suffix(".md")),
    ]
    if mode != "default":
        command.append(f"--{mode}")
    subprocess.run(command, check=True, cwd=REPO)
    return json.loads(out.read_text())


def main() -> int:
    """Run the model benchmark and write the combined JSON; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--full", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "model.json")
    args = parser.parse_args()
    mode = "quick" if args.quick else "full" if args.full else "default"
    reports: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="clef-bench-model-") as tmp:
        for model in args.models:
            print(f"== {model}", file=sys.stderr, flush=True)
            reports[model] = run_model(model, mode, Path(tmp))
            sys.stdout.write((Path(tmp) / f"model-{model}.md").read_text() + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "model", "mode": mode, "models": reports}, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
