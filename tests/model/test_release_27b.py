"""The 27B Clef's geometry family, scaled down: a random checkpoint with the 27B's layer pattern and head
ratios (docs/clef-27b.md section 2) loads, matches the independent reference of the Qwen3.5 text stack, and
answers a System One request through `Clef.load`.

What the 27B asks of the loader that Clef-flash does not: query and DeltaNet value widths above the hidden
size, three DeltaNet value heads per key head (Clef-flash: two) and six query heads per KV head (four).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from clef_runtime import Clef
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.layouts import CLEF_27B_GEOMETRY
from clef_runtime.model.tiny import TINY_FORMAT, Geometry, make_random_checkpoint
from tests.model.test_backbone import _ids, _Reference

ROOT = Path(__file__).resolve().parents[2]

#: Clef (27B) at 1/32 of its width and 1/8 of its depth, every ratio kept: 8 layers (two periods of 3 Gated
#: DeltaNet + 1 gated attention), 6 query heads per KV head, 3 DeltaNet value heads per key head, attention
#: head dim twice the DeltaNet's, query and value widths 1.2x the hidden size, MLP 3.4x; the full vocabulary
#: so that real prompts tokenize. The joint head is of the same family at a small width.
SMALL_27B = Geometry(
    hidden_size=160,
    layers=8,
    intermediate_size=544,
    attention_heads=6,
    kv_heads=1,
    head_dim=32,
    deltanet_key_heads=4,
    deltanet_value_heads=12,
    deltanet_key_dim=16,
    deltanet_value_dim=16,
    head_width=32,
    head_routing_layers=2,
    head_layers=4,
    head_heads=4,
    head_feedforward=128,
)

REQUEST: dict[str, Any] = json.loads((ROOT / "examples" / "request.json").read_text())


def _ratios(geometry: Geometry) -> tuple[float, ...]:
    return (
        geometry.attention_heads / geometry.kv_heads,
        geometry.deltanet_value_heads / geometry.deltanet_key_heads,
        geometry.head_dim / geometry.deltanet_key_dim,
        geometry.deltanet_value_dim / geometry.deltanet_key_dim,
        geometry.attention_heads * geometry.head_dim / geometry.hidden_size,
        geometry.deltanet_value_heads * geometry.deltanet_value_dim / geometry.hidden_size,
        geometry.intermediate_size / geometry.hidden_size,
        geometry.layers % 4,
    )


@pytest.fixture(scope="module")
def small_27b_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json_path: Path) -> Path:
    marker = {"tiny": False, "untrained": True, "seed": 0, "format": TINY_FORMAT, "family": "clef-27b"}
    return make_random_checkpoint(
        tmp_path_factory.mktemp("clef-27b") / "checkpoint", geometry=SMALL_27B, seed=0, marker=marker
    )


@pytest.fixture(scope="module")
def small_27b_clef(small_27b_dir: Path) -> Clef:
    return Clef.load(str(small_27b_dir), dtype="fp32", cache_mb=0)


def test_the_small_model_keeps_the_27b_ratios(small_27b_dir: Path) -> None:
    assert _ratios(SMALL_27B) == _ratios(CLEF_27B_GEOMETRY)
    text = verify_checkpoint(small_27b_dir).text_config
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert text["vocab_size"] == 248_320
    # Three M-RoPE planes, as in the 27B's [11, 11, 10].
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1]


def test_the_backbone_matches_the_independent_reference(small_27b_clef: Clef, small_27b_dir: Path) -> None:
    backbone: Backbone = small_27b_clef.model.backbone
    assert (backbone.hidden_size, backbone.dtype, backbone.device.type) == (160, torch.float32, "cpu")
    reference = _Reference(small_27b_dir)
    ids = _ids(48, seed=1)
    full = backbone.hidden_states(ids)
    assert (full - reference.hidden(ids)).abs().max().item() <= 1e-4
    planes = torch.stack([torch.arange(48), (torch.arange(48) * 3) % 11, (torch.arange(48) * 5) % 13])
    assert (
        backbone.hidden_states(ids, position_ids=planes) - reference.hidden(ids, planes)
    ).abs().max() <= 1e-4
    # Chunked prefill (the CPU DeltaNet kernels with three value heads per key head, carried across chunks)
    # equals the full pass.
    assert (backbone.hidden_states(ids, prefill_chunk=16) - full).abs().max().item() <= 1e-4


def test_the_small_27b_answers_a_system_one_request(small_27b_clef: Clef) -> None:
    response = small_27b_clef.decide(REQUEST)
    assert list(response["answers"]) == list(REQUEST["questions"])
    assert response["usage"]["input_tokens"] == small_27b_clef.encode(REQUEST).input_tokens > 0
    for qid, answer in response["answers"].items():
        question = REQUEST["questions"][qid]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert 0.0 <= answer["noul"] <= 1.0
        else:
            probabilities = answer["probabilities"]
            assert abs(sum(probabilities.values()) - 1.0) <= 5e-5 * len(probabilities) + 1e-9
            assert answer["confidence"] == max(probabilities.values())


@pytest.mark.slow
def test_int8_layers_load_in_the_27b_shapes(small_27b_dir: Path, small_27b_clef: Clef) -> None:
    # int8 decoder Linears of every shape the 27B has (q_proj wider than the hidden size, the narrow
    # in_proj_a/b, out_proj and o_proj from 1.2x the hidden size).
    from clef_runtime.model.quantize import Int8Linear

    int8 = Backbone.load(small_27b_dir, device="cpu", dtype="fp32", weights="int8", int8_layers="all")
    assert int8.weight_mode == "int8 layers 0-7, fp32"
    quantised = {name.split(".")[-1] for name, m in int8.model.named_modules() if isinstance(m, Int8Linear)}
    assert {"q_proj", "o_proj", "in_proj_qkv", "in_proj_a", "in_proj_b", "out_proj", "down_proj"} <= quantised
    ids = _ids(64, seed=3)
    exact, approx = small_27b_clef.model.backbone.hidden_states(ids), int8.hidden_states(ids)
    # Random weights: a sanity bound, not a quality claim (every layer int8, 160-wide rows).
    assert 0 < (approx - exact).norm().item() <= 0.2 * exact.norm().item()
