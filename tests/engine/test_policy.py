"""The step policy: pure decisions about what each engine step computes (no model, no threads)."""

from __future__ import annotations

import pytest

from clef_runtime.engine.policy import (
    DEFAULT_STEP_ROWS,
    Admit,
    Advance,
    Running,
    Step,
    StepSettings,
    Waiting,
    build_step_settings,
    compose_step,
)
from clef_runtime.engine.warmup import warmup_shapes
from clef_runtime.server.settings import ServerSettings


def waiting(key: int, tokens: int, **extra: object) -> Waiting:
    return Waiting(key=key, tokens=tokens, seq=key, group=extra.pop("group", "prefix"), **extra)  # type: ignore[arg-type]


def running(key: int, *remaining: int, seq: int = 0, **extra: object) -> Running:
    return Running(key=key, remaining=tuple(remaining), seq=seq, **extra)  # type: ignore[arg-type]


def compose(
    w: list[Waiting], r: list[Running], budget: int = 512, work_done: int = 0, **settings: object
) -> Step:
    return compose_step(
        w,
        r,
        work_done=work_done,
        settings=StepSettings(max_step_tokens=budget, **settings),  # type: ignore[arg-type]
    )


def test_nothing_to_do_is_an_empty_step() -> None:
    assert not compose([], [])


def test_a_long_request_is_chunked_to_the_budget_in_quanta() -> None:
    step = compose([waiting(0, 1124)], [], budget=500)
    assert step.parts == (Admit((0,), 448),)  # 500 -> the largest multiple of 64
    assert step.tokens == 448


def test_a_running_batch_finishes_then_the_next_request_fills_the_rest() -> None:
    step = compose([waiting(1, 1124)], [running(7, 100)], budget=512)
    assert step.parts == (Advance(7, 100, 1), Admit((1,), 384))
    assert step.tokens <= 512


def test_a_short_request_overtakes_a_long_one_in_the_same_step() -> None:
    step = compose([waiting(5, 120)], [running(7, 900)], budget=512)
    assert step.parts[0] == Admit((5,), 120)
    assert step.parts[1] == Advance(7, 384, 1)


def test_short_requests_with_one_start_share_a_batch_within_the_budget() -> None:
    step = compose([waiting(i, 100 + i) for i in range(8)], [], budget=512)
    # Four rows padded to 103 (412 tokens); a fifth would pad to 104 x 5 = 520: it gets a chunk of its own.
    assert step.parts == (Admit((0, 1, 2, 3), 103), Admit((4,), 64))
    assert step.tokens == 476


def test_rows_join_only_within_the_length_ratio_and_only_with_their_start() -> None:
    step = compose(
        [waiting(0, 50), waiting(1, 90), waiting(2, 120), waiting(3, 60, group="n1")], [], budget=4096
    )
    admits = [part for part in step.parts if isinstance(part, Admit)]
    # 50 and 90 share (90 <= 2 x 50); 120 would make the batch 2.4x its shortest row: a batch of its own.
    assert Admit((0, 1), 90) in admits
    assert Admit((2,), 120) in admits
    assert Admit((3,), 60) in admits  # another start point: never in the prefix's batch


def test_the_first_part_always_runs_even_over_the_budget() -> None:
    step = compose([], [running(1, 900, 900, 900)], budget=100)
    assert step.parts == (Advance(1, 64, 3),)  # one quantum for each row: progress every step


def test_max_rows_caps_a_step() -> None:
    step = compose([waiting(i, 10) for i in range(10)], [], budget=4096, max_rows=4)
    assert step.rows == 4


def test_aging_lets_a_long_wait_beat_fresh_short_requests() -> None:
    old = waiting(0, 1000, work_at_arrival=0)
    young = compose([old, waiting(1, 120, work_at_arrival=1_000)], [], budget=256, work_done=1_000)
    assert young.parts[0] == Admit((1,), 120)  # shortest first while the long one is young
    # After 16 x (1000 - 120) tokens of other work, the long request goes before a fresh short one.
    later = 16 * 880 + 64
    aged = compose([old, waiting(1, 120, work_at_arrival=later)], [], budget=256, work_done=later)
    assert aged.parts[0] == Admit((0,), 256)


def test_nothing_starves_a_long_request_is_taken_within_its_bound() -> None:
    # A stream of fresh 100-token requests, one per step: the long request runs once the engine has
    # computed about overtake_factor x its size of other work since it arrived.
    long = waiting(0, 2000)
    work, steps = 0, 0
    while True:
        fresh = waiting(steps + 1, 100, work_at_arrival=work)
        step = compose([long, fresh], [], budget=128, work_done=work)
        steps += 1
        if step.parts[0] == Admit((0,), 128):
            break
        work += step.tokens
        assert steps < 1000
    assert work <= 16 * 2000


def test_background_work_waits_for_interactive_work_and_is_capped_per_step() -> None:
    jobs = [waiting(i, 50, background=True) for i in range(3)]
    busy = compose([*jobs, waiting(9, 50)], [], budget=4096)
    assert busy.parts == (Admit((9,), 50),)
    paused = compose(jobs, [running(4, 300)], budget=4096)
    assert paused.parts == (Advance(4, 300, 1),)
    idle = compose(jobs, [], budget=4096, background_rows=2)
    assert idle.rows == 2


def test_a_background_batch_pauses_while_interactive_work_runs() -> None:
    step = compose([waiting(1, 80)], [running(2, 500, background=True)], budget=4096)
    assert step.parts == (Admit((1,), 80),)


def test_requests_about_a_state_being_computed_wait_for_it() -> None:
    step = compose(
        [waiting(1, 300, hold=b"s"), waiting(2, 300, hold=b"s"), waiting(3, 300, hold=b"t")], [], budget=4096
    )
    keys = [key for part in step.parts if isinstance(part, Admit) for key in part.keys]
    assert keys == [1, 3]  # 2 waits: its state is being computed by 1
    held = compose([waiting(2, 300, hold=b"s")], [running(1, 50, holds=frozenset({b"s"}))], budget=4096)
    assert held.parts == (Advance(1, 50, 1),)


def test_a_request_retried_alone_is_never_batched() -> None:
    step = compose([waiting(0, 50, alone=True), waiting(1, 50)], [], budget=4096)
    assert step.parts == (Admit((0,), 50), Admit((1,), 50))


def test_deterministic_mode_runs_one_request_at_a_time_in_arrival_order_in_fixed_chunks() -> None:
    settings = {"deterministic": True}
    first = compose([waiting(3, 100), waiting(2, 2000)], [], budget=512, **settings)
    assert first.parts == (Admit((2,), 512),)  # arrival order, not the shortest
    going = compose([waiting(3, 100)], [running(8, 1488, seq=2)], budget=512, **settings)
    assert going.parts == (Advance(8, 512, 1),)
    assert compose([waiting(1, 9, background=True), waiting(5, 9)], [], **settings).parts == (Admit((5,), 9),)


@pytest.mark.parametrize(
    "bad",
    [{"max_step_tokens": 0}, {"max_rows": 0}, {"overtake_factor": 0}, {"length_ratio": 0.5}, {"quantum": 0}],
)
def test_invalid_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StepSettings(**{"max_step_tokens": 512, **bad})  # type: ignore[arg-type]


def test_an_interactive_request_never_waits_for_a_paused_background_batch() -> None:
    # The background batch computing state "s" is paused while interactive work exists: waiting for it
    # would wait forever, so the interactive request computes the state itself.
    background = running(1, 500, background=True, holds=frozenset({b"s"}))
    step = compose([waiting(2, 300, hold=b"s")], [background], budget=4096)
    assert step.parts == (Admit((2,), 300),)


def test_an_engine_loop_s_settings_come_from_one_builder_with_one_row_default() -> None:
    built = build_step_settings(1024, max_rows=8, background_rows=4, deterministic=True)
    assert built == StepSettings(max_step_tokens=1024, max_rows=8, background_rows=4, deterministic=True)
    # The policy's row limit, the server's --max-batch-size and the warm-up's rows are one default.
    assert (
        build_step_settings(1024).max_rows == StepSettings(max_step_tokens=1024).max_rows == DEFAULT_STEP_ROWS
    )
    assert ServerSettings(model="tiny").max_batch_size == DEFAULT_STEP_ROWS
    assert warmup_shapes("cuda", max_step_tokens=10**6) == warmup_shapes(
        "cuda", max_step_tokens=10**6, max_rows=DEFAULT_STEP_ROWS
    )
