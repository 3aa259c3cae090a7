"""Tests for the joint schema head: names/shapes, strict loading, parity with a loop reference, batching."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from clef_runtime.model.head import (
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    HeadLayout,
    HeadLoadError,
    JointSchemaHead,
    probabilities,
    read_head_config,
)

SMALL_CONFIG = {
    "hidden_size": 64,
    "width": 32,
    "routing_layers": 2,
    "layers": 2,
    "heads": 4,
    "feedforward": 64,
}
RELEASE_CONFIG = {
    "hidden_size": 4096,
    "width": 1024,
    "routing_layers": 2,
    "layers": 4,
    "heads": 16,
    "feedforward": 4096,
}


# --- names and shapes ------------------------------------------------------------------------------------


def _expected_release_shapes(hidden: int, width: int, feedforward: int, routing: int, layers: int) -> dict:
    """The parameter table of the release's head (docs/model.md section 6), written out independently of
    the module."""
    shapes: dict[str, tuple[int, ...]] = {
        "hidden_norm.weight": (hidden,),
        "hidden_norm.bias": (hidden,),
        "type_embedding.weight": (3, width),
        "option_summary_norm.weight": (width,),
        "option_summary_norm.bias": (width,),
        "field_norm.weight": (width,),
        "field_norm.bias": (width,),
        "option_norm.weight": (width,),
        "option_norm.bias": (width,),
        "residual_scorer.0.weight": (width, 4 * width),
        "residual_scorer.0.bias": (width,),
        "residual_scorer.3.weight": (1, width),
        "residual_scorer.3.bias": (1,),
        "prior_logit_scale": (),
        "joint_logit_scale": (),
        "residual_gate": (),
    }
    for projection in ("memory", "question", "option_question", "global", "option_context", "option_lexical"):
        shapes[f"{projection}_projection.weight"] = (width, hidden)

    def attention(prefix: str) -> None:
        shapes[f"{prefix}.in_proj_weight"] = (3 * width, width)
        shapes[f"{prefix}.in_proj_bias"] = (3 * width,)
        shapes[f"{prefix}.out_proj.weight"] = (width, width)
        shapes[f"{prefix}.out_proj.bias"] = (width,)

    for layer in range(routing):
        prefix = f"evidence_layers.{layer}"
        for norm in ("query_norm", "memory_norm", "feedforward_norm"):
            shapes[f"{prefix}.{norm}.weight"] = (width,)
            shapes[f"{prefix}.{norm}.bias"] = (width,)
        attention(f"{prefix}.attention")
        shapes[f"{prefix}.feedforward.0.weight"] = (feedforward, width)
        shapes[f"{prefix}.feedforward.0.bias"] = (feedforward,)
        shapes[f"{prefix}.feedforward.3.weight"] = (width, feedforward)
        shapes[f"{prefix}.feedforward.3.bias"] = (width,)
    for layer in range(layers):
        prefix = f"layers.{layer}"
        attention(f"{prefix}.self_attn")
        attention(f"{prefix}.multihead_attn")
        shapes[f"{prefix}.linear1.weight"] = (feedforward, width)
        shapes[f"{prefix}.linear1.bias"] = (feedforward,)
        shapes[f"{prefix}.linear2.weight"] = (width, feedforward)
        shapes[f"{prefix}.linear2.bias"] = (width,)
        for norm in ("norm1", "norm2", "norm3"):
            shapes[f"{prefix}.{norm}.weight"] = (width,)
            shapes[f"{prefix}.{norm}.bias"] = (width,)
    return shapes


def test_release_config_has_the_release_names_shapes_and_parameter_count():
    with torch.device("meta"):
        head = JointSchemaHead(**RELEASE_CONFIG)
    state = head.state_dict()
    assert len(state) == 122
    assert sum(tensor.numel() for tensor in state.values()) == 121_762_820
    actual = {name: tuple(tensor.shape) for name, tensor in state.items()}
    assert actual == _expected_release_shapes(4096, 1024, 4096, routing=2, layers=4)
    assert actual["evidence_layers.1.attention.in_proj_weight"] == (3072, 1024)
    assert actual["layers.3.multihead_attn.out_proj.weight"] == (1024, 1024)
    assert actual["residual_scorer.0.weight"] == (1024, 4096)
    assert actual["prior_logit_scale"] == ()
    assert head.config == RELEASE_CONFIG


def test_constructor_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="divisible"):
        JointSchemaHead(**{**SMALL_CONFIG, "heads": 5})


# --- strict loading --------------------------------------------------------------------------------------


def _random_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        head = JointSchemaHead(**config)
    return {
        name: torch.randn(tuple(tensor.shape), generator=generator) * 0.2
        for name, tensor in head.state_dict().items()
    }


def _write_head(directory: Path, state: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / HEAD_CONFIG_FILE).write_text(json.dumps(config or SMALL_CONFIG))
    save_file(
        {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in state.items()},
        str(directory / HEAD_WEIGHTS_FILE),
    )
    return directory


def test_from_files_loads_bf16_release_names_as_fp32(tmp_path):
    state = _random_state(SMALL_CONFIG)
    head = JointSchemaHead.from_files(_write_head(tmp_path, state), device="cpu")
    loaded = head.state_dict()
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, state[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    assert not head.training
    assert head.config == SMALL_CONFIG


@pytest.mark.parametrize(
    ("edit", "offending"),
    [
        (lambda state: state.pop("layers.1.norm2.bias"), "layers.1.norm2.bias"),
        (
            lambda state: state.__setitem__("layers.2.linear1.weight", torch.zeros(64, 32)),
            "layers.2.linear1.weight",
        ),
        (
            lambda state: state.__setitem__(
                "evidence_layers.0.attention.in_proj_weight", torch.zeros(96, 33)
            ),
            "evidence_layers.0.attention.in_proj_weight",
        ),
        (lambda state: state.__setitem__("residual_gate", torch.zeros(1)), "residual_gate"),
    ],
    ids=["missing", "unexpected", "wrong-shape", "wrong-scalar-shape"],
)
def test_from_files_rejects_mismatched_tensors_naming_them(tmp_path, edit, offending):
    state = _random_state(SMALL_CONFIG)
    edit(state)
    _write_head(tmp_path, state)
    with pytest.raises(HeadLoadError) as caught:
        JointSchemaHead.from_files(tmp_path)
    assert offending in str(caught.value)
    assert HEAD_WEIGHTS_FILE in str(caught.value)
    assert caught.value.tensor_names == (offending,)
    assert isinstance(caught.value, ValueError)


def test_from_files_rejects_integer_tensors(tmp_path):
    state = _random_state(SMALL_CONFIG)
    _write_head(tmp_path, state)
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in state.items()}
    tensors["type_embedding.weight"] = torch.zeros(3, 32, dtype=torch.int32)
    save_file(tensors, str(tmp_path / HEAD_WEIGHTS_FILE))
    with pytest.raises(HeadLoadError, match=re.escape("type_embedding.weight")):
        JointSchemaHead.from_files(tmp_path)


def test_from_files_missing_or_corrupt_weights_file(tmp_path):
    (tmp_path / HEAD_CONFIG_FILE).write_text(json.dumps(SMALL_CONFIG))
    with pytest.raises(HeadLoadError, match=re.escape(HEAD_WEIGHTS_FILE)):
        JointSchemaHead.from_files(tmp_path)
    (tmp_path / HEAD_WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(HeadLoadError, match=re.escape(HEAD_WEIGHTS_FILE)):
        JointSchemaHead.from_files(tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "not found"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({**SMALL_CONFIG, "rope": 1}), "unknown head config keys: rope"),
        (json.dumps({k: v for k, v in SMALL_CONFIG.items() if k != "heads"}), "lacks keys: heads"),
        (json.dumps({**SMALL_CONFIG, "width": "32"}), "width must be a positive integer"),
        (json.dumps({**SMALL_CONFIG, "layers": True}), "layers must be a positive integer"),
        (json.dumps({**SMALL_CONFIG, "heads": 5}), "not divisible"),
        (json.dumps({**SMALL_CONFIG, "dropout": 2}), "dropout"),
    ],
)
def test_config_errors_name_the_file(tmp_path, text, message):
    if text is not None:
        (tmp_path / HEAD_CONFIG_FILE).write_text(text)
    with pytest.raises(HeadLoadError, match=message) as caught:
        JointSchemaHead.from_files(tmp_path)
    assert HEAD_CONFIG_FILE in str(caught.value)


def test_read_head_config_accepts_training_dropout(tmp_path):
    path = tmp_path / HEAD_CONFIG_FILE
    path.write_text(json.dumps({**SMALL_CONFIG, "dropout": 0.1}))
    assert read_head_config(path) == {**SMALL_CONFIG, "dropout": 0.1}


# --- an independent, loop-by-loop reference of docs/model.md section 6 ------------------------------------


def _ref_layer_norm(vector, params, prefix):
    mean = vector.sum() / vector.numel()
    variance = ((vector - mean) ** 2).sum() / vector.numel()
    return (vector - mean) / torch.sqrt(variance + 1e-5) * params[f"{prefix}.weight"] + params[
        f"{prefix}.bias"
    ]


def _ref_gelu(values):
    return 0.5 * values * (1.0 + torch.erf(values / math.sqrt(2.0)))


def _ref_linear(vector, params, prefix, bias=True):
    result = params[f"{prefix}.weight"] @ vector
    return result + params[f"{prefix}.bias"] if bias else result


def _ref_norm(vector, eps):
    return vector / max(float(torch.sqrt((vector * vector).sum())), eps)


def _ref_mean(rows, start, end):
    total = rows[start]
    for row in rows[start + 1 : end]:
        total = total + row
    return total / (end - start)


def _ref_attention(query_inputs, key_inputs, value_inputs, params, prefix, heads):
    """Explicit multi-head attention, one query and one head at a time, softmax written out."""
    weight, bias = params[f"{prefix}.in_proj_weight"], params[f"{prefix}.in_proj_bias"]
    width = weight.shape[1]
    head_dim = width // heads
    query_weight, key_weight, value_weight = weight[:width], weight[width : 2 * width], weight[2 * width :]
    query_bias, key_bias, value_bias = bias[:width], bias[width : 2 * width], bias[2 * width :]
    keys = [key_weight @ row + key_bias for row in key_inputs]
    values = [value_weight @ row + value_bias for row in value_inputs]
    outputs = []
    for query_input in query_inputs:
        query = query_weight @ query_input + query_bias
        head_outputs = []
        for head in range(heads):
            part = slice(head * head_dim, (head + 1) * head_dim)
            scores = [float(query[part] @ key[part]) / math.sqrt(head_dim) for key in keys]
            top = max(scores)
            exponentials = [math.exp(score - top) for score in scores]
            total = sum(exponentials)
            mixed = sum(e / total * value[part] for e, value in zip(exponentials, values, strict=True))
            head_outputs.append(mixed)
        concatenated = torch.cat(head_outputs)
        outputs.append(params[f"{prefix}.out_proj.weight"] @ concatenated + params[f"{prefix}.out_proj.bias"])
    return outputs


def _reference_logits(head: JointSchemaHead, hidden, layout: HeadLayout, lexical) -> torch.Tensor:
    """The reference algorithm in float64 with per-question / per-option Python loops."""
    params = {name: tensor.detach().double() for name, tensor in head.state_dict().items()}
    heads, width = head.heads, head.width
    hidden, lexical = hidden.double(), lexical.double()
    rows = [_ref_layer_norm(hidden[t], params, "hidden_norm") for t in range(hidden.shape[0])]
    memory = [params["memory_projection.weight"] @ row for row in rows]
    global_vector = rows[-1]
    question_vectors = [_ref_mean(rows, start, end) for start, end in layout.question_spans]

    routed, owners, lexical_rows = [], [], []
    option = 0
    for question, spans in enumerate(layout.option_spans):
        for start, end in spans:
            context = _ref_mean(rows, start, end)
            routed.append(
                params["option_context_projection.weight"] @ context
                + params["option_lexical_projection.weight"] @ lexical[option]
                + params["option_question_projection.weight"] @ question_vectors[question]
            )
            owners.append(question)
            lexical_rows.append(lexical[option])
            option += 1

    for layer in range(len(head.evidence_layers)):
        prefix = f"evidence_layers.{layer}"
        memory_normed = [_ref_layer_norm(row, params, f"{prefix}.memory_norm") for row in memory]
        for index, vector in enumerate(routed):
            query = _ref_layer_norm(vector, params, f"{prefix}.query_norm")
            vector = (
                vector
                + _ref_attention([query], memory_normed, memory_normed, params, f"{prefix}.attention", heads)[
                    0
                ]
            )
            hidden_ff = _ref_gelu(
                _ref_linear(
                    _ref_layer_norm(vector, params, f"{prefix}.feedforward_norm"),
                    params,
                    f"{prefix}.feedforward.0",
                )
            )
            routed[index] = vector + _ref_linear(hidden_ff, params, f"{prefix}.feedforward.3")

    fields = []
    for question, type_id in enumerate(layout.type_ids):
        base = params["question_projection.weight"] @ question_vectors[question]
        mine = [index for index, owner in enumerate(owners) if owner == question]
        scores = [float(routed[index] @ base) / math.sqrt(width) for index in mine]
        top = max(scores)
        exponentials = [math.exp(score - top) for score in scores]
        summary = sum(
            e / sum(exponentials) * routed[index] for e, index in zip(exponentials, mine, strict=True)
        )
        fields.append(
            base
            + _ref_layer_norm(summary, params, "option_summary_norm")
            + params["global_projection.weight"] @ global_vector
            + params["type_embedding.weight"][type_id]
        )

    for layer in range(len(head.layers)):
        prefix = f"layers.{layer}"
        normed = [_ref_layer_norm(field, params, f"{prefix}.norm1") for field in fields]
        attended = _ref_attention(normed, normed, normed, params, f"{prefix}.self_attn", heads)
        fields = [field + update for field, update in zip(fields, attended, strict=True)]
        normed = [_ref_layer_norm(field, params, f"{prefix}.norm2") for field in fields]
        attended = _ref_attention(normed, memory, memory, params, f"{prefix}.multihead_attn", heads)
        fields = [field + update for field, update in zip(fields, attended, strict=True)]
        updated = []
        for field in fields:
            inner = _ref_gelu(
                _ref_linear(_ref_layer_norm(field, params, f"{prefix}.norm3"), params, f"{prefix}.linear1")
            )
            updated.append(field + _ref_linear(inner, params, f"{prefix}.linear2"))
        fields = updated
    fields = [_ref_layer_norm(field, params, "field_norm") for field in fields]

    prior_scale = min(math.exp(float(params["prior_logit_scale"])), 100.0)
    joint_scale = min(math.exp(float(params["joint_logit_scale"])), 100.0)
    gate = 1.0 / (1.0 + math.exp(-float(params["residual_gate"])))
    logits = []
    for index, owner in enumerate(owners):
        field = fields[owner]
        anchor = _ref_norm(question_vectors[owner] + global_vector, 1e-12)
        prior = prior_scale * float(_ref_norm(lexical_rows[index], 1e-12) @ anchor)
        option_row = _ref_layer_norm(routed[index], params, "option_norm")
        field_length = max(float(torch.sqrt((field * field).sum())), 1e-8)
        option_length = max(float(torch.sqrt((option_row * option_row).sum())), 1e-8)
        cosine = float(field @ option_row) / (field_length * option_length)
        features = torch.cat([field, option_row, field * option_row, (field - option_row).abs()])
        residual = float(
            _ref_linear(
                _ref_gelu(_ref_linear(features, params, "residual_scorer.0")), params, "residual_scorer.3"
            )[0]
        )
        logits.append(prior + gate * (joint_scale * cosine + residual))
    return torch.tensor(logits, dtype=torch.float64)


# --- fixtures for the forward ---------------------------------------------------------------------------


def _randomized_head(seed: int, prior: float, joint: float, gate: float) -> JointSchemaHead:
    torch.manual_seed(seed)
    head = JointSchemaHead(**SMALL_CONFIG)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.2)
        head.prior_logit_scale.fill_(prior)
        head.joint_logit_scale.fill_(joint)
        head.residual_gate.fill_(gate)
    return head.eval()


def _random_record(seed: int, type_ids: list[int], option_counts: list[int]):
    """A record whose spans are laid out like a prompt: scaffolding, question text, option texts."""
    chooser = random.Random(seed)
    cursor = chooser.randint(2, 5)  # prompt prefix
    question_spans, option_spans = [], []
    for count in option_counts:
        length = chooser.randint(1, 6)
        question_spans.append((cursor, cursor + length))
        cursor += length + chooser.randint(0, 2)
        spans = []
        for _ in range(count):
            length = chooser.randint(1, 5)
            spans.append((cursor, cursor + length))
            cursor += length + chooser.randint(0, 1)
        option_spans.append(spans)
    num_tokens = cursor + chooser.randint(1, 4)  # prompt suffix, ending in the global token
    layout = HeadLayout(type_ids=type_ids, question_spans=question_spans, option_spans=option_spans)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, SMALL_CONFIG["hidden_size"], generator=generator) * 1.5 + 0.3
    lexical = torch.randn(layout.num_options, SMALL_CONFIG["hidden_size"], generator=generator) * 0.05
    return hidden, layout, lexical


@pytest.mark.parametrize(
    ("prior", "joint", "gate"),
    [(5.0, 1.3, -0.7), (0.8, 6.0, -0.5)],
    ids=["prior-capped", "joint-capped"],
)
def test_score_matches_loop_reference(prior, joint, gate):
    head = _randomized_head(1, prior, joint, gate)
    head.memory_chunk_rows = 7  # exercise the block-wise memory projection
    hidden, layout, lexical = _random_record(2, type_ids=[0, 1, 2, 1, 2], option_counts=[2, 7, 4, 3, 6])
    logits = head.score(hidden, layout, lexical)
    expected = _reference_logits(head, hidden, layout, lexical)
    assert logits.dtype == torch.float32
    assert logits.shape == (layout.num_options,)
    assert (logits.double() - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 1.0  # the logits are not trivially small


def test_score_batch_equals_single_calls():
    head = _randomized_head(3, 4.9, 0.5, 0.2)
    records = [
        _random_record(10, type_ids=[1, 0], option_counts=[5, 2]),
        _random_record(11, type_ids=[2, 2, 0, 1], option_counts=[3, 7, 2, 4]),
        _random_record(12, type_ids=[0], option_counts=[2]),
    ]
    assert len({hidden.shape[0] for hidden, _, _ in records}) == 3
    batched = head.score_batch(*zip(*records, strict=True))
    assert len(batched) == 3
    for (hidden, layout, lexical), logits in zip(records, batched, strict=True):
        single = head.score(hidden, layout, lexical)
        assert logits.shape == single.shape == (layout.num_options,)
        assert (logits - single).abs().max().item() <= 1e-5
    assert head.score_batch([], [], []) == []


def test_score_casts_low_precision_hidden_to_fp32():
    head = _randomized_head(4, 1.0, 1.0, 0.0)
    hidden, layout, lexical = _random_record(5, type_ids=[1, 0], option_counts=[3, 2])
    hidden_bf16 = hidden.to(torch.bfloat16)
    torch.testing.assert_close(
        head.score(hidden_bf16, layout, lexical),
        head.score(hidden_bf16.float(), layout, lexical),
        rtol=0,
        atol=1e-6,
    )


def test_probabilities_are_normalised_per_question():
    head = _randomized_head(6, 2.0, 2.0, 0.5)
    hidden, layout, lexical = _random_record(7, type_ids=[0, 1, 2], option_counts=[2, 6, 4])
    logits = head.score(hidden, layout, lexical)
    per_question = probabilities(logits, layout)
    assert [len(p) for p in per_question] == [2, 6, 4]
    start = 0
    for question_probabilities, count in zip(per_question, layout.option_counts, strict=True):
        assert question_probabilities.dtype == torch.float32
        assert abs(question_probabilities.sum().item() - 1.0) <= 1e-6
        torch.testing.assert_close(question_probabilities, torch.softmax(logits[start : start + count], -1))
        start += count
    assert JointSchemaHead.probabilities(logits.double(), layout)[1].dtype == torch.float32
    with pytest.raises(ValueError, match="12 options"):
        probabilities(logits[:-1], layout)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (HeadLayout([1], [(0, 2)], [[(2, 2), (3, 4)]]), "empty or outside"),
        (HeadLayout([1], [(0, 2)], [[(2, 3), (3, 21)]]), "empty or outside"),
        (HeadLayout([3], [(0, 2)], [[(2, 3), (3, 4)]]), "type id"),
        (HeadLayout([1, 0], [(0, 2)], [[(2, 3), (3, 4)]]), "one entry per question"),
        (HeadLayout([1], [(0, 2)], [[]]), "no options"),
        (HeadLayout([], [], []), "at least one question"),
    ],
)
def test_invalid_layouts_are_rejected(layout, message):
    head = _randomized_head(8, 0.0, 0.0, 0.0)
    hidden = torch.randn(20, SMALL_CONFIG["hidden_size"])
    with pytest.raises(ValueError, match=message):
        head.score(hidden, layout, torch.zeros(layout.num_options, SMALL_CONFIG["hidden_size"]))


def test_mismatched_inputs_are_rejected():
    head = _randomized_head(9, 0.0, 0.0, 0.0)
    hidden, layout, lexical = _random_record(9, type_ids=[1], option_counts=[3])
    with pytest.raises(ValueError, match="option_lexical"):
        head.score(hidden, layout, lexical[:2])
    with pytest.raises(ValueError, match="hidden"):
        head.score(hidden[:, :10], layout, lexical)
    with pytest.raises(ValueError, match="1 hiddens, 2 layouts"):
        head.score_batch([hidden], [layout, layout], [lexical])
