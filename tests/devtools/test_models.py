"""`devtools.models`: the benchmark models are named geometries built by the package's own
random-checkpoint builder, cached by geometry; the tiny model stays what it was."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from devtools.flags import engine_options

from clef_runtime.engine.clef import Clef
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.tiny import TINY_HEAD_CONFIG, Geometry, random_checkpoint_config, tiny_config
from devtools import models

SMALL = Geometry(
    hidden_size=32,
    layers=4,
    intermediate_size=48,
    attention_heads=2,
    kv_heads=1,
    head_dim=16,
    deltanet_key_heads=2,
    deltanet_value_heads=2,
    deltanet_key_dim=8,
    deltanet_value_dim=8,
    head_width=16,
    head_routing_layers=1,
    head_layers=1,
    head_heads=2,
    head_feedforward=32,
)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A small named geometry whose checkpoint is cached under ``tmp_path``."""
    monkeypatch.setitem(models.GEOMETRIES, "small", SMALL)
    monkeypatch.setattr(models, "MODEL_NAMES", (*models.MODEL_NAMES, "small"))
    monkeypatch.setattr(models, "_root", lambda: tmp_path)
    return "small"


def test_the_default_geometry_is_the_tiny_model() -> None:
    assert random_checkpoint_config(geometry=Geometry()) == tiny_config()
    assert Geometry().head_config() == dict(TINY_HEAD_CONFIG)


def test_the_named_geometries() -> None:
    medium, wide = models.GEOMETRIES["medium"], models.GEOMETRIES["wide"]
    assert (medium.hidden_size, medium.layers, medium.head_width) == (512, 8, 128)
    assert models.GEOMETRIES["medium-1024"].hidden_size == 1024
    assert (wide.hidden_size, wide.intermediate_size, wide.layers) == (4096, 12288, 4)
    assert dataclasses.replace(wide, layers=32) == models.GEOMETRIES["release"]


def test_a_geometry_builds_a_checkpoint_the_engine_loads(small: str) -> None:
    path = models.checkpoint(small)
    assert path == models.checkpoint_path(small) and path.parent.name == path.parent.name
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == 32
    assert config["clef_runtime"]["benchmark_model"] == "small"
    assert json.loads((path / "joint_head_config.json").read_text()) == SMALL.head_config()

    backbone = Backbone.load(path, device="cpu")
    assert backbone.config.hidden_size == 32 and backbone.config.num_hidden_layers == 4
    rows = backbone.hidden_states(list(range(2000, 2020)))
    assert rows.shape == (20, 32) and torch.isfinite(rows).all()

    clef = Clef.load(models.resolve_model(small), engine_options(cache_mb=0))
    answer = clef.decide({"state": "a refund please", "questions": {"q": {"type": "noul"}}})
    assert 0.0 <= answer["answers"]["q"]["noul"] <= 1.0


def test_the_cache_follows_the_geometry(small: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = models.checkpoint(small)
    written = (first / "config.json").stat().st_mtime_ns
    assert models.checkpoint(small) == first  # reused, not rebuilt
    assert (first / "config.json").stat().st_mtime_ns == written

    monkeypatch.setitem(models.GEOMETRIES, "small", dataclasses.replace(SMALL, intermediate_size=64))
    second = models.checkpoint(small)
    assert second != first and not first.exists()  # rebuilt for the new geometry, the stale one removed
    assert json.loads((second / "config.json").read_text())["text_config"]["intermediate_size"] == 64


def test_names_outside_the_table_pass_through() -> None:
    assert models.resolve_model("tiny") == "tiny"
    assert models.resolve_model("/some/release") == "/some/release"
    with pytest.raises(KeyError):
        models.checkpoint("release")  # too large to write: its memory need comes from the layout alone


def test_text_model_is_the_same_recipe_in_every_dtype(small: str) -> None:
    fp32 = models.text_model(small, torch.float32, vocab_size=256)
    bf16 = models.text_model(small, torch.bfloat16, vocab_size=256)
    assert fp32.config.hidden_size == 32 and fp32.embed_tokens.weight.shape == (256, 32)
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert torch.equal(a, b.float()), name
    ids = torch.arange(0, 40)[None]
    with torch.inference_mode():
        out = fp32(input_ids=ids, use_cache=False).last_hidden_state
    assert out.shape == (1, 40, 32) and torch.isfinite(out).all()
    meta = models.text_model(small, device="meta")
    assert next(meta.parameters()).is_meta
