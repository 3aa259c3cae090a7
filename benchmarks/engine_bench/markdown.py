"""The report as markdown."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# ------------------------------------------------------------------------------------------ markdown


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _both(engine: str, baseline: str) -> str:
    return f"{engine} ({baseline})"


def _table_row(*cells: Any) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _markdown_header(report: dict[str, Any]) -> list[str]:
    model = report["model"]
    machine = report["machine"]
    gemm = report.get("gemm") or {}
    flags = ", ".join(flag for flag, present in machine["cpu_flags"].items() if present) or "none of note"
    torch_build = machine["torch"]
    lines = [
        f"### `engine_bench.py`: model `{model['spec']}` ({report['mode']} mode)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {machine['cpu']} ({flags}), {machine['cpu_count']} cores, {machine['memory_gib']} GiB, "
        f"torch {torch_build['version']} ({torch_build['cpu_capability']}) with {torch_build['threads']} "
        f"threads, device {machine['device']}{' (' + machine['gpu'] + ')' if machine.get('gpu') else ''}. "
        f"Load average at start {machine['load_average']}, at end {report['load_average_end']} (other jobs "
        f"may share the machine). The run took {report['wall_s']:.0f} s, started {report['started_at']}.",
        "",
        f"Model: {model['description']}. Backbone {model['backbone_parameters'] / 1e6:,.1f} M parameters "
        f"({model['backbone_linear_parameters'] / 1e6:,.1f} M in decoder-layer linears), head "
        f"{model['head_parameters'] / 1e6:,.1f} M ({model['head_config']}).",
    ]
    if gemm:
        per_tokens = ", ".join(f"T={tokens}: {value}" for tokens, value in gemm["limit_by_tokens"].items())
        lines += [
            "",
            f"GEMM limit measured in this run: **{gemm['limit_gflops']} GFLOP/s** {gemm['dtype']}, the best "
            f"over the model's {gemm['linear_shapes']} Linear shapes at each request length (best of "
            f"{gemm['repeats']} per shape; per length {per_tokens}). Each latency row's backbone fraction "
            "is taken against the limit at its own length (the JSON's questions, concurrency and state-cache "
            "fractions against the best limit over every length: `gemm_limit.tokens` null).",
        ]
        lines += _markdown_int8_limit(gemm, model)
    if report.get("baseline_description"):
        lines += ["", f"Baseline (figures in parentheses): {report['baseline_description']}"]
    if report.get("parity_max_abs_diff") is not None:
        lines.append(
            f"Engine and baseline answers agree to {report['parity_max_abs_diff']:.4g} (largest difference "
            "of any rounded answer number over every request both ran)."
        )
    targets = report.get("targets") or []
    if targets:
        lines += [
            "",
            "Targets are judged on best-of-N figures (the fastest repetition of each side, like the GEMM "
            "limit), the repetition least disturbed by other jobs; median-based figures are in the notes.",
            "",
            "| target | measured | threshold | status | note |",
            "|---|---|---|---|---|",
        ]
        for target in targets:
            lines.append(
                _table_row(
                    target["goal"],
                    _fmt(target["measured"]),
                    _fmt(target["threshold"]),
                    f"**{target['status']}**",
                    target["note"],
                )
            )
    return lines


def _markdown_int8_limit(gemm: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """How a backbone with int8 layers is judged (nothing for one without)."""
    int8_weights = model.get("backbone_int8_linear_parameters") or 0
    if not int8_weights:
        return []
    share = f"{int8_weights / 1e6:,.1f} M of the {model['backbone_linear_parameters'] / 1e6:,.1f} M"
    if not gemm.get("int8_limit_by_tokens"):
        return [
            "",
            f"The backbone has int8 layers ({share} linear weights) and no int8 GEMM rate was measured at "
            "its shapes on this device: no backbone fraction is given.",
        ]
    per_tokens = ", ".join(f"T={tokens}: {value}" for tokens, value in gemm["int8_limit_by_tokens"].items())
    return [
        "",
        f"int8 layers ({share} linear weights) are judged against the int8 GEMM limit, "
        f"**{gemm['int8_limit_gops']} GOP/s** (per length {per_tokens}): a backbone fraction is the time its "
        "work would take with the int8 layers at that limit and the rest at the "
        f"{gemm['dtype']} one, over the time it took.",
    ]


def _table(
    caption: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, numeric: bool
) -> list[str]:
    """A caption and a markdown table; every column but the first right-aligned (the first too when
    ``numeric``)."""
    alignment = ["---:" if numeric or index else "---" for index in range(len(columns))]
    return [
        "",
        caption,
        "",
        _table_row(*columns),
        _table_row(*alignment),
        *(_table_row(*row) for row in rows),
    ]


def _range(figures: dict[str, Any] | None) -> str:
    return "-" if not figures else f"{_fmt(figures['min'])}-{_fmt(figures['max'])}"


def _markdown_latency(latency: dict[str, Any]) -> list[str]:
    def rates(side: dict[str, Any]) -> str:
        return f"{_pct(side.get('backbone_gemm_fraction'))} / {_pct(side.get('best_backbone_gemm_fraction'))}"

    rows = [
        (
            tokens,
            value["engine"]["runs"],
            _both(_ms(value["engine"]["p50_s"]), _ms(value["baseline"]["p50_s"])),
            _both(_ms(value["engine"]["p95_s"]), _ms(value["baseline"]["p95_s"])),
            f"{_fmt(value['speedup_p50'])}x / {_fmt(value.get('speedup_min'))}x / "
            f"{_fmt(value.get('speedup_cpu_p50'))}x ({_range(value.get('speedup_spread'))})",
            _both(_fmt(value["engine"]["tokens_per_s"]), _fmt(value["baseline"]["tokens_per_s"])),
            _both(rates(value["engine"]), rates(value["baseline"])),
            _both(_fmt(value["engine"]["peak_rss_mib"]), _fmt(value["baseline"]["peak_rss_mib"])),
        )
        for tokens, value in latency.items()
    ]
    lines = _table(
        "One request at a time (2 questions), engine (baseline):",
        (
            "T",
            "runs",
            "p50 ms",
            "p95 ms",
            "speedup: p50 / fastest / CPU time (per repetition: min-max)",
            "tokens/s",
            "backbone % of GEMM limit: median / best run",
            "peak RSS MiB",
        ),
        rows,
        numeric=True,
    )
    split = [
        (
            tokens,
            *(
                _both(_ms(value["engine"].get(key)), _ms(value["baseline"].get(key)))
                for key in ("encode_p50_s", "backbone_p50_s", "head_p50_s", "answer_p50_s")
            ),
            _ms(value["engine"].get("other_p50_s")),
            _both(
                _pct(value["engine"]["non_backbone_fraction"]),
                _pct(value["baseline"]["non_backbone_fraction"]),
            ),
        )
        for tokens, value in latency.items()
    ]
    return lines + _table(
        "Where the time of one request goes (p50 ms), engine (baseline):",
        ("T", "encode", "backbone", "head (incl. lexical rows)", "answer", "other", "not backbone"),
        split,
        numeric=True,
    )


def _markdown_questions(questions: dict[str, Any], state_tokens: int) -> list[str]:
    rows = [
        (
            count,
            _fmt(value["engine"]["tokens_per_run"]),
            _both(_ms(value["engine"]["p50_s"]), _ms(value["baseline"]["p50_s"])),
            f"{_fmt(value['speedup_p50'])}x",
            _both(_ms(value["engine"].get("head_p50_s")), _ms(value["baseline"].get("head_p50_s"))),
        )
        for count, value in questions.items()
    ]
    return _table(
        f"Cost vs number of questions ({state_tokens}-token state), engine (baseline):",
        ("questions", "tokens", "p50 ms", "speedup", "head p50 ms"),
        rows,
        numeric=True,
    )


def _markdown_state_cache(cache: dict[str, Any]) -> list[str]:
    availability = "enabled" if cache["available"] else "NOT AVAILABLE in this engine"
    cold, warm, baseline = cache["cold"], cache["warm"], cache["baseline"]
    rows = [
        (
            label,
            side["runs"],
            _ms(side["p50_s"]),
            _ms(side["min_s"]),
            _ms(side["spread_s"]["max"]),
            _fmt(computed),
        )
        for label, side, computed in (
            ("engine, cold (state seen for the first time)", cold, cold["tokens_per_run"]),
            ("engine, warm (same state, new schema)", warm, cache["warm_backbone_tokens_p50"]),
            ("baseline (no cache)", baseline, baseline["tokens_per_run"]),
        )
    ]
    return [
        *_table(
            f"Same {cache['state_tokens']}-token state, then new schemas "
            f"(~{_fmt(cache['schema_tokens_p50'])} tokens after the state); state cache {availability}:",
            ("request", "runs", "p50 ms", "fastest ms", "slowest ms", "backbone tokens computed (p50)"),
            rows,
            numeric=False,
        ),
        "",
        f"cold / warm: **{cache.get('cold_over_warm_min')}x** fastest, {cache['cold_over_warm']}x p50 (each "
        f"cold / warm pair: {_range(cache.get('cold_over_warm_spread'))}); baseline / warm "
        f"{cache['baseline_over_warm']}x p50.",
    ]


def _markdown_concurrency(concurrency: dict[str, Any]) -> list[str]:
    rows = [
        (
            f"{value['requests']} x {tokens}",
            _fmt(value["engine"]["tokens_per_run"] / value["requests"]),
            value["engine"]["runs"],
            _both(_fmt(value["engine"]["requests_per_s"]), _fmt(value["baseline"]["requests_per_s"])),
            _both(_fmt(value["engine"]["tokens_per_s"]), _fmt(value["baseline"]["tokens_per_s"])),
            f"**{_fmt(value.get('throughput_ratio_best'))}x** / {_fmt(value['throughput_ratio'])}x "
            f"({_range(value.get('throughput_ratio_spread'))})",
            _both(
                _ms(value["engine"]["request_latency_p50_s"]), _ms(value["baseline"]["request_latency_p50_s"])
            ),
            _both(_fmt(value["engine"]["peak_rss_mib"]), _fmt(value["baseline"]["peak_rss_mib"])),
        )
        for tokens, value in concurrency.items()
    ]
    return _table(
        "Concurrent requests arriving together: engine = one batched `decide_encoded` call, baseline = one "
        "request after another; engine (baseline):",
        (
            "requests x state tokens",
            "tokens per request",
            "runs",
            "requests/s",
            "tokens/s",
            "throughput ratio: fastest / all (per repetition: min-max)",
            "p50 completion ms",
            "peak RSS MiB",
        ),
        rows,
        numeric=False,
    )


def _markdown_padding(padding: dict[str, Any]) -> list[str]:
    rows = [
        (value["policy"], value["steps"], value["mean_rows_per_step"], _pct(value["padding_fraction"]))
        for value in (padding[key] for key in ("arrival_order", "token_budget_only", "length_grouping"))
    ]
    return _table(
        f"Padding waste of the step policy over {padding['requests']} requests ({padding['lengths']}):",
        ("policy", "steps", "mean rows per step", "padded tokens wasted"),
        rows,
        numeric=False,
    )


def render_markdown(report: dict[str, Any]) -> str:
    """Render a report (the JSON this script writes) as markdown tables; returns the text."""
    lines = _markdown_header(report)
    sections = report.get("sections", {})
    if sections.get("latency"):
        lines += _markdown_latency(sections["latency"])
    if sections.get("questions"):
        lines += _markdown_questions(sections["questions"], report["plan"]["question_state_tokens"])
    if sections.get("state_cache"):
        lines += _markdown_state_cache(sections["state_cache"])
    if sections.get("concurrency"):
        lines += _markdown_concurrency(sections["concurrency"])
    if sections.get("padding"):
        lines += _markdown_padding(sections["padding"])
    skipped = report.get("skipped") or []
    if skipped:
        lines += ["", "Not measured: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"
