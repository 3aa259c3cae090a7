"""``--weights int8``: the int8 Linear against an independent computation, the layer selection, what stays
exact, the memory estimate and the weight planning, and ``clef decide --weights int8`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from clef_runtime.cli import main
from clef_runtime.engine.clef import Clef
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.memory import estimate_model_memory
from clef_runtime.model.quantize import (
    Int8Linear,
    Int8Plan,
    describe_layers,
    int8_linear_count,
    late_start,
    quantize_rows,
    select_int8_layers,
)
from clef_runtime.model.weights import WeightPlan, plan_weights
from clef_runtime.options import OptionsError
from clef_runtime.release import TEXT_PREFIX

ROOT = Path(__file__).resolve().parents[2]
IDS = list(range(1000, 1200))
GIB = 1024**3


def emulated_int8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The int8 scheme written out in float64 with explicit loops over nothing but numbers: symmetric int8
    per output row of the weight and per token of the input, integer products summed exactly, rescaled."""
    x64, w64 = x.double(), weight.double()
    w_scale = w64.abs().amax(dim=1) / 127
    x_scale = x64.abs().amax(dim=1) / 127
    w_int = torch.round(w64 / w_scale[:, None])
    x_int = torch.round(x64 / x_scale[:, None])
    # Integer values below 2^53: the float64 product is the exact integer dot product.
    return (x_int @ w_int.T) * x_scale[:, None] * w_scale[None, :]


@pytest.mark.parametrize(("rows", "inner", "cols"), [(1, 64, 32), (37, 256, 96), (128, 512, 1024)])
def test_int8_linear_matches_emulation_and_stays_near_fp32(rows: int, inner: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(inner, cols, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(cols, inner, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(cols, generator=generator))
    x = torch.randn(rows, inner, generator=generator)
    x[0, 0] = 40.0  # an outlier in the first token: per-token scales keep the other tokens' resolution
    quantised = Int8Linear.from_linear(linear)
    with torch.inference_mode():
        got = quantised(x[None])[0]
        exact = linear(x)
    emulated = emulated_int8_linear(x, linear.weight.detach()) + linear.bias.detach().double()
    # Same integers, same scales: only fp32 rounding of the rescale differs (stated tolerance 1e-5 relative).
    assert (got.double() - emulated).abs().max().item() <= 1e-5 * emulated.abs().max().item()
    # Against fp32, the tokens after the outlier: int8 rounding of both operands; 2% of the output's norm
    # is the stated tolerance (measured ~0.5-1% on these random shapes).
    rest = slice(1, None) if rows > 1 else slice(None)
    if rows == 1:  # a lone token carrying the outlier: its own scale is coarse (25x its typical value)
        assert (got - exact).norm().item() <= 0.05 * exact.norm().item()
    else:
        assert (got[rest] - exact[rest]).norm().item() <= 0.02 * exact[rest].norm().item()
    assert got.dtype == torch.float32 and got.shape == (rows, cols)


def test_quantize_rows_round_trip_and_zero_rows() -> None:
    matrix = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25], [-254.0, 127.0, 1.0]])
    values, scales = quantize_rows(matrix)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert values[0].tolist() == [0, 0, 0]
    assert values[1].tolist() == [127, -64, 32] and values[2].tolist() == [-127, 64, 0]
    assert torch.allclose(values.float() * scales[:, None], matrix, atol=1.0)
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.zeros(3))


@pytest.mark.parametrize(
    ("spec", "depth", "expected"),
    [
        ("late", 32, tuple(range(12, 32))),
        ("late", 4, (1, 2, 3)),
        ("late", 8, (3, 4, 5, 6, 7)),
        ("all", 4, (0, 1, 2, 3)),
        ("3, 0,3", 4, (0, 3)),
        ("LATE", 16, tuple(range(6, 16))),
    ],
)
def test_layer_selection(spec: str, depth: int, expected: tuple[int, ...]) -> None:
    assert select_int8_layers(spec, depth) == expected


@pytest.mark.parametrize("spec", ["4", "1,9", "first", "-1", "1;2", ""])
def test_bad_layer_selection_names_the_flag(spec: str) -> None:
    with pytest.raises(OptionsError, match="--int8-layers"):
        select_int8_layers(spec, 4)


def test_late_start_and_describe() -> None:
    assert [late_start(depth) for depth in (1, 4, 8, 32, 64)] == [0, 1, 3, 12, 24]
    assert describe_layers([12, 13, 14, 20, 3]) == "3,12-14,20"
    assert describe_layers([]) == "none"


def linear_names_per_layer(model: nn.Module) -> list[set[str]]:
    """The qualified names of the ``nn.Linear`` modules of each decoder layer (an fp32 model)."""
    return [
        {name for name, module in layer.named_modules() if isinstance(module, nn.Linear)}
        for layer in model.layers
    ]


@pytest.fixture(scope="module")
def fp32_backbone(tiny_dir: Path) -> Backbone:
    return Backbone.load(tiny_dir, device="cpu", weights="fp32")


@pytest.mark.parametrize("spec", ["late", "all", "0,2"])
def test_load_quantises_exactly_the_selected_layers(
    tiny_dir: Path, fp32_backbone: Backbone, spec: str
) -> None:
    loaded = Backbone.load(tiny_dir, device="cpu", weights="int8", int8_layers=spec)
    depth = fp32_backbone.config.num_hidden_layers
    chosen = select_int8_layers(spec, depth)
    per_layer = linear_names_per_layer(fp32_backbone.model)
    assert int8_linear_count(loaded.model) == sum(len(per_layer[index]) for index in chosen)
    assert loaded.weight_mode.startswith(f"int8 layers {describe_layers(chosen)}, ")
    reference = dict(fp32_backbone.model.named_modules())
    for index, layer in enumerate(loaded.model.layers):
        for name, module in layer.named_modules():
            original = reference[f"layers.{index}.{name}"] if name else None
            if index in chosen and isinstance(original, nn.Linear):
                assert isinstance(module, Int8Linear), name
                # Quantised while read from the shards = quantising the loaded fp32 weight afterwards.
                values, scales = quantize_rows(original.weight)
                assert torch.equal(module.weight, values) and torch.equal(module.weight_scale, scales)
            elif isinstance(original, nn.Linear):
                assert type(module) is nn.Linear and torch.equal(module.weight, original.weight), name
    # Embeddings and the final norm are loaded as before.
    assert torch.equal(loaded.model.embed_tokens.weight, fp32_backbone.model.embed_tokens.weight)
    assert torch.equal(loaded.model.norm.weight, fp32_backbone.model.norm.weight)
    # The hidden rows move a little, not a lot (random weights: a sanity bound, not a quality claim).
    exact, approx = fp32_backbone.hidden_states(IDS), loaded.hidden_states(IDS)
    assert 0 < (approx - exact).norm().item() <= 0.1 * exact.norm().item()


def test_apply_on_a_loaded_model_equals_quantising_at_load(tiny_dir: Path, fp32_backbone: Backbone) -> None:
    at_load = Backbone.load(tiny_dir, device="cpu", weights="int8", int8_layers="all")
    after = Backbone.load(tiny_dir, device="cpu", weights="fp32")
    count = Int8Plan(select_int8_layers("all", after.config.num_hidden_layers)).apply(after.model)
    assert count == int8_linear_count(at_load.model) > 0
    assert torch.equal(at_load.hidden_states(IDS), after.hidden_states(IDS))


def test_head_lexical_and_embeddings_stay_exact() -> None:
    exact = Clef.load("tiny", dtype="fp32", weights="fp32", cache_mb=0)
    int8 = Clef.load("tiny", dtype="fp32", weights="int8", int8_layers="all", cache_mb=0)
    assert int8_linear_count(int8.backbone.model) > 0
    for (name, a), (_, b) in zip(
        exact.head.state_dict().items(), int8.head.state_dict().items(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert not any(isinstance(m, Int8Linear) for m in int8.head.modules())
    assert exact.lexical.dtype == int8.lexical.dtype
    assert torch.equal(exact.lexical.weight, int8.lexical.weight)
    assert torch.equal(exact.backbone.model.embed_tokens.weight, int8.backbone.model.embed_tokens.weight)


def test_memory_estimate_counts_int8_weights(tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    layers = (1, 2, 3)
    fp32 = estimate_model_memory(info, device="cpu", dtype=torch.float32)
    int8 = estimate_model_memory(info, device="cpu", dtype=torch.float32, int8_layers=layers)
    saved = 0
    for name, tensor in info.tensors.items():
        parts = name.removeprefix(TEXT_PREFIX).split(".")
        in_layers = name.startswith(TEXT_PREFIX) and parts[0] == "layers" and int(parts[1]) in layers
        if in_layers and len(tensor.shape) == 2:
            rows, cols = tensor.shape
            saved += 4 * rows * cols - (rows * cols + 4 * rows)
    assert saved > 0
    assert fp32.text_bytes - int8.text_bytes == saved
    assert "int8 layers 1-3" in int8.describe()


def test_plan_weights(tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    cpu, fp32 = torch.device("cpu"), torch.float32

    def plan(weights: str, available: int, layers: str = "late") -> WeightPlan:
        return plan_weights(
            weights, info=info, device=cpu, dtype=fp32, int8_layers=layers, available_bytes=available
        )

    assert plan("auto", 64 * GIB).label == "fp32"
    assert plan("int8", 64 * GIB).label == "int8 layers 1-3, fp32"
    assert plan("int8", 64 * GIB, "all").int8_layers == (0, 1, 2, 3)
    bf16_need = estimate_model_memory(info, device=cpu, dtype=torch.bfloat16).total_bytes
    # auto: exact weights as long as bf16 storage fits; int8 only below that.
    assert plan("auto", bf16_need).label == "bf16-storage"
    below = plan("auto", bf16_need - 1)
    assert below.int8_layers == (1, 2, 3) and below.bf16_storage and below.storage_dtype == torch.bfloat16
    assert plan("int8", bf16_need - 1).label == "int8 layers 1-3, bf16-storage"
    with pytest.raises(OptionsError, match="--int8-layers"):
        plan("int8", 64 * GIB, "7")
    with pytest.raises(OptionsError, match="--weights int8 is a CPU feature"):
        plan_weights("int8", info=info, device=torch.device("cuda"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weights"):
        plan("int4", 64 * GIB)


def test_the_weight_mode_is_said_in_the_options_words_under_bf16_compute(tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    plan = plan_weights("auto", info=info, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert (plan.label, plan.storage_dtype, plan.bf16_storage) == ("bf16", torch.bfloat16, False)
    # What the load log, /status.json and the tuning features show.
    assert Backbone.load(tiny_dir, device="cpu", dtype="bf16").weight_mode == "bf16"


def test_cli_decide_with_int8(capsys: pytest.CaptureFixture[str]) -> None:
    request = str(ROOT / "examples" / "request.json")
    assert main(["decide", "--model", "tiny", "--weights", "int8", "--cache-mb", "0", request]) == 0
    response = json.loads(capsys.readouterr().out)
    example = json.loads((ROOT / "examples" / "request.json").read_text())
    assert list(response["answers"]) == list(example["questions"])
    exact = Clef.load("tiny", dtype="fp32", weights="fp32", cache_mb=0).decide(example)
    assert response["usage"] == exact["usage"]


@pytest.mark.parametrize("layers", ["9", "late,1"])
def test_cli_bad_int8_layers_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], layers: str) -> None:
    request = str(ROOT / "examples" / "request.json")
    status = main(["decide", "--model", "tiny", "--weights", "int8", "--int8-layers", layers, request])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--int8-layers" in err[-1]
