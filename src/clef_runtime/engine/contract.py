"""What the server needs of an engine, and nothing more: the contract `clef_runtime.engine.clef.Clef`, the
Ray Serve ingress's engine (`clef_runtime.scale.ray_serve.IngressEngine`) and the tests' fake engine all
implement.

The server never reaches past this protocol (no optional methods looked up with ``getattr``), so a new
engine, or a fake one, is complete when it has every member below. ``tests/server/test_engine_contract.py``
checks that every implementation has every member with the same parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from clef_runtime.engine.card import EngineCard
from clef_runtime.engine.head_records import HeadInfo
from clef_runtime.engine.independent import IndependentRequest, merge_decisions, submit_parts
from clef_runtime.engine.loop import StepRunner
from clef_runtime.engine.policy import DEFAULT_STEP_ROWS
from clef_runtime.protocol.systemone import SystemOneRequest

__all__ = [
    "DecisionEngine",
    "EncodedRow",
    "EngineCard",
    "IndependentRequest",
    "PreparedItem",
    "ReplicaReport",
    "ReplicaStatus",
    "merge_decisions",
    "submit_parts",
]


class EncodedRow(Protocol):
    """The token accounting of an encoded request (``EncodedRecord`` has it)."""

    @property
    def input_tokens(self) -> int:
        """Tokens the model reads (``usage.input_tokens``)."""
        ...

    @property
    def truncated_state_tokens(self) -> int:
        """State tokens cut to fit the token limit (0 when nothing was cut)."""
        ...


class PreparedItem(Protocol):
    """A validated, encoded request, ready for the engine's runner (``PreparedRequest``)."""

    @property
    def request(self) -> SystemOneRequest:
        """The parsed request (images taken out)."""
        ...

    @property
    def record(self) -> EncodedRow:
        """Its encoded row."""
        ...


# Covariant: the protocol only hands PreparedT out (from `prepare`); an engine of a narrower prepared type
# is a DecisionEngine[PreparedItem] too.
PreparedT = TypeVar("PreparedT", bound=PreparedItem, covariant=True)


@dataclass(frozen=True)
class ReplicaReport:
    """One model replica of a scale-out engine, as of its latest answer."""

    replica: str
    """Its id (what responses name in ``X-Clef-Replica``)."""
    pid: int
    """Its process id, on its own machine."""
    cache: Mapping[str, int]
    """Its state-cache counters (`DecisionEngine.cache_stats` of its engine)."""


@dataclass(frozen=True)
class ReplicaStatus:
    """The model replicas behind a scale-out engine."""

    up: int
    """Replicas running now."""
    target: int
    """Replicas there should be."""
    reports: tuple[ReplicaReport, ...] = ()
    """The running replicas that have answered at least once."""


class DecisionEngine(Protocol[PreparedT]):
    """A loaded model as the server uses it. ``PreparedT``: the engine's own prepared-request type; the
    server passes back exactly what `prepare` returned."""

    card: EngineCard
    """What the engine is: the model (name, description, release date, untrained), its options, device,
    weights, compute dtype, step budget and calibration (``/v1/models``, ``/status.json``, the pages)."""

    @property
    def name(self) -> str:
        """The model name answered in ``model`` and listed by ``/v1/models`` (``card.model.name``)."""
        ...

    @property
    def step_tokens(self) -> int:
        """The token budget of one engine step (``card.step_tokens``)."""
        ...

    def prepare(
        self, request: Any, *, max_length: int | None = None
    ) -> PreparedT | IndependentRequest[PreparedT]:
        """Validate and encode one JSON-decoded System One body (images included) without touching the
        model. An ``x_independent`` request with several questions comes back as an `IndependentRequest`
        whose parts (one per question) the server submits with `submit_parts`. Raises
        ``RequestValidationError`` (422) or ``InputTooLongError`` (413)."""
        ...

    def head_infos(self) -> tuple[HeadInfo, ...]:
        """Every head served now, the default head first (``GET /v1/heads``, ``/v1/models``): a request whose
        ``model`` names a head is answered by it, any other ``model`` by the default head."""
        ...

    def load_head(self, name: str, path: str) -> HeadInfo:
        """Load the head in directory ``path`` (on the server's machine) and serve it as ``name``. Blocks
        while its weights load (the server calls it off the event loop); requests go on meanwhile. Raises
        ``HeadRefusedError`` naming the field at fault (a conflict for a name taken, or an engine whose
        heads are fixed)."""
        ...

    def unload_head(self, name: str) -> HeadInfo:
        """Stop serving the named head ``name``; requests already prepared with it finish on it. Raises
        ``HeadNotLoadedError`` for a name not served, ``HeadRefusedError`` for the default head."""
        ...

    def runner(self) -> StepRunner:
        """The step runner the server's `clef_runtime.engine.loop.EngineLoop` drives on its engine thread: it
        takes exactly what `prepare` returned and answers with `clef_runtime.engine.decision.Decision`
        records."""
        ...

    def warmup(self, *, max_rows: int = DEFAULT_STEP_ROWS) -> None:
        """Run one small request so the first real one does not pay for lazy initialisation (an engine that
        compiles per shape also runs the step shapes it can form with at most ``max_rows`` rows)."""
        ...

    def cache_stats(self) -> Mapping[str, int]:
        """Counters exported on ``/metrics`` as ``clef_cache_*`` and shown by ``/status.json`` (empty for an
        engine without a cache; a scale-out engine sums its running replicas'). May block on a network call:
        the server calls it off the event loop."""
        ...

    def replica_status(self) -> ReplicaStatus | None:
        """The model replicas behind this engine (``/ready``, ``/status.json``, per-replica ``/metrics``), or
        None for an engine that computes in this process. May block: the server calls it off the event
        loop."""
        ...

    def prepare_compute_thread(self) -> None:
        """Called once on the thread that will run every engine step, before the first (the CPU engine
        starts that thread's OpenMP team there)."""
        ...
