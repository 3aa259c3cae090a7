"""fla's Triton causal conv in place of causal-conv1d: the adapter maps transformers' ``causal_conv1d_fn`` /
``causal_conv1d_update`` arguments onto fla's ``causal_conv1d``.

Triton does not run on CPU, so fla's conv is replaced here by `documented_fla_conv`: the math fla's docstring
and kernel state, in float64, with the layouts it documents checked. The adapter's output (and conv state)
must equal transformers' own torch reference; the same comparison fails for an adapter that hands fla
transformers' layout unchanged (the negative control). The device check compares fused and reference hidden
rows on a GPU with the real kernel."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from clef_runtime.model import fused
from clef_runtime.model.fused import (
    fla_causal_conv1d_fn,
    fla_causal_conv1d_update,
    fused_kernels_status,
    reset_fused_call_counts,
    set_fused_kernels,
)

WIDTH = 4  # Qwen3.5's linear_conv_kernel_dim


def documented_fla_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """fla's ``causal_conv1d`` as documented: ``x`` [B, T, D], ``weight`` [D, W], ``bias`` [D],
    ``initial_state`` [N, D, W] whose last column is the input before ``x``'s first; output [B, T, D] with
    ``y[t] = act(bias + sum_w weight[:, w] * x[t - (W - 1) + w])``, computed in float64."""
    batch, time, channels = x.shape
    width = weight.shape[1]
    assert weight.shape == (channels, width), f"weight {tuple(weight.shape)} is not [D, W] for x [B, T, D]"
    assert residual is None and not output_final_state
    if initial_state is None:
        before = torch.zeros(batch, channels, width - 1, dtype=torch.float64)
    else:
        assert initial_state.shape == (batch, channels, width), "initial_state is not [N, D, W]"
        before = initial_state[..., 1:].double()
    inputs = torch.cat([before.transpose(1, 2), x.double()], dim=1)  # [B, W - 1 + T, D]
    y = sum(weight[:, w].double() * inputs[:, w : w + time] for w in range(width))
    if bias is not None:
        y = y + bias.double()
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y.to(x.dtype), None


def _reference(name: str) -> Callable[..., Tensor]:
    """transformers' own torch code for ``name`` (what runs without causal-conv1d)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    return inspect.unwrap(getattr(module, name))  # type: ignore[no-any-return]


def _inputs(channels: int, time: int, bias: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    generator = torch.Generator().manual_seed(channels * 100 + time)
    x = torch.randn(2, channels, time, generator=generator)
    weight = torch.randn(channels, WIDTH, generator=generator)
    return x, weight, torch.randn(channels, generator=generator) if bias else None


@pytest.mark.parametrize(("bias", "activation"), [(True, "silu"), (False, None)])
def test_the_conv_equals_transformers_reference(bias: bool, activation: str | None) -> None:
    x, weight, b = _inputs(6, 9, bias)
    expected = _reference("causal_conv1d_fn")(x, weight, b, activation=activation)
    got = fla_causal_conv1d_fn(documented_fla_conv, x, weight, b, activation=activation)
    assert got.shape == expected.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_len", [WIDTH - 1, WIDTH, WIDTH + 2])
@pytest.mark.parametrize("time", [1, 3])
def test_the_update_equals_transformers_reference_and_moves_the_state_alike(
    state_len: int, time: int
) -> None:
    x, weight, b = _inputs(6, time)
    state = torch.randn(2, 6, state_len, generator=torch.Generator().manual_seed(state_len))
    expected_state, got_state = state.clone(), state.clone()
    expected = _reference("causal_conv1d_update")(x, expected_state, weight, b, "silu")
    got = fla_causal_conv1d_update(documented_fla_conv, x, got_state, weight, b, "silu")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state, expected_state, rtol=0, atol=0)


def test_a_wrong_layout_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: transformers' [batch, channels, time] handed to fla as if it were [B, T, D]
    (square, so that every shape check passes) gives other numbers, which the comparison above catches."""
    monkeypatch.setattr(fused, "_to_fla", lambda hidden_states: hidden_states)
    monkeypatch.setattr(fused, "_from_fla", lambda output: output)
    x, weight, b = _inputs(6, 6)
    expected = _reference("causal_conv1d_fn")(x, weight, b, activation="silu")
    got = fla_causal_conv1d_fn(documented_fla_conv, x, weight, b, activation="silu")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match=r"not \[D, W\]"):
        fla_causal_conv1d_fn(documented_fla_conv, *_inputs(6, 9)[:2])


def test_what_fla_cannot_do_is_refused() -> None:
    x, weight, _ = _inputs(6, 5)
    with pytest.raises(ValueError, match="gelu"):
        fla_causal_conv1d_fn(documented_fla_conv, x, weight, activation="gelu")
    with pytest.raises(ValueError, match="seq_idx"):
        fla_causal_conv1d_fn(documented_fla_conv, x, weight, seq_idx=torch.zeros(2, 5, dtype=torch.int32))


@pytest.fixture
def fla_conv_in_place(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """fla "installed" (its conv: `documented_fla_conv`) while causal-conv1d is not; put back afterwards."""
    monkeypatch.setattr(fused, "_fla_causal_conv1d", lambda: documented_fla_conv)
    try:
        yield
    finally:
        monkeypatch.undo()
        set_fused_kernels(True)


@pytest.mark.usefixtures("fla_conv_in_place")
def test_the_adapter_takes_the_conv_names_and_the_status_says_fla() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    set_fused_kernels(True)
    status = fused_kernels_status()
    assert status["conv"] == "fla"
    assert status["active"]["causal_conv1d_fn"] and status["active"]["causal_conv1d_update"]
    set_fused_kernels(False)  # --no-fused-kernels: the reference conv, said so
    assert fused_kernels_status()["conv"] == "reference"
    assert not fused_kernels_status()["active"]["causal_conv1d_fn"]
    set_fused_kernels(True)
    # CPU tensors, which Triton cannot take, go to transformers' code, counted as reference calls.
    reset_fused_call_counts()
    x, weight, b = _inputs(6, 9)
    torch.testing.assert_close(
        module.causal_conv1d_fn(x, weight, b, activation="silu"),
        _reference("causal_conv1d_fn")(x, weight, b, activation="silu"),
    )
    assert fused_kernels_status()["calls"]["causal_conv1d_fn"] == {"fused": 0, "reference": 1}


@pytest.mark.usefixtures("fla_conv_in_place")
def test_the_model_through_the_adapter_equals_the_reference(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' own DeltaNet forward, calling the conv names as it does, through the adapter (the CPU
    taken for a device, as a GPU would be): the same hidden rows as the reference conv, counted as fused.
    Chunks of 30, 30 and 1 tokens: the conv continues from the cache, the last chunk by the one-token
    update."""
    from clef_runtime.model.backbone import Backbone

    backbone = Backbone.load(tiny_dir, device="cpu", dtype="fp32", cpu_kernels=False)
    tokens = list(range(100, 161))
    set_fused_kernels(False)
    expected = backbone.hidden_states(tokens, prefill_chunk=30)
    monkeypatch.setattr(fused, "_on_cpu", lambda args: False)
    set_fused_kernels(True)
    reset_fused_call_counts()
    got = backbone.hidden_states(tokens, prefill_chunk=30)
    calls = fused_kernels_status()["calls"]
    assert calls["causal_conv1d_fn"]["fused"] > 0 and calls["causal_conv1d_update"]["fused"] > 0
    assert calls["causal_conv1d_fn"]["reference"] == calls["causal_conv1d_update"]["reference"] == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
