"""The flags of ``clef eval``, ``clef calibrate`` and ``clef compare`` (their engine flags come from
``clef_runtime.cli.add_engine_arguments``). Standard library only, so building the parser stays fast."""

from __future__ import annotations

import argparse

__all__ = ["add_calibrate_arguments", "add_compare_arguments", "add_eval_arguments"]


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", metavar="FILE", help="the case file (JSON lines: a request + expected answers)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, metavar="N", help="cases per engine call (default 8)"
    )


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """``clef eval``'s own flags (the engine's come from ``add_engine_arguments``)."""
    _common_arguments(parser)
    parser.add_argument("--url", metavar="URL", help="evaluate a System One server instead of a local model")
    parser.add_argument("--api-key", metavar="K", help="the server's API key (with --url)")
    parser.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight (--url)")
    parser.add_argument("--json", metavar="OUT", help="write the metrics as JSON")
    parser.add_argument("--report", metavar="DIR", help="write reliability/coverage PNGs and report.html")


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """``clef calibrate``'s own flags."""
    _common_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write calibration.json")
    parser.add_argument("--holdout", metavar="F", help="a second case file: metrics before/after on it")


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """``clef compare``'s flags."""
    _common_arguments(parser)
    spec = "model=M,OPTION=VALUE,... (engine option names) or url=URL[,api_key=K] or a bare http(s) URL"
    parser.add_argument("--a", required=True, metavar="SPEC", help=f"side A: {spec}")
    parser.add_argument("--b", required=True, metavar="SPEC", help="side B, the same form")
    parser.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight (URLs)")
    parser.add_argument("--json", metavar="OUT", help="write the comparison as JSON")
    parser.add_argument("--flips", type=int, default=20, metavar="N", help="flips to print (default 20)")
