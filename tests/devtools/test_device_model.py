"""devtools.device_model: a random model of a release geometry built in memory on a device. Its parameter
counts follow from the config alone, and ``Clef`` over it answers exactly as ``Clef.load`` over the same
tensors written as a checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from devtools.device_model import build_device_model, write_checkpoint

from clef_runtime.engine.clef import Clef
from clef_runtime.model.layouts import CLEF_FLASH_GEOMETRY
from clef_runtime.model.tiny import Geometry, random_checkpoint_config

#: Question types of the head's type embedding (noul, choice, score).
QUESTION_TYPES = 3


def text_parameters(text: dict[str, Any]) -> int:
    """Parameters of the text stack (embeddings and final norm included, ``lm_head`` not), counted from the
    config's sizes alone: Gated DeltaNet and gated-attention mixers, SwiGLU MLP, RMSNorm weights."""
    hidden, inner = text["hidden_size"], text["intermediate_size"]
    keys = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    values = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    value_heads, conv = text["linear_num_value_heads"], 2 * keys + values
    deltanet = (
        hidden * (conv + values + 2 * value_heads)  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        + conv * text["linear_conv_kernel_dim"]  # depthwise conv, no bias
        + 2 * value_heads  # dt_bias, A_log
        + text["linear_value_head_dim"]  # gated norm
        + values * hidden  # out_proj
    )
    queries = text["num_attention_heads"] * text["head_dim"]
    kv = text["num_key_value_heads"] * text["head_dim"]
    # q_proj carries the output gate (2x); q_norm and k_norm are per head dim.
    attention = hidden * 2 * queries + 2 * hidden * kv + queries * hidden + 2 * text["head_dim"]
    mixers = {"linear_attention": deltanet, "full_attention": attention}
    layers = sum(mixers[kind] + 3 * hidden * inner + 2 * hidden for kind in text["layer_types"])
    return text["vocab_size"] * hidden + layers + hidden


def head_parameters(config: dict[str, int]) -> int:
    """Parameters of the joint head from its config: norms, six projections of the hidden rows, the type
    embedding, routing and decoder layers (torch MultiheadAttention: packed in-projection with biases), the
    residual scorer and three scalars."""
    hidden, width, feedforward = config["hidden_size"], config["width"], config["feedforward"]
    attention = 4 * width * width + 4 * width
    mlp = 2 * width * feedforward + feedforward + width
    routing = 3 * 2 * width + attention + mlp
    decoder = 2 * attention + mlp + 3 * 2 * width
    scorer = 4 * width * width + width + width + 1
    return (
        2 * hidden
        + 6 * hidden * width
        + QUESTION_TYPES * width
        + config["routing_layers"] * routing
        + 2 * width  # option summary norm
        + config["layers"] * decoder
        + 2 * 2 * width  # field and option norms
        + scorer
        + 3
    )


def test_the_counts_from_the_config_are_the_published_release_counts() -> None:
    # docs/model.md section 2: 8,953,803,264 text parameters (lm_head included), a 121,762,820-parameter head.
    text = random_checkpoint_config(geometry=CLEF_FLASH_GEOMETRY)["text_config"]
    assert text_parameters(text) + text["vocab_size"] * text["hidden_size"] == 8_953_803_264
    assert head_parameters(CLEF_FLASH_GEOMETRY.head_config()) == 121_762_820


@pytest.mark.parametrize(
    "geometry",
    [Geometry(), dataclasses.replace(Geometry(), layers=8, head_layers=3, head_width=48, head_heads=3)],
    ids=["tiny", "8-layers"],
)
def test_the_built_model_holds_the_parameters_its_config_implies(geometry: Geometry) -> None:
    model = build_device_model(geometry, device="cpu", dtype=torch.bfloat16)
    text = model.config["text_config"]
    counts = model.parameter_counts()
    assert counts["backbone"] == text_parameters(text)
    assert counts["lm_head"] == text["vocab_size"] * text["hidden_size"]
    assert counts["head"] == head_parameters(geometry.head_config())
    assert counts["total"] == counts["backbone"] + counts["lm_head"] + counts["head"]
    record = model.record()
    assert (record["layers"], record["hidden"], record["vocab"]) == (geometry.layers, 64, 248_320)
    assert record["random_weights"] and record["compute_dtype"] == "bf16" and record["head_dtype"] == "fp32"
    # Every tensor was drawn: nothing is left as to_empty allocated it (all-zero) or non-finite.
    for name, parameter in model.loaded.backbone.model.named_parameters():
        assert torch.isfinite(parameter.float()).all() and parameter.float().abs().sum() > 0, name


REQUESTS = [
    {"state": "the customer says the invoice is wrong", "questions": {"q": {"type": "noul"}}},
    {
        "state": "outage in the login service since this morning " * 20,
        "questions": {
            "topic": {"type": "choice", "criteria": {"billing": None, "outage": "down", "other": None}},
            "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        },
    },
]


def test_answers_equal_those_of_clef_load_over_the_same_tensors_written(tmp_path: Path) -> None:
    model = build_device_model(Geometry(), device="cpu", seed=3)
    in_memory = Clef(model.loaded)  # no files: the head's digest comes from the build
    loaded = Clef.load(str(write_checkpoint(model, tmp_path / "written")), dtype="fp32", weights="fp32")
    for request in REQUESTS:
        expected = loaded.probabilities_encoded([loaded.prepare(request)])
        assert in_memory.probabilities_encoded([in_memory.prepare(request)]) == expected
    assert in_memory.heads.default.digest == model.loaded.head_digest
    assert in_memory.card.model.untrained
    # Another seed is another model: the comparison above can tell two models apart.
    other = Clef(build_device_model(Geometry(), device="cpu", seed=4).loaded)
    assert other.probabilities_encoded([other.prepare(REQUESTS[1])]) != loaded.probabilities_encoded(
        [loaded.prepare(REQUESTS[1])]
    )
