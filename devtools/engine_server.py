"""Serve an in-process engine through the real server code: ``python -m devtools.engine_server
FACTORY ARGUMENTS_JSON serve FLAGS``.

``FACTORY`` is ``"package.module:callable"`` (importable from the repository root), called once with the
keyword arguments of ``ARGUMENTS_JSON``; the engine it returns answers every request instead of a loaded
model. ``FLAGS`` are ``clef serve``'s own (parsed by the ``clef`` parser, so they mean what they mean there).
The one place a benchmark reaches into the server's entry point. Started by `harness.engine_launcher`.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM; returns its exit status (2 for bad arguments)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) < 3 or ":" not in arguments[0] or arguments[2] != "serve":
        print("usage: engine_server MODULE:FACTORY ARGUMENTS_JSON serve FLAGS", file=sys.stderr)
        return 2
    module_name, _, factory_name = arguments[0].partition(":")
    factory = getattr(importlib.import_module(module_name), factory_name)
    engine = factory(**json.loads(arguments[1]))

    from clef_runtime.cli import build_parser
    from clef_runtime.serve_command import configure_logging, serve
    from clef_runtime.server.settings import settings_from_namespace

    settings = settings_from_namespace(build_parser().parse_args(arguments[2:]), {})
    configure_logging(settings.log_level)
    return serve(settings, engine_factory=lambda _settings: engine)


if __name__ == "__main__":
    sys.exit(main())
