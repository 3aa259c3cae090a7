"""VisionTower: lazy, reads only model.visual.* from the shards, and equals transformers' Qwen3_5VisionModel
built directly with the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel

from clef_runtime.model.tiny import make_tiny
from clef_runtime.vision.preprocess import PreprocessedImage, preprocess
from clef_runtime.vision.tower import VisionTower, read_vision_state_dict
from tests.vision.helpers import photo_like

VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 48,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [],
    "model_type": "qwen3_5_vision",
}


def random_vision_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**VISION_CONFIG))
    # Random values everywhere (LayerNorms too), so that every tensor's placement matters.
    return {name: torch.randn(t.shape, generator=generator) * 0.2 for name, t in model.state_dict().items()}


def write_checkpoint(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    """Release layout: config.json + index + two shards, vision tensors split across them, text tensors too,
    and one text tensor mapped to a shard that does not exist (the tower must never open it)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    half = len(names) // 2
    shard_a = {f"model.visual.{n}": state[n] for n in names[:half]}
    shard_b = {f"model.visual.{n}": state[n] for n in names[half:]}
    shard_a["model.language_model.norm.weight"] = torch.ones(8)
    save_file(shard_a, str(directory / "model-00001-of-00002.safetensors"))
    save_file(shard_b, str(directory / "model-00002-of-00002.safetensors"))
    weight_map = dict.fromkeys(shard_a, "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(shard_b, "model-00002-of-00002.safetensors"))
    weight_map["lm_head.weight"] = "model-00003-of-00003.safetensors"  # absent on purpose
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {"model_type": "qwen3_5", "vision_config": VISION_CONFIG, "text_config": {"hidden_size": 48}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def direct_model(vision_config: dict, state: dict[str, torch.Tensor]) -> Qwen3_5VisionModel:
    model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vision_config))
    model.load_state_dict(state, strict=True)
    return model.eval()


def direct_embed(model: Qwen3_5VisionModel, image: PreprocessedImage) -> torch.Tensor:
    with torch.no_grad():
        return model(image.pixel_values, grid_thw=torch.tensor([image.grid_thw])).pooler_output


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_vision_state(seed=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, state) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("vision") / "ckpt", state)


@pytest.fixture(scope="module")
def images() -> list[PreprocessedImage]:
    return [
        preprocess(photo_like(120, 90, seed=1), "native"),  # 8x10 merged (min pixels), 80 tokens
        preprocess(photo_like(300, 500, seed=2), "g256"),
        preprocess(photo_like(64, 64, seed=3), "native", max_tokens=None),
    ]


def test_nothing_is_read_before_first_use(tmp_path):
    tower = VisionTower(tmp_path / "missing")
    assert not tower.loaded
    with pytest.raises(FileNotFoundError):
        tower.embed([preprocess(photo_like(32, 32), "g256")])


def test_embed_equals_the_directly_built_model(checkpoint, state, images):
    tower = VisionTower(checkpoint)
    assert not tower.loaded
    assert tower.out_hidden_size == 48 and not tower.loaded
    reference = direct_model(VISION_CONFIG, state)
    for image in images:
        (ours,) = tower.embed([image])
        expected = direct_embed(reference, image)
        assert ours.dtype == torch.float32 and ours.device.type == "cpu"
        assert tuple(ours.shape) == (image.n_tokens, 48)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert tower.loaded


def test_several_images_in_one_pass_equal_each_alone(checkpoint, images):
    tower = VisionTower(checkpoint)
    together = tower.embed(images)
    assert [t.shape[0] for t in together] == [image.n_tokens for image in images]
    for image, batched in zip(images, together, strict=True):
        (alone,) = tower.embed([image])
        torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)


def test_unload_then_embed_reloads(checkpoint, images):
    tower = VisionTower(checkpoint)
    first = tower.embed(images[:1])[0]
    tower.unload()
    assert not tower.loaded
    again = tower.embed(images[:1])[0]
    assert tower.loaded
    assert torch.equal(first, again)


def test_only_vision_tensors_are_read(checkpoint, state):
    loaded = read_vision_state_dict(checkpoint)
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name])
    assert all(t.dtype == torch.float32 for t in loaded.values())


def test_single_file_checkpoint(tmp_path, state, images):
    save_file({f"model.visual.{n}": t for n, t in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": VISION_CONFIG}))
    (ours,) = VisionTower(tmp_path).embed(images[:1])
    torch.testing.assert_close(
        ours, direct_embed(direct_model(VISION_CONFIG, state), images[0]), rtol=0, atol=1e-6
    )


def test_missing_tensor_is_an_error(tmp_path, state, images):
    partial = {k: v for k, v in state.items() if k != "merger.norm.bias"}
    write_checkpoint(tmp_path / "c", partial)
    with pytest.raises(ValueError, match=r"merger\.norm\.bias"):
        VisionTower(tmp_path / "c").embed(images[:1])


def test_shard_outside_the_checkpoint_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.visual.pos_embed.weight": "../elsewhere.safetensors"}})
    )
    with pytest.raises(ValueError, match="outside"):
        read_vision_state_dict(tmp_path)


def test_checkpoint_without_vision_is_an_error(tmp_path, images):
    save_file({"model.language_model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no vision tower tensors"):
        read_vision_state_dict(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {}}))
    with pytest.raises(ValueError, match="vision_config"):
        VisionTower(tmp_path).embed(images[:1])


def test_mismatched_pixel_values_are_refused(checkpoint):
    good = preprocess(photo_like(32, 32), "g256")
    bad = PreprocessedImage(good.pixel_values[:10], good.grid_thw, good.merged_hw, good.n_tokens)
    tower = VisionTower(checkpoint)
    with pytest.raises(ValueError):
        tower.embed([bad])
    assert tower.embed([]) == []
    assert not tower.loaded


def test_from_module_wraps_a_built_model(state, images):
    reference = direct_model(VISION_CONFIG, state)
    tower = VisionTower.from_module(reference)
    torch.testing.assert_close(tower.embed(images[:1])[0], direct_embed(reference, images[0]), rtol=0, atol=0)


@pytest.mark.slow
def test_tiny_release_checkpoint(tmp_path, images):
    directory = make_tiny(tmp_path / "tiny", seed=3)
    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    # Independent load: every shard in full, then keep the vision tensors.
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, tensor in load_file(str(directory / shard)).items():
            if name.startswith("model.visual."):
                state[name.removeprefix("model.visual.")] = tensor.float()
    reference = direct_model(config["vision_config"], state)
    tower = VisionTower(directory)
    assert tower.out_hidden_size == config["vision_config"]["out_hidden_size"]
    processor_config = json.loads((directory / "processor_config.json").read_text())
    image = preprocess(photo_like(200, 150), "native", processor_config=processor_config)
    for candidate in (image, images[1]):
        (ours,) = tower.embed([candidate])
        torch.testing.assert_close(ours, direct_embed(reference, candidate), rtol=0, atol=1e-6)
