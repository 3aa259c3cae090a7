"""The engine's step policy: what runs in the next step, and how many tokens of it. Pure and model-free.

The engine (`clef_runtime.engine.loop`) works in steps. A step computes at most ``max_step_tokens`` padded
tokens (rows x tokens of every model call in it) drawn from two kinds of work:

- *running* batches: rows that were admitted together, continue one start state and advance together, a
  chunk at a time, over their hybrid cache; a row leaves its batch as soon as its last token is computed
  (its answer goes back then, whatever the other rows still have to do);
- *waiting* requests, admitted into a new batch (requests with the same start point, ``group``, may share
  one; a request that does not fit the step whole gets a chunk of it).

Rules, in order:

1. **Deterministic mode**: one request at a time, in arrival order, in chunks of ``max_step_tokens``: its
   answer never depends on what else was waiting.
2. **Lanes**: background work (batch-job lines) is considered only when no interactive work is waiting or
   running; at most ``background_rows`` background requests are admitted per step.
3. **Order**: shortest remaining work first, so a short request overtakes long ones and returns after about
   one step; with **aging**: a unit's urgency is its remaining tokens minus the tokens the engine has
   computed for others since it arrived, divided by ``overtake_factor``. A request can therefore be
   overtaken by at most about ``overtake_factor`` times its own size of other work before it goes first:
   nothing starves, and the bound is in work, not in seconds, so it means the same on every machine.
4. **Budget**: units are taken in that order while the step's tokens fit; a unit that does not fit whole
   gets the largest multiple of ``quantum`` tokens that fits (a chunk), or waits for the next step. The
   first unit of a step always runs (at least one quantum), so every step makes progress.
5. **Joining**: a waiting request joins a batch admitted in the same step when it has the same start
   point, the step still fits, and the batch's width stays within ``length_ratio`` times its shortest
   row (right-padding waste is bounded).
6. **Holds**: a waiting request whose state (``hold``) is being computed by a running or just admitted
   request waits for it: it then resumes from the state cache instead of computing the state again.

On CPU the default budget is small (long rows run alone, chunk by chunk, and finish one after another); on
CUDA it is large (many requests' tokens packed into each step). ARCHITECTURE.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_STEP_ROWS",
    "Admit",
    "Advance",
    "Running",
    "Step",
    "StepSettings",
    "Waiting",
    "build_step_settings",
    "compose_step",
]

DEFAULT_QUANTUM = 64
"""Chunk widths are multiples of the Gated DeltaNet chunk (64 tokens): other widths pad inside the kernel."""

DEFAULT_STEP_ROWS = 32
"""Most rows computed in one step when the caller does not say (the server's ``--max-batch-size``, the rows
a warm-up prepares for)."""


@dataclass(frozen=True)
class StepSettings:
    """The policy's knobs (see the module docstring). Raises ValueError for a non-positive limit."""

    max_step_tokens: int
    max_rows: int = DEFAULT_STEP_ROWS
    """Most rows computed in one step (all batches together)."""
    background_rows: int = 1
    """Most background requests admitted in one step."""
    deterministic: bool = False
    overtake_factor: float = 16.0
    quantum: int = DEFAULT_QUANTUM
    length_ratio: float = 2.0

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1 or self.max_rows < 1 or self.background_rows < 1 or self.quantum < 1:
            raise ValueError("max_step_tokens, max_rows, background_rows and quantum must be at least 1")
        if self.overtake_factor <= 0:
            raise ValueError("overtake_factor must be positive")
        if self.length_ratio < 1:
            raise ValueError("length_ratio must be >= 1")


def build_step_settings(
    step_tokens: int,
    *,
    max_rows: int = DEFAULT_STEP_ROWS,
    background_rows: int = 1,
    deterministic: bool = False,
) -> StepSettings:
    """The settings of an engine loop over an engine whose step budget is ``step_tokens``: every loop (the
    server's, a scale-out replica's, `Clef.decide_encoded`'s own) is set up here, the rest left to the
    policy's defaults."""
    return StepSettings(
        max_step_tokens=step_tokens,
        max_rows=max_rows,
        background_rows=background_rows,
        deterministic=deterministic,
    )


@dataclass(frozen=True)
class Waiting:
    """A request not started yet."""

    key: Hashable
    tokens: int
    """Tokens it has to compute (from where the state cache lets it resume)."""
    seq: int
    """Arrival order."""
    work_at_arrival: int = 0
    """The engine's work counter (tokens computed) when it arrived: its aging starts there."""
    background: bool = False
    group: Hashable = None
    """Its start point: requests with equal groups can be computed as one batch."""
    hold: Hashable | None = None
    """Its state: requests with an equal hold are started one at a time (None: never held)."""
    alone: bool = False
    """Never batched with others (a request retried alone after its batch failed)."""


@dataclass(frozen=True)
class Running:
    """A batch of rows being computed."""

    key: Hashable
    remaining: tuple[int, ...]
    """Tokens every row still has to compute."""
    seq: int
    """Arrival order of its oldest row."""
    work_at_arrival: int = 0
    background: bool = False
    holds: frozenset[Hashable] = field(default_factory=frozenset)
    """The states its rows compute."""


@dataclass(frozen=True)
class Advance:
    """Advance running batch ``key`` by ``tokens`` tokens (every row; rows that end earlier are padded)."""

    key: Hashable
    tokens: int
    rows: int


@dataclass(frozen=True)
class Admit:
    """Start the waiting requests ``keys`` as one new batch and compute its first ``tokens`` tokens."""

    keys: tuple[Hashable, ...]
    tokens: int

    @property
    def rows(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class Step:
    """One step: its parts in the order they run (most urgent first)."""

    parts: tuple[Advance | Admit, ...] = ()

    @property
    def tokens(self) -> int:
        """Padded tokens the step computes (rows x tokens, summed)."""
        return sum(part.tokens * part.rows for part in self.parts)

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    def __bool__(self) -> bool:
        return bool(self.parts)


def _urgency(tokens: int, work_at_arrival: int, work_done: int, settings: StepSettings) -> float:
    return tokens - (work_done - work_at_arrival) / settings.overtake_factor


def _fit(tokens: int, budget: int, quantum: int) -> int:
    """Tokens of a unit needing ``tokens`` that fit ``budget``: all of them, else the largest multiple of
    ``quantum`` (0: nothing fits)."""
    return tokens if tokens <= budget else budget // quantum * quantum


@dataclass
class _Group:
    """A batch being admitted in this step."""

    keys: list[Hashable]
    tokens: int
    shortest: int
    chunked: bool
    position: int


def _deterministic(waiting: Sequence[Waiting], running: Sequence[Running], settings: StepSettings) -> Step:
    limit = settings.max_step_tokens
    if running:
        batch = min(running, key=lambda r: r.seq)
        return Step((Advance(batch.key, min(limit, max(batch.remaining)), len(batch.remaining)),))
    if waiting:
        first = min(waiting, key=lambda w: (w.background, w.seq))
        return Step((Admit((first.key,), min(limit, max(1, first.tokens))),))
    return Step()


def compose_step(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    *,
    work_done: int,
    settings: StepSettings,
) -> Step:
    """The next step for ``waiting`` requests and ``running`` batches, ``work_done`` tokens into the
    engine's life (see the module docstring). Returns an empty `Step` when there is nothing to do."""
    if settings.deterministic:
        return _deterministic(waiting, running, settings)
    every_unit: list[Running | Waiting] = [*running, *waiting]
    interactive = [u for u in every_unit if not u.background]
    units = interactive or every_unit

    def order(unit: Running | Waiting) -> tuple[float, int]:
        tokens = max(unit.remaining) if isinstance(unit, Running) else unit.tokens
        return _urgency(tokens, unit.work_at_arrival, work_done, settings), unit.seq

    quantum = min(settings.quantum, settings.max_step_tokens)
    budget, rows_left = settings.max_step_tokens, settings.max_rows
    parts: list[Advance | _Group] = []
    groups: dict[Hashable, _Group] = {}
    # Only batches that can run now hold others back: an interactive request never waits for a state that
    # a paused background batch is computing (it would wait for as long as interactive work exists).
    holds = {hold for batch in running if batch in units for hold in batch.holds}
    background_admitted = 0
    for unit in sorted(units, key=order):
        if isinstance(unit, Running):
            rows = len(unit.remaining)
            if rows > rows_left and parts:
                continue
            tokens = _fit(max(unit.remaining), budget // rows, quantum)
            if tokens == 0:
                if parts:
                    continue
                tokens = min(max(unit.remaining), quantum)
            parts.append(Advance(unit.key, tokens, rows))
            budget -= tokens * rows
            rows_left -= rows
            continue
        if rows_left < 1 or (unit.hold is not None and unit.hold in holds):
            continue
        if unit.background and background_admitted >= settings.background_rows:
            continue
        need = max(1, unit.tokens)
        group = None if unit.alone else groups.get(unit.group)
        if group is not None:
            width = group.tokens if group.chunked else max(group.tokens, need)
            extra = width * (len(group.keys) + 1) - group.tokens * len(group.keys)
            shortest = min(group.shortest, need)
            if extra <= budget and width <= settings.length_ratio * shortest:
                group.keys.append(unit.key)
                group.tokens, group.shortest = width, shortest
                budget -= extra
                rows_left -= 1
                background_admitted += unit.background
                if unit.hold is not None:
                    holds.add(unit.hold)
                continue
        tokens = _fit(need, budget, quantum)
        if tokens == 0:
            if parts:
                continue
            tokens = min(need, quantum)
        group = _Group([unit.key], tokens, need, tokens < need, len(parts))
        parts.append(group)
        if not unit.alone:
            groups[unit.group] = group
        budget -= tokens
        rows_left -= 1
        background_admitted += unit.background
        if unit.hold is not None:
            holds.add(unit.hold)
    return Step(
        tuple(part if isinstance(part, Advance) else Admit(tuple(part.keys), part.tokens) for part in parts)
    )
