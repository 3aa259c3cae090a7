"""The built-in tiny checkpoint: exact release layout, transformers-compatible names, determinism."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.head import JointSchemaHead
from clef_runtime.model.tiny import TINY_HEAD_CONFIG, make_tiny

RELEASE_FILES = {
    "config.json",
    "model.safetensors.index.json",
    "joint_head.safetensors",
    "joint_head_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
}


def _weight_files(directory: Path) -> list[Path]:
    return sorted([*directory.glob("*.safetensors")])


def _digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in _weight_files(directory)}


def test_exact_release_layout(tiny_dir: Path) -> None:
    names = {path.name for path in tiny_dir.iterdir()}
    shards = sorted(name for name in names if name.startswith("model-") and name.endswith(".safetensors"))
    assert names == RELEASE_FILES | set(shards)
    assert len(shards) >= 2
    assert shards == [f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    assert not any(name.endswith(".py") for name in names)


def test_index_is_consistent_with_the_shards(tiny_dir: Path) -> None:
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    total = 0
    seen: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(tiny_dir / shard), framework="pt") as reader:
            assert reader.metadata() == {"format": "pt"}
            for name in reader.keys():  # noqa: SIM118
                tensor = reader.get_tensor(name)
                assert tensor.dtype == torch.bfloat16, name
                total += tensor.numel() * tensor.element_size()
                seen[name] = shard
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_names_are_what_transformers_expects(tiny_dir: Path) -> None:
    # transformers' own loader is the independent judge of the layout: no missing or unexpected keys.
    from transformers import Qwen3_5ForConditionalGeneration

    model, loading = Qwen3_5ForConditionalGeneration.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not loading["missing_keys"]
    assert not loading["unexpected_keys"]
    assert not loading["mismatched_keys"]
    names = set(json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"])
    assert names == set(model.state_dict())
    assert "lm_head.weight" in names
    assert any(name.startswith("model.visual.") for name in names)
    assert all(name.startswith(("model.language_model.", "model.visual.", "lm_head.")) for name in names)


def test_config(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5"
    assert config["clef_runtime"] == {"tiny": True, "untrained": True, "seed": 0, "format": 1}
    assert config["tie_word_embeddings"] is False
    assert (config["image_token_id"], config["video_token_id"]) == (248_056, 248_057)
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (248_053, 248_054)
    text = config["text_config"]
    assert text["vocab_size"] == 248_320
    assert text["hidden_size"] == 64
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (4, 2, 32)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (2, 4)
    rope = text["rope_parameters"]
    assert rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) == int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]

    from transformers import Qwen3_5Config

    parsed = Qwen3_5Config.from_dict(config)
    assert parsed.text_config.hidden_size == 64
    assert parsed.vision_config.depth == 2


def test_head_files(tiny_dir: Path) -> None:
    text = (tiny_dir / "joint_head_config.json").read_text()
    assert text == json.dumps(dict(TINY_HEAD_CONFIG), indent=2) + "\n"
    head = JointSchemaHead.from_files(tiny_dir)
    assert head.config == dict(TINY_HEAD_CONFIG)
    with safe_open(str(tiny_dir / "joint_head.safetensors"), framework="pt") as reader:
        tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
    assert set(tensors) == set(head.state_dict())
    assert all(tensor.dtype == torch.bfloat16 for tensor in tensors.values())
    # Non-trivial initialisation: the scalars are not the constructor's zeros, matrices are not constant.
    assert tensors["residual_gate"].item() != 0.0
    assert tensors["memory_projection.weight"].float().std() > 0.05


@pytest.mark.slow
def test_tokenizer_files(tiny_dir: Path, tokenizer_json_path: Path) -> None:
    assert (tiny_dir / "tokenizer.json").read_bytes() == tokenizer_json_path.read_bytes()
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert tokenizer.pad_token_id == 248_044
    assert tokenizer.eos_token_id == 248_046
    text = "Is this a refund request? 123 wörld <|im_end|>"
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert (
        tokenizer(text, add_special_tokens=False)["input_ids"]
        == raw.encode(text, add_special_tokens=False).ids
    )


def test_processor_config(tiny_dir: Path) -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_dir)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
    assert list(processor.image_mean) == [0.5, 0.5, 0.5]
    assert list(processor.image_std) == [0.5, 0.5, 0.5]
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (256 * 256, 4096 * 4096)


def test_loads_like_a_release_and_gives_non_trivial_rows(tiny_dir: Path, tiny_backbone: Backbone) -> None:
    info = verify_checkpoint(tiny_dir)
    assert info.is_tiny
    rows = tiny_backbone.hidden_states(list(range(1000, 1100)))
    assert rows.shape == (100, 64)
    assert torch.isfinite(rows).all()
    assert rows.std() > 0.3
    # Positions differ from each other (the mixers see context), and not just by the token embedding.
    assert (rows[1:] - rows[:-1]).abs().mean() > 0.1


def test_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(FileExistsError):
        make_tiny(tmp_path)
    with pytest.raises(ValueError):
        make_tiny(tmp_path / "fresh", seed=-1)


def test_deterministic_in_the_seed(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny_dir)
    assert (again / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    other = make_tiny(tmp_path / "other", seed=1)
    other_digests = _digests(other)
    assert set(other_digests) == set(_digests(tiny_dir))
    assert all(other_digests[name] != digest for name, digest in _digests(tiny_dir).items())
    assert json.loads((other / "config.json").read_text())["clef_runtime"]["seed"] == 1
