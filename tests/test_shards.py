"""The one shard reader: every consumer (lexical rows, vision tower) checks shard paths the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from clef_runtime.model.lexical import LexicalTable, LexicalTableError
from clef_runtime.shards import ShardError, ShardsNotFoundError, open_index, read_tensors, shard_path
from clef_runtime.vision.tower import read_vision_state_dict


def _write_two_shards(root: Path) -> None:
    save_file({"a": torch.ones(2), "model.visual.x": torch.zeros(3)}, str(root / "one.safetensors"))
    save_file({"lm_head.weight": torch.ones(4, 2), "b": torch.full((1,), 2.0)}, str(root / "two.safetensors"))
    weight_map = {
        "a": "one.safetensors",
        "model.visual.x": "one.safetensors",
        "lm_head.weight": "two.safetensors",
        "b": "two.safetensors",
    }
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_names_that_leave_the_directory_are_refused(tmp_path: Path) -> None:
    assert shard_path(tmp_path, "model-1.safetensors") == tmp_path / "model-1.safetensors"
    for name in ("../elsewhere.safetensors", "/etc/passwd", "sub/../../x.safetensors"):
        with pytest.raises(ShardError, match="outside the checkpoint directory"):
            shard_path(tmp_path, name)


def test_a_link_to_a_blob_store_is_accepted(tmp_path: Path) -> None:
    # Hugging Face snapshots are directories of links into the cache's blobs/.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    save_file({"lm_head.weight": torch.ones(4, 2)}, str(blobs / "abc123"))
    (snapshot / "model.safetensors").symlink_to(blobs / "abc123")
    assert torch.equal(LexicalTable.from_safetensors(snapshot).weight, torch.ones(4, 2))


def test_every_consumer_refuses_a_shard_outside_the_checkpoint(tmp_path: Path) -> None:
    weight_map = {"lm_head.weight": "../elsewhere.safetensors", "model.visual.x": "../elsewhere.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(LexicalTableError, match="outside the checkpoint directory"):
        LexicalTable.from_safetensors(tmp_path)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        read_vision_state_dict(tmp_path)


def test_read_tensors_reads_what_is_asked_from_every_shard(tmp_path: Path) -> None:
    _write_two_shards(tmp_path)
    index = open_index(tmp_path)
    assert index.names("model.visual.") == ["model.visual.x"]
    read = dict(read_tensors(index, ["b", "a"]))
    assert set(read) == {"a", "b"}
    assert torch.equal(read["a"], torch.ones(2)) and torch.equal(read["b"], torch.full((1,), 2.0))
    with pytest.raises(ShardError, match="no entry for 'c'"):
        list(read_tensors(index, ["c"]))


def test_a_shard_without_the_tensor_its_index_names_is_an_error(tmp_path: Path) -> None:
    _write_two_shards(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"b": "one.safetensors"}})
    )
    with pytest.raises(ShardError, match=r"one\.safetensors: no tensor named 'b'"):
        list(read_tensors(open_index(tmp_path), ["b"]))


def test_a_directory_without_weights_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ShardsNotFoundError, match="neither") as caught:
        open_index(tmp_path)
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)
