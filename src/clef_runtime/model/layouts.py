"""The known releases' tensor layouts, built from their geometry without any weights.

The memory planner (`clef_runtime.model.memory`) reads nothing but tensor names, shapes and dtypes. For a
release that is not on disk (yet), `release_layout` builds exactly those from the release's geometry:
transformers' ``Qwen3_5ForConditionalGeneration`` of the release's config on the meta device (no allocation)
plus the joint head, every tensor bf16 as published. The result is the `CheckpointInfo` that
`verify_checkpoint` would return for the downloaded release (no files, no weights), so

    estimate_release_memory("Cloudflare/clef", dtype=torch.bfloat16)

or ``estimate_model_memory(release_layout("Cloudflare/clef"), ...)`` says what the release needs before a
byte of it is downloaded.

Geometries (`RELEASE_GEOMETRIES`):

- Clef-flash: Qwen3.5-9B's text stack and the published joint head (docs/model.md sections 4 and 6); its
  layout matches the published release exactly (760 tensors, 18,819,627,488 bytes; tested).
- Clef: Qwen3.5-27B's text stack (docs/clef-27b.md: hidden 5,120, 64 layers in the same 3:1 Gated DeltaNet /
  gated attention pattern, MLP 17,408, attention 24 heads / 4 KV heads x 256, DeltaNet 16 key / 48 value
  heads x 128). Its joint head's config is not published: the layout assumes Clef-flash's head at hidden
  5,120 (0.13 B parameters, ~0.5 GB in fp32: under 1% of the estimate either way).

Both carry the stock Qwen3.5 vision tower (27 blocks of width 1,152, transformers' ``Qwen3_5VisionConfig``
defaults) with its output width set to the text hidden size; the planner counts it only when asked
(``include_vision``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from clef_runtime.model.checkpoint import CLEF_27B, CLEF_FLASH, CheckpointInfo, TensorInfo, known_release
from clef_runtime.model.memory import MemoryEstimate, estimate_model_memory
from clef_runtime.model.tiny import Geometry, random_checkpoint_config

__all__ = [
    "CLEF_27B_GEOMETRY",
    "CLEF_FLASH_GEOMETRY",
    "RELEASE_GEOMETRIES",
    "STOCK_VISION_CONFIG",
    "estimate_release_memory",
    "layout_info",
    "release_config",
    "release_layout",
]

#: Clef-flash: Qwen3.5-9B text stack, published head (docs/model.md sections 4 and 6).
CLEF_FLASH_GEOMETRY = Geometry(
    hidden_size=4096,
    layers=32,
    intermediate_size=12_288,
    attention_heads=16,
    kv_heads=4,
    head_dim=256,
    deltanet_key_heads=16,
    deltanet_value_heads=32,
    deltanet_key_dim=128,
    deltanet_value_dim=128,
    head_width=1024,
    head_routing_layers=2,
    head_layers=4,
    head_heads=16,
    head_feedforward=4096,
)

#: Clef: Qwen3.5-27B text stack (docs/clef-27b.md); the head is Clef-flash's at hidden 5,120 (assumed: the
#: release does not publish its head config).
CLEF_27B_GEOMETRY = dataclasses.replace(
    CLEF_FLASH_GEOMETRY,
    hidden_size=5120,
    layers=64,
    intermediate_size=17_408,
    attention_heads=24,
    deltanet_value_heads=48,
)

#: Geometry of every known release, by lower-cased repo id (the keys of `KNOWN_RELEASES`).
RELEASE_GEOMETRIES: Mapping[str, Geometry] = {
    CLEF_FLASH.repo_id.lower(): CLEF_FLASH_GEOMETRY,
    CLEF_27B.repo_id.lower(): CLEF_27B_GEOMETRY,
}

#: The Qwen3.5 vision tower both releases carry (transformers' ``Qwen3_5VisionConfig`` defaults; its
#: ``out_hidden_size`` follows the text hidden size). Clef-flash's 456,010,480 vision parameters
#: (docs/model.md section 2) are exactly this tower's at output width 4,096.
STOCK_VISION_CONFIG: Mapping[str, Any] = {
    "deepstack_visual_indexes": [],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "model_type": "qwen3_5_vision",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def release_config(geometry: Geometry) -> dict[str, Any]:
    """A release config.json for ``geometry``: the text stack's sizes (3:1 layer pattern, M-RoPE sections
    from the head dim: [11, 11, 10] at 256), the stock vision tower at the text width, and a marker that says
    it describes a layout, not a checkpoint (``{"tiny": false, "layout_only": true}``)."""
    config = random_checkpoint_config(geometry=geometry, marker={"tiny": False, "layout_only": True})
    config["vision_config"] = {**STOCK_VISION_CONFIG, "out_hidden_size": geometry.hidden_size}
    return config


def layout_info(
    config: Mapping[str, Any], head_config: Mapping[str, int], *, name: str = "layout", dtype: str = "BF16"
) -> CheckpointInfo:
    """The `CheckpointInfo` of a release with ``config`` (config.json) and ``head_config``
    (joint_head_config.json), every tensor stored as ``dtype``: tensor names and shapes exactly as
    transformers builds the model, on the meta device. No weights, no files (``shards`` is empty and
    ``path`` is ``Path(name)``). Raises ValueError (from transformers or the head) for an inconsistent
    geometry."""
    from clef_runtime.model.tiny import _backbone_shapes, _head_shapes

    backbone = _backbone_shapes(dict(config))
    head = _head_shapes(head_config)
    tensors = {key: TensorInfo(key, "meta", dtype, shape) for key, shape in backbone.items()}
    head_tensors = {key: TensorInfo(key, "meta", dtype, shape) for key, shape in head.items()}
    return CheckpointInfo(
        path=Path(name),
        config=dict(config),
        head_config=dict(head_config),
        shards=(),
        total_weight_bytes=sum(tensor.nbytes for tensor in tensors.values()),
        tensor_count=len(tensors),
        is_tiny=False,
        tensors=tensors,
        head_tensors=head_tensors,
    )


def _geometry(repo_id: str) -> tuple[str, Geometry]:
    release = known_release(repo_id)
    if release is None:
        known = ", ".join(geometry_id for geometry_id in RELEASE_GEOMETRIES)
        raise KeyError(f"no known release {repo_id!r}; known: {known}")
    return release.repo_id, RELEASE_GEOMETRIES[release.repo_id.lower()]


@functools.cache
def _cached_layout(repo_id: str) -> CheckpointInfo:
    name, geometry = _geometry(repo_id)
    return layout_info(release_config(geometry), geometry.head_config(), name=name)


def release_layout(repo_id: str) -> CheckpointInfo:
    """The tensor layout of the known release ``repo_id`` (``Cloudflare/clef-flash``, ``Cloudflare/clef``;
    any letter case), built once per process (about a second for the 27B). Treat it as read-only. Raises
    KeyError for a repo id that is not a known release."""
    return _cached_layout(_geometry(repo_id)[0])


def estimate_release_memory(
    repo_id: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    int8_layers: str | None = None,
    include_vision: bool = False,
) -> MemoryEstimate:
    """What the known release ``repo_id`` needs on ``device`` (`estimate_model_memory` of its layout).

    ``dtype``: the storage dtype of the text (and vision) tensors: float32 for ``--weights fp32``, bfloat16
    for ``--weights bf16-storage`` or bf16 compute. ``int8_layers``: an ``--int8-layers`` value (``late``,
    ``all``, indices) for ``--weights int8``, resolved against the release's depth; None for no int8 layers.
    Raises KeyError for an unknown release, `OptionsError` for a bad ``int8_layers``.
    """
    from clef_runtime.model.quantize import select_int8_layers

    info = release_layout(repo_id)
    layers: tuple[int, ...] = ()
    if int8_layers is not None:
        layers = select_int8_layers(int8_layers, int(info.text_config["num_hidden_layers"]))
    return estimate_model_memory(
        info, device=device, dtype=dtype, int8_layers=layers, include_vision=include_vision
    )
