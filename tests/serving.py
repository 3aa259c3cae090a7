"""The server harness the tests share with the benchmarks: one implementation, in
``devtools/harness.py`` (the repository root is on the tests' path)."""

from __future__ import annotations

from devtools.harness import REPO, ServerProcess, clef_serve_argv, free_port, start_server_process

__all__ = ["REPO", "ServerProcess", "clef_serve_argv", "free_port", "start_server_process"]
