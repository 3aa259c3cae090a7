"""``clef heads list | load | unload``: a small client of a server's /v1/heads routes.

It sits beside the jobs client and calls through its HTTP helper (`ServerClient`): standard library only, the
same ``--url`` / ``--api-key`` flags and variables. ``list`` takes the ordinary API key; ``load`` and
``unload`` take the server's admin key (``--admin-key`` / ``$CLEF_ADMIN_KEY``, the variable the server reads:
one value serves both). Errors are the server's message on one line of stderr: exit 2 for a 4xx (the request
is at fault), 1 when the server cannot be reached or fails (5xx).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from urllib.parse import quote

from clef_runtime.engine.head_records import DIGEST_SHORT
from clef_runtime.jobs.client import (
    ServerClient,
    ServerClientError,
    add_api_key_argument,
    add_url_argument,
    server_url,
)

__all__ = ["HeadsClient", "add_heads_arguments", "admin_key_of", "format_head_list", "run_heads"]


class HeadsClient(ServerClient):
    """Calls one server's head routes."""

    def list(self) -> dict[str, Any]:
        """GET /v1/heads: ``{"object": "list", "data": [head card...]}``."""
        result: dict[str, Any] = json.loads(self.call("GET", "/v1/heads")[1])
        return result

    def load(self, name: str, path: str) -> dict[str, Any]:
        """POST /v1/heads; returns the head's card."""
        body = json.dumps({"name": name, "path": path}).encode("utf-8")
        _, data = self.call("POST", "/v1/heads", body, {"Content-Type": "application/json"})
        result: dict[str, Any] = json.loads(data)
        return result

    def unload(self, name: str) -> dict[str, Any]:
        """DELETE /v1/heads/{name}: ``{"name", "digest", "unloaded": true}``."""
        result: dict[str, Any] = json.loads(self.call("DELETE", f"/v1/heads/{quote(name, safe='')}")[1])
        return result


def admin_key_of(value: str | None) -> str | None:
    """The key to send for an ``--admin-key`` / ``$CLEF_ADMIN_KEY`` value written as the server takes it:
    ``NAME:KEY`` sends KEY (a bare key has no colon: the server asks a key with one to be named), and of a
    comma-separated list (the variable's form) the first. None for no value."""
    if not value:
        return None
    first = next((item.strip() for item in value.split(",") if item.strip()), "")
    _, colon, secret = first.partition(":")
    return (secret if colon else first) or None


def add_heads_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``clef heads`` subcommands; ``--url`` and the keys go before or after the subcommand."""
    add_url_argument(parser, after_subcommand=False)
    add_api_key_argument(parser, after_subcommand=False)
    _admin_key_argument(parser, after_subcommand=False)
    actions = parser.add_subparsers(dest="heads_command", required=True)
    listing = actions.add_parser("list", help="the heads served: name, digest, default, source, path")
    listing.add_argument("--json", action="store_true", help="print the server's JSON list instead")
    load = actions.add_parser("load", help="load a head at run time (admin key)")
    load.add_argument("name", metavar="NAME", help="the name requests give as their model to pick the head")
    load.add_argument(
        "path",
        metavar="PATH",
        help="the head's directory (what clef tune --out wrote) on the SERVER'S machine: the server reads "
        "it; a relative PATH is made absolute here first, so it names the same place only when the server "
        "runs on this machine",
    )
    unload = actions.add_parser("unload", help="stop serving a head (admin key)")
    unload.add_argument("name", metavar="NAME", help="the head's name, as clef heads list shows it")
    add_api_key_argument(listing, after_subcommand=True)
    for action in (listing, load, unload):
        add_url_argument(action, after_subcommand=True)
    for admin in (load, unload):
        _admin_key_argument(admin, after_subcommand=True)


def _admin_key_argument(parser: argparse.ArgumentParser, *, after_subcommand: bool) -> None:
    parser.add_argument(
        "--admin-key",
        default=argparse.SUPPRESS if after_subcommand else None,
        metavar="KEY",
        help="the server's admin key, for load and unload (default $CLEF_ADMIN_KEY, the server's own "
        "variable: NAME:KEY sends KEY; prefer the variable) [env CLEF_ADMIN_KEY]",
    )


def _short(digest: Any) -> str:
    return str(digest or "")[:DIGEST_SHORT] or "-"


def format_head_list(listing: dict[str, Any]) -> str:
    """``clef heads list``: a table of the heads in the server's order (the default head first); a missing
    value is ``-``."""
    header = ["NAME", "DIGEST", "DEFAULT", "SOURCE", "PATH", "CALIBRATION"]
    rows = [header] + [
        [
            str(head.get("name")),
            _short(head.get("digest")),
            "yes" if head.get("default") else "no",
            str(head.get("source") or "-"),
            str(head.get("path") or "-"),
            str((head.get("calibration") or {}).get("label") or "-"),
        ]
        for head in listing.get("data") or []
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _one_line(error: ServerClientError) -> str:
    """The server's message on one line: a 422's ``detail`` list as ``loc: msg`` items (naming the field),
    anything else as the message the helper read."""
    try:
        detail = json.loads(error.body).get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list) and detail:
        return "; ".join(
            f"{'.'.join(str(part) for part in item.get('loc', []))}: {item.get('msg')}"
            for item in detail
            if isinstance(item, dict)
        )
    return " ".join(error.message.split())


def run_heads(args: argparse.Namespace) -> int:
    """Entry point of ``clef heads``. Returns 0, 1 (server unreachable or failing) or 2 (a 4xx: bad input,
    a wrong key, an unknown head)."""
    url = server_url(args)
    try:
        if args.heads_command == "list":
            listing = HeadsClient(url, args.api_key or os.environ.get("CLEF_API_KEY")).list()
            print(json.dumps(listing) if args.json else format_head_list(listing))
            return 0
        admin_key = admin_key_of(args.admin_key or os.environ.get("CLEF_ADMIN_KEY"))
        if admin_key is None:
            print(
                f"clef heads {args.heads_command}: error: no admin key: give --admin-key KEY or set "
                "CLEF_ADMIN_KEY (the server's --admin-key)",
                file=sys.stderr,
            )
            return 2
        client = HeadsClient(url, admin_key)
        if args.heads_command == "load":
            # The server resolves a relative path against its own working directory: send what it means here.
            path = os.path.abspath(args.path)
            card = client.load(args.name, path)
            print(f"loaded {card['name']}@{_short(card['digest'])} from {card.get('path') or path}")
        else:
            gone = client.unload(args.name)
            print(f"unloaded {gone['name']}@{_short(gone['digest'])}")
    except ServerClientError as exc:
        if 400 <= exc.status < 500:
            print(f"error: {_one_line(exc)} (HTTP {exc.status})", file=sys.stderr)
            return 2
        # Unreachable (its message names the URL) or failing: say which server, the request was not at fault.
        failed = f"{url} failed with HTTP {exc.status}: " if exc.status else ""
        print(f"error: {failed}{_one_line(exc)}", file=sys.stderr)
        return 1
    return 0
