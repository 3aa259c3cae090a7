"""``clef batch`` with INPUT and OUTPUT on S3: a real S3 API (moto's server on 127.0.0.1) reached through
pyarrow's S3 filesystem from ``s3://`` URIs, as a bucket on AWS or MinIO would be; the rerun resumes from
what the bucket holds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from clef_runtime.batch.output import read_output
from tests.batch.requests import outputs_by_line, ticket_requests
from tests.helpers import run_cli


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[pafs.FileSystem, str]]:
    """A bucket ``jobs`` on a local S3 server; yields its filesystem and the URI query that reaches it."""
    from moto.server import ThreadedMotoServer

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        query = f"endpoint_override={host}:{port}&scheme=http&region=us-east-1&allow_bucket_creation=true"
        filesystem, _ = pafs.FileSystem.from_uri(f"s3://jobs?{query}")
        filesystem.create_dir("jobs")
        yield filesystem, query
    finally:
        server.stop()


def test_input_and_output_in_a_bucket_and_a_rerun_resumes_from_it(
    bucket: tuple[pafs.FileSystem, str], tmp_path: Path
) -> None:
    filesystem, query = bucket
    requests = ticket_requests(12, 4)
    with filesystem.open_output_stream("jobs/in/part-0.jsonl") as stream:
        stream.write("".join(json.dumps(r) + "\n" for r in requests[:7]).encode())
    with filesystem.open_output_stream("jobs/in/part-1.jsonl") as stream:
        stream.write("".join(json.dumps(r) + "\n" for r in requests[7:]).encode())
    source, out = f"s3://jobs/in?{query}", f"s3://jobs/out?{query}"

    first = run_cli("batch", source, out, "--commit-rows", "5", "--batch-rows", "4")
    assert first.returncode == 0, first.stderr
    parts = [i.path for i in filesystem.get_file_info(pafs.FileSelector("jobs/out")) if "part-" in i.path]
    # A commit once 5 rows wait: the 4 states of 3 rows each make batches of 3 (cut between states), so
    # parts of 6 and 6 rows.
    assert len(parts) == 2
    rows = outputs_by_line(read_output(out))
    assert [rows[line].custom_id for line in sorted(rows)] == [r["custom_id"] for r in requests]

    # Drop the last part, as if the run had been stopped before it: the rerun computes only its rows.
    filesystem.delete_file(sorted(parts)[-1])
    second = run_cli("batch", source, out, "--commit-rows", "5", "--batch-rows", "4")
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert (summary["skipped"], summary["computed"]) == (6, 6)
    assert sorted(outputs_by_line(read_output(out))) == list(range(1, 13))
    # Nothing but the parts and the manifest: an object store gets no temporary files.
    names = sorted(i.path.rsplit("/", 1)[-1] for i in filesystem.get_file_info(pafs.FileSelector("jobs/out")))
    assert names == ["_clef_batch.json", "part-0001-000001.parquet", "part-0002-000001.parquet"]
