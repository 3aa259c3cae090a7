"""Many heads on one backbone: tuned heads picked by a request's ``model``, the release head for any other
model, one state cache for all of them, batches that mix heads, a bare ``--head DIR`` replacing the release
head, a head's own calibration, and clear errors for a bad ``--head``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from clef_runtime import Clef
from clef_runtime.engine.executor import head_inputs
from clef_runtime.model.head import JointSchemaHead, probabilities
from clef_runtime.options import EngineOptions, OptionsError
from tests.engine.head_dirs import write_tuned_head
from tests.helpers import run_cli

STATE = "the invoice was charged twice and the customer wants a refund " * 3


def request(state: str = STATE, model: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "state": state,
        "questions": {
            "billing": {"type": "noul", "instructions": "is this about billing?"},
            "team": {"type": "choice", "criteria": {"pay": "payments", "eng": "engineering", "ops": None}},
            "urgency": {"type": "score", "criteria": ["low", "mid", "high"]},
        },
        **extra,
    }
    if model is not None:
        body["model"] = model
    return body


@pytest.fixture(scope="module")
def head_dirs(tiny: Clef, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {name: write_tuned_head(tiny.path, root / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def served(head_dirs: dict[str, Path]) -> Clef:
    return Clef.load("tiny", dtype="fp32", head=tuple(f"{name}={path}" for name, path in head_dirs.items()))


def reference_probabilities(tiny: Clef, head_dir: Path | None, body: dict[str, Any]) -> list[list[float]]:
    """The head in ``head_dir`` (None: the release head) scoring the backbone rows of ``body`` directly."""
    prepared = tiny.prepare({key: value for key, value in body.items() if key != "model"})
    (hidden,) = tiny.hidden_rows([prepared])
    head = tiny.model.head if head_dir is None else JointSchemaHead.from_files(head_dir)
    layout, lexical = head_inputs(prepared.record, tiny.lexical)
    logits = head.score(hidden, layout, lexical)
    return [p.tolist() for p in probabilities(logits, layout)]


def assert_close(got: list[list[float]], want: list[list[float]], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        assert max(abs(x - y) for x, y in zip(g, w, strict=True)) <= tol, (g, w)


def max_gap(one: list[list[float]], other: list[list[float]]) -> float:
    return max(abs(x - y) for a, b in zip(one, other, strict=True) for x, y in zip(a, b, strict=True))


def test_a_request_picks_a_head_by_its_model_and_any_other_model_gets_the_release_head(
    tiny: Clef, served: Clef, head_dirs: dict[str, Path]
) -> None:
    for name, path in head_dirs.items():
        (got,) = served.probabilities_encoded([served.prepare(request(model=name))])
        assert_close(got, reference_probabilities(tiny, path, request()))
    release = reference_probabilities(tiny, None, request())
    for model in (None, "clef-flash", "jev-latest"):
        (got,) = served.probabilities_encoded([served.prepare(request(model=model))])
        assert_close(got, release)
    # The tuned heads really answer differently (else this test could not fail).
    (tuned,) = served.probabilities_encoded([served.prepare(request(model="a"))])
    assert max_gap(tuned, release) > 1e-3
    assert served.decide(request(model="a"))["model"] == "a"


def test_one_batch_mixes_heads_and_each_row_gets_its_own(served: Clef) -> None:
    models = ["a", None, "b", "a"]
    states = [f"{STATE} case {i}" for i in range(len(models))]
    alone = [
        served.probabilities_encoded([served.prepare(request(s, m))])[0]
        for s, m in zip(states, models, strict=True)
    ]
    served.clear_cache()
    together = served.probabilities_encoded(
        [served.prepare(request(s, m)) for s, m in zip(states, models, strict=True)]
    )
    assert served.last_timings.batch_size == 4
    for got, want in zip(together, alone, strict=True):
        assert_close(got, want)


def test_the_state_cache_is_shared_by_every_head(served: Clef) -> None:
    served.clear_cache()
    state = STATE + " shared across heads"
    first = served.decide_encoded([served.prepare(request(state, "a"))])[0]
    assert first.cache.status == "miss"
    for model in ("b", None, "a"):
        prepared = served.prepare(request(state, model))
        decision = served.decide_encoded([prepared])[0]
        assert decision.cache.status == "hit", model
        # Only the schema after the cached state went through the backbone.
        assert decision.timings.backbone_tokens == prepared.record.input_tokens - prepared.record.state_end


def test_a_bare_head_directory_replaces_the_release_head(tiny: Clef, head_dirs: dict[str, Path]) -> None:
    clef = Clef.load("tiny", dtype="fp32", head=str(head_dirs["b"]))
    want = reference_probabilities(tiny, head_dirs["b"], request())
    for model in (None, "anything"):
        (got,) = clef.probabilities_encoded([clef.prepare(request(model=model))])
        assert_close(got, want)
    (default,) = clef.head_infos()  # no named head: the directory replaced the release's
    assert default.default and default.name == clef.name and default.path == str(head_dirs["b"])


def test_a_head_with_its_own_calibration_uses_it_and_the_others_do_not(
    tiny: Clef, head_dirs: dict[str, Path], tmp_path: Path
) -> None:
    calibrated = write_tuned_head(tiny.path, tmp_path / "c", seed=3)
    calibration = {"version": 1, "temperatures": {"noul": 2.5, "choice": 2.5, "score": 2.5}}
    (calibrated / "calibration.json").write_text(json.dumps(calibration))
    clef = Clef.load("tiny", dtype="fp32", head=(f"c={calibrated}", f"a={head_dirs['a']}"))
    answer = clef.decide(request(model="c"))
    label = answer["x_calibration"]
    assert label.startswith("calibration.json@sha256:")
    raw = reference_probabilities(tiny, calibrated, request())
    (got,) = clef.probabilities_encoded([clef.prepare(request(model="c"))])
    assert max_gap(got, raw) > 1e-3  # flattened by T = 2.5
    for g, r in zip(got, raw, strict=True):
        scaled = [math.exp(math.log(p) / 2.5) for p in r]
        assert_close([g], [[s / sum(scaled) for s in scaled]], 1e-6)
    assert "x_calibration" not in clef.decide(request(model="a"))
    assert "x_calibration" not in clef.decide(request())
    assert {info.name: info for info in clef.head_infos()}["c"].calibration["label"] == label  # type: ignore[index]


def test_head_infos_name_each_head_with_its_digest(served: Clef, head_dirs: dict[str, Path]) -> None:
    infos = {info.name: info for info in served.head_infos()}
    assert list(infos) == [served.name, "a", "b"]  # the default head first
    assert infos[served.name].default and infos[served.name].source == "release"
    assert infos["a"].path == str(head_dirs["a"]) and infos["a"].source == "--head"
    digests = {info.digest for info in infos.values()}
    assert len(digests) == 3 and all(len(digest) == 64 for digest in digests)


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        (("a=/nonexistent/head",), "--head a=/nonexistent/head: not a directory"),
        (("x=DIR", "x=DIR"), "given more than once"),
        (("DIR", "DIR"), "at most one head without a name"),
        (("bad name!=DIR",), "the name must be"),
        (("a=",), "no directory"),
        (("=DIR",), "the name before '=' is empty"),
    ],
)
def test_bad_head_options_are_refused_naming_the_flag(
    heads: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    heads = tuple(h.replace("DIR", str(tmp_path)) for h in heads)
    with pytest.raises(OptionsError, match="--head") as caught:
        EngineOptions(head=heads) if "nonexistent" not in heads[0] else Clef.load("tiny", head=heads)
    assert message in str(caught.value)


def test_a_head_for_another_backbone_is_refused_before_serving(tmp_path: Path, tiny: Clef) -> None:
    config = json.loads((tiny.path / "joint_head_config.json").read_text())
    wide = {**config, "hidden_size": config["hidden_size"] * 2}
    other = JointSchemaHead(**wide)
    from safetensors.torch import save_file

    (tmp_path / "w").mkdir()
    save_file(
        {k: v.contiguous() for k, v in other.state_dict().items()},
        str(tmp_path / "w" / "joint_head.safetensors"),
    )
    (tmp_path / "w" / "joint_head_config.json").write_text(json.dumps(wide))
    with pytest.raises(OptionsError, match="hidden_size"):
        Clef.load("tiny", dtype="fp32", head=f"w={tmp_path / 'w'}")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "joint_head_config.json").write_text("{")
    with pytest.raises(OptionsError, match=r"joint_head_config\.json"):
        Clef.load("tiny", dtype="fp32", head=f"w={tmp_path / 'broken'}")


def test_clef_decide_takes_a_head_by_flag_and_by_variable(
    tiny: Clef, head_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps(request()) + "\n")
    by_flag = run_cli("decide", "--model", "tiny", "--head", str(head_dirs["a"]), str(source))
    assert by_flag.returncode == 0, by_flag.stderr
    clef = Clef.load("tiny", dtype="fp32", head=str(head_dirs["a"]))
    assert json.loads(by_flag.stdout)["answers"] == clef.decide(request())["answers"]
    monkeypatch.setenv("CLEF_HEAD", str(head_dirs["a"]))
    by_variable = run_cli("decide", "--model", "tiny", str(source))
    assert by_variable.returncode == 0 and by_variable.stdout == by_flag.stdout
    monkeypatch.delenv("CLEF_HEAD")
    plain = run_cli("decide", "--model", "tiny", str(source))
    assert json.loads(plain.stdout)["answers"] != json.loads(by_flag.stdout)["answers"]
    bad = run_cli("decide", "--model", "tiny", "--head", str(tmp_path / "missing"), str(source))
    assert bad.returncode == 2 and "--head" in bad.stderr
