"""A dummy engine implementing the server's engine contract (`clef_runtime.engine.contract.DecisionEngine`),
for API tests that run in milliseconds.

Tokens are whitespace-separated words of the rendered text (so tests can build inputs of an exact length).
Answers are pseudo-random but a pure function of the request: the same request always gets the same
answer, different requests (almost surely) different ones, which lets tests check that every response went
to the request that asked for it. A request whose state contains ``FAIL_MARKER`` makes ``decide_encoded``
raise, to test failure isolation; ``delay_s`` makes each engine call slow, to fill queues. The engine loop
drives it through `WholeRequestRunner`: every admitted batch is answered by one ``decide_encoded`` call.

With ``x_explain`` it answers in the real wire shape (see `fake_evidence`), with evidence that is a pure
function of the state, so the pages can be tested against exact spans: its units are the rendered state's
``\\w+`` runs (granularity word), its whitespace-separated tokens (token), or a JSON state's leaf values /
a text state's lines (field); the answer to the j-th question gets the units j, j+1, ... (top_k of them, fewer
when the state has fewer), weighted 1, (k-1)/k, ... 1/k in rank order with every third weight negative, plus
one patch per image (its top-left 16x16 pixels, weight 0.5), strongest first, cut to top_k.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
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
from clef_runtime.protocol.explain import ExplainOptions
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
            return [self._answer(item.request, item.record, item.head, len(item.images)) for item in items]
        finally:
            with self._lock:
                self.calls_in_progress -= 1

    def _answer(
        self,
        request: SystemOneRequest,
        record: FakeRecord,
        head: HeadIdentity | None = None,
        images: int = 0,
    ) -> Decision:
        answers: dict[str, Any] = {}
        for qid, question in request.questions.items():
            seed_text = _render(request.state) + "\x00" + qid + "\x00" + question.model_dump_json()
            rng = random.Random(hashlib.sha256(seed_text.encode()).digest())
            answers[qid] = expected_answer(question, rng)
        explanation = None
        if request.x_explain is not None:
            explanation = explain_record(request.state, request.x_explain)
            units = evidence_units(request.state, request.x_explain.granularity)
            for index, answer in enumerate(answers.values()):
                answer["x_evidence"] = fake_evidence(units, index, images, request.x_explain.top_k)
        # This engine has no state cache: every state is a miss (the decision's default report).
        return Decision(
            model=request.model or self.name,
            answers=answers,
            input_tokens=record.input_tokens,
            head=head,
            explanation=explanation,
        )


# ----------------------------------------------------------------------------------------------- evidence

FAKE_PATCH = (0, 0, 16, 16)
"""The box of every image's fake evidence: its top-left 16x16 pixels."""
FAKE_PATCH_WEIGHT = 0.5
UNIT_PATTERNS = {"word": re.compile(r"\w+"), "token": re.compile(r"\S+"), "line": re.compile(r"[^\n]+")}


@dataclass(frozen=True)
class FakeUnit:
    """One unit of evidence: ``start``/``end`` are Python str (code point) offsets into the rendered state,
    ``path`` the JSON pointer of the member it lies in (None for a text state); ``key``: a JSON key."""

    start: int
    end: int
    text: str
    path: str | None
    key: bool = False


def _pointer(parent: str, key: str | int) -> str:
    return parent + "/" + str(key).replace("~", "~0").replace("/", "~1")


def rendered_members(value: Any, pointer: str = "", at: int = 0) -> tuple[str, list[FakeUnit]]:
    """``_render(value)`` of a JSON value, with the range of every key (its member's pointer) and every
    leaf value (inside a string's quotes), each as a unit."""
    if isinstance(value, dict):
        text, members = "{", []
        for key in sorted(value):
            if text != "{":
                text += ","
            key_text = json.dumps(key, ensure_ascii=False)
            child = _pointer(pointer, key)
            members.append(
                FakeUnit(at + len(text) + 1, at + len(text) + len(key_text) - 1, key, child, key=True)
            )
            text += key_text + ":"
            inner, inner_members = rendered_members(value[key], child, at + len(text))
            text += inner
            members += inner_members
        return text + "}", members
    if isinstance(value, list):
        text, members = "[", []
        for index, item in enumerate(value):
            if index:
                text += ","
            inner, inner_members = rendered_members(item, _pointer(pointer, index), at + len(text))
            text += inner
            members += inner_members
        return text + "]", members
    text = json.dumps(value, ensure_ascii=False)
    quoted = 1 if isinstance(value, str) else 0
    return text, [FakeUnit(at + quoted, at + len(text) - quoted, text[quoted : len(text) - quoted], pointer)]


def evidence_units(state: Any, granularity: str) -> list[FakeUnit]:
    """The fake's units of ``state`` in text order: ``\\w+`` runs (word), whitespace-separated tokens
    (token), or leaf values of a JSON state and lines of a text state (field); for a JSON state each with
    the pointer of the member it starts in."""
    text = _render(state)
    if isinstance(state, str):
        pattern = UNIT_PATTERNS["line" if granularity == "field" else granularity]
        return [FakeUnit(m.start(), m.end(), m.group(), None) for m in pattern.finditer(text)]
    rendered, members = rendered_members(state)
    assert rendered == text, "the fake's JSON rendering drifted from _render"
    if granularity == "field":
        return [m for m in members if not m.key and m.end > m.start]
    spans = UNIT_PATTERNS[granularity].finditer(text)
    return [FakeUnit(m.start(), m.end(), m.group(), _member_at(members, m.start())) for m in spans]


def _member_at(members: list[FakeUnit], offset: int) -> str:
    """The pointer of the innermost key or leaf range holding ``offset`` (the root, "", when none does)."""
    holding = [m for m in members if m.start <= offset < m.end]
    return holding[-1].path if holding and holding[-1].path is not None else ""


def fake_evidence(units: Sequence[FakeUnit], index: int, images: int, top_k: int) -> list[dict[str, Any]]:
    """The ``x_evidence`` of the ``index``-th answer: units ``index``, ``index + 1``, ... weighted
    ``(top_k - rank) / top_k``, every third negative, and one patch per image, strongest first, at most
    ``top_k``."""
    chosen = list(units[index : index + top_k]) if index < len(units) else list(units[:top_k])
    items: list[dict[str, Any]] = []
    for rank, unit in enumerate(chosen):
        weight = round((top_k - rank) / top_k, 4) * (-1 if rank % 3 == 2 else 1)
        item: dict[str, Any] = {"text": unit.text, "start": unit.start, "end": unit.end, "weight": weight}
        if unit.path is not None:
            item["path"] = unit.path
        items.append(item)
    items += [{"image": i, "box": list(FAKE_PATCH), "weight": FAKE_PATCH_WEIGHT} for i in range(images)]
    items.sort(key=lambda item: -abs(item["weight"]))
    return items[:top_k]


#: The method the fake engine's explanations name.
FAKE_EXPLAIN_METHOD = "fake"


def explain_record(state: Any, options: ExplainOptions) -> dict[str, Any]:
    """The body's ``x_explain``: the fake method's name, the options, and the rendered JSON state."""
    record: dict[str, Any] = {
        "method": FAKE_EXPLAIN_METHOD,
        "granularity": options.granularity,
        "top_k": options.top_k,
        "weights": "fake evidence: the k units after the question's index, weight falling with rank, "
        "every third negative (not an attribution)",
    }
    if not isinstance(state, str):
        record["state_text"] = _render(state)
    return record


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
