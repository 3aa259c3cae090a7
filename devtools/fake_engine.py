"""A dummy engine implementing the server's engine contract (`clef_runtime.engine.contract.DecisionEngine`),
for API tests that run in milliseconds.

Tokens are whitespace-separated words of the rendered text (so tests can build inputs of an exact length).
Answers are pseudo-random but a pure function of the request: the same request always gets the same
answer, different requests (almost surely) different ones, which lets tests check that every response went
to the request that asked for it. A request whose state contains ``FAIL_MARKER`` makes ``decide_encoded``
raise, to test failure isolation; ``delay_s`` makes each engine call slow, to fill queues. The engine loop
drives it through `WholeRequestRunner`: every admitted batch is answered by one ``decide_encoded`` call.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clef_runtime.engine.card import CardedEngine, EngineCard, ModelCard
from clef_runtime.engine.decision import Decision
from clef_runtime.engine.head_records import (
    HeadIdentity,
    HeadInfo,
    HeadNotLoadedError,
    HeadRefusedError,
    check_pin,
)
from clef_runtime.engine.independent import IndependentRequest, merge_decisions
from clef_runtime.engine.loop import WholeRequestRunner
from clef_runtime.options import EngineOptions
from clef_runtime.protocol.errors import InputTooLongError
from clef_runtime.protocol.images import extract_images
from clef_runtime.protocol.systemone import SystemOneRequest, independent_parts, parse_request

FAIL_MARKER = "__fake_engine_fail__"
PREFIX_TOKENS = 5
SUFFIX_TOKENS = 3


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def words(value: Any) -> list[str]:
    """The fake tokenizer: whitespace-separated words of the rendered value."""
    return _render(value).split()


@dataclass(frozen=True)
class FakeRecord:
    input_ids: tuple[int, ...]
    questions: tuple[str, ...]
    truncated_state_tokens: int
    state_end: int

    @property
    def input_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class FakePrepared:
    """What `FakeClef.prepare` returns (the contract's ``PreparedItem``): the request without its images, its
    record, and the images' wire sources as they came."""

    request: SystemOneRequest
    record: FakeRecord
    images: tuple[Any, ...] = ()
    head: HeadIdentity | None = None


def schema_tokens(request: SystemOneRequest) -> int:
    """Tokens of everything but the state: prefix, one per question id, its instructions and criteria."""
    total = PREFIX_TOKENS + SUFFIX_TOKENS
    for qid, question in request.questions.items():
        total += 1 + len(words(qid)) + len(words(question.instructions or qid))
        criteria = getattr(question, "criteria", None)
        if criteria is not None:
            total += len(words(criteria))
    return total


class FakeClef(CardedEngine):
    """Implements the server's engine contract, as ``clef_runtime.engine.clef.Clef`` does."""

    def __init__(
        self,
        *,
        max_length: int = 16384,
        delay_s: float = 0.0,
        name: str = "fake-clef",
        release_date: str | None = None,
        warmup_s: float = 0.0,
    ) -> None:
        self.card = EngineCard(
            model=ModelCard(
                name,
                "Fake engine for API tests (untrained: answers are pseudo-random).",
                release_date,
                untrained=True,
            ),
            options=EngineOptions(max_length=max_length),
            device="cpu",
            weight_mode="fp32",
            compute_dtype="fp32",
            step_tokens=16384,
        )
        self.delay_s = delay_s
        self.warmup_s = warmup_s
        self.batches: list[list[str]] = []  # the states of every engine call, in order
        self._lock = threading.Lock()
        self.calls_in_progress = 0
        self.max_concurrent_calls = 0
        # Heads as the real engine serves them, without weights: a digest per name, the default head first.
        self.heads: dict[str, HeadInfo] = {name: fake_head(name, default=True)}
        self.unloaded: set[str] = set()

    def head_infos(self) -> tuple[HeadInfo, ...]:
        return tuple(self.heads.values())

    def load_head(self, name: str, path: str) -> HeadInfo:
        """Serve ``name`` with a digest made of ``path`` (no weights); a path containing "missing" is refused
        as a directory that is not there."""
        if name in self.heads:
            raise HeadRefusedError("name", f"a head named {name!r} is already served", conflict=True)
        if "missing" in path:
            raise HeadRefusedError("path", f"{path}: not a directory")
        self.heads[name] = fake_head(name, path=path)
        self.unloaded.discard(name)
        return self.heads[name]

    def unload_head(self, name: str) -> HeadInfo:
        if name == self.name:
            raise HeadRefusedError("name", f"{name!r} is the default head", conflict=True)
        if name not in self.heads:
            raise HeadNotLoadedError(name, tuple(self.heads))
        self.unloaded.add(name)
        return self.heads.pop(name)

    def _head_of(self, request: SystemOneRequest) -> HeadIdentity:
        if request.model in self.unloaded:
            raise HeadNotLoadedError(request.model, tuple(self.heads))
        check_pin(self.head_infos(), request.model, request.x_head_digest)
        info = self.heads.get(request.model or "") or self.heads[self.name]
        return info.identity

    def parse(self, request: Any) -> SystemOneRequest:
        body, _ = extract_images(request) if isinstance(request, dict) else (request, [])
        return parse_request(body)

    def prepare(
        self, request: Any, *, max_length: int | None = None
    ) -> FakePrepared | IndependentRequest[FakePrepared]:
        body, sources = extract_images(request) if isinstance(request, dict) else (request, [])
        parsed = parse_request(body)
        head = self._head_of(parsed)
        parts = [
            FakePrepared(part, self.encode(part, max_length=max_length), tuple(sources), head)
            for part in independent_parts(parsed)
        ]
        return parts[0] if len(parts) == 1 else IndependentRequest(parsed, tuple(parts))

    def encode(self, request: Any, *, max_length: int | None = None) -> FakeRecord:
        parsed = self.parse(request)
        limit = self.card.max_length if max_length is None else max_length
        fixed = schema_tokens(parsed)
        if fixed > limit:
            raise InputTooLongError(
                ("questions",),
                f"the questions alone are {fixed} tokens, over max_length {limit}",
                input_tokens=fixed,
                limit=limit,
            )
        state_words = words(parsed.state)
        budget = limit - fixed
        kept = min(len(state_words), budget)
        ids = tuple(range(fixed + kept))
        return FakeRecord(ids, tuple(parsed.questions), len(state_words) - kept, PREFIX_TOKENS + kept)

    def warmup(self, *, max_rows: int = 32) -> None:
        time.sleep(self.warmup_s)

    def runner(self) -> WholeRequestRunner:
        return WholeRequestRunner(self.decide_encoded, lambda item: item.record.input_tokens)

    def cache_stats(self) -> dict[str, int]:
        return {}  # no state cache

    def replica_status(self) -> None:
        return None  # one engine in this process

    def prepare_compute_thread(self) -> None:
        self.compute_thread = threading.current_thread().name

    def decide(self, request: Any) -> dict[str, Any]:
        prepared = self.prepare(request)
        if isinstance(prepared, IndependentRequest):
            return merge_decisions(prepared.request, self.decide_encoded(list(prepared.parts))).body()
        return self.decide_encoded([prepared])[0].body()

    def decide_encoded(self, items: Sequence[FakePrepared]) -> list[Decision]:
        with self._lock:
            self.calls_in_progress += 1
            self.max_concurrent_calls = max(self.max_concurrent_calls, self.calls_in_progress)
            self.batches.append([_render(item.request.state) for item in items])
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            for item in items:
                if FAIL_MARKER in _render(item.request.state):
                    raise RuntimeError("fake engine failure")
            return [self._answer(item.request, item.record, item.head) for item in items]
        finally:
            with self._lock:
                self.calls_in_progress -= 1

    def _answer(
        self, request: SystemOneRequest, record: FakeRecord, head: HeadIdentity | None = None
    ) -> Decision:
        answers: dict[str, Any] = {}
        for qid, question in request.questions.items():
            seed_text = _render(request.state) + "\x00" + qid + "\x00" + question.model_dump_json()
            rng = random.Random(hashlib.sha256(seed_text.encode()).digest())
            answers[qid] = expected_answer(question, rng)
        # This engine has no state cache: every state is a miss (the decision's default report).
        return Decision(
            model=request.model or self.name, answers=answers, input_tokens=record.input_tokens, head=head
        )


def fake_head(name: str, *, default: bool = False, path: str | None = None) -> HeadInfo:
    """A head card with a digest of its name and path (the fake engine has no head files)."""
    digest = hashlib.sha256(f"{name}\x00{path}".encode()).hexdigest()
    source = "release" if default else "api"
    return HeadInfo(name, digest, default, source, path, None, 1_700_000_000.0)


class GatedEngine(FakeClef):
    """The first engine call waits for ``gate`` so that the requests sent meanwhile queue up and go to the
    next call together, as one batch (batching tested without depending on arrival times)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.first_entered = threading.Event()

    def decide_encoded(self, items: Sequence[FakePrepared]) -> list[Decision]:
        if not self.first_entered.is_set():
            self.first_entered.set()
            assert self.gate.wait(20)
        return super().decide_encoded(items)


def _distribution(rng: random.Random, n: int) -> list[float]:
    weights = [rng.random() + 0.01 for _ in range(n)]
    total = sum(weights)
    return [w / total for w in weights]


def expected_answer(question: Any, rng: random.Random) -> dict[str, Any]:
    """A System One answer of the question's type, with values drawn from ``rng``, rounded as the
    reference (4 decimals)."""
    if question.type == "noul":
        return {"type": "noul", "noul": round(rng.random(), 4)}
    if question.type == "choice":
        keys = list(question.criteria)
        probs = _distribution(rng, len(keys))
        best = max(range(len(keys)), key=lambda i: probs[i])
        return {
            "type": "choice",
            "choice": keys[best],
            "confidence": round(probs[best], 4),
            "probabilities": {k: round(p, 4) for k, p in zip(keys, probs, strict=True)},
        }
    levels = list(question.criteria)
    probs = _distribution(rng, len(levels))
    return {
        "type": "score",
        "score": round(sum(i * p for i, p in enumerate(probs)), 4),
        "confidence": round(max(probs), 4),
        "legend": {str(i): level for i, level in enumerate(levels)},
        "probabilities": {str(i): round(p, 4) for i, p in enumerate(probs)},
    }
