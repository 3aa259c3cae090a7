"""The ``clef`` command: encode, decide, serve, mcp, make-tiny, bench, eval, calibrate, tune, compare, batch,
jobs, heads.

Invalid input exits with status 2 and one line on stderr naming the field (an unknown flag names the flag
and the closest known one); heavy imports (torch) happen only in the subcommands that need them.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

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

if TYPE_CHECKING:
    from clef_runtime.encoding.encoder import Encoder
    from clef_runtime.engine.preparer import RequestPreparer

__all__ = ["build_parser", "evidence_lines", "main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

INPUT_HELP = "the request file (JSON), or - for stdin (the default); with --jsonl, one request per line"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr and exit status 2.

    An unknown flag is refused by the (sub)command that sees it, naming the flag and the closest known one:
    left to the top-level parser, ``--weigths fp32 FILE`` reads ``fp32`` as the input file and reports the
    flag together with the real file, under the usage of the wrong command.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return parsed, extras

    def _unrecognized(self, extras: Sequence[str]) -> str:
        flags = [item.split("=", 1)[0] for item in extras if item.startswith("-") and item != "-"]
        if not flags:
            return f"unexpected argument {extras[0]!r}"
        known = [flag for action in self._actions for flag in action.option_strings]
        close = difflib.get_close_matches(flags[0], known, n=1)
        return f"unknown flag {flags[0]}" + (f": did you mean {close[0]}?" if close else "")


def _error_line(exc: ClefError) -> str:
    if isinstance(exc, RequestValidationError):
        parts = [f"{format_loc(e['loc'])}: {e['msg']}" for e in exc.errors]
        return "invalid request: " + "; ".join(parts)
    return f"error: {exc.message}"


def _error_object(exc: ClefError, line: int) -> dict[str, Any]:
    """The ``--jsonl`` output line of a request that failed: the error and the input line it answers."""
    if isinstance(exc, RequestValidationError):
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors]
        return {"error": {"type": exc.error_type, "detail": detail}, "line": line}
    return {"error": {"type": exc.error_type, "message": exc.message}, "line": line}


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
    at the end unless it is stdin). With ``jsonl`` every line is one item, a blank one too (an error), so
    output line N always answers input line N. Raises :class:`InputFileError` when the text is not UTF-8."""
    name = getattr(stream, "name", "input")
    try:
        if not jsonl:
            yield 1, _decoded(stream.read())
            return
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield number, _decoded(line)
            else:
                yield (
                    number,
                    RequestValidationError.single(
                        (), "the line is blank: --jsonl takes one request on every line", "blank_line"
                    ),
                )
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

    Without --jsonl an invalid request exits 2 with one line on stderr; with --jsonl an ``{"error", "line"}``
    line is written and the rest continue (exit 2 at the end if any failed).
    """
    failed = False
    out = sys.stdout
    for number, item in _read_requests(stream, args.jsonl):
        try:
            if isinstance(item, ClefError):
                raise item
            result = handle(item)
        except ClefError as exc:
            if not args.jsonl:
                print(_error_line(exc), file=sys.stderr)
                return EXIT_USAGE
            failed = True
            out.write(json.dumps(_error_object(exc, number), ensure_ascii=False) + "\n")
            continue
        if args.jsonl or not pretty:
            out.write(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n")
        else:
            out.write(json.dumps(result, ensure_ascii=False, indent=2) + "\n")
        out.flush()
    return EXIT_USAGE if failed else EXIT_OK


class _RequestEncoder:
    """``clef encode``'s step for one request.

    A request with images goes through the engine's `RequestPreparer` (what the server runs: decode,
    preprocess in the ``--image-mode``, pads, spans), built on the first such request because it imports
    torch; a text request goes through the same encoder alone, so ``clef encode`` of text starts fast.
    """

    def __init__(self, encoder: Encoder, options: EngineOptions, checkpoint_dir: str | None) -> None:
        self.encoder = encoder
        self.options = options
        self.checkpoint_dir = checkpoint_dir
        self._preparer: RequestPreparer | None = None

    def __call__(self, request: Any) -> dict[str, Any]:
        from clef_runtime.protocol.images import parse_with_images

        parsed, sources = parse_with_images(request)
        if not sources:
            return self.encoder.encode(parsed).to_json()
        from clef_runtime.engine.independent import IndependentRequest

        prepared = self._image_preparer().prepare(request)
        if isinstance(prepared, IndependentRequest):
            # The engine answers it as one request per question: there is no single record to print.
            raise RequestValidationError.single(
                ("x_independent",),
                "clef encode cannot split a request with images per question",
                "value_error",
            )
        return prepared.record.to_json()

    def _image_preparer(self) -> RequestPreparer:
        if self._preparer is None:
            from clef_runtime.engine.images import ImageSettings, load_processor_config
            from clef_runtime.engine.preparer import RequestPreparer

            try:
                config = load_processor_config(self.checkpoint_dir) if self.checkpoint_dir else None
                settings = ImageSettings(
                    mode=self.options.image_mode,
                    max_tokens=self.options.image_max_tokens,
                    processor_config=config,
                )
            except ValueError as exc:  # a malformed processor config, an image-token cap below the minimum
                raise OptionsError(str(exc)) from None
            self._preparer = RequestPreparer(self.encoder, settings)
        return self._preparer


def _cmd_encode(args: argparse.Namespace) -> int:
    from clef_runtime.encoding.encoder import Encoder
    from clef_runtime.encoding.tokenizer import ClefTokenizer, TokenizerLoadError

    options = EngineOptions.from_sources(args, os.environ, fields=ENCODE_OPTION_FIELDS)
    try:
        # A directory the user names must hold the tokenizer: falling back to the built-in one would print
        # another tokenizer's ids without a word.
        tokenizer = ClefTokenizer.load(args.tokenizer, require_file=args.tokenizer is not None)
    except TokenizerLoadError as exc:
        print(f"clef encode: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # The HF tokenizer itself, not the tiktoken fast path: the same ids (tested), and building the fast
    # path's table costs ~1-3 s, more than it saves on the few requests a command line encodes.
    encoder = Encoder(tokenizer, max_length=options.max_length)
    return _run_per_request(
        args, args.stream, _RequestEncoder(encoder, options, args.tokenizer), pretty=False
    )


def _load_clef(args: argparse.Namespace) -> Any:
    """The model of ``--model`` with the engine options, or None after one line on stderr when it cannot be
    loaded. Raises `OptionsError` (a usage error) for a bad option."""
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.load_errors import LoadFailure, classify_load_error

    model = read_option_values(args, os.environ, [MODEL_OPTION]).get("model", "tiny")
    try:
        # Clef.load itself warns (once) when the model is untrained.
        return Clef.load(model, EngineOptions.from_sources(args, os.environ))
    except Exception as exc:
        # A bad option goes on to the usage error; a bug keeps its traceback.
        if classify_load_error(exc) is not LoadFailure.UNLOADABLE:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return None


_EXPLAIN_FLAGS = {"top_k": "--explain-top-k", "granularity": "--explain-granularity"}


def _explain_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """``clef decide``'s ``x_explain``: None without the explain flags; ``--explain-top-k`` or
    ``--explain-granularity`` alone turn it on too. Raises `OptionsError` naming the flag of a bad value
    (validated as the request field is, before the model loads)."""
    given = {field: getattr(args, f"explain_{field}") for field in _EXPLAIN_FLAGS}
    given = {field: value for field, value in given.items() if value is not None}
    if not (args.explain or given):
        return None
    from clef_runtime.protocol.explain import checked_explain

    try:
        checked_explain(given)
    except RequestValidationError as exc:
        error = exc.errors[0]
        field = error["loc"][-1]
        raise OptionsError(f"{_EXPLAIN_FLAGS.get(str(field), '--explain')}: {error['msg']}") from None
    return given


def evidence_lines(body: dict[str, Any]) -> list[str]:
    """The answers' evidence of a System One response, for people: one line per span, strongest first
    within each answer: question id, rank, weight, then the text quoted with its ``[start:end]`` character
    offsets in the rendered state and its JSON pointer (for a JSON state), or an image's index and patch box.
    No line for an answer without ``x_evidence``."""
    lines: list[str] = []
    for question_id, answer in body.get("answers", {}).items():
        for rank, span in enumerate(answer.get("x_evidence", ()), start=1):
            lines.append(f"{question_id} #{rank} {span['weight']:+.4f} {_where(span)}")
    return lines


def _where(span: dict[str, Any]) -> str:
    if "image" in span:
        return f"image {span['image']} box {span['box']}"
    quoted = f"{json.dumps(span['text'], ensure_ascii=False)} [{span['start']}:{span['end']}]"
    return f"{quoted} {span['path']}" if span.get("path") else quoted


def _cmd_decide(args: argparse.Namespace) -> int:
    explain = _explain_of(args)
    clef = _load_clef(args)
    if clef is None:
        return EXIT_FAILURE
    if explain is None:
        return _run_per_request(args, args.stream, clef.decide)

    def decide_and_show_evidence(request: Any) -> dict[str, Any]:
        # The spans go to stderr, for the person at the terminal: stdout stays the JSON alone.
        body: dict[str, Any] = clef.decide(request, explain=explain)
        for line in evidence_lines(body):
            print(line, file=sys.stderr)
        return body

    return _run_per_request(args, args.stream, decide_and_show_evidence)


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
    from clef_runtime.serve_command import run_serve

    return run_serve(args)


def _check_before_serving(options: EngineOptions) -> None:
    """What `Clef.load` checks before the slow part, done here: ``clef mcp`` loads the model only after the
    agent's handshake, where a bad option would end the server mid-session instead of as a usage error.
    Raises `OptionsError` naming the flag."""
    from clef_runtime.engine.images import ImageSettings
    from clef_runtime.engine.preflight import check_engine_files

    try:
        ImageSettings(mode=options.image_mode, max_tokens=options.image_max_tokens)
    except ValueError as exc:
        raise OptionsError(f"--image-max-tokens: {exc}") from None
    check_engine_files(options)  # a CalibrationError names the file and the field


def _cmd_mcp(args: argparse.Namespace) -> int:
    from clef_runtime.mcp_command import serve_stdio

    # A bad option is a usage error now (exit 2, nothing on stdout), not a failed load once the agent is
    # connected.
    _check_before_serving(EngineOptions.from_sources(args, os.environ))
    return serve_stdio(lambda: _load_clef(args))


def _deferred(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose module is imported only when it runs (``clef --help`` stays fast)."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), function)(args))

    return run


def _cmd_bench(args: argparse.Namespace) -> int:
    from clef_runtime.bench import run_bench

    if args.requests < 1 or args.state_words < 0:
        print("clef bench: error: --requests must be at least 1, --state-words at least 0", file=sys.stderr)
        return EXIT_USAGE
    clef = _load_clef(args)
    if clef is None:
        return EXIT_FAILURE
    print(json.dumps(run_bench(clef, args.requests, args.state_words), indent=2, default=str))
    return EXIT_OK


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and every engine option (`clef_runtime.options.ENGINE_OPTIONS`), each with its variable.
    For subcommands that load a model: decide, serve, bench, eval."""
    add_option_arguments(parser, (MODEL_OPTION, *ENGINE_OPTIONS))


def build_parser() -> argparse.ArgumentParser:
    """The ``clef`` argument parser."""
    from clef_runtime.version import __version__

    parser = _Parser(prog="clef", description="Run Clef decision models.")
    parser.add_argument(
        "--version", action="version", version=f"clef-runtime {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="print the token ids and spans of requests (no model needed)")
    enc.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a checkpoint directory holding tokenizer.json (and processor_config.json for images); "
        "default: the built-in Qwen3.5 tokenizer",
    )
    add_option_arguments(enc, [o for o in ENGINE_OPTIONS if o.field in ENCODE_OPTION_FIELDS])
    enc.add_argument("--jsonl", action="store_true", help="one request per line in, one result per line out")
    enc.add_argument("file", nargs="?", default="-", metavar="FILE|-", help=INPUT_HELP)
    enc.set_defaults(func=_cmd_encode)

    dec = sub.add_parser("decide", help="answer requests with a model and print System One responses")
    add_engine_arguments(dec)
    dec.add_argument(
        "--jsonl", action="store_true", help="one request per line in, one response per line out"
    )
    dec.add_argument(
        "--explain",
        action="store_true",
        help="evidence for every answer (x_explain): each answer gains x_evidence, and its spans are "
        "also printed to stderr, one line each",
    )
    dec.add_argument(
        "--explain-top-k",
        type=int,
        metavar="N",
        help="spans per answer, 1-20 (default 5); implies --explain",
    )
    dec.add_argument(
        "--explain-granularity",
        choices=("word", "token", "field"),
        help="what a span is: word (default), token or field; implies --explain",
    )
    dec.add_argument("file", nargs="?", default="-", metavar="FILE|-", help=INPUT_HELP)
    dec.set_defaults(func=_cmd_decide)

    tiny = sub.add_parser("make-tiny", help="write the untrained tiny checkpoint in the release layout")
    tiny.add_argument("directory", metavar="DIR", help="where to write it (created if needed)")
    tiny.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the random weights (default 0, the built-in tiny model's); "
        "another seed gives another untrained model",
    )
    tiny.set_defaults(func=_cmd_make_tiny)

    serve = sub.add_parser("serve", help="serve the System One API over HTTP")
    from clef_runtime.serve_command import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    mcp = sub.add_parser(
        "mcp", help="serve the decide tool over MCP on stdin/stdout, for desktop agents (see README, MCP)"
    )
    add_engine_arguments(mcp)
    mcp.set_defaults(func=_cmd_mcp)

    batch = sub.add_parser(
        "batch",
        help="answer a JSONL or Parquet file of requests into a folder of results, resumable, in this "
        "process or on Ray Data (--ray)",
    )
    from clef_runtime.batch.command import add_batch_arguments

    add_batch_arguments(batch)
    batch.set_defaults(func=_deferred("clef_runtime.batch.command", "run_batch_command"))

    jobs = sub.add_parser("jobs", help="submit and follow durable batch jobs on a server (/v1/jobs)")
    from clef_runtime.jobs.client import add_jobs_arguments

    add_jobs_arguments(jobs)
    jobs.set_defaults(func=_deferred("clef_runtime.jobs.client", "run_jobs"))

    heads = sub.add_parser(
        "heads", help="list the heads a server answers with; load and unload them (/v1/heads)"
    )
    from clef_runtime.jobs.heads_client import add_heads_arguments

    add_heads_arguments(heads)
    heads.set_defaults(func=_deferred("clef_runtime.jobs.heads_client", "run_heads"))

    from clef_runtime.bench import add_bench_arguments
    from clef_runtime.evaluation.arguments import (
        add_calibrate_arguments,
        add_compare_arguments,
        add_eval_arguments,
    )
    from clef_runtime.tuning.arguments import add_tune_arguments

    evaluation = "clef_runtime.evaluation.commands"
    model_commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Any]] = [
        (
            "bench",
            "quick throughput of a loaded model (benchmarks/ has the full suite)",
            add_bench_arguments,
            _cmd_bench,
        ),
        (
            "eval",
            "measure accuracy and calibration on a labelled case file (a model or a server URL)",
            add_eval_arguments,
            _deferred(evaluation, "run_eval"),
        ),
        (
            "calibrate",
            "fit temperatures on a labelled case file (calibration.json)",
            add_calibrate_arguments,
            _deferred(evaluation, "run_calibrate"),
        ),
        (
            "tune",
            "fit the joint head to labelled cases, the backbone frozen (a head directory for --head)",
            add_tune_arguments,
            _deferred("clef_runtime.tuning.command", "run_tune"),
        ),
    ]
    for name, help_text, add_own_arguments, run in model_commands:
        command = sub.add_parser(name, help=help_text)
        add_engine_arguments(command)
        add_own_arguments(command)
        command.set_defaults(func=run)

    compare = sub.add_parser("compare", help="how far two models, modes or servers drift on the same cases")
    add_compare_arguments(compare)
    compare.set_defaults(func=_deferred(evaluation, "run_compare"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``clef`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only `clef bench` pays for importing its module (torch): `clef --help` and `clef encode` start fast.
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or --version (status 0), or a usage error already printed (2)
        return int(exc.code or 0)
    if args.command in ("encode", "decide"):
        # Before any heavy import or model load: a wrong path fails at once.
        try:
            args.stream = _open_input(args.file)
        except InputFileError as exc:
            print(f"clef {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if args.command in ("decide", "serve", "mcp", "bench", "eval", "calibrate", "tune", "compare"):
        # Before torch's first parallel operation: flush-to-zero and thread setup (see model/kernels.py).
        # `clef serve` and `clef mcp` run the model on an engine thread, which starts its own thread team:
        # one started here on the main thread as well would slow it (configure_cpu_threads says why).
        from clef_runtime.model.kernels import configure_cpu_threads

        configure_cpu_threads(start_pool=args.command not in ("serve", "mcp"))
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
