"""``--dtype auto|fp32|bf16``: how the compute dtype is chosen, and the bf16 path from load to answers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from clef_runtime.engine.clef import Clef
from clef_runtime.model import compute_dtype
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.compute_dtype import MIN_BF16_SPEEDUP, bf16_cpu_flags, choose_compute_dtype
from clef_runtime.options import EngineOptions, OptionsError

CPU = torch.device("cpu")
WIDTH = {"hidden_size": 1024, "intermediate_size": 3072}


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
    return path


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The speedup the load-time measurement reports (set the list's one value); calls are counted by the
    list growing."""
    speedups = [3.0]

    def fake(hidden_size: int, intermediate_size: int) -> float:
        speedups.append(speedups[0])
        return speedups[0]

    monkeypatch.setattr(compute_dtype, "measure_bf16_speedup", fake)
    return speedups


def test_explicit_dtypes_need_no_measurement(measured: list[float]) -> None:
    assert choose_compute_dtype("fp32", device=CPU, **WIDTH).dtype == torch.float32
    assert choose_compute_dtype("bf16", device=CPU, **WIDTH).dtype == torch.bfloat16
    assert choose_compute_dtype("bf16", device=CPU, **WIDTH).reason == "--dtype bf16"
    assert len(measured) == 1


def test_auto_on_cuda_is_bf16_without_looking_at_the_cpu(measured: list[float], tmp_path: Path) -> None:
    choice = choose_compute_dtype(
        "auto", device=torch.device("cuda"), cpuinfo=_cpuinfo(tmp_path, ""), **WIDTH
    )
    assert (choice.dtype, choice.name) == (torch.bfloat16, "bf16")
    assert len(measured) == 1


def test_auto_on_a_cpu_without_native_bf16_stays_fp32_unmeasured(
    measured: list[float], tmp_path: Path
) -> None:
    cpuinfo = _cpuinfo(tmp_path, "avx512f fma")
    choice = choose_compute_dtype("auto", device=CPU, cpuinfo=cpuinfo, **WIDTH)
    assert choice.dtype == torch.float32
    assert "no native bf16" in choice.reason
    assert len(measured) == 1  # the flags decided: nothing was timed


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_with_native_bf16_follows_the_measurement(
    measured: list[float], tmp_path: Path, flag: str
) -> None:
    cpuinfo = _cpuinfo(tmp_path, f"avx512f {flag}")
    measured[0] = MIN_BF16_SPEEDUP + 0.5
    fast = choose_compute_dtype("auto", device=CPU, cpuinfo=cpuinfo, **WIDTH)
    assert fast.dtype == torch.bfloat16 and flag in fast.reason and "1.8x" in fast.reason
    measured[0] = MIN_BF16_SPEEDUP - 0.4
    slow = choose_compute_dtype("auto", device=CPU, cpuinfo=cpuinfo, **WIDTH)
    assert slow.dtype == torch.float32 and "0.9x" in slow.reason
    assert len(measured) == 3


@pytest.mark.parametrize("weights", ["fp32", "bf16-storage", "int8"])
def test_fp32_weight_modes_mean_fp32_compute(measured: list[float], tmp_path: Path, weights: str) -> None:
    cpuinfo = _cpuinfo(tmp_path, "avx512_bf16")
    choice = choose_compute_dtype("auto", device=CPU, weights=weights, cpuinfo=cpuinfo, **WIDTH)
    assert choice.dtype == torch.float32 and f"--weights {weights}" in choice.reason
    with pytest.raises(OptionsError, match=f"--weights {weights}"):
        choose_compute_dtype("bf16", device=CPU, weights=weights, **WIDTH)
    with pytest.raises(OptionsError, match="--dtype bf16"):
        EngineOptions(dtype="bf16", weights=weights)
    assert len(measured) == 1


def test_unknown_dtypes_are_refused_naming_the_flag() -> None:
    with pytest.raises(OptionsError, match="--dtype must be one of auto, fp32, bf16"):
        EngineOptions(dtype="fp16")
    with pytest.raises(OptionsError, match="--dtype"):
        choose_compute_dtype("float64", device=CPU, **WIDTH)
    with pytest.raises(OptionsError, match="CLEF_DTYPE"):
        EngineOptions.from_sources(None, {"CLEF_DTYPE": "int4"})
    assert EngineOptions.from_sources(None, {"CLEF_DTYPE": "BF16"}).dtype == "bf16"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    assert bf16_cpu_flags(_cpuinfo(tmp_path, "amx_bf16 amx_tile avx512_bf16")) == ("amx_bf16", "avx512_bf16")
    assert bf16_cpu_flags(_cpuinfo(tmp_path, "")) == ()
    assert bf16_cpu_flags(tmp_path / "absent") == ()


def test_the_measurement_interleaves_both_dtypes_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[torch.dtype] = []

    def fake_batch(inputs: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
        timed.append(inputs.dtype)
        return 0.03 if inputs.dtype == torch.float32 else 0.01  # a 3x speedup

    monkeypatch.setattr(compute_dtype, "_batch_seconds", fake_batch)
    monkeypatch.setattr(compute_dtype, "_measured", {})
    assert compute_dtype.measure_bf16_speedup(300, 600) == pytest.approx(3.0)
    assert compute_dtype.measure_bf16_speedup(300, 600) == pytest.approx(3.0)
    pairs = compute_dtype._PROBE_PAIRS
    # Two warm-up calls per dtype, then fp32 / bf16 batches alternating, and nothing the second time.
    assert timed == [torch.float32] * 2 + [torch.bfloat16] * 2 + [torch.float32, torch.bfloat16] * pairs
    # The release's width is probed at a capped shape, so the probe stays short.
    compute_dtype.measure_bf16_speedup(4096, 12288)
    assert (256, 2048, 4096) in compute_dtype._measured


def test_narrow_models_stay_fp32_unmeasured(measured: list[float], tmp_path: Path) -> None:
    cpuinfo = _cpuinfo(tmp_path, "avx512_bf16")
    choice = choose_compute_dtype("auto", device=CPU, cpuinfo=cpuinfo, hidden_size=64, intermediate_size=128)
    assert choice.dtype == torch.float32 and "too narrow" in choice.reason
    assert len(measured) == 1


def test_a_real_measurement_is_a_positive_ratio() -> None:
    assert compute_dtype.measure_bf16_speedup(64, 96) > 0


# --------------------------------------------------------------------------------------- the bf16 path


def _answers(clef: Clef, body: dict[str, Any]) -> dict[str, float]:
    flat = {}
    for name, answer in clef.decide(body)["answers"].items():
        probabilities = answer.get("probabilities") or {"true": answer["noul"]}
        flat.update({f"{name}/{option}": value for option, value in probabilities.items()})
    return flat


BODY = {
    "state": "The parcel arrived broken; the customer asks for a refund. " * 12,
    "questions": {
        "refund": {"type": "noul", "criteria": {"true": "asks for a refund"}},
        "mood": {"type": "choice", "criteria": {"angry": "angry", "calm": "calm", "happy": "happy"}},
        "urgency": {"type": "score", "criteria": ["none", "low", "mid", "high", "critical"]},
    },
}


@pytest.fixture(scope="module")
def bf16_clef() -> Clef:
    return Clef.load("tiny", dtype="bf16", cache_mb=64)


def test_bf16_computes_the_backbone_in_bf16_and_the_head_in_fp32(bf16_clef: Clef, tiny: Clef) -> None:
    assert bf16_clef.card.compute_dtype == "bf16" and tiny.card.compute_dtype == "fp32"
    assert bf16_clef.backbone.dtype == torch.bfloat16
    weights = {p.dtype for p in bf16_clef.backbone.model.parameters()}
    assert weights == {torch.bfloat16}  # stored in bf16 too: half the memory of fp32
    assert {p.dtype for p in bf16_clef.head.parameters()} == {torch.float32}


def test_bf16_answers_drift_a_little_from_fp32(bf16_clef: Clef, tiny: Clef) -> None:
    exact, rounded = _answers(tiny, BODY), _answers(bf16_clef, BODY)
    assert exact.keys() == rounded.keys()
    drift = max(abs(exact[key] - rounded[key]) for key in exact)
    assert drift <= 0.02
    assert drift > 0  # bf16 really computed: the answers are not the fp32 ones


def test_bf16_states_keep_the_delta_rule_in_fp32(bf16_clef: Clef) -> None:
    bf16_clef.clear_cache()
    bf16_clef.decide(BODY)  # stores the state of BODY's text
    state = bf16_clef.prefix_state
    recurrent = [layer.recurrent for layer in state.layers if hasattr(layer, "recurrent")]
    keys = [layer.keys for layer in state.layers if hasattr(layer, "keys")]
    assert recurrent and {t.dtype for t in recurrent} == {torch.float32}
    assert keys and {t.dtype for t in keys} == {torch.bfloat16}
    # A cache hit in bf16 answers exactly as the cold run did.
    assert bf16_clef.decide(BODY)["answers"] == bf16_clef.decide(BODY)["answers"]


def test_cpu_kernels_in_bf16_match_transformers_in_bf16(tiny_dir: Path, tiny_backbone: Backbone) -> None:
    ids = torch.randint(0, 5000, (150,), generator=torch.Generator().manual_seed(3))
    ours = Backbone.load(tiny_dir, device="cpu", dtype="bf16").hidden_states(ids)
    reference = Backbone.load(tiny_dir, device="cpu", dtype="bf16", cpu_kernels=False).hidden_states(ids)
    exact = tiny_backbone.hidden_states(ids)

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # Ours keeps the delta rule, the conv and the gated norm in fp32, so it is at least as close to fp32 as
    # transformers' bf16 path is, and both are bf16-close to each other.
    assert relative(ours, exact) <= max(relative(reference, exact), 0.01)
    assert relative(ours, reference) <= 0.05


def test_bf16_rows_stay_in_the_compute_dtype_until_the_api_boundary(bf16_clef: Clef) -> None:
    from clef_runtime.model.state import Continuation

    # extend's rows are what the model made (no host fp32 copy per step: on a GPU that is a round trip)...
    (result,) = bf16_clef.backbone.extend(None, [Continuation(list(range(200, 260)))])
    assert result.hidden.dtype == torch.bfloat16 and result.hidden.device == bf16_clef.backbone.device
    # ...and the public hidden_rows are fp32 on the CPU, as documented.
    (rows,) = bf16_clef.hidden_rows([bf16_clef.prepare(BODY)])
    assert rows.dtype == torch.float32 and rows.device.type == "cpu"


def test_the_call_cap_is_a_cpu_setting(tiny_backbone: Backbone) -> None:
    from clef_runtime.model.prefill import DEFAULT_MAX_CALL_TOKENS

    assert tiny_backbone.max_call_tokens == DEFAULT_MAX_CALL_TOKENS
    # On any other device one step is one call: its step budget already bounds it.
    with torch.device("meta"):
        elsewhere = Backbone(copy.deepcopy(tiny_backbone.model).to("meta"), path=tiny_backbone.path)
    assert elsewhere.device.type == "meta" and elsewhere.max_call_tokens is None
