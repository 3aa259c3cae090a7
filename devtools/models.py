"""The benchmark models: named geometries, built once by the package's random-checkpoint builder.

Every model here is untrained (random weights from `clef_runtime.model.tiny`'s recipe, deterministic in the
seed), so figures measure speed and numerical drift, never answer quality. Checkpoints are written once into
``<cache dir>/benchmarks/<name>-<digest>/``; the digest covers the whole config, the head and the recipe's
format, so a changed geometry gets a fresh directory (and the stale one is removed).

- ``medium``: hidden 512, 8 layers (6 Gated DeltaNet + 2 attention), DeltaNet 4 / 8 heads x 64, head width
  128, full vocabulary (~0.3 B parameters): the model of the server benchmarks (batching, warm path,
  growing states, call cap, the HTTP server's model rows).
- ``medium-1024``: the release's text geometry scaled down to hidden 1,024 and 8 layers, keeping the
  attention head dims (8 q / 2 kv x 256, output gate, partial M-RoPE [11, 11, 10]) and the DeltaNet head
  dims (8 key / 16 value heads x 128), full vocabulary; a head of the release's depth at width 256 (at width
  1,024 the head would cost ~10% of this backbone's FLOPs per token instead of the release's ~0.25%). The
  model of ``benchmarks.engine_bench``, the int8 drift, the kernel comparison and the GPU check.
- ``medium-1024x4``: ``medium-1024`` with 4 layers (3 Gated DeltaNet + 1 attention): the model of the
  serving engine's targets (``bench_engine.py``).
- ``release``: the 9B release's geometry (32 layers, hidden 4,096; no weights are ever built for it: the
  int8 benchmark reads its memory need from the tensor layout).
- ``wide``: 4 layers of the release's geometry (3 Gated DeltaNet + 1 attention): built in memory with a
  small vocabulary (`text_model`), the real-width block of ``bench_realwidth.py`` and ``bench_weights.py``;
  as a checkpoint (full vocabulary, the release's head: ~5.6 GB of bf16 shards, about a minute to write),
  the real-width model that ``bench_dtype.py`` loads through ``Clef``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from clef_runtime.model.layouts import CLEF_FLASH_GEOMETRY
from clef_runtime.model.tiny import (
    TINY_FORMAT,
    Geometry,
    make_random_checkpoint,
    random_backbone_tensor,
    random_checkpoint_config,
)
from clef_runtime.release import TEXT_PREFIX

__all__ = [
    "GEOMETRIES",
    "MODEL_NAMES",
    "checkpoint",
    "checkpoint_path",
    "model_config",
    "model_directory",
    "resolve_model",
    "text_model",
]

logger = logging.getLogger("benchmarks.models")

_RELEASE = CLEF_FLASH_GEOMETRY  # the 9B release's geometry, as the package's memory planner knows it

GEOMETRIES: dict[str, Geometry] = {
    "medium": Geometry(
        hidden_size=512,
        layers=8,
        intermediate_size=1536,
        attention_heads=8,
        kv_heads=2,
        head_dim=64,
        deltanet_key_heads=4,
        deltanet_value_heads=8,
        deltanet_key_dim=64,
        deltanet_value_dim=64,
        head_width=128,
        head_routing_layers=2,
        head_layers=2,
        head_heads=4,
        head_feedforward=256,
    ),
    "medium-1024": Geometry(
        hidden_size=1024,
        layers=8,
        intermediate_size=3072,
        attention_heads=8,
        kv_heads=2,
        head_dim=256,
        deltanet_key_heads=8,
        deltanet_value_heads=16,
        deltanet_key_dim=128,
        deltanet_value_dim=128,
        head_width=256,
        head_routing_layers=2,
        head_layers=4,
        head_heads=4,
        head_feedforward=1024,
    ),
    "release": _RELEASE,
    "wide": dataclasses.replace(_RELEASE, layers=4),
}
# medium-1024 with 4 layers (3 Gated DeltaNet + 1 attention): the serving engine's target model.
GEOMETRIES["medium-1024x4"] = dataclasses.replace(GEOMETRIES["medium-1024"], layers=4)
#: The geometries written as checkpoints (``release`` is too large for that: see above).
MODEL_NAMES = ("medium", "medium-1024", "medium-1024x4", "wide")

_SHARD_BYTES = 1 << 30
_SEED = 0


def _marker(name: str) -> dict[str, Any]:
    return {"tiny": False, "untrained": True, "seed": _SEED, "format": TINY_FORMAT, "benchmark_model": name}


def model_config(name: str) -> dict[str, Any]:
    """The config.json of the named geometry's checkpoint. Raises KeyError for an unknown name."""
    return random_checkpoint_config(geometry=GEOMETRIES[name], seed=_SEED, marker=_marker(name))


def _root() -> Path:
    from clef_runtime.encoding.tokenizer import cache_dir

    return Path(cache_dir()) / "benchmarks"


def checkpoint_path(name: str) -> Path:
    """Where the named checkpoint lives: ``<cache dir>/benchmarks/<name>-<digest of its geometry>``."""
    content = {"config": model_config(name), "head": GEOMETRIES[name].head_config(), "format": TINY_FORMAT}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]
    return _root() / f"{name}-{digest}"


def checkpoint(name: str) -> Path:
    """The named checkpoint's directory, built first if it is not there (medium: ~1.2 GB, ~30 s).

    It is written into a private staging directory and renamed into place, so a concurrent or interrupted
    build never leaves a half-written checkpoint at the final path; older builds of the same name (another
    geometry) are removed. Raises KeyError for a name not in `MODEL_NAMES`, OSError on filesystem errors."""
    if name not in MODEL_NAMES:
        raise KeyError(f"no benchmark checkpoint {name!r}; use one of {', '.join(MODEL_NAMES)}")
    final = checkpoint_path(name)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        logger.info("building the %s random checkpoint in %s", name, final)
        make_random_checkpoint(
            staging / "checkpoint",
            geometry=GEOMETRIES[name],
            seed=_SEED,
            marker=_marker(name),
            shard_bytes=_SHARD_BYTES,
        )
        try:
            os.rename(staging / "checkpoint", final)
        except OSError:
            if not final.is_dir():  # not a concurrent build that finished first: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for stale in final.parent.glob(f"{name}-*"):
        if stale != final and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return final


def resolve_model(spec: str) -> str:
    """``spec`` for ``Clef.load`` / ``clef serve --model``: a name of `MODEL_NAMES` becomes its checkpoint
    directory (built if needed); anything else ("tiny", a directory, a repo id) is returned as it is."""
    return str(checkpoint(spec)) if spec in MODEL_NAMES else spec


def model_directory(spec: str) -> Path:
    """The checkpoint directory of ``spec``: a benchmark model's (built if needed), or what the package's
    resolver makes of "tiny", a directory or a repo id (downloading it if needed)."""
    if spec in MODEL_NAMES:
        return checkpoint(spec)
    from clef_runtime.model.resolve import resolve_model as resolve_release

    return Path(resolve_release(spec).path)


def text_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    *,
    vocab_size: int = 4096,
    seed: int = _SEED,
    device: str = "cpu",
) -> nn.Module:
    """The named geometry's text stack (transformers' ``Qwen3_5TextModel``) built in memory with the random
    checkpoint recipe, in ``dtype``, for timing the backbone alone.

    ``vocab_size`` shrinks the embedding (4,096 instead of 248,320: a row gather the prefill never
    multiplies by, and 4 GB at the release's width); token ids must stay below it. Built on the meta device
    and allocated once in ``dtype``, so a bf16 model never has an fp32 copy. Every dtype gets the same
    values (the recipe draws bf16). ``device="meta"`` returns the model without weights (its shapes only).
    Raises KeyError for an unknown name."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel, Qwen3_5TextRotaryEmbedding

    from clef_runtime.model.backbone import TRANSFORMERS_CONSTRUCTION_LOCK

    text = random_checkpoint_config(geometry=GEOMETRIES[name], seed=seed)["text_config"]
    # No end-of-text id: the release's lies outside the small vocabulary, and a prefill never reads it.
    config = Qwen3_5TextConfig(**{**text, "vocab_size": vocab_size, "eos_token_id": None})
    with TRANSFORMERS_CONSTRUCTION_LOCK, torch.device("meta"):
        model = Qwen3_5TextModel(config)
    if device == "meta":
        return model.eval()
    model = model.to(dtype).to_empty(device=device).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            values = random_backbone_tensor(seed, TEXT_PREFIX + parameter_name, tuple(parameter.shape))
            parameter.copy_(values)
    # inv_freq is a non-persistent buffer that to_empty left uninitialised.
    model.rotary_emb = Qwen3_5TextRotaryEmbedding(config)
    return model
