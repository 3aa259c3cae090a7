"""``--weights fp8``: e4m3 rows against float64, the ``torch._scaled_mm`` product against a float64
dequantised reference (the real call: it runs on CPU in this torch) with a negative control, the refusals
(CPU, fp32 compute, a GPU older than compute capability 8.9, faked), and loading / converting the tiny model
with the device check stood in for (the kernels' math is the same on CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from clef_runtime.cli import main
from clef_runtime.engine.clef import Clef
from clef_runtime.model import fp8
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.compute_dtype import choose_compute_dtype
from clef_runtime.model.memory import estimate_model_memory
from clef_runtime.model.quantize import describe_layers, select_int8_layers
from clef_runtime.model.weights import plan_weights
from clef_runtime.options import EngineOptions, OptionsError

ROOT = Path(__file__).resolve().parents[2]
IDS = list(range(1000, 1200))
CUDA = torch.device("cuda")
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 1/16 of itself, and a
# value in the subnormal range (below 2^-6) by at most half its spacing, 2^-10.
E4M3_HALF_ULP = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10
# What the tests accept of an fp8 product against the exact one: relative L2 per output channel (measured
# 4-6% on these random shapes: both operands rounded to 3 mantissa bits).
FP8_CHANNEL_TOLERANCE = 0.10


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str = "NVIDIA A100") -> None:
    """Make torch answer for a CUDA device of ``capability`` without one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.fixture
def fp8_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let ``--weights fp8`` load on this CPU (``torch._scaled_mm`` runs there, slowly): the device check
    answers as a capable GPU would."""
    monkeypatch.setattr(fp8, "fp8_device_problem", lambda device: None)


def channel_errors(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each output channel (column) of ``got`` against ``exact``, float64."""
    got64, exact64 = got.double(), exact.double()
    return (got64 - exact64).norm(dim=0) / exact64.norm(dim=0)


def dequantised(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return values.double() * scales.double()[:, None]


# ------------------------------------------------------------------------------------------ the math


def test_rows_round_trip_within_e4m3_resolution() -> None:
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(6, 300, generator=generator)
    matrix[1] = 0.0  # a zero row
    matrix[2, 7] = 1e4  # an outlier: the rest of its row falls into e4m3's subnormal range
    matrix[3] *= 1e-6  # a tiny row keeps its own resolution (per-row scale)
    matrix[4, :5] = torch.tensor([448.0, -448.0, 1.0, 0.5, -3.0])
    values, scales = fp8.quantize_rows_fp8(matrix)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert values.shape == matrix.shape and scales.shape == (6,)
    reference = matrix.double()
    expected_scales = reference.abs().amax(dim=1) / fp8.FP8_MAX
    nonzero = expected_scales > 0
    assert torch.allclose(scales.double()[nonzero], expected_scales[nonzero], rtol=1e-6, atol=0)
    # Each non-zero row's largest magnitude lands on 448.
    assert values.float().abs().amax(dim=1)[nonzero].tolist() == [fp8.FP8_MAX] * int(nonzero.sum())
    assert values[1].float().abs().max().item() == 0.0 and torch.isfinite(scales[1])
    # Round to nearest e4m3, in float64: at most half a unit in the last place of each scaled value.
    scaled = reference / scales.double()[:, None]
    bound = torch.maximum(E4M3_HALF_ULP * scaled.abs(), torch.full_like(scaled, E4M3_SUBNORMAL_HALF_STEP))
    assert bool(((values.double() - scaled).abs() <= bound * (1 + 1e-6)).all())
    # The tiny row is as accurate as a normal one.
    assert (dequantised(values, scales)[3] - reference[3]).norm() <= 0.05 * reference[3].norm()
    # A transposed (column-major) input still gives row-major values: what the CUDA kernel takes.
    transposed, _ = fp8.quantize_rows_fp8(matrix.T)
    assert transposed.is_contiguous()
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_rows_fp8(torch.zeros(3))


@pytest.mark.parametrize(("rows", "inner", "cols"), [(3, 64, 32), (37, 256, 96), (128, 512, 1024)])
def test_scaled_mm_matches_the_float64_dequantised_product(rows: int, inner: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inner, generator=generator)
    x[0, 0] = 40.0  # an outlier token: per-token scales keep the other tokens' resolution
    weight = torch.randn(cols, inner, generator=generator) * 0.05
    x_values, x_scales = fp8.quantize_rows_fp8(x)
    w_values, w_scales = fp8.quantize_rows_fp8(weight)
    got = fp8.scaled_mm_rowwise(x_values, x_scales, w_values, w_scales, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, cols)
    reference = dequantised(x_values, x_scales) @ dequantised(w_values, w_scales).T
    # The same fp8 operands: only fp32 accumulation and the bf16 output's rounding (2^-9 relative) differ.
    tolerance = 2.0**-8 * reference.abs() + 1e-6 * reference.abs().max()
    assert bool(((got.double() - reference).abs() <= tolerance).all())
    # fp8_matmul is exactly the quantisation then this product.
    assert torch.equal(fp8.fp8_matmul(x, w_values, w_scales), got)


def test_fp8_product_stays_near_the_exact_one_and_a_per_tensor_scale_does_not() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=generator)
    weight = torch.randn(96, 256, generator=generator) * 0.05
    weight[0] *= 1e5  # one large output row
    exact = x.double() @ weight.double().T
    per_channel = fp8.fp8_matmul(x, *fp8.quantize_rows_fp8(weight))
    assert channel_errors(per_channel, exact).max().item() <= FP8_CHANNEL_TOLERANCE
    # Negative control: one scale for the whole matrix pushes every other row below e4m3's smallest values,
    # and the same assertion must catch it.
    values, scale = fp8.quantize_rows_fp8(weight.reshape(1, -1))
    per_tensor = fp8.fp8_matmul(x, values.reshape(weight.shape), scale.expand(weight.shape[0]).contiguous())
    assert channel_errors(per_tensor, exact).max().item() > FP8_CHANNEL_TOLERANCE


def test_fp8_linear_against_the_bf16_linear() -> None:
    generator = torch.Generator().manual_seed(2)
    linear = nn.Linear(128, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=generator))
    linear = linear.to(torch.bfloat16)
    quantised = fp8.Fp8Linear.from_linear(linear)
    assert quantised.weight.dtype == torch.float8_e4m3fn and quantised.bias is not None
    assert torch.allclose(
        quantised.dequantized_weight(), linear.weight.float(), rtol=E4M3_HALF_ULP, atol=1e-3
    )
    x = torch.randn(2, 40, 128, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        got, exact = quantised(x), linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 40, 48)
    assert channel_errors(got.reshape(-1, 48), exact.reshape(-1, 48)).max().item() <= FP8_CHANNEL_TOLERANCE


def test_shapes_the_kernel_takes() -> None:
    assert fp8.fp8_shape_supported(4096, 12288) and fp8.fp8_shape_supported(4096, 32)
    assert not fp8.fp8_shape_supported(64, 4) and not fp8.fp8_shape_supported(24, 32)


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("capability", "refused"), [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)]
)
def test_the_device_is_asked_its_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], refused: bool
) -> None:
    fake_gpu(monkeypatch, capability)
    if not refused:
        assert fp8.fp8_device_problem(CUDA) is None
        fp8.check_fp8_device(CUDA)
        return
    with pytest.raises(
        OptionsError, match=r"--weights fp8 needs a CUDA GPU of compute capability 8\.9"
    ) as error:
        fp8.check_fp8_device(CUDA)
    assert f"compute capability {capability[0]}.{capability[1]}" in str(error.value)
    assert "NVIDIA A100" in str(error.value) and "--weights auto" in str(error.value)


def test_cpu_and_rocm_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OptionsError, match=r"--weights fp8 .* would run on cpu"):
        fp8.check_fp8_device(torch.device("cpu"))
    fake_gpu(monkeypatch, (9, 4), name="AMD Instinct MI300X")
    monkeypatch.setattr(torch.version, "hip", "6.4")
    with pytest.raises(OptionsError, match="ROCm"):
        fp8.check_fp8_device(CUDA)


def test_plan_weights_for_fp8(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    fake_gpu(monkeypatch, (9, 0))
    plan = plan_weights("fp8", info=info, device=CUDA, dtype=torch.bfloat16)
    assert plan.fp8_layers == (1, 2, 3) and plan.int8_layers == () and plan.quantized_layers == (1, 2, 3)
    assert plan.label == "fp8 layers 1-3, bf16" and plan.storage_dtype == torch.bfloat16
    assert not plan.bf16_storage
    every = plan_weights("fp8", info=info, device=CUDA, dtype=torch.bfloat16, int8_layers="all")
    assert every.fp8_layers == (0, 1, 2, 3)
    with pytest.raises(OptionsError, match="--weights fp8 computes in bf16"):
        plan_weights("fp8", info=info, device=CUDA, dtype=torch.float32)
    with pytest.raises(OptionsError, match="--int8-layers"):
        plan_weights("fp8", info=info, device=CUDA, dtype=torch.bfloat16, int8_layers="9")
    fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(OptionsError, match=r"compute capability 8\.0"):
        plan_weights("fp8", info=info, device=CUDA, dtype=torch.bfloat16)
    with pytest.raises(OptionsError, match="would run on cpu"):
        plan_weights("fp8", info=info, device=torch.device("cpu"), dtype=torch.bfloat16)


def test_fp8_means_bf16_compute() -> None:
    width = {"hidden_size": 4096, "intermediate_size": 12288}
    for device in (CUDA, torch.device("cpu")):
        choice = choose_compute_dtype("auto", device=device, weights="fp8", **width)
        assert choice.dtype == torch.bfloat16 and "--weights fp8" in choice.reason
    assert choose_compute_dtype("bf16", device=CUDA, weights="fp8", **width).dtype == torch.bfloat16
    with pytest.raises(OptionsError, match="--weights fp8 computes in bf16"):
        choose_compute_dtype("fp32", device=CUDA, weights="fp8", **width)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [({"dtype": "fp32"}, "not --dtype fp32"), ({"device": "cpu"}, "not with --device cpu")],
)
def test_options_refuse_fp8_where_it_cannot_run(changes: dict[str, str], needle: str) -> None:
    assert EngineOptions(weights="fp8").weights == "fp8"
    with pytest.raises(OptionsError, match=needle) as error:
        EngineOptions(weights="fp8", **changes)
    assert "--weights fp8" in str(error.value)


@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--dtype", "fp32"], []])
def test_cli_refuses_fp8_here_with_exit_2(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    # This machine has no CUDA: with --device auto the model would run on the CPU, refused at load.
    request = str(ROOT / "examples" / "request.json")
    assert main(["decide", "--model", "tiny", "--weights", "fp8", *flags, "--cache-mb", "0", request]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("clef decide: error: ") and "--weights fp8" in last
    assert "Traceback" not in captured.err


# ------------------------------------------------------------------------------------------ the model


def eligible_linears(model: Any, layers: tuple[int, ...]) -> int:
    return sum(
        1
        for index in layers
        for module in model.layers[index].modules()
        if isinstance(module, nn.Linear) and fp8.fp8_shape_supported(module.in_features, module.out_features)
    )


@pytest.fixture(scope="module")
def bf16_backbone(tiny_dir: Path) -> Backbone:
    return Backbone.load(tiny_dir, device="cpu", dtype="bf16")


@pytest.mark.usefixtures("fp8_on_cpu")
@pytest.mark.parametrize("spec", ["late", "all"])
def test_load_quantises_the_selected_aligned_linears(
    tiny_dir: Path, bf16_backbone: Backbone, spec: str
) -> None:
    loaded = Backbone.load(tiny_dir, device="cpu", dtype="auto", weights="fp8", int8_layers=spec)
    chosen = select_int8_layers(spec, bf16_backbone.config.num_hidden_layers)
    assert (
        loaded.dtype == torch.bfloat16 and loaded.weight_mode == f"fp8 layers {describe_layers(chosen)}, bf16"
    )
    assert fp8.fp8_linear_count(loaded.model) == eligible_linears(bf16_backbone.model, chosen) > 0
    reference = dict(bf16_backbone.model.named_modules())
    for name, module in loaded.model.named_modules():
        original = reference[name]
        if isinstance(module, fp8.Fp8Linear):
            # Quantised while read from the shards = quantising the loaded bf16 weight afterwards.
            values, scales = fp8.quantize_rows_fp8(original.weight)
            assert torch.equal(module.weight.view(torch.uint8), values.view(torch.uint8))
            assert torch.equal(module.weight_scale, scales)
        elif isinstance(original, nn.Linear):  # other layers, and the 4-wide gate projections
            assert type(module) is nn.Linear and torch.equal(module.weight, original.weight), name
    # The 4-wide DeltaNet gate projections of the chosen layers stay in bf16.
    assert any(isinstance(m, nn.Linear) for index in chosen for m in loaded.model.layers[index].modules())
    assert torch.equal(loaded.model.embed_tokens.weight, bf16_backbone.model.embed_tokens.weight)
    assert torch.equal(loaded.model.norm.weight, bf16_backbone.model.norm.weight)
    assert loaded.num_parameters == bf16_backbone.num_parameters
    # The hidden rows move, boundedly (random weights: a sanity bound, not a quality claim; measured against
    # fp32: 8% with the late layers in fp8, 15% with all, where int8 moves them 2.4% and 4.1%: e4m3 keeps 3
    # mantissa bits).
    exact, approx = bf16_backbone.hidden_states(IDS).float(), loaded.hidden_states(IDS).float()
    assert 0 < (approx - exact).norm().item() <= 0.25 * exact.norm().item()


@pytest.mark.usefixtures("fp8_on_cpu")
def test_converting_a_built_model_equals_quantising_at_load(tiny_dir: Path) -> None:
    at_load = Backbone.load(tiny_dir, device="cpu", dtype="auto", weights="fp8", int8_layers="all")
    built = Backbone.load(tiny_dir, device="cpu", dtype="bf16")
    assert (
        fp8.convert_linears_to_fp8(built.model)
        == fp8.fp8_linear_count(built.model)
        == fp8.fp8_linear_count(at_load.model)
    )
    assert torch.equal(at_load.hidden_states(IDS), built.hidden_states(IDS))
    again = Backbone.load(tiny_dir, device="cpu", dtype="bf16")
    eligible = eligible_linears(again.model, (1, 3))
    made = fp8.convert_linears_to_fp8(again.model, [3, 1, 3])
    assert made == eligible == fp8.fp8_linear_count(again.model) > 0


def test_memory_estimate_names_fp8(tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    bf16 = estimate_model_memory(info, device="cpu", dtype=torch.bfloat16)
    quantised = estimate_model_memory(
        info, device="cpu", dtype=torch.bfloat16, int8_layers=(1, 2, 3), quantized_as="fp8"
    )
    assert quantised.text_bytes < bf16.text_bytes and "fp8 layers 1-3" in quantised.describe()


@pytest.mark.usefixtures("fp8_on_cpu")
def test_the_card_and_answers_with_fp8() -> None:
    clef = Clef.load("tiny", weights="fp8", int8_layers="all", cache_mb=0)
    assert clef.card.weight_mode == "fp8 layers 0-3, bf16" and clef.card.compute_dtype == "bf16"
    assert fp8.fp8_linear_count(clef.backbone.model) > 0
    assert not any(isinstance(m, fp8.Fp8Linear) for m in clef.head.modules())
    assert {parameter.dtype for parameter in clef.head.parameters()} == {torch.float32}
    assert clef.backbone.model.embed_tokens.weight.dtype == torch.bfloat16
    example = json.loads((ROOT / "examples" / "request.json").read_text())
    response = clef.decide(example)
    assert list(response["answers"]) == list(example["questions"])
