"""Encoding throughput: a 2,000-token state with 10 questions of 5 options, on one core.

Three workloads, measured side by side in one run:
- ``cold``: every request has a new state and a new schema (nothing can come from the piece cache);
- ``same_state``: the state repeats, the schema is new each time (the typical decision workload);
- ``repeat``: the identical request again (everything cached);
- ``cold_hf_only``: ``cold`` without the tiktoken fast path (every piece through HF tokenizers).
Baseline: the plain reference way, each piece tokenized with one ``encode`` call and no cache.

Each workload runs for ``--seconds`` per pass, ``--reps`` passes (default 3) interleaved with the other
workloads; requests/s is reported as the median with its spread over the passes.

Run: ``taskset -c 0 python -m benchmarks.bench_encode [--seconds 3] [--json out.json]``, or ``--quick``
for a smoke run (a fraction of a second per workload).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")  # tokenizers' thread pool: one core, as the target says


from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import spread

from clef_runtime.encoding.encoder import Encoder
from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
from clef_runtime.encoding.tokenizer import ClefTokenizer

_WORD_TEXT = (
    "invoice refund customer charged twice March account billing support urgent please résumé 日本 data "
    "2026 order shipping delayed { } value status"
)
WORDS = _WORD_TEXT.split()


def make_state(seed: int, tokenizer: ClefTokenizer, target_tokens: int = 2000) -> str:
    words = []
    i = seed
    while True:
        words.append(WORDS[(i * 7919 + seed) % len(WORDS)] + str(i % 97))
        i += 1
        if len(words) % 50 == 0 and len(tokenizer.encode(" ".join(words))) >= target_tokens:
            return " ".join(words)


def make_request(state: str, schema_seed: int) -> dict[str, Any]:
    questions: dict[str, Any] = {}
    for q in range(10):
        kind = ("noul", "choice", "score")[q % 3]
        name = f"q{schema_seed}_{q}"
        if kind == "noul":
            questions[name] = {"type": "noul", "instructions": f"Is statement {schema_seed}-{q} true?"}
        elif kind == "choice":
            questions[name] = {
                "type": "choice",
                "instructions": f"Pick the category ({schema_seed})",
                "criteria": {f"opt{schema_seed}_{k}": f"description of option {k}" for k in range(5)},
            }
        else:
            questions[name] = {
                "type": "score",
                "instructions": {"ask": "rate", "n": schema_seed},
                "criteria": [f"level {k} of {schema_seed}" for k in range(5)],
            }
    return {"model": "jev-latest", "state": state, "questions": questions}


def run_for(seconds: float, fn: Any) -> tuple[int, float]:
    n = 0
    start = time.perf_counter()
    while True:
        fn(n)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n, elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="per workload and pass (default 3)")
    parser.add_argument("--reps", type=int, default=3, help="passes over every workload (default 3)")
    add_run_arguments(parser, quick="0.2 s per workload, one pass")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.reps = 0.2, 1
    report = start_report("encode", __file__, argv, quick=args.quick)

    tokenizer = ClefTokenizer.default()
    states = [make_state(s, tokenizer) for s in range(64)]
    state_tokens = len(tokenizer.encode(states[0]))
    encoder = Encoder(tokenizer_for_encoding(tokenizer))
    encoder_cold = Encoder(tokenizer_for_encoding(tokenizer))
    encoder_hf = Encoder(tokenizer)
    input_tokens = encoder.encode(make_request(states[0], 0)).input_tokens

    class Uncached:
        """The reference way: every piece through its own encode() call, no cache."""

        def __init__(self) -> None:
            self.inner = tokenizer

        def encode(self, text: str) -> list[int]:
            return self.inner.encode(text)

        def encode_many(self, texts: list[str]) -> list[list[int]]:
            return [self.inner.encode(t) for t in texts]

    def fresh_encoder_cold(i: int) -> None:
        # A new Encoder per request, so its cache never helps; every piece is tokenized.
        Encoder(Uncached()).encode(make_request(states[i % len(states)] + f" #{i}", i))

    def cold(i: int) -> None:
        # New state and new schema every time: only the fixed scaffolding pieces come from the cache.
        encoder_cold.encode(make_request(states[i % len(states)] + f" #{i}", i))

    def cold_hf_only(i: int) -> None:
        encoder_hf.encode(make_request(states[i % len(states)] + f" #{i}", i))

    def same_state(i: int) -> None:
        encoder.encode(make_request(states[0], i + 1000))

    fixed = make_request(states[0], 0)

    def repeat(_i: int) -> None:
        encoder.encode(fixed)

    workloads: list[tuple[str, Callable[[int], None]]] = [
        ("baseline_uncached", fresh_encoder_cold),
        ("cold_hf_only", cold_hf_only),
        ("cold", cold),
        ("same_state", same_state),
        ("repeat", repeat),
    ]
    passes: dict[str, list[float]] = {name: [] for name, _ in workloads}
    for _name, fn in workloads:
        fn(0)  # warm-up
    for _ in range(args.reps):
        for name, fn in workloads:
            n, elapsed = run_for(args.seconds, fn)
            passes[name].append(n / elapsed)
    results = {name: {"requests_per_s_spread": spread(rates, 1)} for name, rates in passes.items()}
    for figures in results.values():
        figures["requests_per_s"] = figures["requests_per_s_spread"]["median"]
    report.update(
        {
            "state_tokens": state_tokens,
            "input_tokens": input_tokens,
            "questions": 10,
            "options_per_question": 5,
            "seconds_per_pass": args.seconds,
            "results": results,
        }
    )
    return publish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
