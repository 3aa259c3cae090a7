"""Which rows of a record drove each answer: attribution over the joint schema head's memory rows.

The head reads a state token only through its memory row (``LN(hidden) @ memory_projectionᵀ``): the
question and option spans and the last token reach it by other paths, but a state row has no other way in.
So the attributions here are over memory rows, with the backbone frozen (its rows are constants): one
backward through the head (a fraction of a percent of the backbone's work), never through the backbone.

A *target* is the number an answer is explained as: the log-probability of the option answered (choice and
noul), or the expected level (score). Methods (docs/explain.md has their measured faithfulness):

- ``gradient_x_input``: d target / d m_t . m_t for each memory row m_t (signed: positive supports the
  answer, or raises the expected level). One backward per question.
- ``integrated_gradients``: the same product with the gradient integrated along the straight path from a
  zero memory row to the real one, all explained rows scaled together (`IG_STEPS` points; the weights of a
  question sum to about target(real) - target(rows zeroed)). ``IG_STEPS`` forwards and backwards per
  question.
- ``attention``: how much the answer's own queries attend to each row, averaged over heads and layers: the
  option answered in every evidence-routing layer, its question's field in every decoder layer (for a score,
  every level's option, weighted by its probability). Non-negative; one forward.

The raw hidden rows are deliberately not the input: the head LayerNorms every row first, and a function
that ignores a row's scale has gradient x input 0 for it (Euler's theorem), whatever the row says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from clef_runtime.model.head import HeadLayout, JointSchemaHead
from clef_runtime.options import EXPLAIN_METHODS

__all__ = ["IG_BATCH", "IG_STEPS", "METHODS", "AttributionTarget", "row_attributions", "target_values"]

METHODS = EXPLAIN_METHODS
#: Points on the integrated-gradients path.
IG_STEPS = 16
#: Path points scored in one batched forward (bounds the extra memory: that many copies of the record's
#: hidden and memory rows).
IG_BATCH = 8
#: The path's points are the midpoints s of [0, 1] taken to this power (the scale of the rows, weighted by
#: its derivative): the evidence-routing layers LayerNorm the memory, so they see a scaled row as the real
#: one until the scale is near 0, and all their effect happens there. Evenly spaced points step over it (on a
#: random head the weights then missed up to half of the completeness sum); cubed ones resolve it.
IG_PATH_POWER = 3


@dataclass(frozen=True)
class AttributionTarget:
    """What one question's answer is explained as: ``option`` (an index into the question's options in model
    order) for the log-probability of that option, or None for the expected level of a score."""

    question: int
    option: int | None


def target_values(logits: Tensor, layout: HeadLayout, targets: Sequence[AttributionTarget]) -> Tensor:
    """The targets [len(targets)] of a record's [O] logits (differentiable)."""
    counts = layout.option_counts
    firsts = [sum(counts[:question]) for question in range(len(counts))]
    values = []
    for target in targets:
        first = firsts[target.question]
        question_logits = logits[first : first + counts[target.question]]
        if target.option is None:
            levels = torch.arange(question_logits.shape[0], dtype=logits.dtype, device=logits.device)
            values.append((torch.softmax(question_logits, dim=0) * levels).sum())
        else:
            values.append(torch.log_softmax(question_logits, dim=0)[target.option])
    return torch.stack(values)


def row_attributions(
    head: JointSchemaHead,
    hidden: Tensor,
    layout: HeadLayout,
    option_lexical: Tensor,
    rows: Tensor,
    targets: Sequence[AttributionTarget],
    method: str = METHODS[0],
) -> Tensor:
    """The weight of each of ``rows`` (indexes into ``hidden``'s rows) for each target, [len(targets),
    len(rows)] fp32 on the CPU. ``hidden``: the record's [T, hidden_size] rows as `JointSchemaHead.score`
    takes them (an inference tensor is fine). Raises ValueError for an unknown method."""
    if method not in METHODS:
        raise ValueError(f"unknown attribution method {method!r} (expected one of {', '.join(METHODS)})")
    # The engine decides in inference mode, whose tensors cannot take part in autograd: everything here runs
    # outside it, on fresh copies.
    with torch.inference_mode(False):
        with torch.no_grad():
            rows = rows.to(head.device).clone()
            hidden = hidden.to(head.device).clone()
            lexical = option_lexical.to(head.device).clone()
            memory = head.memory_rows(hidden).clone()
        record = _Record(head, hidden, layout, lexical, memory, rows)
        if method == "attention":
            weights = _attention(record, targets)
        else:
            steps = None if method == "gradient_x_input" else IG_STEPS
            weights = _gradient_x_input(record, targets, steps=steps)
        return weights.to("cpu")


@dataclass(frozen=True)
class _Record:
    """One record's head inputs (fresh, non-inference tensors), its memory and the rows explained."""

    head: JointSchemaHead
    hidden: Tensor
    layout: HeadLayout
    lexical: Tensor
    memory: Tensor
    rows: Tensor

    def logits(self, memory: Tensor) -> Tensor:
        """The record's logits with ``memory`` (see `JointSchemaHead.logits_from_memory`)."""
        return self.head.logits_from_memory(self.hidden, self.layout, self.lexical, memory)


def _gradient_x_input(record: _Record, targets: Sequence[AttributionTarget], *, steps: int | None) -> Tensor:
    """Gradient x input on the memory rows ``rows`` (``steps`` None), or integrated gradients from zero rows
    with ``steps`` points (scale s ** `IG_PATH_POWER` at each midpoint s, weighted by its derivative), scored
    `IG_BATCH` points at a time (one batched forward, one backward per question: a point's targets depend on
    its own memory only, so the sum's gradient is each point's)."""
    memory, rows, layout = record.memory, record.rows, record.layout
    explained = memory[rows]
    if steps is None:
        path = [(1.0, 1.0)]
    else:
        midpoints = [(step + 0.5) / steps for step in range(steps)]
        power = IG_PATH_POWER
        path = [(point**power, power * point ** (power - 1) / steps) for point in midpoints]
    gradient_sum = torch.zeros(len(targets), *explained.shape, dtype=torch.float32, device=memory.device)
    with torch.enable_grad():
        for first in range(0, len(path), IG_BATCH):
            chunk = path[first : first + IG_BATCH]
            scales = torch.tensor([scale for scale, _ in chunk], device=memory.device)
            step_weights = torch.tensor([weight for _, weight in chunk], device=memory.device)
            scaled = (scales[:, None, None] * explained).requires_grad_(True)  # [n, R, W]
            path_memory = memory.expand(len(chunk), -1, -1).clone()
            path_memory[:, rows] = scaled
            logits = record.logits(path_memory)
            values = torch.stack([target_values(point, layout, targets) for point in logits])  # [n, Q]
            for number in range(len(targets)):
                (gradient,) = torch.autograd.grad(
                    values[:, number].sum(), scaled, retain_graph=number + 1 < len(targets)
                )
                gradient_sum[number] += (gradient * step_weights[:, None, None]).sum(0)
    return (gradient_sum * explained).sum(-1)


def _attention(record: _Record, targets: Sequence[AttributionTarget]) -> Tensor:
    """The answer's queries' attention to the record's explained rows, averaged over heads and
    memory-attention layers."""
    memory, rows, layout = record.memory, record.rows, record.layout
    with torch.no_grad(), record.head.recording_attention() as log:
        logits = record.logits(memory)
    counts = layout.option_counts
    weights = torch.zeros(len(targets), rows.shape[0], dtype=torch.float32, device=memory.device)
    for number, target in enumerate(targets):
        first = sum(counts[: target.question])
        question_probs = torch.softmax(logits[first : first + counts[target.question]], dim=0)
        if target.option is None:
            option_mix = question_probs
        else:
            option_mix = torch.zeros_like(question_probs)
            option_mix[target.option] = 1.0
        layers = 0
        for tag, probabilities in log:
            per_head = probabilities[0].mean(dim=0)  # [L, T]: one record, heads averaged
            if tag == "evidence":
                attended = option_mix @ per_head[first : first + counts[target.question]]
            else:
                attended = per_head[target.question]
            weights[number] += attended[rows]
            layers += 1
        weights[number] /= max(layers, 1)
    return weights
