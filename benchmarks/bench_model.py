"""Model benchmark: ``decide`` latency on the tiny and the hidden-1,024 benchmark model, split into encode /
backbone / head / answer time, and the backbone's FLOP/s as a fraction of the GEMM limit over the model's own
shapes, measured in the same run. Each figure sits beside the reference-way baseline that
`benchmarks/engine_bench/` implements.

This is the ``gemm`` + ``latency`` part of ``benchmarks/engine_bench/``; each model runs in a fresh process
(clean peak RSS, no allocator state carried over).

    python -m benchmarks.bench_model                          # tiny + medium-1024, default mode
    python -m benchmarks.bench_model --models tiny --quick --out /tmp/model.json
    python -m benchmarks.bench_model --out benchmarks/results/model-2.json

Not a test: the numbers depend on the machine and on whatever else runs on it (the load average is
recorded with every figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.results import command_line, default_output, write_json

from benchmarks.suite import add_mode_arguments, mode_of, run_engine_bench


def main(argv: Sequence[str] | None = None) -> int:
    """Run the model benchmark and write the combined JSON; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_mode_arguments(parser, ["tiny", "medium-1024"])
    parser.add_argument("--out", type=Path, default=None, help="default: a new file in benchmarks/results/")
    args = parser.parse_args(argv)
    mode = mode_of(args)
    reports: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="clef-bench-model-") as tmp:
        for model in args.models:
            print(f"== {model}", file=sys.stderr, flush=True)
            json_path = Path(tmp) / f"model-{model}.json"
            markdown = run_engine_bench(model, mode, json_path, sections=["gemm", "latency"])
            reports[model] = json.loads(json_path.read_text())
            sys.stdout.write(markdown.read_text() + "\n")
    combined = {
        "benchmark": "model",
        "command": command_line(__file__, argv),
        "mode": mode,
        "models": reports,
    }
    out = args.out or default_output("model")
    write_json(out, combined)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
