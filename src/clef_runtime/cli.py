"""The ``clef`` command: encode, decide, serve, make-tiny, bench, eval, calibrate, compare.

Invalid input exits with status 2 and one line on stderr naming the field; heavy imports (torch) happen only
in the subcommands that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from clef_runtime.options import (
    ENCODE_OPTION_FIELDS,
    ENGINE_OPTIONS,
    MODEL_OPTION,
    EngineOptions,
    OptionsError,
    add_option_arguments,
    read_option_values,
)
from clef_runtime.protocol.errors import ClefError, RequestValidationError, format_loc

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def _error_line(exc: ClefError) -> str:
    if isinstance(exc, RequestValidationError):
        parts = [f"{format_loc(e['loc'])}: {e['msg']}" for e in exc.errors]
        return "invalid request: " + "; ".join(parts)
    return f"error: {exc.message}"


def _error_object(exc: ClefError) -> dict[str, Any]:
    if isinstance(exc, RequestValidationError):
        return {
            "error": {
                "type": exc.error_type,
                "detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors],
            }
        }
    return {"error": {"type": exc.error_type, "message": exc.message}}


def _open_input(path: str) -> IO[str]:
    if path == "-":
        return sys.stdin
    return open(path, encoding="utf-8")


def _read_requests(path: str, jsonl: bool) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded JSON or a RequestValidationError) for each request of the input."""
    stream = _open_input(path)
    try:
        if not jsonl:
            text = stream.read()
            try:
                yield 1, json.loads(text)
            except json.JSONDecodeError as exc:
                yield 1, RequestValidationError.single((), f"malformed JSON: {exc}", "json_invalid")
            return
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, RequestValidationError.single((), f"malformed JSON: {exc}", "json_invalid")
    finally:
        if stream is not sys.stdin:
            stream.close()


def _run_per_request(
    args: argparse.Namespace, handle: Callable[[Any], dict[str, Any]], *, pretty: bool = True
) -> int:
    """Apply ``handle`` to each request of the input and print the results (one JSON per line with --jsonl).

    Without --jsonl an invalid request exits 2 with one line on stderr; with --jsonl an ``{"error"}`` line
    is written and the rest continue (exit 2 at the end if any failed).
    """
    failed = False
    out = sys.stdout
    for _number, item in _read_requests(args.file, args.jsonl):
        try:
            if isinstance(item, ClefError):
                raise item
            result = handle(item)
        except ClefError as exc:
            if not args.jsonl:
                print(_error_line(exc), file=sys.stderr)
                return EXIT_USAGE
            failed = True
            out.write(json.dumps(_error_object(exc), ensure_ascii=False) + "\n")
            continue
        if args.jsonl or not pretty:
            out.write(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n")
        else:
            out.write(json.dumps(result, ensure_ascii=False, indent=2) + "\n")
        out.flush()
    return EXIT_USAGE if failed else EXIT_OK


def _cmd_encode(args: argparse.Namespace) -> int:
    from clef_runtime.encoding.encoder import Encoder
    from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
    from clef_runtime.encoding.tokenizer import ClefTokenizer, TokenizerLoadError

    try:
        tokenizer = ClefTokenizer.load(args.tokenizer)
    except TokenizerLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = EngineOptions.from_sources(args, os.environ, fields=ENCODE_OPTION_FIELDS)
    encoder = Encoder(tokenizer_for_encoding(tokenizer), max_length=options.max_length)
    return _run_per_request(args, lambda request: encoder.encode(request).to_json(), pretty=False)


def _load_clef(args: argparse.Namespace) -> Any:
    from clef_runtime.engine.clef import Clef

    model = read_option_values(args, os.environ, [MODEL_OPTION]).get("model", "tiny")
    return Clef.load(model, EngineOptions.from_sources(args, os.environ))


def _cmd_decide(args: argparse.Namespace) -> int:
    from clef_runtime.model.checkpoint import CheckpointError
    from clef_runtime.model.memory import InsufficientMemoryError

    try:
        clef = _load_clef(args)
    except OptionsError:
        raise
    except (CheckpointError, InsufficientMemoryError, ClefError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if clef.untrained:
        print(
            f"note: model {clef.name!r} is untrained (random weights): answers are meaningless",
            file=sys.stderr,
        )
    return _run_per_request(args, clef.decide)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from clef_runtime.model.tiny import make_tiny

    path = make_tiny(Path(args.directory), seed=args.seed)
    print(f"wrote an untrained tiny Clef checkpoint (random weights, seed {args.seed}) to {path}")
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace) -> int:
    from clef_runtime.server.cli import run_serve

    return run_serve(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from clef_runtime.bench import run_bench

    return run_bench(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from clef_runtime.evaluation.commands import run_eval

    return run_eval(args)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from clef_runtime.evaluation.commands import run_calibrate

    return run_calibrate(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from clef_runtime.evaluation.commands import run_compare

    return run_compare(args)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and every engine option (`clef_runtime.options.ENGINE_OPTIONS`), each with its variable.
    For subcommands that load a model: decide, serve, bench, eval."""
    add_option_arguments(parser, (MODEL_OPTION, *ENGINE_OPTIONS))


def build_parser() -> argparse.ArgumentParser:
    """The ``clef`` argument parser."""
    from clef_runtime import __version__

    parser = argparse.ArgumentParser(prog="clef", description="Run Clef decision models.")
    parser.add_argument("--version", action="version", version=f"clef-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="print the token ids and spans of requests (no model needed)")
    enc.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="a checkpoint directory with tokenizer.json"
    )
    add_option_arguments(enc, [o for o in ENGINE_OPTIONS if o.field in ENCODE_OPTION_FIELDS])
    enc.add_argument("--jsonl", action="store_true", help="one request per line in, one result per line out")
    enc.add_argument("file", nargs="?", default="-", metavar="FILE|-")
    enc.set_defaults(func=_cmd_encode)

    dec = sub.add_parser("decide", help="answer requests with a model and print System One responses")
    add_engine_arguments(dec)
    dec.add_argument(
        "--jsonl", action="store_true", help="one request per line in, one response per line out"
    )
    dec.add_argument("file", nargs="?", default="-", metavar="FILE|-")
    dec.set_defaults(func=_cmd_decide)

    tiny = sub.add_parser("make-tiny", help="write the untrained tiny checkpoint in the release layout")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_make_tiny)

    serve = sub.add_parser("serve", help="serve the System One API over HTTP")
    from clef_runtime.server.cli import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="run the benchmark suite")
    try:
        from clef_runtime.bench import add_bench_arguments
    except ImportError:
        add_bench_arguments = None
    if add_bench_arguments is not None:
        add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    from clef_runtime.evaluation.arguments import (
        add_calibrate_arguments,
        add_compare_arguments,
        add_eval_arguments,
    )

    evaluate = sub.add_parser(
        "eval", help="measure accuracy and calibration on a labelled case file (a model or a server URL)"
    )
    add_engine_arguments(evaluate)
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=_cmd_eval)

    calibrate = sub.add_parser(
        "calibrate", help="fit temperatures on a labelled case file (calibration.json)"
    )
    add_engine_arguments(calibrate)
    add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=_cmd_calibrate)

    compare = sub.add_parser("compare", help="how far two models, modes or servers drift on the same cases")
    add_compare_arguments(compare)
    compare.set_defaults(func=_cmd_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``clef`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("decide", "serve", "bench", "eval", "calibrate", "compare"):
        # Before torch's first parallel operation: flush-to-zero and thread setup (see model/kernels.py).
        from clef_runtime.model.kernels import configure_cpu_threads

        configure_cpu_threads()
    try:
        return int(args.func(args))
    except OptionsError as exc:
        print(f"clef {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
