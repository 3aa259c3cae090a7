"""CPU time per token and row of `Backbone.extend`: one row alone vs 16 rows in one call vs 16 rows in calls
of 512 / 256 / 128 / 64 tokens, on the hidden-512 / 8-layer medium model (``server_harness.make_medium``).

One intra-op thread and process CPU time, so that other jobs on a shared machine change the figures little;
each figure is the fastest of ``--reps`` runs. This is the profile behind `DEFAULT_MAX_CALL_TOKENS`.

    python benchmarks/bench_call_cap.py --model-dir /tmp/medium --json benchmarks/results/call_cap.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_harness import make_medium


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/call_cap.json"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1152, 256])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)

    # Before anything else touches torch (as the CLI does): flush-to-zero must reach the OpenMP workers.
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads(1)
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.backbone import Continuation

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_dir or Path(tmp) / "medium"
        if not (model / "config.json").exists():
            make_medium(model)
        clef = Clef.load(str(model), cache_mb=0)
    backbone, prefix = clef.backbone, clef.prefix_state
    generator = torch.Generator().manual_seed(0)

    def rows(count: int, length: int) -> list[Any]:
        return [Continuation(torch.randint(0, 200_000, (length,), generator=generator)) for _ in range(count)]

    def cpu_seconds(count: int, length: int, width: int | None) -> float:
        best = float("inf")
        for _ in range(args.reps):
            batch = rows(count, length)
            started = time.process_time()
            # A width w is asked for as a budget of count * w rows x tokens.
            backbone.extend(prefix, batch, max_call_tokens=None if width is None else count * width)
            best = min(best, time.process_time() - started)
        return best

    backbone.extend(prefix, rows(1, 64))
    results: dict[str, Any] = {"unit": "CPU ms per token and row (fastest run)", "lengths": {}}
    for length in args.lengths:
        figures = {"1 row, one call": cpu_seconds(1, length, None)}
        figures["16 rows, one call"] = cpu_seconds(16, length, None) / 16
        for width in (512, 256, 128, 64):
            figures[f"16 rows, {width}-token calls"] = cpu_seconds(16, length, width) / 16
        results["lengths"][str(length)] = {k: round(v * 1000 / length, 4) for k, v in figures.items()}
        print(length, results["lengths"][str(length)], flush=True)
    results["load_average_after"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
