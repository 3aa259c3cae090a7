"""Tuned-head directories for tests: the tiny release head with seeded noise on every tensor, written in the
release layout (safetensors + config), so that its answers differ clearly from the release head's."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from clef_runtime.model.head import JointSchemaHead
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE


def write_tuned_head(checkpoint: Path, directory: Path, *, seed: int, scale: float = 0.5) -> Path:
    """Write a perturbed copy of ``checkpoint``'s head to ``directory`` (created) and return it."""
    head = JointSchemaHead.from_files(checkpoint)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in head.state_dict().items():
        spread = float(tensor.std()) if tensor.numel() > 1 else 1.0
        noise = torch.randn(tensor.shape, generator=generator) * scale * max(spread, 0.05)
        state[name] = (tensor + noise).contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / HEAD_WEIGHTS_FILE))
    shutil.copyfile(checkpoint / HEAD_CONFIG_FILE, directory / HEAD_CONFIG_FILE)
    return directory
