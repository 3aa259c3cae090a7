"""bf16 weight storage with fp32 compute: same results as an fp32 model with bf16-rounded weights."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from clef_runtime.model.kernels import install_cpu_kernels
from clef_runtime.model.weights import (
    apply_bf16_storage,
    choose_weight_mode,
    has_fast_bf16_matmul,
    parameter_bytes,
    set_linear_compute_dtype,
)

GIB = 1 << 30


def small_config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    )


@pytest.fixture(scope="module")
def fp32_model() -> hf_qwen3_5.Qwen3_5TextModel:
    torch.manual_seed(0)
    model = hf_qwen3_5.Qwen3_5TextModel(small_config()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
            elif name.endswith("A_log"):
                # Mild decays: transformers' init (rates up to 16) drives the reference delta rule into
                # denormals, which makes each reference forward here take seconds; decays are
                # covered by the kernel tests.
                parameter.copy_(torch.empty_like(parameter).uniform_(0.01, 0.5).log())
    return model


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(1))


def rounded_copy(model: torch.nn.Module, *, everything: bool = False) -> torch.nn.Module:
    """An fp32 copy whose Linear and Embedding weights (or all parameters) were rounded to bf16."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            for name, parameter in module.named_parameters(recurse=False):
                big_weight = name == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
                if everything or big_weight:
                    parameter.copy_(parameter.bfloat16().float())
    return rounded


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run this module single-threaded: its many small ops stall at OpenMP barriers when the
    2-core machine is shared (measured: the same module took 6 s alone and 70 s under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_bf16_storage_equals_fp32_with_rounded_weights(
    fp32_model: torch.nn.Module, ids: torch.Tensor
) -> None:
    reference = rounded_copy(fp32_model)
    stored = copy.deepcopy(fp32_model)
    apply_bf16_storage(stored)
    with torch.inference_mode():
        expected = reference(input_ids=ids).last_hidden_state
        out = stored(input_ids=ids).last_hidden_state
        again = stored(input_ids=ids).last_hidden_state  # the scratch is reused across calls
    assert out.dtype == torch.float32
    assert max_abs(out, expected) < 1e-4
    assert torch.equal(out, again)
    # Not vacuous: rounding the weights moves the output by much more than the tolerance.
    with torch.inference_mode():
        assert max_abs(fp32_model(input_ids=ids).last_hidden_state, expected) > 1e-3


def test_bf16_storage_with_kernels_and_chunked_prefill(
    fp32_model: torch.nn.Module, ids: torch.Tensor
) -> None:
    reference = rounded_copy(fp32_model)
    stored = copy.deepcopy(fp32_model)
    apply_bf16_storage(stored)
    assert install_cpu_kernels(stored) == 3
    with torch.inference_mode():
        expected = reference(input_ids=ids).last_hidden_state
        cache = DynamicCache(config=stored.config)
        parts = [
            stored(input_ids=ids[:, start : start + 64], cache=cache, use_cache=True).last_hidden_state
            for start in range(0, ids.shape[1], 64)
        ]
    assert max_abs(torch.cat(parts, dim=1), expected) < 1e-4


def test_storage_dtypes_and_bytes(fp32_model: torch.nn.Module) -> None:
    stored = copy.deepcopy(fp32_model)
    big_numel = sum(
        module.weight.numel()
        for module in stored.modules()
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
    )
    all_numel = sum(parameter.numel() for parameter in stored.parameters())
    assert parameter_bytes(stored) == 4 * all_numel
    apply_bf16_storage(stored)
    assert parameter_bytes(stored) == 2 * big_numel + 4 * (all_numel - big_numel)
    # The Linear and Embedding weights are nearly all of it: the bytes almost halve.
    assert parameter_bytes(stored) < 0.52 * 4 * all_numel
    gdn = stored.layers[0].linear_attn
    assert gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert stored.embed_tokens.weight.dtype == torch.bfloat16
    for small in (gdn.A_log, gdn.dt_bias, gdn.conv1d.weight, gdn.norm.weight, stored.norm.weight):
        assert small.dtype == torch.float32
    assert stored.rotary_emb.inv_freq.dtype == torch.float32


def test_model_cast_to_bf16_gets_fp32_small_params_and_exact_rope(
    fp32_model: torch.nn.Module, ids: torch.Tensor
) -> None:
    """The way a bf16 checkpoint arrives: every tensor bf16, including the RoPE frequencies."""
    loaded = copy.deepcopy(fp32_model).to(torch.bfloat16)
    assert loaded.rotary_emb.inv_freq.dtype == torch.bfloat16
    apply_bf16_storage(loaded)
    assert torch.equal(loaded.rotary_emb.inv_freq, fp32_model.rotary_emb.inv_freq)
    reference = rounded_copy(fp32_model, everything=True)
    with torch.inference_mode():
        out = loaded(input_ids=ids).last_hidden_state
        expected = reference(input_ids=ids).last_hidden_state
    assert out.dtype == torch.float32
    assert max_abs(out, expected) < 1e-4


def test_bf16_compute_is_close_and_returns_fp32(fp32_model: torch.nn.Module, ids: torch.Tensor) -> None:
    reference = rounded_copy(fp32_model)
    fast = copy.deepcopy(fp32_model)
    apply_bf16_storage(fast, compute_dtype=torch.bfloat16)
    with torch.inference_mode():
        out = fast(input_ids=ids).last_hidden_state
        expected = reference(input_ids=ids).last_hidden_state
    assert out.dtype == torch.float32
    # Activations are rounded to bf16 at every Linear: close, not equal.
    assert 0 < max_abs(out, expected) < 0.1


def test_switching_compute_dtype_back_and_forth(fp32_model: torch.nn.Module, ids: torch.Tensor) -> None:
    model = copy.deepcopy(fp32_model)
    apply_bf16_storage(model)
    with torch.inference_mode():
        fp32_out = model(input_ids=ids).last_hidden_state
        set_linear_compute_dtype(model, torch.bfloat16)
        bf16_out = model(input_ids=ids).last_hidden_state
        set_linear_compute_dtype(model, torch.float32)
        back = model(input_ids=ids).last_hidden_state
    assert not torch.equal(bf16_out, fp32_out)
    assert torch.equal(back, fp32_out)
    with pytest.raises(ValueError, match="apply_bf16_storage"):
        set_linear_compute_dtype(copy.deepcopy(fp32_model), torch.bfloat16)
    with pytest.raises(ValueError, match="compute_dtype"):
        set_linear_compute_dtype(model, torch.float16)


def test_apply_rejects_bad_arguments_and_second_application(fp32_model: torch.nn.Module) -> None:
    model = copy.deepcopy(fp32_model)
    with pytest.raises(ValueError, match="compute_dtype"):
        apply_bf16_storage(model, compute_dtype=torch.float16)
    apply_bf16_storage(model)
    with pytest.raises(ValueError, match="already"):
        apply_bf16_storage(model)


def test_choose_weight_mode() -> None:
    nine_b_fp32 = 4 * 7_937_000_000
    assert choose_weight_mode(nine_b_fp32, 24 * GIB) == "bf16-storage"
    assert choose_weight_mode(nine_b_fp32, 64 * GIB) == "fp32"
    tiny = 4 * 1_000_000
    assert choose_weight_mode(tiny, 8 * GIB) == "fp32"
    # Default headroom: 3 GiB + 10 % of the fp32 bytes.
    ten_gib = 10 * GIB
    assert choose_weight_mode(ten_gib, ten_gib + 4 * GIB) == "fp32"
    assert choose_weight_mode(ten_gib, ten_gib + 3 * GIB) == "bf16-storage"
    assert choose_weight_mode(ten_gib, ten_gib, headroom_bytes=0) == "fp32"
    with pytest.raises(ValueError):
        choose_weight_mode(-1, GIB)


def test_has_fast_bf16_matmul_reads_cpu_flags(tmp_path: Path) -> None:
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma f16c\n")
    assert has_fast_bf16_matmul(amx)
    assert not has_fast_bf16_matmul(avx2)
    assert not has_fast_bf16_matmul(tmp_path / "missing")
