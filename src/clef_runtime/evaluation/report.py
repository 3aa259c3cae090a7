"""``clef eval --report DIR``: reliability and coverage plots (PNG, matplotlib's Agg backend) and one
self-contained HTML page with the tables and the plots inlined as data URIs (no external asset)."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_ms", "text_summary", "untrained_banner", "write_report"]

_METRIC_KEYS = ("n", "accuracy", "brier", "nll", "ece", "mce", "macro_f1", "mae")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def format_ms(value: float | None) -> str:
    """A latency in milliseconds as a person reads it: to 0.1 ms below 100 ms, whole ms above (a timer's
    last digits are noise, "399.9933 ms" claims a precision nobody measured)."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def untrained_banner(source: dict[str, Any]) -> str | None:
    """The warning that leads the report of an untrained model (random weights: the tiny model), so its
    numbers are not read as a real model's accuracy; None for a trained one."""
    if not source.get("untrained"):
        return None
    return (
        f"UNTRAINED MODEL: {source.get('model')} has random weights. These numbers show that the pipeline "
        "runs, not how accurate or calibrated a real model is."
    )


def _latency(summary: dict[str, Any]) -> str:
    latency = summary["latency_ms"]
    return f"p50 {format_ms(latency['p50'])} ms, p95 {format_ms(latency['p95'])} ms"


def _groups(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("overall", summary["overall"]), *summary["by_type"].items()]


def _reliability_png(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(summary)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.2), squeeze=False)
    for ax, (name, metrics) in zip(axes[0], groups, strict=True):
        bins = metrics["reliability"]
        centers = [(b["lower"] + b["upper"]) / 2 for b in bins if b["n"]]
        accuracy = [b["accuracy"] for b in bins if b["n"]]
        confidence = [b["confidence"] for b in bins if b["n"]]
        ax.bar(centers, accuracy, width=0.09, color="#4c78a8", alpha=0.8, label="accuracy")
        ax.plot([0, 1], [0, 1], "--", color="#888888", label="perfect calibration")
        ax.plot(confidence, accuracy, "o", color="#e45756", label="mean confidence")
        for b in bins:
            if b["n"]:
                ax.annotate(str(b["n"]), ((b["lower"] + b["upper"]) / 2, 0.02), ha="center", fontsize=7)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="top-1 probability", ylabel="accuracy")
        ax.set_title(f"{name} (n={metrics['n']}, ECE {metrics['ece']:.3f})", fontsize=10)
    axes[0][0].legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _coverage_png(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for name, metrics in _groups(summary):
        rows = [r for r in metrics["coverage"] if r["accuracy"] is not None]
        ax.plot([r["coverage"] for r in rows], [r["accuracy"] for r in rows], "o-", label=name)
    ax.set(
        xlim=(0, 1.02), ylim=(0, 1.02), xlabel="coverage (share answered)", ylabel="accuracy when answered"
    )
    ax.set_title("Coverage vs accuracy (answer only above a top-1 threshold)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(cell))}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _metrics_rows(groups: Sequence[tuple[str, dict[str, Any]]]) -> list[list[Any]]:
    return [[name, *(metrics.get(key) for key in _METRIC_KEYS)] for name, metrics in groups]


def _source_note(source: dict[str, Any]) -> str:
    if source.get("rounded"):
        return (
            f"Answers from the server {source.get('url')} (model {source.get('model')}). The wire rounds "
            "probabilities to 4 decimals, so these metrics carry that rounding (|dp| <= 0.00005 each)."
        )
    return f"Answers in-process from model {source.get('model')}: metrics from unrounded probabilities."


def write_report(summary: dict[str, Any], source: dict[str, Any], directory: Path) -> Path:
    """Write ``reliability.png``, ``coverage.png`` and ``report.html`` (the PNGs inlined) into ``directory``
    (created if needed). Returns the HTML path. Raises OSError when the directory cannot be written."""
    directory.mkdir(parents=True, exist_ok=True)
    reliability, coverage = directory / "reliability.png", directory / "coverage.png"
    _reliability_png(summary, reliability)
    _coverage_png(summary, coverage)

    def inline(path: Path, alt: str) -> str:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'<img alt="{alt}" src="data:image/png;base64,{data}">'

    banner = untrained_banner(source)
    sections = [
        "<h1>clef eval report</h1>",
        *(
            [f'<p class="untrained" role="alert"><strong>{html.escape(banner)}</strong></p>']
            if banner
            else []
        ),
        f"<p>{html.escape(_source_note(source))}</p>",
        f"<p>Calibration: {html.escape(str(source.get('calibration') or 'none'))}. Questions answered: "
        f"{summary['questions']['answered']}, scored: {summary['questions']['scored']}. Latency "
        f"{_latency(summary)}.</p>",
        "<h2>Metrics</h2>",
        _table(["group", *_METRIC_KEYS], _metrics_rows(_groups(summary))),
        "<h2>Reliability</h2>",
        inline(reliability, "reliability diagram"),
    ]
    for name, metrics in _groups(summary):
        rows = [
            [f"{b['lower']:.1f}-{b['upper']:.1f}", b["n"], b["accuracy"], b["confidence"]]
            for b in metrics["reliability"]
        ]
        sections += [
            f"<h3>{html.escape(name)}</h3>",
            _table(["top-1 bin", "n", "accuracy", "confidence"], rows),
        ]
    sections += ["<h2>Coverage vs accuracy</h2>", inline(coverage, "coverage vs accuracy")]
    for name, metrics in _groups(summary):
        rows = [[r["threshold"], r["n"], r["coverage"], r["accuracy"]] for r in metrics["coverage"]]
        sections += [
            f"<h3>{html.escape(name)}</h3>",
            _table(["threshold", "n", "coverage", "accuracy"], rows),
        ]
    sections += [
        "<h2>Per question</h2>",
        _table(["question", *_METRIC_KEYS], _metrics_rows(list(summary["by_question"].items()))),
        "<h2>Source</h2>",
        f"<pre>{html.escape(json.dumps(source, indent=2, default=str))}</pre>",
    ]
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;"
        "margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
        ".untrained{background:#fdecea;border:2px solid #b3261e;color:#5f1411;padding:.6em 1em}"
    )
    page = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>clef eval report</title>'
        f"<style>{style}</style></head><body>{''.join(sections)}</body></html>\n"
    )
    out = directory / "report.html"
    out.write_text(page, encoding="utf-8")
    return out


def text_summary(summary: dict[str, Any], source: dict[str, Any]) -> str:
    """The metrics as a plain-text table (what ``clef eval`` prints), with the coverage table of the whole
    set and the note on where the probabilities came from."""
    banner = untrained_banner(source)
    lines = [f"WARNING: {banner}"] if banner else []
    lines.append(_source_note(source))
    if source.get("calibration"):
        lines.append(f"calibration: {source['calibration']}")
    header = ["group", *_METRIC_KEYS]
    rows = [[name, *(_fmt(metrics.get(key)) for key in _METRIC_KEYS)] for name, metrics in _groups(summary)]
    rows += [
        [f"  {qid}", *(_fmt(metrics.get(key)) for key in _METRIC_KEYS)]
        for qid, metrics in summary["by_question"].items()
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))
    lines.append("coverage (overall): threshold -> share answered, accuracy")
    for r in summary["overall"]["coverage"]:
        lines.append(f"  >= {r['threshold']:.2f}: {r['coverage']:.3f} ({r['n']}), {_fmt(r['accuracy'])}")
    lines.append(f"latency: {_latency(summary)}")
    return "\n".join(lines)
