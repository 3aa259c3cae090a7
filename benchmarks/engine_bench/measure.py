"""What a measurement needs: device synchronisation, peak RSS, the backbone's FLOP model."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch
from devtools.gemm import linear_modules
from torch import Tensor, nn

# ------------------------------------------------------------------------------------------ machine


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- memory


def _reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (Linux ``clear_refs`` 5); returns whether that worked."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB (since the last reset, where resets work)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 1024 / (1024 if sys.platform == "darwin" else 1), 1)


# ---------------------------------------------------------------------------------------- FLOP model


def _text_model(model: nn.Module) -> nn.Module:
    return getattr(model, "language_model", model)


def linear_weights(model: nn.Module) -> tuple[int, int]:
    """(floating, int8) weights of the decoder layers' Linear layers (`linear_modules`: `Int8Linear` is not
    an ``nn.Linear``). The int8 ones run on int8 GEMMs (``--weights int8``) and are judged against that
    limit."""
    floating = int8 = 0
    for module in linear_modules(_text_model(model).layers):
        weights = module.in_features * module.out_features
        weight = getattr(module, "weight", None)
        if isinstance(weight, Tensor) and weight.dtype == torch.int8:
            int8 += weights
        else:
            floating += weights
    return floating, int8


def backbone_flops(model: nn.Module, tokens: int, context: int = 0) -> float:
    """Useful FLOPs of a prefill of ``tokens`` tokens after ``context`` cached ones on a Qwen3.5 text model.

    Counted: every Linear layer of the decoder layers, int8 ones included (2 x weights per token, see
    `linear_weights`); causal attention scores and value mixing in the full-attention layers (4 x heads x
    head_dim per query-key pair, keys 1..t for the query at position t); the Gated DeltaNet recurrence (6 x
    key_dim x value_dim per value head per token: read-out, the delta correction and the state update); the
    depthwise causal convolution. Not counted: norms, activations, gates, padding. Returns the total as a
    float.
    """
    text = _text_model(model)
    config = text.config
    total = 2.0 * sum(linear_weights(text)) * tokens
    layer_types = list(config.layer_types)
    attention_layers = layer_types.count("full_attention")
    linear_layers = layer_types.count("linear_attention")
    # sum_{t = context + 1}^{context + tokens} t: the number of (query, key) pairs under the causal mask.
    pairs = tokens * context + tokens * (tokens + 1) / 2
    total += attention_layers * 4.0 * config.num_attention_heads * config.head_dim * pairs
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    total += linear_layers * 6.0 * config.linear_num_value_heads * key_dim * value_dim * tokens
    conv_channels = 2 * config.linear_num_key_heads * key_dim + config.linear_num_value_heads * value_dim
    total += linear_layers * 2.0 * config.linear_conv_kernel_dim * conv_channels * tokens
    return total


def int8_flops(model: nn.Module, tokens: int) -> float:
    """The part of `backbone_flops` for ``tokens`` computed tokens that runs on int8 GEMMs (int8 operations,
    2 x int8 weights per token); 0 for a model without int8 layers."""
    return 2.0 * linear_weights(model)[1] * tokens
