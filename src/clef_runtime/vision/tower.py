"""The Qwen3.5 vision tower (transformers' ``Qwen3_5VisionModel``), loaded lazily from a release checkpoint.

Only the ``model.visual.*`` tensors are read, through the shared shard reader (`clef_runtime.shards`:
the shards named by ``model.safetensors.index.json``, or a single ``model.safetensors``); the module is built
from the ``vision_config`` of the checkpoint's ``config.json``. Nothing is executed from the checkpoint (no
``trust_remote_code``, no pickle). Nothing is read until the first :meth:`VisionTower.embed` (or an explicit
:meth:`VisionTower.load`).

Weights are cast to ``dtype`` (fp32 by default: on CPUs without bf16 FMA the fp32 GEMMs are several times
faster than bf16 ones). :meth:`VisionTower.embed` always returns fp32 tensors on the CPU.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clef_runtime.release import CONFIG_FILE, VISION_PREFIX
from clef_runtime.shards import ShardError, open_index, read_tensors
from clef_runtime.vision.preprocess import PATCH_DIM, PreprocessedImage

__all__ = ["VisionTower", "read_vision_state_dict"]


def read_vision_state_dict(
    checkpoint_dir: str | Path, *, prefix: str = VISION_PREFIX, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """Read only the tensors named ``prefix*`` from the checkpoint's safetensors files
    (`clef_runtime.shards`: the index, or a single ``model.safetensors``).

    Returns them keyed without the prefix (``patch_embed.proj.weight``, ...), cast to ``dtype`` (``None``:
    as stored). Raises ``FileNotFoundError`` (a `ShardsNotFoundError`) when the directory has neither
    ``model.safetensors.index.json`` nor ``model.safetensors``, ``ValueError`` (a `ShardError`) when no tensor
    has the prefix, the index names a file outside the directory or a shard cannot be read.
    """
    root = Path(checkpoint_dir)
    index = open_index(root)
    names = index.names(prefix)
    if not names:
        raise ShardError(f"no vision tower tensors ({prefix}*) in the checkpoint at {root}", root)
    return {
        name[len(prefix) :]: tensor if dtype is None else tensor.to(dtype)
        for name, tensor in read_tensors(index, names)
    }


def _read_vision_config(checkpoint_dir: Path) -> dict[str, Any]:
    config = json.loads((checkpoint_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{checkpoint_dir / CONFIG_FILE} has no vision_config")
    return vision


def _build_module(vision_config: dict[str, Any], state: dict[str, torch.Tensor], device: torch.device) -> Any:
    """A ``Qwen3_5VisionModel`` holding ``state`` (strict), without random initialisation of the weights."""
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionRotaryEmbedding

    config = Qwen3_5VisionConfig(**vision_config)
    with torch.device("meta"):
        module = Qwen3_5VisionModel(config)
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"vision tower weights do not match its config: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}"
        )
    # Non-persistent buffers (the rotary inverse frequencies) are not in the checkpoint: rebuild them.
    module.rotary_pos_emb = Qwen3_5VisionRotaryEmbedding(config)
    # transformers declares PreTrainedModel.to through functools.wraps(nn.Module.to), which its types read
    # as a function still expecting `self`: the call is nn.Module.to's (device) -> module.
    module = module.to(device)  # type: ignore[arg-type]
    leftover = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"vision tower tensors left uninitialised: {leftover[:8]}")
    return module.eval().requires_grad_(False)


class VisionTower:
    """Lazily loaded Qwen3.5 vision tower.

    ``VisionTower(checkpoint_dir, device="cpu", dtype=torch.float32)``; ``embed(images)`` loads on first
    use; ``unload()`` frees the weights (a later ``embed`` loads them again).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path | None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix: str = VISION_PREFIX,
    ) -> None:
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefix = prefix
        self._module: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_module(cls, module: Any) -> VisionTower:
        """Wrap an already built ``Qwen3_5VisionModel`` (tests, benchmarks). ``unload()`` then drops it for
        good (there is no checkpoint to reload from)."""
        parameter = next(module.parameters())
        tower = cls(None, device=parameter.device, dtype=parameter.dtype)
        tower._module = module.eval().requires_grad_(False)
        return tower

    @property
    def loaded(self) -> bool:
        """Whether the weights are in memory."""
        return self._module is not None

    @property
    def out_hidden_size(self) -> int:
        """Width of the image embeddings (the backbone's hidden size), read from the config (no load)."""
        if self._module is not None:
            return int(self._module.config.out_hidden_size)
        if self.checkpoint_dir is None:
            raise RuntimeError("this vision tower was unloaded and has no checkpoint")
        return int(_read_vision_config(self.checkpoint_dir)["out_hidden_size"])

    def load(self) -> Any:
        """Load the weights now if they are not loaded yet. Returns the ``Qwen3_5VisionModel``.

        Raises ``FileNotFoundError`` / ``ValueError`` for a checkpoint without a usable vision tower.
        """
        with self._lock:
            if self._module is None:
                if self.checkpoint_dir is None:
                    raise RuntimeError("this vision tower was unloaded and has no checkpoint")
                vision_config = _read_vision_config(self.checkpoint_dir)
                state = read_vision_state_dict(self.checkpoint_dir, prefix=self.prefix, dtype=self.dtype)
                self._module = _build_module(vision_config, state, self.device)
            return self._module

    def unload(self) -> None:
        """Drop the weights (the next :meth:`embed` loads them again)."""
        with self._lock:
            self._module = None

    def embed(self, images: Sequence[PreprocessedImage]) -> list[torch.Tensor]:
        """Run the tower on ``images`` in one pass (attention never crosses images).

        Returns one fp32 CPU tensor [n_tokens_i, out_hidden_size] per image, rows in the merged grid's
        row-major order (the order of the image's ``<|image_pad|>`` tokens).
        Raises ``ValueError`` when an image's ``pixel_values`` do not match its ``grid_thw``.
        """
        if not images:
            return []
        for number, image in enumerate(images):
            t, gh, gw = image.grid_thw
            expected = (t * gh * gw, PATCH_DIM)
            if tuple(image.pixel_values.shape) != expected:
                raise ValueError(
                    f"image {number}: pixel_values {tuple(image.pixel_values.shape)} != {expected}"
                )
        module = self.load()
        pixel_values = torch.cat([image.pixel_values for image in images]).to(self.device, self.dtype)
        grid_thw = torch.tensor([image.grid_thw for image in images], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            merged = module(pixel_values, grid_thw=grid_thw).pooler_output
        merged = merged.to(device="cpu", dtype=torch.float32)
        return list(torch.split(merged, [image.n_tokens for image in images]))
