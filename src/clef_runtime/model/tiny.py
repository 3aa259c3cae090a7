"""The built-in tiny checkpoint: an untrained, deterministic model in the exact Clef-flash release layout.

It exists so that everything (loading, prefill, head, server, CLI) can be exercised without the 18.8 GB
release. The geometry is the release's in miniature: the same layer pattern (3 Gated DeltaNet layers + 1 full
attention layer), grouped heads on both mixers, partial interleaved M-RoPE, a small vision tower, and the FULL
248,320-token vocabulary so that real prompts tokenize and index the embedding and ``lm_head`` tables.

Weights are drawn from numpy's PCG64 generator keyed by (seed, tensor name), so a tensor's values do not
depend on which other tensors exist, and stored as bf16: the same seed gives byte-identical weight files.
The outputs mean nothing; the model is for tests and plumbing only.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from clef_runtime.encoding.special_tokens import ENDOFTEXT_ID
from clef_runtime.model.checkpoint import RELEASE_ARCHITECTURE, RELEASE_MODEL_TYPE
from clef_runtime.release import (
    CONFIG_FILE,
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    INDEX_FILE,
    PROCESSOR_CONFIG_FILE,
    TEXT_PREFIX,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    VISION_PREFIX,
)

__all__ = [
    "TINY_FORMAT",
    "TINY_HEAD_CONFIG",
    "Geometry",
    "make_random_checkpoint",
    "make_tiny",
    "random_backbone_tensor",
    "random_checkpoint_config",
    "tiny_config",
]

#: Bump when the tiny checkpoint's layout, geometry or weight recipe changes (part of its cache dir name).
TINY_FORMAT = 1

VOCAB_SIZE = 248_320
TEXT_HIDDEN = 64

#: Head geometry of the tiny checkpoint (joint_head_config.json, in the release's key order).
TINY_HEAD_CONFIG: Mapping[str, int] = {
    "hidden_size": TEXT_HIDDEN,
    "width": 32,
    "routing_layers": 2,
    "layers": 2,
    "heads": 4,
    "feedforward": 64,
}

# Shards are filled greedily in name order up to this size, which splits the tiny model into three shards
# (lm_head | embed_tokens | everything else): loading must cross shard boundaries as with the release.
_SHARD_BYTES = 24 * 1024 * 1024


@dataclass(frozen=True)
class Geometry:
    """The sizes of a random checkpoint's text stack and joint head; the defaults are the tiny model's.

    One object names a whole model, so that benchmarks and tests can say "this geometry" instead of patching
    config keys one by one. `random_checkpoint_config` and `make_random_checkpoint` take it as ``geometry``;
    the layer pattern (3 Gated DeltaNet layers, then one full attention layer), the M-RoPE split and the
    vision tower's output width follow from it.
    """

    hidden_size: int = TEXT_HIDDEN
    layers: int = 4
    intermediate_size: int = 128
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    deltanet_key_heads: int = 2
    deltanet_value_heads: int = 4
    deltanet_key_dim: int = 16
    deltanet_value_dim: int = 16
    head_width: int = 32
    head_routing_layers: int = 2
    head_layers: int = 2
    head_heads: int = 4
    head_feedforward: int = 64

    def text_overrides(self) -> dict[str, int]:
        """The text-config keys this geometry sets (`random_checkpoint_config` derives the rest)."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.attention_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.deltanet_key_heads,
            "linear_num_value_heads": self.deltanet_value_heads,
            "linear_key_head_dim": self.deltanet_key_dim,
            "linear_value_head_dim": self.deltanet_value_dim,
        }

    def head_config(self) -> dict[str, int]:
        """The joint head's joint_head_config.json content (in the release's key order)."""
        return {
            "hidden_size": self.hidden_size,
            "width": self.head_width,
            "routing_layers": self.head_routing_layers,
            "layers": self.head_layers,
            "heads": self.head_heads,
            "feedforward": self.head_feedforward,
        }


def tiny_config(seed: int = 0) -> dict[str, Any]:
    """Return the tiny checkpoint's config.json content.

    A ``Qwen3_5ForConditionalGeneration`` config with the release's keys at small sizes, plus the marker
    ``"clef_runtime": {"tiny": true, "untrained": true, "seed": seed, "format": TINY_FORMAT}``.
    """
    head_dim = 32
    # partial_rotary_factor 0.25 -> 8 rotary dims -> 4 frequencies; mrope_section [2, 1, 1] splits them T/H/W.
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": ENDOFTEXT_ID,
        "full_attention_interval": 4,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": TEXT_HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262_144,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": 2,
        "pad_token_id": None,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10_000_000.0,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }
    vision_config = {
        "deepstack_visual_indexes": [],
        "depth": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "model_type": "qwen3_5_vision",
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": TEXT_HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": [RELEASE_ARCHITECTURE],
        "clef_runtime": {"tiny": True, "untrained": True, "seed": seed, "format": TINY_FORMAT},
        "dtype": "bfloat16",
        "image_token_id": 248_056,
        "model_type": RELEASE_MODEL_TYPE,
        "text_config": text_config,
        "tie_word_embeddings": False,
        "video_token_id": 248_057,
        "vision_config": vision_config,
        "vision_end_token_id": 248_054,
        "vision_start_token_id": 248_053,
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_prefix_space": False,
        "backend": "tokenizers",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262_144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }


def _processor_config() -> dict[str, Any]:
    # Qwen3.5's stock processor (docs/model.md section 5): pixel-count bounds 256^2 .. 4096^2, patch 16,
    # merge 2, temporal 2, mean = std = 0.5, rescale 1/255, bicubic.
    image_processor = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": 16,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": 16_777_216, "shortest_edge": 65_536},
        "temporal_patch_size": 2,
    }
    video_processor = {
        **{key: value for key, value in image_processor.items() if key != "image_processor_type"},
        "do_sample_frames": True,
        "fps": 2,
        "max_frames": 768,
        "min_frames": 4,
        "size": {"longest_edge": 25_165_824, "shortest_edge": 4_096},
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    return {
        "image_processor": image_processor,
        "processor_class": "Qwen3VLProcessor",
        "video_processor": video_processor,
    }


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode("utf-8"))]))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)).astype(
        np.float32
    )


def random_backbone_tensor(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic bf16 values for the backbone tensor ``name`` (its checkpoint name, e.g.
    ``model.language_model.layers.0.mlp.up_proj.weight``), chosen so every block does visible work.

    The recipe of every random checkpoint; exposed so that a model too large to write to disk (a block of the
    release's width) can be filled in memory with the same values."""
    rng = _rng(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.A_log"):
        # Decay rates in [0.02, 0.5]: the DeltaNet state carries over tens of tokens, across prefill chunks.
        values = np.log(rng.uniform(0.02, 0.5, shape)).astype(np.float32)
    elif name.endswith("linear_attn.dt_bias"):
        values = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    elif name.endswith("linear_attn.norm.weight"):
        values = _normal(rng, shape, 0.1, mean=1.0)  # gated RMSNorm: plain weight
    elif name.startswith(TEXT_PREFIX) and leaf == "weight" and len(shape) == 1:
        values = _normal(rng, shape, 0.1)  # zero-centred RMSNorms: y = x_hat * (1 + w)
    elif name.startswith(VISION_PREFIX) and "norm" in name and leaf == "weight":
        values = _normal(rng, shape, 0.1, mean=1.0)  # LayerNorm weight
    elif leaf == "bias":
        values = _normal(rng, shape, 0.02)
    elif name.endswith("embed_tokens.weight"):
        values = _normal(rng, shape, 1.0)
    elif name.endswith("conv1d.weight") or name.endswith("pos_embed.weight"):
        values = _normal(rng, shape, 0.5)
    else:  # projection matrices (and lm_head): unit-variance outputs for unit-variance inputs
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        values = _normal(rng, shape, fan_in**-0.5)
    return torch.from_numpy(values).to(torch.bfloat16)


def _head_tensor(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    rng = _rng(seed + 1_000_003, name)  # a different stream from the backbone's
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 0:  # prior_logit_scale, joint_logit_scale, residual_gate
        values = _normal(rng, shape, 0.5)
    elif "norm" in name and leaf == "weight":
        values = _normal(rng, shape, 0.1, mean=1.0)
    elif len(shape) == 1:
        values = _normal(rng, shape, 0.02)
    else:
        values = _normal(rng, shape, int(np.prod(shape[1:])) ** -0.5)
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).to(torch.bfloat16)


def _write_json(path: Path, value: Any, *, sort_keys: bool = True) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=sort_keys) + "\n", encoding="utf-8")


def _backbone_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes exactly as transformers saves Qwen3_5ForConditionalGeneration."""
    # Submodule imports: transformers' lazy top-level names are not safe to resolve from two threads at once.
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    from clef_runtime.model.backbone import TRANSFORMERS_CONSTRUCTION_LOCK

    model_config = Qwen3_5Config.from_dict(config)
    with TRANSFORMERS_CONSTRUCTION_LOCK, torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(model_config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _head_shapes(head_config: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    from clef_runtime.model.head import JointSchemaHead

    with torch.device("meta"):
        head = JointSchemaHead(**head_config)
    return {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}


def _default_tokenizer_path() -> Path:
    from clef_runtime.encoding.tokenizer import default_tokenizer_path

    return Path(default_tokenizer_path())


def _mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """Split the rotary frequencies over the T/H/W planes like the release ([11, 11, 10] for 32)."""
    frequencies = int(head_dim * partial_rotary_factor) // 2
    base, remainder = divmod(frequencies, 3)
    return [base + (1 if plane < remainder else 0) for plane in range(3)]


def random_checkpoint_config(
    *,
    geometry: Geometry | None = None,
    text_overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    marker: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return a config.json for a random checkpoint: the tiny config with ``geometry``'s sizes, then
    ``text_overrides``, applied.

    Derived keys follow the overrides unless overridden themselves: ``layer_types`` (the release's 3:1
    pattern, full attention at every 4th layer) from ``num_hidden_layers``; ``rope_parameters.mrope_section``
    from ``head_dim`` and ``partial_rotary_factor``; ``vision_config.out_hidden_size`` from ``hidden_size``.
    ``vocab_size`` replaces the vocabulary size (prompts must then only use ids below it). ``marker``
    replaces the ``"clef_runtime"`` marker (default: the tiny one). Raises ValueError when ``layer_types``
    does not have ``num_hidden_layers`` entries.
    """
    config = tiny_config(seed)
    text = config["text_config"]
    overrides = {**(geometry.text_overrides() if geometry is not None else {}), **(text_overrides or {})}
    text.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        text["layer_types"] = [
            "full_attention" if (layer + 1) % 4 == 0 else "linear_attention"
            for layer in range(int(text["num_hidden_layers"]))
        ]
    if len(text["layer_types"]) != text["num_hidden_layers"]:
        raise ValueError(
            f"layer_types has {len(text['layer_types'])} entries for {text['num_hidden_layers']} layers"
        )
    if "rope_parameters" not in overrides:
        rope = dict(text["rope_parameters"])
        rope["mrope_section"] = _mrope_section(int(text["head_dim"]), float(rope["partial_rotary_factor"]))
        text["rope_parameters"] = rope
    if vocab_size is not None:
        if vocab_size <= ENDOFTEXT_ID:
            # The pad id (<|endoftext|>) must index the embedding table: batched prefill pads with it.
            raise ValueError(f"vocab_size must exceed the pad id {ENDOFTEXT_ID}, got {vocab_size}")
        text["vocab_size"] = vocab_size
    config["vision_config"]["out_hidden_size"] = text["hidden_size"]
    if marker is not None:
        config["clef_runtime"] = dict(marker)
    return config


def make_random_checkpoint(
    directory: str | os.PathLike[str],
    *,
    geometry: Geometry | None = None,
    text_overrides: Mapping[str, Any] | None = None,
    head_config: Mapping[str, int] | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    marker: Mapping[str, Any] | None = None,
    shard_bytes: int = _SHARD_BYTES,
) -> Path:
    """Write an untrained checkpoint of any geometry in the release layout (the tiny recipe, scaled).

    ``geometry`` sets the text stack's and the head's sizes (default: the tiny ones); ``text_overrides``
    updates the text config on top of it (see `random_checkpoint_config` for the derived keys);
    ``head_config`` replaces the geometry's head (its ``hidden_size`` must equal the text hidden size);
    ``marker`` replaces the config's ``"clef_runtime"`` marker (default: the tiny marker, so a checkpoint
    that is not the tiny one should pass e.g. ``{"tiny": False, "untrained": True, ...}``); shards are
    filled greedily in name order up to ``shard_bytes`` (a larger tensor gets a shard of its own).
    Weights are drawn exactly as for `make_tiny`: deterministic in (seed, tensor name), bf16.

    Returns the directory as an absolute Path. Raises FileExistsError if the directory is not empty,
    ValueError for a negative seed, an inconsistent geometry or a head/backbone width mismatch.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    config = random_checkpoint_config(
        geometry=geometry, text_overrides=text_overrides, seed=seed, vocab_size=vocab_size, marker=marker
    )
    if head_config is not None:
        head = dict(head_config)
    else:
        head = geometry.head_config() if geometry is not None else dict(TINY_HEAD_CONFIG)
    if head.get("hidden_size") != config["text_config"]["hidden_size"]:
        raise ValueError(
            f"head_config hidden_size {head.get('hidden_size')} does not match the text hidden size "
            f"{config['text_config']['hidden_size']}"
        )
    target = Path(directory).expanduser().resolve()
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target}: directory is not empty; a fresh checkpoint needs an empty one")
    target.mkdir(parents=True, exist_ok=True)
    _write_checkpoint(target, config, head, seed, shard_bytes)
    return target


def _write_checkpoint(
    target: Path, config: dict[str, Any], head_config: dict[str, int], seed: int, shard_bytes: int
) -> None:
    """Write every release file of a random checkpoint into the (existing, empty) directory ``target``."""
    shapes = _backbone_shapes(config)

    # Greedy sharding in name order, like transformers' save_pretrained with a max_shard_size.
    shards: list[list[str]] = [[]]
    filled_bytes = 0
    for name in sorted(shapes):
        size = int(np.prod(shapes[name])) * 2
        if shards[-1] and filled_bytes + size > shard_bytes:
            shards.append([])
            filled_bytes = 0
        shards[-1].append(name)
        filled_bytes += size
    weight_map: dict[str, str] = {}
    total_size = 0
    for number, names in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_backbone_tensor(seed, name, shapes[name]) for name in names}
        save_file(tensors, str(target / file_name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_size += tensor.numel() * tensor.element_size()
        del tensors
    _write_json(target / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    _write_json(target / CONFIG_FILE, config)

    head_tensors = {
        name: _head_tensor(seed, name, shape) for name, shape in sorted(_head_shapes(head_config).items())
    }
    save_file(head_tensors, str(target / HEAD_WEIGHTS_FILE), metadata={"format": "pt"})
    # The release writes json.dumps(cfg, indent=2) + "\n" in constructor-argument order.
    _write_json(target / HEAD_CONFIG_FILE, head_config, sort_keys=False)

    shutil.copyfile(_default_tokenizer_path(), target / TOKENIZER_FILE)
    _write_json(target / TOKENIZER_CONFIG_FILE, _tokenizer_config())
    _write_json(target / PROCESSOR_CONFIG_FILE, _processor_config())
    # safetensors creates its files user-only; give them the same permissions as the JSON files beside them.
    for weights in target.glob("*.safetensors"):
        shutil.copymode(target / CONFIG_FILE, weights)


def make_tiny(directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny checkpoint (release layout, untrained, deterministic in ``seed``) into ``directory``.

    ``directory`` is created if needed and must not already hold files. Writes config.json, three bf16
    ``model-0000N-of-00003.safetensors`` shards with model.safetensors.index.json, joint_head.safetensors +
    joint_head_config.json, tokenizer.json (a copy of the built-in Qwen3.5 tokenizer), tokenizer_config.json
    and processor_config.json. Returns the directory as an absolute Path. Raises FileExistsError if the
    directory is not empty, ValueError for a negative seed.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    target = Path(directory).expanduser().resolve()
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target}: directory is not empty; make_tiny writes a fresh checkpoint")
    target.mkdir(parents=True, exist_ok=True)
    _write_checkpoint(target, tiny_config(seed), dict(TINY_HEAD_CONFIG), seed, _SHARD_BYTES)
    return target
