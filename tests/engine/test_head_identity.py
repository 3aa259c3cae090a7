"""Heads as named weights: each head's digest (computed here independently from its files), the head that
answered on every decision, heads loaded and unloaded at run time (a request admitted before an unload
finishes on its head, one prepared after is refused), digests pinned by a request, and the names a head
may not take."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from clef_runtime import Clef
from clef_runtime.engine.head_records import HeadChangedError, HeadNotLoadedError, HeadRefusedError
from clef_runtime.options import OptionsError
from tests.engine.head_dirs import write_tuned_head
from tests.engine.test_heads import assert_close, max_gap, reference_probabilities, request


def manifest_digest(directory: Path, calibration: Path | None = None) -> str:
    """The documented digest, recomputed from the files with hashlib alone."""

    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    weights, config = sha(directory / "joint_head.safetensors"), sha(directory / "joint_head_config.json")
    text = f"weights {weights}\nconfig {config}\n"
    if calibration is not None:
        text += f"calibration {sha(calibration)}\n"
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def engine() -> Clef:
    """An engine of its own: these tests load and unload heads on it."""
    return Clef.load("tiny", dtype="fp32")


@pytest.fixture(scope="module")
def head_dir(tiny: Clef, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tuned_head(tiny.path, tmp_path_factory.mktemp("identity") / "h", seed=7)


def infos(engine: Clef) -> dict[str, Any]:
    return {info.name: info for info in engine.head_infos()}


def test_the_release_head_and_a_tuned_head_are_named_by_the_digest_of_their_files(
    engine: Clef, head_dir: Path
) -> None:
    release = infos(engine)[engine.name]
    assert release.default and release.digest == manifest_digest(engine.path)
    info = engine.load_head("ident-a", head_dir)
    try:
        assert info.digest == manifest_digest(head_dir) != release.digest
        decision = engine.decide_encoded([engine.prepare(request(model="ident-a"))])[0]
        assert (
            decision.head is not None
            and decision.head.name == "ident-a"
            and decision.head.digest == info.digest
        )
        assert decision.body()["x_head"] == {"name": "ident-a", "digest": info.digest}
        other = engine.decide_encoded([engine.prepare(request(model="jev-latest"))])[0]
        assert (
            other.head is not None and other.head.name == engine.name and other.head.digest == release.digest
        )
    finally:
        engine.unload_head("ident-a")


def test_a_digest_covers_the_config_and_the_calibration(engine: Clef, head_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(head_dir, copy)
    (copy / "joint_head_config.json").write_text(
        json.dumps(json.loads((head_dir / "joint_head_config.json").read_text()), indent=4)
    )
    calibrated = tmp_path / "calibrated"
    shutil.copytree(head_dir, calibrated)
    calibration = calibrated / "calibration.json"
    calibration.write_text(json.dumps({"version": 1, "temperatures": {"noul": 2.0}}))
    try:
        digests = {
            name: engine.load_head(name, path).digest
            for name, path in (("ident-orig", head_dir), ("ident-copy", copy), ("ident-cal", calibrated))
        }
        assert len(set(digests.values())) == 3
        assert digests["ident-cal"] == manifest_digest(calibrated, calibration)
    finally:
        for name in ("ident-orig", "ident-copy", "ident-cal"):
            engine.unload_head(name)


def test_a_head_loaded_at_run_time_answers_by_its_name_and_is_refused_once_unloaded(
    tiny: Clef, engine: Clef, head_dir: Path
) -> None:
    engine.load_head("ident-live", head_dir)
    (got,) = engine.probabilities_encoded([engine.prepare(request(model="ident-live"))])
    assert_close(got, reference_probabilities(tiny, head_dir, request()))
    admitted = engine.prepare(request(model="ident-live"))  # admitted before the unload
    engine.unload_head("ident-live")
    with pytest.raises(HeadNotLoadedError) as caught:
        engine.prepare(request(model="ident-live"))
    assert caught.value.name == "ident-live" and engine.name in caught.value.served
    # The admitted request finishes on the head it was admitted with, not the default head.
    (decision,) = engine.decide_encoded([admitted])
    assert decision.head is not None and decision.head.name == "ident-live"
    assert_close(decision.probabilities or [], reference_probabilities(tiny, head_dir, request()))
    assert max_gap(decision.probabilities or [], reference_probabilities(tiny, None, request())) > 1e-3
    # Any other unknown name is still answered by the default head (SDKs send jev-latest).
    assert engine.decide_encoded([engine.prepare(request(model="gpt-4o"))])[0].head.name == engine.name  # type: ignore[union-attr]
    # Loading it again serves it again.
    engine.load_head("ident-live", head_dir)
    assert engine.decide_encoded([engine.prepare(request(model="ident-live"))])[0].head.name == "ident-live"  # type: ignore[union-attr]
    engine.unload_head("ident-live")


def test_a_request_pins_a_head_by_its_digest(engine: Clef, head_dir: Path) -> None:
    info = engine.load_head("ident-pin", head_dir)
    release = infos(engine)[engine.name].digest
    try:
        assert (
            engine.prepare(request(model="ident-pin", x_head_digest=info.digest[:12])).head.digest
            == info.digest
        )  # type: ignore[union-attr]
        assert engine.prepare(request(model=engine.name, x_head_digest=release)).head.default  # type: ignore[union-attr]
        with pytest.raises(HeadChangedError) as changed:
            engine.prepare(request(model="ident-pin", x_head_digest=release[:12]))
        assert changed.value.served == info.digest and changed.value.pinned == release[:12]
        # With a pin, a name that is no head is refused instead of answered by the default head.
        with pytest.raises(HeadNotLoadedError):
            engine.prepare(request(model="jev-latest", x_head_digest=release[:12]))
    finally:
        engine.unload_head("ident-pin")


def refused(engine: Clef, name: str, path: Path) -> HeadRefusedError:
    with pytest.raises(HeadRefusedError) as caught:
        engine.load_head(name, path)
    return caught.value


def test_names_a_head_may_not_take_and_the_default_head_stays(
    engine: Clef, head_dir: Path, tmp_path: Path
) -> None:
    own = refused(engine, engine.name, head_dir)
    assert (own.field, own.conflict) == ("name", False) and "model's own name" in own.message
    engine.load_head("ident-once", head_dir)
    try:
        taken = refused(engine, "ident-once", head_dir)
        assert (taken.field, taken.conflict) == ("name", True) and "already served" in taken.message
    finally:
        engine.unload_head("ident-once")
    assert refused(engine, "bad name", head_dir).field == "name"
    missing = refused(engine, "ident-missing", tmp_path / "nothing")
    assert missing.field == "path" and "not a directory" in missing.message
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "joint_head_config.json").write_text(
        (head_dir / "joint_head_config.json").read_text()
    )
    assert "joint_head.safetensors" in refused(engine, "ident-half", tmp_path / "half").message
    with pytest.raises(HeadRefusedError, match="default head") as default:
        engine.unload_head(engine.name)
    assert default.value.conflict
    with pytest.raises(HeadNotLoadedError):
        engine.unload_head("never-loaded")
    assert list(infos(engine)) == [engine.name]


def test_a_head_named_as_the_model_is_refused_at_startup(head_dir: Path) -> None:
    with pytest.raises(OptionsError, match=r"--head tiny=.*model's own name"):
        Clef.load("tiny", head=f"tiny={head_dir}")


def test_loading_a_head_never_waits_for_the_model(engine: Clef, head_dir: Path) -> None:
    """Requests go on while a head loads: loading reads and moves its weights without the model lock (held
    here for the whole load, as a long step would hold it)."""
    loaded: list[Any] = []
    with engine._model_lock:
        worker = threading.Thread(target=lambda: loaded.append(engine.load_head("ident-lockfree", head_dir)))
        worker.start()
        worker.join(60)
        assert not worker.is_alive() and loaded, "load_head waited for the model lock"
    engine.unload_head("ident-lockfree")


def test_an_encoded_record_is_answered_by_the_head_its_request_names_or_refused(
    tiny: Clef, engine: Clef, head_dir: Path
) -> None:
    """The ``(request, EncodedRecord)`` form of `decide_encoded` resolves its head as `prepare` does."""
    engine.load_head("ident-tuple", head_dir)
    named = engine.parse(request(model="ident-tuple"))
    record = engine.encode(request(model="ident-tuple"))
    (decision,) = engine.decide_encoded([(named, record)])
    assert decision.head is not None and decision.head.name == "ident-tuple"
    assert_close(decision.probabilities or [], reference_probabilities(tiny, head_dir, request()))
    engine.unload_head("ident-tuple")
    with pytest.raises(HeadNotLoadedError):
        engine.decide_encoded([(named, record)])
