"""The startup warm-up: which batch shapes it runs; running them leaves the engine's answers alone."""

from __future__ import annotations

from clef_runtime import Clef
from clef_runtime.engine.warmup import WARMUP_TOKENS, run_backbone_warmup, warmup_shapes


def test_cpu_runs_no_batch_shapes() -> None:
    assert warmup_shapes("cpu") == []


def test_cuda_shapes_cover_the_step_limits() -> None:
    shapes = warmup_shapes("cuda", max_step_tokens=16384, max_rows=16)
    assert (1, 64) in shapes and (16, 1024) in shapes and (4, 4096) in shapes
    assert (8, 4096) not in shapes  # 32,768 padded tokens: more than one call may hold
    assert all(rows * tokens <= 16384 and rows <= 16 for rows, tokens in shapes)
    assert {tokens for _, tokens in shapes} == set(WARMUP_TOKENS)
    assert warmup_shapes("cuda", max_step_tokens=100, max_rows=4) == [(1, 64)]


def test_backbone_warmup_runs_the_shapes_and_changes_no_answer() -> None:
    clef = Clef.load("tiny", dtype="fp32", cache_mb=0)
    request = {"state": "warm", "questions": {"q": {"type": "noul", "instructions": "is it?"}}}
    before = clef.decide(request)
    tokens_before = clef.backbone_tokens
    assert run_backbone_warmup(clef.backbone, clef.prefix_state, [(2, 64), (1, 256)]) == 2 * 64 + 256
    assert clef.decide(request) == before
    assert clef.backbone_tokens > tokens_before
