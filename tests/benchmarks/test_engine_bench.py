"""benchmarks/engine_bench/ (developer tooling, not in the package): the quick run on the tiny model, the
state-cache section, the in-benchmark baseline, the hidden-1,024 geometry's FLOP count, the padding
measurement and the random-checkpoint writer the benchmark models are built with."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import torch
from benchmarks.engine_bench.cli import _state_cache_on
from benchmarks.engine_bench.plans import PLANS
from benchmarks.engine_bench.sections import _Context
from benchmarks.engine_bench.stats import summarize
from benchmarks.engine_bench.targets import evaluate_targets
from benchmarks.engine_bench.workload import request_of_length
from devtools.flags import engine_options
from devtools.models import GEOMETRIES
from devtools.requests import make_state

from benchmarks import engine_bench
from clef_runtime.engine.clef import Clef
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.head import HeadLayout
from clef_runtime.model.tiny import make_random_checkpoint, random_checkpoint_config
from clef_runtime.options import EngineOptions

SECTIONS = engine_bench.SECTIONS
ReferenceBaseline = engine_bench.ReferenceBaseline
backbone_flops = engine_bench.backbone_flops
padding_waste = engine_bench.padding_waste


@pytest.fixture(scope="module")
def tiny_clef() -> Clef:
    return Clef.load("tiny", dtype="fp32", device="cpu")


@pytest.mark.slow
def test_quick_bench_on_tiny_writes_json_and_markdown(tmp_path: Path) -> None:
    json_path, markdown_path = tmp_path / "bench.json", tmp_path / "bench.md"
    status = engine_bench.main(
        ["--quick", "--model", "tiny", "--json", str(json_path), "--markdown", str(markdown_path)]
    )
    assert status == 0
    report = json.loads(json_path.read_text())
    assert report["mode"] == "quick"
    assert report["model"]["spec"] == "tiny"
    assert set(report["sections"]) == set(SECTIONS) - {"gemm"}
    # The limit judged against is the best over the model's own Linear shapes, at each request length.
    assert report["gemm"]["limit_gflops"] > 0
    assert set(report["gemm"]["limit_by_tokens"]) == {"256", "512", "1024"}
    assert report["gemm"]["limit_gflops"] == max(report["gemm"]["limit_by_tokens"].values())
    assert report["machine"]["gemm"]["limit"]["fp32_gflops"] >= report["gemm"]["limit_gflops"]
    assert report["command"].startswith("python -m benchmarks.engine_bench --quick --model tiny")
    assert len(report["machine"]["load_average"]) == 3
    assert set(report["sections"]["latency"]) == {"256", "512", "1024"}
    for value in report["sections"]["latency"].values():
        for side in ("engine", "baseline"):
            assert value[side]["p50_s"] > 0
            assert value[side]["peak_rss_mib"] > 0
            assert value[side]["backbone_gemm_fraction"] > 0
            # Every repetition is kept, with the spread.
            spread = value[side]["spread_s"]
            assert spread["n"] == value[side]["runs"] == len(spread["samples"])
            assert spread["min"] <= spread["median"] <= spread["max"]
    # The engine and the reference-way baseline compute the same answers (rounded to 4 decimals).
    assert report["parity_max_abs_diff"] <= 2e-4
    names = {target["name"] for target in report["targets"]}
    assert names == {
        "state_cache_speedup",
        "backbone_gemm_fraction",
        "non_backbone_fraction_512",
        "concurrency_16x100",
    }
    assert all(target["status"] in {"met", "not met", "not available"} for target in report["targets"])
    markdown = markdown_path.read_text()
    assert "| target | measured | threshold | status | note |" in markdown
    assert "GEMM limit measured in this run" in markdown


def test_the_state_cache_section_runs_with_the_cache_the_option_table_offers() -> None:
    # Clef.load(model, options, **overrides) has no cache_mb parameter of its own: whether the engine has a
    # state cache is the option table's to say, and the bench must load the engine with it.
    report = engine_bench.run_suite("tiny", mode="quick", sections=["state_cache"])
    assert report["model"]["state_cache"] == {"available": True, "cache_mb": engine_bench.DEFAULT_CACHE_MB}
    assert report["engine_options"]["cache_mb"] == engine_bench.DEFAULT_CACHE_MB
    cache = report["sections"]["state_cache"]
    assert cache["available"] is True
    # A warm request computes only what follows the cached state.
    assert cache["warm_backbone_tokens_p50"] < cache["state_tokens"] < cache["cold"]["tokens_per_run"]
    assert not any("state-cache" in note for note in report["skipped"])
    names = {target["name"]: target["status"] for target in report["targets"]}
    assert names["state_cache_speedup"] in {"met", "not met"}


def test_cache_mb_0_reports_the_cache_off() -> None:
    assert _state_cache_on(engine_options(cache_mb=256))
    assert not _state_cache_on(engine_options(cache_mb=0))


def test_engine_flags_reach_the_engine(tmp_path: Path) -> None:
    args = argparse.ArgumentParser()
    engine_bench.add_bench_arguments(args)
    parsed = args.parse_args(
        ["--model", "tiny", "--weights", "fp32", "--cache-mb", "0", "--prefill-chunk", "64"]
    )
    assert EngineOptions.from_sources(parsed, {}) == engine_options(
        weights="fp32", cache_mb=0, prefill_chunk=64
    )


def test_baseline_matches_the_engine_on_the_same_weights(tiny_clef: Clef) -> None:
    baseline = ReferenceBaseline(tiny_clef)
    workload = request_of_length(random.Random(3), 300, 3, "parity")
    _, record = baseline.encode(workload)
    assert record.input_tokens == 300
    assert record.input_ids == tiny_clef.encode(workload.body, max_length=300).input_ids

    hidden = baseline.hidden_states(record.input_ids)
    engine_hidden = tiny_clef.backbone.hidden_states(record.input_ids)
    assert torch.allclose(hidden, engine_hidden, atol=1e-4, rtol=0)

    looped = torch.cat(baseline.head_logits(engine_hidden, record.input_ids, record))
    layout = HeadLayout(
        type_ids=[q.type_id for q in record.questions],
        question_spans=[q.question_span for q in record.questions],
        option_spans=[list(q.option_spans) for q in record.questions],
    )
    lexical = tiny_clef.lexical.option_means(
        record.input_ids, [span for q in record.questions for span in q.option_spans]
    )
    vectorised = tiny_clef.head.score(engine_hidden, layout, lexical)
    assert looped.shape == vectorised.shape == (record.num_options,)
    assert torch.allclose(looped, vectorised, atol=1e-5, rtol=0)


def test_make_state_is_exactly_one_token_per_word(tiny_clef: Clef) -> None:
    state = make_state(random.Random(0), 500)
    assert len(tiny_clef.tokenizer.encode(state)) == 500


def test_medium_geometry_is_the_release_pattern_scaled_down() -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    geometry = GEOMETRIES["medium-1024"]
    config = random_checkpoint_config(geometry=geometry)
    text = config["text_config"]
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]  # the release's, head dim 256
    assert text["vocab_size"] == 248_320
    assert config["vision_config"]["out_hidden_size"] == 1024
    assert geometry.head_config()["hidden_size"] == text["hidden_size"]
    with torch.device("meta"):
        model = Qwen3_5TextModel(Qwen3_5Config.from_dict(config).text_config)

    hidden, mlp = 1024, 3 * 1024 * 3072
    # DeltaNet: qkv (2 x 8 x 128 keys + 16 x 128 values), z gate, b and a (one per value head), out.
    deltanet = hidden * (2 * 8 * 128 + 16 * 128) + hidden * 16 * 128 + 2 * hidden * 16 + 16 * 128 * hidden
    # Gated attention: q and its output gate (8 x 256 x 2), k and v (2 x 256 each), o.
    attention = hidden * 8 * 256 * 2 + 2 * hidden * 2 * 256 + 8 * 256 * hidden
    expected_linear = 6 * (deltanet + mlp) + 2 * (attention + mlp)
    tokens = 100
    expected_flops = (
        2 * expected_linear * tokens
        + 2 * 4 * 8 * 256 * tokens * (tokens + 1) / 2  # causal score + mix pairs, 2 attention layers
        + 6 * 6 * 16 * 128 * 128 * tokens  # DeltaNet recurrence, 6 layers
        + 6 * 2 * 4 * (2 * 8 * 128 + 16 * 128) * tokens  # causal conv, kernel 4
    )
    assert backbone_flops(model, tokens) == pytest.approx(expected_flops, rel=1e-12)
    # A prefill after cached context adds only the new queries' attention pairs.
    split = backbone_flops(model, 40) + backbone_flops(model, 60, context=40)
    assert split == pytest.approx(backbone_flops(model, 100), rel=1e-12)


@pytest.fixture(scope="module")
def tiny_int8() -> Clef:
    """The tiny model with ``--weights int8``: its layers 1-3 are `Int8Linear` (not ``nn.Linear``)."""
    return Clef.load("tiny", engine_options(weights="int8", cache_mb=0))


def test_the_flop_count_includes_the_int8_layers(tiny_clef: Clef, tiny_int8: Clef) -> None:
    exact, quantised = tiny_clef.backbone.model, tiny_int8.backbone.model
    floating, int8 = engine_bench.linear_weights(quantised)
    assert floating > 0 and int8 > 0  # a mix: the first layer stays fp32
    assert floating + int8 == sum(engine_bench.linear_weights(exact)) == engine_bench.linear_weights(exact)[0]
    # Quantising changes how the work runs, not how much of it there is.
    assert backbone_flops(quantised, 100) == backbone_flops(exact, 100)
    assert engine_bench.int8_flops(quantised, 100) == 2 * 100 * int8
    assert engine_bench.int8_flops(exact, 100) == 0


def test_int8_work_is_judged_against_the_int8_limit() -> None:
    limits = engine_bench.GemmLimits(gflops=100.0, int8_gops=400.0, tokens=512)
    # 1 GFLOP at 100 GFLOP/s and 2 GOP at 400 GOP/s: 15 ms at the limits, in 500 ms.
    run = {"flops": 3e9, "int8_flops": 2e9, "backbone_s": 0.5}
    assert limits.fraction(run) == pytest.approx(0.015 / 0.5, rel=1e-12)
    assert limits.fraction({"flops": 3e9, "backbone_s": 0.5}) == pytest.approx(0.03 / 0.5, rel=1e-12)
    # int8 work and no int8 limit measured: no fraction rather than one against the wrong limit.
    assert engine_bench.GemmLimits(100.0, None, 512).fraction(run) is None
    runs = [{"total_s": 1.0, "tokens": 512.0, "backbone_tokens": 512.0, **run}]
    assert summarize(runs, limits, 0.0)["backbone_gemm_fraction"] == pytest.approx(0.03)
    assert "backbone_gemm_fraction" not in summarize(runs, engine_bench.GemmLimits(100.0, None, 1), 0.0)


def test_sections_of_other_lengths_are_judged_against_the_best_limit_over_every_length() -> None:
    context = _Context(
        clef=None,
        baseline=None,
        plan=PLANS["quick"],
        gemm_limits={256: 50.0, 512: 80.0},
        device=torch.device("cpu"),
        seed=0,
        progress=print,
        int8_limits={512: 300.0},
    )
    assert context.limit_at(256) == engine_bench.GemmLimits(50.0, None, 256)
    assert context.limit_at(512) == engine_bench.GemmLimits(80.0, 300.0, 512)
    assert context.limit_at() == engine_bench.GemmLimits(80.0, 300.0, None)
    assert context.limit_at().as_dict() == {"gflops": 80.0, "int8_gops": 300.0, "tokens": None}


@pytest.mark.slow
def test_an_int8_run_reports_the_int8_limit_and_judges_against_it() -> None:
    report = engine_bench.run_suite(
        "tiny", mode="quick", sections=["gemm", "latency"], options=engine_options(weights="int8", cache_mb=0)
    )
    model, gemm = report["model"], report["gemm"]
    assert 0 < model["backbone_int8_linear_parameters"] < model["backbone_linear_parameters"]
    assert set(gemm["int8_limit_by_tokens"]) == {"256", "512", "1024"}
    for tokens, value in report["sections"]["latency"].items():
        assert value["gemm_limit"] == {
            "gflops": gemm["limit_by_tokens"][tokens],
            "int8_gops": gemm["int8_limit_by_tokens"][tokens],
            "tokens": int(tokens),
        }
        assert value["engine"]["backbone_gemm_fraction"] > 0
    assert "judged against the int8 GEMM limit" in engine_bench.render_markdown(report)


def test_random_checkpoint_of_another_geometry(tmp_path: Path) -> None:
    overrides = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 8, "head_dim": 16}
    head = {"hidden_size": 32, "width": 16, "routing_layers": 1, "layers": 1, "heads": 2, "feedforward": 32}
    marker = {"tiny": False, "untrained": True, "seed": 5}
    path = make_random_checkpoint(
        tmp_path / "random", text_overrides=overrides, head_config=head, seed=5, marker=marker
    )
    config = json.loads((path / "config.json").read_text())
    assert config["clef_runtime"] == marker
    text = config["text_config"]
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert sum(text["rope_parameters"]["mrope_section"]) == 16 * 0.25 // 2
    assert json.loads((path / "joint_head_config.json").read_text()) == head
    info = verify_checkpoint(path)
    assert not info.is_tiny
    backbone = Backbone.load(path, device="cpu", info=info)
    assert backbone.config.num_hidden_layers == 8
    rows = backbone.hidden_states(list(range(2000, 2040)))
    assert rows.shape == (40, 32)
    assert torch.isfinite(rows).all() and rows.std() > 0.1

    with pytest.raises(ValueError, match="hidden_size"):
        make_random_checkpoint(
            tmp_path / "bad", text_overrides=overrides, head_config={**head, "hidden_size": 64}
        )
    with pytest.raises(FileExistsError):
        make_random_checkpoint(path, text_overrides=overrides, head_config=head)


def test_padding_waste_with_and_without_length_grouping() -> None:
    lengths = [100, 1000, 100, 1000]
    mixed = padding_waste(lengths, length_ratio=math.inf, max_step_tokens=1 << 40, max_rows=4)
    assert (mixed["steps"], mixed["real_tokens"], mixed["padded_tokens"]) == (1, 2200, 4000)
    assert mixed["padding_fraction"] == pytest.approx(0.45)
    grouped = padding_waste(lengths, length_ratio=2.0, max_step_tokens=1 << 40, max_rows=4)
    # Two batches (100s, 1000s) in one step: no padding.
    assert (grouped["steps"], grouped["padded_tokens"], grouped["padding_fraction"]) == (1, 2200, 0.0)
    chunked = padding_waste(lengths, length_ratio=2.0, max_step_tokens=512, max_rows=4)
    assert chunked["real_tokens"] == 2200 and chunked["steps"] >= 2200 // 512


def test_targets_report_met_not_met_and_not_available() -> None:
    def side(fraction: float, best_fraction: float, non_backbone: float, best_non_backbone: float) -> dict:
        return {
            "backbone_gemm_fraction": fraction,
            "best_backbone_gemm_fraction": best_fraction,
            "non_backbone_fraction": non_backbone,
            "best_run_non_backbone_fraction": best_non_backbone,
        }

    results = {
        "state_cache": {"available": False, "cold_over_warm": 1.0, "cold_over_warm_min": 1.1},
        "latency": {
            "512": {"engine": side(0.5, 0.9, 0.05, 0.02), "baseline": side(0.5, 0.5, 0.1, 0.1)},
            "1024": {"engine": side(0.5, 0.8, 0.01, 0.01), "baseline": side(0.5, 0.5, 0.1, 0.1)},
            "4096": {"engine": side(0.5, 0.7, 0.01, 0.01), "baseline": side(0.5, 0.5, 0.1, 0.1)},
        },
        "concurrency": {
            "100": {"throughput_ratio": 1.2, "throughput_ratio_best": 1.5},
            "1000": {"throughput_ratio": 1.1, "throughput_ratio_best": 0.9},
        },
    }
    status = {target["name"]: (target["status"], target["measured"]) for target in evaluate_targets(results)}
    # Judged on the best-of-N figures, the lowest over T >= 1,024 for the GEMM fraction.
    assert status == {
        "state_cache_speedup": ("not available", 1.1),
        "backbone_gemm_fraction": ("not met", 0.7),
        "non_backbone_fraction_512": ("met", 0.02),
        "concurrency_16x100": ("met", 1.5),
        "concurrency_16x1000": ("not met", 0.9),
    }
