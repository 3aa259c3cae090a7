"""Suite-wide settings (every cache the tests create stays out of the user's home directory) and the fixtures
every suite shares; the shared helpers are in tests/helpers.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from clef_runtime.engine.clef import Clef

# The built-in tokenizer and the tiny checkpoint are built once into this directory and reused between
# local runs; a fresh clone (CI) builds them once per run. Set before any clef_runtime import reads it.
os.environ.setdefault(
    "CLEF_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "clef-cache")
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP workers sleep instead of spinning (kernels.RECOMMENDED_CPU_ENVIRONMENT): the suite runs a
# worker per core (make test: pytest -n auto) beside the servers it starts, and a spinning team then waits at
# every barrier for a descheduled peer (a prefill measured 3-9x slower at load average ~6). libgomp reads it
# when torch loads, so it is set before the first clef_runtime import below; server processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Exactness tests compare with reference numbers computed in fp32, so every model a test starts through the
# CLI or a server process computes in fp32 unless the test asks otherwise (`Clef.load` calls pass dtype="fp32"
# themselves); the bf16 path and `--dtype auto` have tests of their own (tests/model/test_compute_dtype.py).
os.environ.setdefault("CLEF_DTYPE", "fp32")
# Servers built by tests open their batch-jobs database under the user data directory: keep it out of the
# home directory, one fresh directory per run (tests that submit jobs use a database of their own).
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="clef-tests-data-")

# Flush-to-zero and the thread setup must happen before torch's first parallel operation, or OpenMP worker
# threads keep computing with denormals (~100x slower in the DeltaNet decay); the CLI does the same.
from clef_runtime.model.kernels import configure_cpu_threads

configure_cpu_threads()


# The files that take longest (each starts server or CLI processes, or runs for a set time), longest first.
# `make test` hands whole files to its workers in collection order; xdist's own order (most tests first) left
# these few-test files for last, where one worker ran them alone while the other sat idle (measured: 85 s of
# a 444 s run on 2 cores). tests/test_makefile.py checks that they exist.
LONG_FILES_FIRST = (
    "tests/reliability/test_schemathesis.py",
    "tests/scale/test_ray_serve.py",
    "tests/deploy/test_container_image.py",
    "tests/reliability/test_overload.py",
    "tests/server/routes/test_conformance.py",
    "tests/test_cli.py",
    "tests/reliability/test_faults.py",
    "tests/scale/test_serve_config.py",
    "tests/server/jobs/test_jobs_ownership.py",
    "tests/batch/test_resume.py",
    "tests/engine/test_clef.py",
    "tests/benchmarks/test_explain_faithfulness.py",
    "tests/test_gpu_check.py",
    "tests/test_mcp_command.py",
    "tests/devtools/test_harness.py",
    "tests/tuning/test_command.py",
    "tests/reliability/test_load.py",
    # Last of the long ones: a Ray head per machine (a file lock), so not beside test_ray_serve's.
    "tests/batch/test_ray_batch.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long files first (see `LONG_FILES_FIRST`); a stable sort, so every file keeps its own test order."""
    rank = {path: position for position, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny() -> Clef:
    """The built-in untrained tiny model with the default options but fp32 compute, loaded once for the whole
    run: share it only where a test does not depend on what others ran before (its state cache is shared
    too)."""
    from clef_runtime.engine.clef import Clef

    return Clef.load("tiny", dtype="fp32")
