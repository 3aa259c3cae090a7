"""A random model of any release geometry built directly on a device: no checkpoint, no download.

The 9B release is 19 GB of shards; a random model of its geometry written to disk and read back would cost
minutes of a device call that has eight. `build_device_model` builds the same parts `Clef.load` reads
(transformers' text model, the joint head, the ``lm_head`` table, the tokenizer) on the meta device, allocates
them once on the target device (``to_empty``) and fills every tensor in place from a seeded generator on that
device, then wraps them in a `LoadedModel` that ``Clef(model, options)`` serves like a loaded release.

The weights follow the random checkpoints' recipe (`clef_runtime.model.tiny.random_backbone_tensor`: the same
law for each kind of tensor), with one change for depth: the projections that write into the residual stream
(attention ``o_proj``, DeltaNet ``out_proj``, MLP ``down_proj``) are scaled by ``1 / sqrt(2 * layers)`` so
that 32 layers of random blocks keep the residual stream near unit scale instead of growing with depth.
Values are deterministic in (seed, tensor name, device type) but differ from a written checkpoint's (drawn
by numpy on the CPU): compare a device model with `write_checkpoint` of itself, not with
`make_random_checkpoint`.

The backbone computes in ``dtype`` (bf16 on CUDA, fp32 on CPU by default), the head in fp32, the ``lm_head``
table is kept in bf16 as published; the tokenizer is the built-in Qwen3.5 one that random checkpoints copy.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from clef_runtime.encoding.tokenizer import ClefTokenizer
from clef_runtime.engine.clef import LoadedModel
from clef_runtime.model.backbone import TRANSFORMERS_CONSTRUCTION_LOCK, Backbone
from clef_runtime.model.compute_dtype import dtype_name
from clef_runtime.model.device import resolve_device
from clef_runtime.model.fused import quiet_fallback_advice, set_fused_kernels
from clef_runtime.model.head import JointSchemaHead
from clef_runtime.model.kernels import install_cpu_kernels
from clef_runtime.model.lexical import LexicalTable
from clef_runtime.model.resolve import ResolvedModel, resolve_model
from clef_runtime.model.tiny import TINY_FORMAT, Geometry, random_checkpoint_config
from clef_runtime.release import (
    CONFIG_FILE,
    INDEX_FILE,
    LM_HEAD_TENSOR,
    PROCESSOR_CONFIG_FILE,
    TEXT_PREFIX,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from clef_runtime.vision.tower import VisionTower

__all__ = ["DeviceModel", "build_device_model", "write_checkpoint"]

#: Bump when the recipe below changes (part of the head's in-memory digest).
DEVICE_MODEL_FORMAT = 1

#: Leaves of the projections that add into the residual stream (scaled down with depth, see the docstring).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")

_SHARD = "model-00001-of-00001.safetensors"

#: A tensor's law: ("normal", mean, std), ("uniform", low, high) or ("log_uniform", low, high).
Law = tuple[str, float, float]


@dataclass(frozen=True)
class DeviceModel:
    """A random model built on a device: the `LoadedModel` an engine serves and what it was built from:
    ``config`` is its config.json (what `write_checkpoint` writes), ``build_s`` the seconds from the meta
    model to the last tensor filled (the device synchronised)."""

    loaded: LoadedModel
    geometry: Geometry
    config: dict[str, Any]
    seed: int
    build_s: float

    def parameter_counts(self) -> dict[str, int]:
        """Parameters held: the text backbone (embeddings included), ``lm_head``, the joint head, all."""
        counts = {
            "backbone": self.loaded.backbone.num_parameters,
            "lm_head": self.loaded.lexical.weight.numel(),
            "head": sum(parameter.numel() for parameter in self.loaded.head.parameters()),
        }
        counts["total"] = sum(counts.values())
        return counts

    def record(self) -> dict[str, Any]:
        """What a report says about this model: geometry, parameter counts, dtypes, device, random weights."""
        text = self.config["text_config"]
        backbone = self.loaded.backbone
        return {
            "name": self.loaded.resolved.name,
            "layers": int(text["num_hidden_layers"]),
            "hidden": int(text["hidden_size"]),
            "vocab": int(text["vocab_size"]),
            "layer_types": {
                kind: text["layer_types"].count(kind) for kind in sorted(set(text["layer_types"]))
            },
            "head_config": self.loaded.head.config,
            "parameters": self.parameter_counts(),
            "compute_dtype": backbone.dtype_name,
            "head_dtype": dtype_name(self.loaded.head.prior_logit_scale.dtype),
            "lm_head_dtype": dtype_name(self.loaded.lexical.dtype),
            "device": str(backbone.device),
            "weights": f"random (seed {self.seed}), built on the device in {self.build_s:.1f} s",
            "random_weights": True,
        }


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    """A generator for one tensor, keyed by (seed, name): a tensor's values do not depend on the others."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode("utf-8")))
    return generator


def backbone_law(name: str, shape: tuple[int, ...], layers: int) -> Law:
    """The law of the text-model tensor ``name`` (a ``Qwen3_5TextModel`` name): the random checkpoints'
    recipe, with the residual-stream outputs scaled by ``1 / sqrt(2 * layers)``."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.A_log"):
        return ("log_uniform", 0.02, 0.5)  # decay rates: the DeltaNet state carries over tens of tokens
    if name.endswith("linear_attn.dt_bias"):
        return ("uniform", -1.0, 1.0)
    if name.endswith("linear_attn.norm.weight"):
        return ("normal", 1.0, 0.1)  # the gated RMSNorm multiplies by its weight
    if leaf == "weight" and len(shape) == 1:
        return ("normal", 0.0, 0.1)  # zero-centred RMSNorms: y = x_hat * (1 + w)
    if leaf == "bias":
        return ("normal", 0.0, 0.02)
    if name.endswith("embed_tokens.weight"):
        return ("normal", 0.0, 1.0)
    if name.endswith("conv1d.weight"):
        return ("normal", 0.0, 0.5)
    std = math.prod(shape[1:]) ** -0.5
    if name.endswith(_RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * layers)
    return ("normal", 0.0, std)


def head_law(name: str, shape: tuple[int, ...]) -> Law:
    """The law of the joint head's tensor ``name`` (the random checkpoints' head recipe)."""
    if len(shape) == 0:  # prior_logit_scale, joint_logit_scale, residual_gate
        return ("normal", 0.0, 0.5)
    if "norm" in name and name.endswith("weight"):
        return ("normal", 1.0, 0.1)
    if len(shape) == 1:
        return ("normal", 0.0, 0.02)
    return ("normal", 0.0, math.prod(shape[1:]) ** -0.5)


def _fill_(tensor: Tensor, law: Law, generator: torch.Generator) -> None:
    """Draw ``tensor``'s values in place (on its device, in its dtype; log-uniform draws in fp32)."""
    kind, first, second = law
    if kind == "normal":
        tensor.normal_(first, second, generator=generator)
    elif kind == "uniform":
        tensor.uniform_(first, second, generator=generator)
    else:
        draws = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
        tensor.copy_(draws.uniform_(first, second, generator=generator).log_())


def _materialise(module: nn.Module, device: torch.device, seed: int, prefix: str, law: Any) -> None:
    """Allocate ``module``'s meta tensors on ``device`` and fill each from its own generator; ``law(name,
    shape)`` gives each tensor's law (names with ``prefix``, the checkpoint's names)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            _fill_(
                parameter, law(prefix + name, tuple(parameter.shape)), _generator(device, seed, prefix + name)
            )


def _text_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """Transformers' ``Qwen3_5TextModel`` of ``config``, built on meta, allocated in ``dtype`` on ``device``,
    filled with `backbone_law`; its rotary table rebuilt in fp32 as `Backbone.load` does."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel, Qwen3_5TextRotaryEmbedding

    text_config = Qwen3_5Config.from_dict(config).text_config
    assert isinstance(text_config, Qwen3_5TextConfig)
    text_config._attn_implementation = "sdpa"
    text_config.use_cache = False
    with TRANSFORMERS_CONSTRUCTION_LOCK, torch.device("meta"):
        model = Qwen3_5TextModel(text_config)
    nn.Module.to(model, dtype)  # transformers types its own to() for models, not dtypes
    layers = int(text_config.num_hidden_layers)
    _materialise(model, device, seed, TEXT_PREFIX, lambda name, shape: backbone_law(name, shape, layers))
    with TRANSFORMERS_CONSTRUCTION_LOCK, torch.device(device):
        model.rotary_emb = Qwen3_5TextRotaryEmbedding(config=text_config)
    return model.eval().requires_grad_(False)


def _head(geometry: Geometry, device: torch.device, seed: int) -> JointSchemaHead:
    with torch.device("meta"):
        head = JointSchemaHead(**geometry.head_config())
    head.float()
    _materialise(head, device, seed + 1, "", head_law)
    return head.eval()


def _lm_head(vocab: int, hidden: int, device: torch.device, seed: int) -> Tensor:
    table = torch.empty((vocab, hidden), dtype=torch.bfloat16, device=device)
    _fill_(table, ("normal", 0.0, hidden**-0.5), _generator(device, seed, LM_HEAD_TENSOR))
    return table


def _head_digest(geometry: Geometry, seed: int, device: torch.device) -> str:
    """The in-memory head's identity: what determines its values (there are no files to hash)."""
    recipe = {
        "head": geometry.head_config(),
        "seed": seed,
        "device_type": device.type,
        "format": DEVICE_MODEL_FORMAT,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode("utf-8")).hexdigest()


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_device_model(
    geometry: Geometry,
    *,
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    name: str = "random-release",
) -> DeviceModel:
    """Build a random model of ``geometry`` (full vocabulary) directly on ``device`` (``auto``: CUDA when
    available); ``dtype``: the backbone's compute and storage dtype (None: bf16 on CUDA, fp32 on CPU).

    Prepares the device as `Backbone.load` does (CPU: clef-runtime's DeltaNet kernels; off CPU: the fused
    kernels on, `clef_runtime.model.fused.set_fused_kernels` toggles them). Serve it with
    ``Clef(model.loaded, options)``; its card says untrained. Raises ValueError for a bad device."""
    resolved_device = resolve_device(device)
    compute_dtype = dtype or (torch.float32 if resolved_device.type == "cpu" else torch.bfloat16)
    quiet_fallback_advice(resolved_device.type)
    if resolved_device.type != "cpu":
        set_fused_kernels(True)
    config = random_checkpoint_config(
        geometry=geometry,
        seed=seed,
        marker={"tiny": False, "untrained": True, "seed": seed, "format": TINY_FORMAT, "in_memory": True},
    )
    started = time.perf_counter()
    model = _text_model(config, resolved_device, compute_dtype, seed)
    if resolved_device.type == "cpu":
        install_cpu_kernels(model)
    text = config["text_config"]
    lm_head = _lm_head(int(text["vocab_size"]), int(text["hidden_size"]), resolved_device, seed)
    head = _head(geometry, resolved_device, seed)
    _synchronise(resolved_device)
    build_s = time.perf_counter() - started
    path = Path(f"<in-memory {name}>")  # no directory: nothing is read from it (no processor config)
    backbone = Backbone(
        model,
        path=path,
        compute_dtype=compute_dtype,
        dtype_reason=f"random weights built on {resolved_device} in {dtype_name(compute_dtype)}",
    )
    loaded = LoadedModel(
        resolved=ResolvedModel(path=path, name=name, revision=None, is_tiny=True),  # is_tiny: untrained
        tokenizer=ClefTokenizer.load(None),  # the built-in tokenizer random checkpoints copy
        backbone=backbone,
        head=head,
        lexical=LexicalTable(lm_head),
        vision_tower=VisionTower(None, device=resolved_device, dtype=compute_dtype),
        head_digest=_head_digest(geometry, seed, resolved_device),
    )
    return DeviceModel(loaded=loaded, geometry=geometry, config=config, seed=seed, build_s=build_s)


def _cpu_tensors(module: nn.Module, prefix: str) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in module.state_dict().items():
        yield prefix + name, tensor.detach().to("cpu").contiguous()


def write_checkpoint(model: DeviceModel, directory: str | Path) -> Path:
    """Write ``model``'s tensors as a release checkpoint in ``directory`` (one shard with the text tensors
    in their stored dtype and ``lm_head``, the head's files, config.json, the tiny checkpoint's tokenizer and
    processor files), so that ``Clef.load(directory)`` serves the same weights: the parity check of the
    builder. Small models only (everything goes through host memory at once). Returns the directory."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    loaded = model.loaded
    tensors = dict(_cpu_tensors(loaded.backbone.model, TEXT_PREFIX))
    tensors = {name: tensor for name, tensor in tensors.items() if "rotary_emb" not in name}
    tensors[LM_HEAD_TENSOR] = loaded.lexical.weight.detach().to("cpu").contiguous()
    save_file(tensors, str(target / _SHARD), metadata={"format": "pt"})
    index = {
        "metadata": {
            "total_size": sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        },
        "weight_map": dict.fromkeys(sorted(tensors), _SHARD),
    }
    (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    loaded.head.save_files(target)
    (target / CONFIG_FILE).write_text(json.dumps(model.config, indent=2) + "\n", encoding="utf-8")
    tiny = resolve_model("tiny").path  # its tokenizer and processor files are the release's own
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, PROCESSOR_CONFIG_FILE):
        shutil.copyfile(tiny / name, target / name)
    return target
