"""Bulk decisions: rows/s and state-cache hit rate of ``clef batch`` in this process, on Ray Data with 1 and 2
actors, and of the jobs route, side by side on one machine; and how rows about one state are grouped.

Workload (generated, seed ``--seed``): ``--requests`` System One requests (default 2,000) with custom_ids,
states of 40-120 words, one of two question sets (a yes/no + a choice question, or a score question). 30% of
the rows share their state with exactly one other row, placed half the input away (so input order alone
never brings the two together); the second row of a pair asks the other question set (a new schema about a
known state). The best possible hit count is one per pair: 300 of 2,000 rows, 15%.

Modes, each a fresh ``python -m clef_runtime.cli batch INPUT OUTPUT --model M --dtype fp32`` process (model
load included the same way in every mode) into a new OUTPUT:

- ``inprocess``: no ``--ray``;
- ``ray1``: ``--ray --replicas 1 --ray-num-cpus <cores>`` (one actor with every core's threads);
- ``ray2``, ``ray2-partition``, ``ray2-none``: ``--ray --replicas 2 --ray-num-cpus <cores / 2>`` with
  ``--grouping sort`` (the default), ``partition`` and ``none``;
- ``jobs``: a fresh ``clef serve --model M --dtype fp32 --jobs-db FILE``, the same lines as one
  ``POST /v1/jobs``, polled every 0.2 s until finished; timed from submission (the model is loaded by then,
  which favours this mode) and from the server's start (interpreter start and model load included).

Every ``--ray`` mode starts (and stops) its own local Ray head, under the machine-wide lock the Ray tests
hold (one Ray head per machine), and the run waits until Ray's processes are gone before going on. The
modes run round robin, one repetition after another (each repetition starts with the next mode), so a
change in the machine's load hits every mode. Reported per mode: rows/s (computed rows / the summary's
``seconds``: reading, Ray start, model load, compute, commits), rows/s over the process' wall time, the
hit rate (cache_hits / answered), the ratio to ``inprocess`` in the same repetition, and whether OUTPUT
holds every custom_id exactly once. Grouping on the driver: `clef_runtime.batch.grouping.group_batches`
timed directly on a generated table of ``--grouping-rows`` rows, per grouping (batches formed, share of
shared states whose rows land in one batch).

Usage::

    python -m benchmarks.bench_batch --out benchmarks/results/batch-2.json
    python -m benchmarks.bench_batch --quick --out /tmp/batch.json    # smoke run (no Ray; --modes adds it)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from devtools.flags import engine_flags, option_flags
from devtools.harness import CLEF_LAUNCHER, REPO, start_clef_server
from devtools.models import resolve_model
from devtools.requests import make_state
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import spread

from benchmarks.bench_jobs import QUESTIONS
from clef_runtime.batch.command import BATCH_OPTIONS
from clef_runtime.batch.grouping import GROUPINGS, group_batches
from clef_runtime.batch.output import read_output
from clef_runtime.batch.rows import InputRow, input_table, state_group
from clef_runtime.jobs.client import JobsClient
from clef_runtime.scale.settings import RAY_OPTIONS

SHARED_FRACTION = 0.3
STATE_WORDS_RANGE = (40, 120)
SCHEMAS: tuple[dict[str, Any], ...] = (
    {"refund": QUESTIONS["refund"], "team": QUESTIONS["team"]},
    {"urgency": QUESTIONS["urgency"]},
)
BATCH_ROWS = 64  # clef batch's default --batch-rows, for the grouping timings
RAY_LOCK = Path(tempfile.gettempdir()) / "clef-tests-ray.lock"
"""The lock tests/scale/test_ray_serve.py (`one_ray_cluster_at_a_time`) holds while it runs a Ray head."""
RAY_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "ray/dashboard", "ray/autoscaler")
JOB_POLL_S = 0.2
QUICK_MODES = ("inprocess", "jobs")


@dataclass(frozen=True)
class Mode:
    """One way through the workload: ``clef batch`` with ``flags`` (by option field), or the jobs route."""

    name: str
    label: str
    flags: dict[str, Any] = field(default_factory=dict)
    ray: bool = False
    jobs: bool = False


def modes(cores: int) -> tuple[Mode, ...]:
    half = max(cores / 2, 1.0)
    return (
        Mode("inprocess", "clef batch, in this process"),
        Mode("ray1", "clef batch --ray, 1 actor", {"replicas": 1, "ray_num_cpus": float(cores)}, ray=True),
        *(
            Mode(
                "ray2" if grouping == "sort" else f"ray2-{grouping}",
                f"clef batch --ray, 2 actors, --grouping {grouping}",
                {"replicas": 2, "ray_num_cpus": half, "grouping": grouping},
                ray=True,
            )
            for grouping in GROUPINGS
        ),
        Mode("jobs", "POST /v1/jobs to clef serve", jobs=True),
    )


def generate_requests(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` requests with custom_ids ``req-00000``...; ``SHARED_FRACTION`` of the rows in pairs about
    one state, the pair's rows ``count // 2`` apart, the second asking the other question set."""
    rng = random.Random(seed)
    pool = make_state(rng, 4096).split()  # words to cut states from: cheap for 200,000 rows
    half = count // 2
    pairs = set(rng.sample(range(half), round(count * SHARED_FRACTION / 2)))
    requests: list[dict[str, Any]] = []
    for index in range(count):
        first = index - half if index >= half and index - half in pairs else None
        if first is not None:
            body = {"state": requests[first]["state"], "questions": SCHEMAS[1 - _schema(first)]}
        else:
            length = rng.randint(*STATE_WORDS_RANGE)
            start = rng.randrange(len(pool) - length)
            state = f"Ticket {index}: " + " ".join(pool[start : start + length])
            body = {"state": state, "questions": SCHEMAS[_schema(index)]}
        requests.append({"custom_id": f"req-{index:05d}", **body})
    return requests


def _schema(index: int) -> int:
    return index % len(SCHEMAS)


def best_hits(requests: Sequence[dict[str, Any]]) -> int:
    """Rows about a state another row asked about first: the most state-cache hits a run can have."""
    counts = Counter(request["state"] for request in requests)
    return sum(count - 1 for count in counts.values())


def write_jsonl(path: Path, requests: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(request) + "\n" for request in requests), encoding="utf-8")
    return path


def _environment() -> dict[str, str]:
    """This checkout's package and the repository on the path; no ``CLEF_*`` variable (the command line is
    the whole configuration)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CLEF_")}
    path = [str(REPO / "src"), str(REPO), environment.get("PYTHONPATH", "")]
    environment["PYTHONPATH"] = os.pathsep.join(part for part in path if part)
    return environment


def ray_processes(session: int) -> list[str]:
    """``pid command`` of each live Ray process in process session ``session`` (a command started in a
    session of its own: the Ray head it starts, its workers and actors stay in it; someone else's Ray does
    not)."""
    listing = subprocess.run(
        ["ps", "-o", "pid=,args=", "--sid", str(session)], capture_output=True, text=True, check=False
    ).stdout
    return [
        line.strip()[:160]
        for line in listing.splitlines()
        if any(marker in line for marker in RAY_PROCESS_MARKERS) and "<defunct>" not in line
    ]


@contextmanager
def ray_lock() -> Iterator[None]:
    """Hold the Ray tests' machine-wide lock: one Ray head per machine (its ports, its /tmp/ray session)."""
    with RAY_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def wait_for_ray_to_stop(session: int, timeout: float = 60) -> None:
    """Until no Ray process of ``session`` is left. Raises RuntimeError naming them after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while ray_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    if ray_processes(session):
        raise RuntimeError(f"Ray processes were left behind: {ray_processes(session)[:3]}")


def batch_argv(mode: Mode, model: str, source: Path, output: Path) -> list[str]:
    argv = [*CLEF_LAUNCHER, "batch", str(source), str(output), *engine_flags(model=model, dtype="fp32")]
    argv += option_flags((*BATCH_OPTIONS, *RAY_OPTIONS), mode.flags)
    return [*argv, "--ray"] if mode.ray else argv


def run_batch_mode(mode: Mode, model: str, source: Path, output: Path, rows: int) -> dict[str, Any]:
    """One ``clef batch`` process: its summary, wall time and whether OUTPUT holds each row once. Raises
    RuntimeError (with its stderr) when the command fails."""
    argv = batch_argv(mode, model, source, output)
    started = time.perf_counter()
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its session's id is its pid: what it leaves behind is found by that
    )
    stdout, stderr = process.communicate(timeout=3600)
    wall = time.perf_counter() - started
    wait_for_ray_to_stop(process.pid)
    if process.returncode != 0:
        raise RuntimeError(f"{mode.name} exited with {process.returncode}:\n{stderr[-4000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    written = [row.custom_id for row in read_output(str(output))]
    return {
        "rows_per_s": summary["rows_per_s"],
        "seconds": round(summary["seconds"], 3),
        "wall_s": round(wall, 3),
        "rows_per_s_wall": round(summary["computed"] / wall, 3),
        "hit_rate": _rate(summary["cache_hits"], summary["answered"]),
        "every_row_once": len(written) == len(set(written)) == rows,
        "session": process.pid,
        "summary": summary,
    }


def run_jobs_mode(model: str, source: Path, directory: Path) -> dict[str, Any]:
    """A fresh ``clef serve`` with the jobs route, the whole input as one job, its results read back."""
    started = time.perf_counter()
    server = start_clef_server(
        model,
        log_path=directory / "server.log",
        jobs_db=str(directory / "jobs.sqlite3"),
        log_level="warning",
        dtype="fp32",
        env={"PYTHONPATH": _environment()["PYTHONPATH"]},
    )
    try:
        ready = time.perf_counter()
        client = JobsClient(server.url, timeout=600)
        job = client.submit(source.read_bytes())
        while job["status"] in ("queued", "running"):
            time.sleep(JOB_POLL_S)
            job = client.status(job["id"])
        finished = time.perf_counter()
        results = [json.loads(line) for line in client.results(job["id"]).splitlines() if line.strip()]
    finally:
        server.stop(60)
    answered = [result["response"] for result in results if "response" in result]
    hits = sum(response.get("x_state_cache") == "hit" for response in answered)
    ids = [result["custom_id"] for result in results]
    computed = len(results)
    return {
        "rows_per_s": round(computed / (finished - ready), 3),
        "seconds": round(finished - ready, 3),
        "wall_s": round(finished - started, 3),
        "rows_per_s_wall": round(computed / (finished - started), 3),
        "server_start_s": round(ready - started, 3),
        "hit_rate": _rate(hits, len(answered)),
        "every_row_once": len(ids) == len(set(ids)) == job["counts"]["total"],
        "summary": {
            "status": job["status"],
            "rows": job["counts"]["total"],
            "computed": computed,
            "errors": computed - len(answered),
            "answered": len(answered),
            "cache_hits": hits,
        },
    }


def _rate(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def run_mode(mode: Mode, model: str, source: Path, rows: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-batch-{mode.name}-") as tmp:
        if mode.jobs:
            return run_jobs_mode(model, source, Path(tmp))
        if mode.ray:
            with ray_lock():
                return run_batch_mode(mode, model, source, Path(tmp) / "out", rows)
        return run_batch_mode(mode, model, source, Path(tmp) / "out", rows)


def run_modes(
    chosen: Sequence[Mode], model: str, source: Path, rows: int, repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """Every mode ``repeats`` times, round robin, each repetition starting one mode further."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for repetition in range(repeats):
        shift = repetition % len(chosen)
        for mode in (*chosen[shift:], *chosen[:shift]):
            print(f"repetition {repetition + 1}/{repeats}: {mode.name}", file=sys.stderr, flush=True)
            result = run_mode(mode, model, source, rows)
            runs[mode.name].append({"repetition": repetition, **result})
    for results in runs.values():
        results.sort(key=lambda result: result["repetition"])
    return runs


def _spread_text(figure: dict[str, Any], digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    low, mid, high = (f"{figure[key] * scale:.{digits}f}" for key in ("min", "median", "max"))
    return f"{mid}{suffix} ({low}-{high}{suffix})"


def _header(*columns: str) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(report: dict[str, Any]) -> str:
    """The modes side by side, then the grouping on the driver: medians with (min-max) over repetitions."""
    lines = _header(
        "mode",
        "rows/s: median (min-max)",
        "vs in-process",
        "rows/s over the process' wall time",
        "state-cache hit rate",
        "every row once",
    )
    for entry in report["modes"]:
        ratio = _spread_text(entry["vs_inprocess"], 2, suffix="x") if "vs_inprocess" in entry else "-"
        wall = _spread_text(entry["rows_per_s_wall"])
        if "server_start_s" in entry:
            wall += f"; server start {_spread_text(entry['server_start_s'], suffix=' s')}"
        lines.append(
            f"| {entry['label']} | {_spread_text(entry['rows_per_s'])} | {ratio} | {wall} "
            f"| {_spread_text(entry['hit_rate'], 0, 100, '%')} | {entry['every_row_once']} |"
        )
    lines += [
        "",
        *_header(
            "rows", "grouping", "time on the driver: median (min-max)", "batches", "shared states, one batch"
        ),
    ]
    for entry in report["grouping"]:
        lines.append(
            f"| {entry['rows']:,} | {entry['grouping']} | {_spread_text(entry['seconds'], 2, 1000, ' ms')} "
            f"| {entry['batches']} | {entry['shared_states_in_one_batch']:.0%} |"
        )
    return "\n".join(lines)


def summarise(chosen: Sequence[Mode], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per mode: the spread of each figure over the repetitions, and of its ratio to ``inprocess`` (rows/s
    of the same repetition)."""
    base = runs.get("inprocess")
    table = []
    for mode in chosen:
        results = runs[mode.name]
        entry: dict[str, Any] = {
            "mode": mode.name,
            "label": mode.label,
            "flags": mode.flags,
            "repetitions": len(results),
            "every_row_once": all(result["every_row_once"] for result in results),
        }
        for figure in ("rows_per_s", "rows_per_s_wall", "seconds", "wall_s", "hit_rate"):
            entry[figure] = spread((result[figure] for result in results), 4)
        if mode.jobs:
            entry["server_start_s"] = spread((result["server_start_s"] for result in results), 3)
        if base is not None:
            ratios = (
                own["rows_per_s"] / other["rows_per_s"] for own, other in zip(results, base, strict=True)
            )
            entry["vs_inprocess"] = spread(ratios, 3)
        table.append(entry)
    return table


def grouping_table(rows: int, seed: int) -> tuple[pa.Table, set[str]]:
    """A generated `clef_runtime.batch.rows.INPUT_SCHEMA` table of ``rows`` rows and its shared groups."""
    requests = generate_requests(rows, seed)
    inputs = []
    for line, request in enumerate(requests, start=1):
        body = {key: value for key, value in request.items() if key != "custom_id"}
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        inputs.append(InputRow(line, request["custom_id"], text, None, state_group(body)))
    shared = {group for group, count in Counter(row.group for row in inputs).items() if count > 1}
    return input_table(inputs), shared


def time_grouping(rows: int, seed: int, repeats: int) -> list[dict[str, Any]]:
    """`group_batches` per grouping on ``rows`` generated rows: seconds over ``repeats`` calls, batches
    formed, and the share of shared states whose rows all land in one batch."""
    table, shared = grouping_table(rows, seed)
    measured = []
    for grouping in GROUPINGS:
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            batches = group_batches(table, BATCH_ROWS, grouping)
            seconds.append(time.perf_counter() - started)
        measured.append(
            {
                "rows": rows,
                "grouping": grouping,
                "batch_rows": BATCH_ROWS,
                "seconds": spread(seconds, 5),
                "batches": len(batches),
                "shared_states": len(shared),
                "shared_states_in_one_batch": _together(batches, shared),
            }
        )
    return measured


def _together(batches: Sequence[pa.Table], shared: set[str]) -> float:
    where: dict[str, set[int]] = defaultdict(set)
    for number, batch in enumerate(batches):
        for group in batch.column("group").to_pylist():
            if group in shared:
                where[group].add(number)
    return _rate(sum(len(found) == 1 for found in where.values()), len(shared))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(
        parser,
        quick="40 requests, 1 repetition, modes inprocess jobs, grouping on 40 and 400 rows",
        output="--out",
        model="tiny",
    )
    parser.add_argument("--requests", type=int, default=2000, help="rows of the workload (2000)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every mode (3)")
    parser.add_argument("--modes", nargs="+", default=None, help="the modes to run (default: every one)")
    parser.add_argument(
        "--grouping-rows", type=int, nargs="+", default=[2000, 200_000], help="tables to group (2000 200000)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    every = {mode.name: mode for mode in modes(cores)}
    if args.quick:
        args.requests, args.repeats, args.grouping_rows = 40, 1, [40, 400]
        args.modes = args.modes or list(QUICK_MODES)
    names = args.modes or list(every)
    unknown = sorted(set(names) - set(every))
    if unknown or args.requests < 2 or args.repeats < 1:
        parser.error(
            f"--modes from {', '.join(every)}; --requests >= 2, --repeats >= 1 (got {unknown or ''})"
        )
    chosen = [every[name] for name in names]
    report = start_report("batch", __file__, argv, quick=args.quick)
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["settings"].update(cores=cores, dtype="fp32", batch_rows=BATCH_ROWS, job_poll_s=JOB_POLL_S)
    model = resolve_model(args.model)
    requests = generate_requests(args.requests, args.seed)
    report["workload"] = {
        "requests": len(requests),
        "distinct_states": len({request["state"] for request in requests}),
        "best_hits": best_hits(requests),
        "best_hit_rate": _rate(best_hits(requests), len(requests)),
    }
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        source = write_jsonl(Path(tmp) / "requests.jsonl", requests)
        runs = run_modes(chosen, model, source, len(requests), args.repeats)
    report["modes"] = summarise(chosen, runs)
    report["runs"] = runs
    report["grouping"] = [
        entry for rows in args.grouping_rows for entry in time_grouping(rows, args.seed, max(args.repeats, 3))
    ]
    out = save(report, args.out, "batch")
    table = markdown(report)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
