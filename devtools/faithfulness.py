"""How faithful ``x_explain``'s evidence is: ERASER's comprehensiveness and sufficiency, and the known words.

On a head tuned (the real ``clef tune`` code path) on a task whose label is decided by known words
(`devtools.explain_tasks`), for each case of a holdout set and each attribution method:

1. the engine decides it with ``x_explain {"top_k": k, "granularity": "word"}``; the evidence words are its
   answer's ``x_evidence`` (located by their character offsets);
2. *comprehensiveness*: p(answer) - p(answer | the evidence words removed): large when the answer depended
   on them; *sufficiency*: p(answer) - p(answer | only the evidence words kept): small (or negative) when they
   alone carry it. Both are compared with the same figures for random word sets of the same size (the mean
   over ``draws`` seeded sets per case): a case is a *win* when the evidence removes strictly more, or keeps
   strictly more, than the random sets do;
3. *known-word recall@k*: the share of the case's inserted keywords that are among the evidence words.

The win rates and the recall are taken over the *rationale cases*: those answered with the case's own label
when that label has keywords (a noul's true side, every choice option), where the words that decide the
answer are known. A noul's false side is the absence of keywords: no words decide it, so removing "its"
evidence is as arbitrary as removing random words. The rates over every case are reported beside them.

The row ``random`` (evidence = k random words of the case, another seeded draw) is the negative control: the
same figures must not pass the thresholds a faithful method passes.

Every probability is the engine's own answer to the edited state (the head served by name), so the
measurement goes through the same code as a user's request.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.explain_tasks import KeywordTask, answered_label, label_probability, write_cases

__all__ = [
    "RANDOM",
    "CaseEvidence",
    "Thresholds",
    "explain_cases",
    "random_evidence",
    "score_method",
    "tune_task",
]

#: The negative control's row name.
RANDOM = "random"


@dataclass(frozen=True)
class CaseEvidence:
    """One holdout case as decided with ``x_explain``: its words (split at spaces), its label, the label the
    engine answered with its probability, and the indexes of the evidence words, strongest first."""

    words: tuple[str, ...]
    label: Any
    answered: Any
    probability: float
    evidence: tuple[int, ...]


@dataclass(frozen=True)
class Thresholds:
    """What a faithful method reaches on a task's rationale cases: win rates and known-word recall@k."""

    comprehensiveness_win: float = 0.55
    sufficiency_win: float = 0.7
    keyword_recall: float = 0.6
    #: The evidence's mean comprehensiveness over the random sets' mean, at least.
    comprehensiveness_ratio: float = 2.0

    def failures(self, row: Mapping[str, Any]) -> list[str]:
        """The figures of ``row`` (a `score_method` result) below their threshold, by name."""
        wanted = {
            "comprehensiveness_win": self.comprehensiveness_win,
            "sufficiency_win": self.sufficiency_win,
            "keyword_recall": self.keyword_recall,
        }
        failed = [name for name, least in wanted.items() if row[name] is None or row[name] < least]
        comp, random_comp = row["comprehensiveness"], row["comprehensiveness_random"]
        if comp is None or random_comp is None or comp < self.comprehensiveness_ratio * max(random_comp, 0.0):
            failed.append("comprehensiveness_ratio")
        return failed


def tune_task(clef: Any, task: KeywordTask, directory: Path, train: int, holdout: int) -> dict[str, Any]:
    """Tunes a head on ``train`` cases of ``task`` (seed 1) with every ``clef tune`` default, checked on
    ``holdout`` other cases (seed 2), into ``directory``/head; returns the tuning report. ``clef``: the loaded
    model the head is tuned for."""
    from clef_runtime.cli import build_parser
    from clef_runtime.evaluation.cases import load_cases
    from clef_runtime.tuning.arguments import TuneSettings
    from clef_runtime.tuning.command import TuneJob, tune

    train_file = write_cases(directory / "train.jsonl", task.cases(train, 1, "t"))
    holdout_file = write_cases(directory / "holdout.jsonl", task.cases(holdout, 2, "h"))
    out = directory / "head"
    args = build_parser().parse_args(
        ["tune", str(train_file), "--holdout", str(holdout_file), "--out", str(out)]
    )
    job = TuneJob(
        cases=load_cases(train_file),
        cases_path=str(train_file),
        out=out,
        settings=TuneSettings.from_args(args),
        holdout=load_cases(holdout_file),
        holdout_path=str(holdout_file),
        show_progress=False,
        force=True,
    )
    return tune(clef, job)


def _request(model: str, task: KeywordTask, state: str) -> dict[str, Any]:
    return {"model": model, "state": state, "questions": {task.question_id: dict(task.question)}}


def _evidence_indexes(words: Sequence[str], items: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """The word indexes of ``x_evidence`` items, by their start offsets in the space-joined words."""
    starts: dict[int, int] = {}
    offset = 0
    for index, word in enumerate(words):
        starts[offset] = index
        offset += len(word) + 1
    indexes = []
    for item in items:
        found = starts.get(item["start"])
        if found is None or words[found] != item["text"]:
            raise ValueError(f"evidence {item!r} is not a word of the state")
        indexes.append(found)
    return tuple(indexes)


def explain_cases(
    clef: Any, model: str, task: KeywordTask, cases: Sequence[Mapping[str, Any]], top_k: int
) -> list[CaseEvidence]:
    """Each case decided by ``clef`` (head ``model``) with word evidence, ``top_k`` words."""
    explain = {"top_k": top_k, "granularity": "word"}
    bodies = clef.decide_many([_request(model, task, case["state"]) for case in cases], explain=explain)
    decided = []
    for case, body in zip(cases, bodies, strict=True):
        answer = body["answers"][task.question_id]
        words = tuple(case["state"].split(" "))
        answered, probability = answered_label(answer)
        evidence = _evidence_indexes(words, answer["x_evidence"])
        decided.append(
            CaseEvidence(words, case["expected"][task.question_id], answered, probability, evidence)
        )
    return decided


def random_evidence(decided: Sequence[CaseEvidence], top_k: int, seed: int) -> list[CaseEvidence]:
    """The negative control: each case with ``top_k`` random words (seeded) as its evidence."""
    rng = random.Random(seed)
    return [
        CaseEvidence(
            case.words,
            case.label,
            case.answered,
            case.probability,
            tuple(rng.sample(range(len(case.words)), min(top_k, len(case.words)))),
        )
        for case in decided
    ]


def _removed(words: Sequence[str], chosen: set[int]) -> str:
    return " ".join(word for index, word in enumerate(words) if index not in chosen)


def _kept(words: Sequence[str], chosen: set[int]) -> str:
    return " ".join(word for index, word in enumerate(words) if index in chosen)


def _edits(case: CaseEvidence, sets: Sequence[set[int]]) -> list[str]:
    """The edited states of ``case``: for each word set, the state without it, then only it."""
    return [edit(case.words, chosen) for chosen in sets for edit in (_removed, _kept)]


def score_method(
    clef: Any,
    model: str,
    task: KeywordTask,
    decided: Sequence[CaseEvidence],
    *,
    draws: int,
    seed: int,
) -> dict[str, Any]:
    """The faithfulness figures of one method's evidence ``decided`` (see the module docstring): per case,
    the evidence's and ``draws`` random sets' comprehensiveness and sufficiency, then the win rates, means
    and the known-word recall@k (on the rationale cases). The random sets of a case depend only on ``seed``
    and the case's number (every method is compared with the same ones)."""
    comprehensiveness, sufficiency, random_comp, random_suff = [], [], [], []
    comp_wins: list[bool] = []
    suff_wins: list[bool] = []
    rationale: list[bool] = []
    recall = []
    for number, case in enumerate(decided):
        rng = random.Random(seed * 1_000_003 + number)
        size = len(case.evidence)
        sets = [set(case.evidence)] + [set(rng.sample(range(len(case.words)), size)) for _ in range(draws)]
        bodies = clef.decide_many([_request(model, task, state) for state in _edits(case, sets)])
        drops = [
            case.probability - label_probability(body["answers"][task.question_id], case.answered)
            for body in bodies
        ]
        comp, suff = drops[0], drops[1]
        mean_comp = statistics.fmean(drops[2::2])
        mean_suff = statistics.fmean(drops[3::2])
        comprehensiveness.append(comp)
        sufficiency.append(suff)
        random_comp.append(mean_comp)
        random_suff.append(mean_suff)
        comp_wins.append(comp > mean_comp)
        suff_wins.append(suff < mean_suff)
        keywords = task.keywords[case.answered]
        rationale.append(bool(case.answered == case.label and keywords))
        if rationale[-1]:
            decisive = [index for index, word in enumerate(case.words) if word in keywords]
            found = sum(index in case.evidence for index in decisive)
            recall.append(found / len(decisive) if decisive else 1.0)
    count = len(decided)
    on_rationale = [index for index, flag in enumerate(rationale) if flag]
    return {
        "cases": count,
        "accuracy": _rate(sum(case.answered == case.label for case in decided), count),
        "rationale_cases": len(on_rationale),
        "comprehensiveness_win": _rate(sum(comp_wins[i] for i in on_rationale), len(on_rationale)),
        "sufficiency_win": _rate(sum(suff_wins[i] for i in on_rationale), len(on_rationale)),
        "comprehensiveness_win_all": _rate(sum(comp_wins), count),
        "sufficiency_win_all": _rate(sum(suff_wins), count),
        "comprehensiveness": _mean([comprehensiveness[i] for i in on_rationale]),
        "comprehensiveness_random": _mean([random_comp[i] for i in on_rationale]),
        "sufficiency": _mean([sufficiency[i] for i in on_rationale]),
        "sufficiency_random": _mean([random_suff[i] for i in on_rationale]),
        "keyword_recall": _mean(recall),
        "evidence_words": _mean([len(case.evidence) for case in decided]),
    }


def _rate(count: int, total: int) -> float | None:
    return round(count / total, 4) if total else None


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None
