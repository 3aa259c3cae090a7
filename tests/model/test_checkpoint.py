"""verify_checkpoint: release layout, safetensors headers, pinned sizes; one error type naming the file."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clef_runtime.model.checkpoint import (
    PINNED_FILE_SIZES,
    REQUIRED_FILES,
    CheckpointError,
    read_safetensors_header,
    verify_checkpoint,
)
from clef_runtime.release import HEAD_WEIGHTS_FILE, INDEX_FILE


def _shard_names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("model-*-of-*.safetensors"))


def _index(directory: Path) -> dict:
    return json.loads((directory / INDEX_FILE).read_text())


def test_tiny_checkpoint_verifies(tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    index = _index(tiny_dir)
    assert info.path == tiny_dir
    assert info.is_tiny
    assert sorted(info.shards) == _shard_names(tiny_dir)
    assert info.tensor_count == len(index["weight_map"]) == len(info.tensors)
    assert info.total_weight_bytes == index["metadata"]["total_size"]
    assert info.config["model_type"] == "qwen3_5"
    assert info.hidden_size == 64
    assert info.head_config["hidden_size"] == 64
    assert "lm_head.weight" in info.tensors
    assert info.tensors["lm_head.weight"].shape == (248_320, 64)
    assert len(info.head_tensors) > 0


def test_header_reader_agrees_with_safetensors(tiny_dir: Path) -> None:
    for shard in [*_shard_names(tiny_dir), HEAD_WEIGHTS_FILE]:
        ours = read_safetensors_header(tiny_dir / shard)
        with safe_open(str(tiny_dir / shard), framework="pt") as reader:
            theirs = {name: reader.get_slice(name) for name in reader.keys()}  # noqa: SIM118
            assert set(ours) == set(theirs)
            for name, info in ours.items():
                assert list(info.shape) == list(theirs[name].get_shape())
                assert info.dtype == theirs[name].get_dtype()


def _assert_names(error: pytest.ExceptionInfo[CheckpointError], path: Path, *words: str) -> None:
    message = str(error.value)
    assert str(path) in message, message
    assert error.value.file == path
    for word in words:
        assert word in message, message


def test_truncated_shard(clone_tiny: Callable[..., Path]) -> None:
    shard = "model-00003-of-00003.safetensors"
    directory = clone_tiny(shard)
    path = directory / shard
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, path, "truncated")


def test_shard_with_garbage_header(clone_tiny: Callable[..., Path]) -> None:
    shard = "model-00002-of-00003.safetensors"
    directory = clone_tiny(shard)
    path = directory / shard
    path.write_bytes(b"\xff" * 64 + path.read_bytes()[64:])
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, path, "header")


def test_shard_whose_header_is_not_json(clone_tiny: Callable[..., Path]) -> None:
    shard = "model-00003-of-00003.safetensors"
    directory = clone_tiny(shard)
    path = directory / shard
    body = b"this is not json at all"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, path, "not valid JSON")


def test_shard_tensors_must_match_index(clone_tiny: Callable[..., Path]) -> None:
    shard = "model-00003-of-00003.safetensors"
    directory = clone_tiny(shard)
    path = directory / shard
    tensors = load_file(str(path))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, path, dropped)


def test_missing_head_file(clone_tiny: Callable[..., Path]) -> None:
    directory = clone_tiny()
    (directory / HEAD_WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / HEAD_WEIGHTS_FILE, "missing")


@pytest.mark.parametrize("name", [name for name in REQUIRED_FILES if name != HEAD_WEIGHTS_FILE])
def test_every_required_file_is_required(clone_tiny: Callable[..., Path], name: str) -> None:
    directory = clone_tiny()
    (directory / name).unlink()
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / name, "missing")


def test_missing_shard_named_by_index(clone_tiny: Callable[..., Path]) -> None:
    directory = clone_tiny()
    shard = "model-00002-of-00003.safetensors"
    (directory / shard).unlink()
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / shard, "missing", INDEX_FILE)


def test_index_may_not_point_outside_the_directory(clone_tiny: Callable[..., Path]) -> None:
    directory = clone_tiny(INDEX_FILE)
    index = _index(directory)
    index["weight_map"]["lm_head.weight"] = "../model-00001-of-00003.safetensors"
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / INDEX_FILE, "invalid shard file")


def test_index_without_lm_head(clone_tiny: Callable[..., Path]) -> None:
    directory = clone_tiny(INDEX_FILE)
    index = _index(directory)
    del index["weight_map"]["lm_head.weight"]
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / INDEX_FILE, "lm_head.weight")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"architectures": ["Qwen3_5ForConditionalGeneration"], ', "not valid JSON"),
        ("[1, 2, 3]", "JSON object"),
        ('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}', "architectures"),
        ('{"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}', "text_config"),
    ],
)
def test_malformed_config(clone_tiny: Callable[..., Path], content: str, words: str) -> None:
    directory = clone_tiny("config.json")
    (directory / "config.json").write_text(content)
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / "config.json", words)


def test_a_malformed_tokenizer_json_fails_verify_unless_the_caller_parses_it(
    clone_tiny: Callable[..., Path],
) -> None:
    directory = clone_tiny("tokenizer.json")
    (directory / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / "tokenizer.json", "not valid JSON")
    # Clef.load parses it with the tokenizer next (tests/engine/test_clef.py): verify only checks it is there.
    assert verify_checkpoint(directory, parse_tokenizer=False).path == directory
    (directory / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory, parse_tokenizer=False)
    _assert_names(error, directory / "tokenizer.json", "missing")


def test_head_config_must_match_backbone(clone_tiny: Callable[..., Path]) -> None:
    directory = clone_tiny("joint_head_config.json")
    config = json.loads((directory / "joint_head_config.json").read_text())
    config["hidden_size"] = 4096
    (directory / "joint_head_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(directory)
    _assert_names(error, directory / "joint_head_config.json", "hidden_size")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "nowhere")


def test_pinned_sizes_reject_other_files(tiny_dir: Path) -> None:
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(tiny_dir, expected_sizes=PINNED_FILE_SIZES)
    message = str(error.value)
    assert "published sizes" in message
    assert (
        f"{tiny_dir / 'config.json'}: {(tiny_dir / 'config.json').stat().st_size:,} bytes, expected 2,832"
        in message
    )
    assert f"{tiny_dir / 'model-00001-of-00004.safetensors'}: missing" in message


def test_pinned_sizes_are_checked_before_anything_is_parsed(tmp_path: Path) -> None:
    # Sparse files of exactly the published sizes, all zeros: the size check passes and only then does
    # parsing fail, on the first JSON file. (No disk space is used: the files are holes.)
    for name, size in PINNED_FILE_SIZES.items():
        with (tmp_path / name).open("wb") as handle:
            handle.truncate(size)
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(tmp_path, expected_sizes=PINNED_FILE_SIZES)
    assert "published sizes" not in str(error.value)
    assert error.value.file == tmp_path / "config.json"

    with (tmp_path / "tokenizer.json").open("r+b") as handle:
        handle.truncate(PINNED_FILE_SIZES["tokenizer.json"] - 1)
    with pytest.raises(
        CheckpointError, match=re.escape("tokenizer.json: 19,989,324 bytes, expected 19,989,325")
    ):
        verify_checkpoint(tmp_path, expected_sizes=PINNED_FILE_SIZES)


def test_pinned_sizes_are_the_published_ones() -> None:
    shards = sum(size for name, size in PINNED_FILE_SIZES.items() if name.startswith("model-0"))
    # docs/model.md section 2: 18,819,627,488 bytes of bf16 tensors + 93,632 bytes of headers.
    assert shards == 18_819_721_120
