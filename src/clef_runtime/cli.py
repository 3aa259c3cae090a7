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


class InputFileError(Exception):
    """The input file cannot be opened or read; the message says which and why."""


def _open_input(path: str) -> IO[str]:
    """The input stream: stdin for ``-``, else the file opened as UTF-8. Raises :class:`InputFileError`."""
    if path == "-":
        return sys.stdin
    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise InputFileError(f"cannot read {path}: {exc.strerror or exc}") from None


def _decoded(text: str) -> Any:
    """The JSON value of one request's text, or a RequestValidationError (never raises)."""
    try:
        # NaN/Infinity literals are not JSON; a number too large for a float (1e400) parses to inf and is
        # refused by the protocol, naming the field.
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return RequestValidationError.single((), f"malformed JSON: {exc}", "json_invalid")
    except ValueError as exc:  # an integer of more than 4300 digits, a NaN/Infinity literal
        return RequestValidationError.single((), f"malformed JSON: {exc}", "json_invalid")
    except RecursionError:
        return RequestValidationError.single((), "malformed JSON: nested too deeply", "json_invalid")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _read_requests(stream: IO[str], jsonl: bool) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded JSON or a RequestValidationError) for each request of ``stream`` (closed
    at the end unless it is stdin). Raises :class:`InputFileError` when the text is not UTF-8."""
    name = getattr(stream, "name", "input")
    try:
        if not jsonl:
            yield 1, _decoded(stream.read())
            return
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield number, _decoded(line)
    except UnicodeDecodeError as exc:
        raise InputFileError(f"cannot read {name}: it is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise InputFileError(f"cannot read {name}: {exc.strerror or exc}") from None
    finally:
        if stream is not sys.stdin:
            stream.close()


def _run_per_request(
    args: argparse.Namespace,
    stream: IO[str],
    handle: Callable[[Any], dict[str, Any]],
    *,
    pretty: bool = True,
) -> int:
    """Apply ``handle`` to each request of ``stream`` and print the results (one JSON per line with --jsonl).

    Without --jsonl an invalid request exits 2 with one line on stderr; with --jsonl an ``{"error"}`` line
    is written and the rest continue (exit 2 at the end if any failed).
    """
    failed = False
    out = sys.stdout
    for _number, item in _read_requests(stream, args.jsonl):
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
    from clef_runtime.encoding.tokenizer import ClefTokenizer, TokenizerLoadError

    options = EngineOptions.from_sources(args, os.environ, fields=ENCODE_OPTION_FIELDS)
    try:
        tokenizer = ClefTokenizer.load(args.tokenizer)
    except TokenizerLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # The HF tokenizer itself, not the tiktoken fast path: the same ids (tested), and building the fast
    # path's table costs ~1-3 s, more than it saves on the few requests a command line encodes.
    encoder = Encoder(tokenizer, max_length=options.max_length)
    return _run_per_request(
        args, args.stream, lambda request: encoder.encode(request).to_json(), pretty=False
    )


def _load_clef(args: argparse.Namespace) -> Any:
    from clef_runtime.engine.clef import Clef

    model = read_option_values(args, os.environ, [MODEL_OPTION]).get("model", "tiny")
    return Clef.load(model, EngineOptions.from_sources(args, os.environ))


def _cmd_decide(args: argparse.Namespace) -> int:
    from clef_runtime.model.checkpoint import CheckpointError
    from clef_runtime.model.memory import InsufficientMemoryError

    try:
        # Clef.load itself warns (once) when the model is untrained.
        clef = _load_clef(args)
    except OptionsError:
        raise
    except (CheckpointError, InsufficientMemoryError, ClefError, OSError, ValueError) as exc:
        # What Clef.load reports with a complete message: a missing or damaged checkpoint, a failed
        # download, not enough memory, a device torch does not see (ValueError).
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return _run_per_request(args, args.stream, clef.decide)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from clef_runtime.model.tiny import make_tiny

    try:
        path = make_tiny(Path(args.directory), seed=args.seed)
    except OSError as exc:
        print(f"clef make-tiny: error: cannot write {args.directory}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"wrote an untrained tiny Clef checkpoint (random weights, seed {args.seed}) to {path}")
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace) -> int:
    from clef_runtime.server.cli import run_serve

    return run_serve(args)


def _cmd_jobs(args: argparse.Namespace) -> int:
    from clef_runtime.jobs.client import run_jobs

    return run_jobs(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from clef_runtime.bench import run_bench
    from clef_runtime.model.checkpoint import CheckpointError
    from clef_runtime.model.memory import InsufficientMemoryError

    if args.requests < 1 or args.state_words < 0:
        print("clef bench: error: --requests must be at least 1, --state-words at least 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        clef = _load_clef(args)
    except (CheckpointError, InsufficientMemoryError, ClefError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(run_bench(clef, args.requests, args.state_words), indent=2, default=str))
    return EXIT_OK


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
    from clef_runtime.version import __version__

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

    jobs = sub.add_parser("jobs", help="submit and follow durable batch jobs on a server (/v1/jobs)")
    from clef_runtime.jobs.client import add_jobs_arguments

    add_jobs_arguments(jobs)
    jobs.set_defaults(func=_cmd_jobs)

    bench = sub.add_parser(
        "bench", help="quick throughput of a loaded model (benchmarks/ has the full suite)"
    )
    from clef_runtime.bench import add_bench_arguments

    add_engine_arguments(bench)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only `clef bench` pays for importing its module (torch): `clef --help` and `clef encode` start fast.
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("encode", "decide"):
        # Before any heavy import or model load: a wrong path fails at once.
        try:
            args.stream = _open_input(args.file)
        except InputFileError as exc:
            print(f"clef {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if args.command in ("decide", "serve", "bench", "eval", "calibrate", "compare"):
        # Before torch's first parallel operation: flush-to-zero and thread setup (see model/kernels.py).
        # `clef serve` runs the model on its batcher thread, which starts its own thread team: one started
        # here on the main thread as well would slow it (configure_cpu_threads says why).
        from clef_runtime.model.kernels import configure_cpu_threads

        configure_cpu_threads(start_pool=args.command != "serve")
    try:
        return int(args.func(args))
    except (OptionsError, InputFileError) as exc:
        print(f"clef {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
