"""``x_explain``: the evidence of every answer of a decided row, from the head's attribution to the wire.

For a row whose request asks for it, after the head scored it (`clef_runtime.engine.executor`):

1. each question's *target* is the answer given: the option answered for noul (true when P(true) >= 0.5)
   and choice (the first maximum in the request's order, as the answer), the expected level for score;
2. `clef_runtime.model.attribution.row_attributions` weighs the record's state rows and image rows for each
   target with the engine's ``--explain-method`` (backbone frozen; only the head runs again);
3. the state's token weights go to units of the request's granularity (`clef_runtime.encoding.evidence`:
   words, tokens or fields, with character offsets into the rendered state and JSON pointers), each image's
   rows to its patches (a box in the image's pixels), and the ``top_k`` strongest become ``x_evidence``.

Only state and image rows are ever weighed: the schema (instructions, options) is never evidence. Nothing
here runs for a request without ``x_explain``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from clef_runtime.encoding.encoder import EncodedRecord
from clef_runtime.encoding.evidence import evidence_items, rank_units, significant, state_units
from clef_runtime.encoding.render import render
from clef_runtime.engine.images import PreparedImage
from clef_runtime.model.attribution import AttributionTarget, row_attributions
from clef_runtime.model.head import HeadLayout, JointSchemaHead
from clef_runtime.protocol.explain import ExplainOptions
from clef_runtime.protocol.systemone import ChoiceQuestion, NoulQuestion, SystemOneRequest

__all__ = ["WEIGHT_MEANINGS", "Explanation", "answer_targets", "explain_row"]

#: What a weight means, per method (the body's ``x_explain.weights``).
WEIGHT_MEANINGS = {
    "integrated_gradients": "signed: how much the span moves the answer's log-probability (the expected "
    "level for a score) along the path from an empty memory row to the real one; positive supports it",
    "gradient_x_input": "signed: the first-order change of the answer's log-probability (the expected level "
    "for a score) from the span's memory rows; positive supports the answer",
    "attention": "non-negative: the share of the answer's attention over the state that the span receives, "
    "averaged over the head's evidence-routing and decoder layers",
}


@dataclass(frozen=True)
class Explanation:
    """One row's evidence: ``x_evidence`` per question id, and the body's ``x_explain`` record."""

    evidence: dict[str, list[dict[str, Any]]]
    record: dict[str, Any]


def answer_targets(
    request: SystemOneRequest, record: EncodedRecord, probabilities: Sequence[Sequence[float]]
) -> list[AttributionTarget]:
    """The target of each question of ``record`` (in its order) given its option ``probabilities`` in model
    order: the answered option of a noul or choice (as `clef_runtime.engine.answers.build_answer` picks it),
    None (the expected level) for a score."""
    targets = []
    for number, (encoded, probs) in enumerate(zip(record.questions, probabilities, strict=True)):
        question = request.questions[encoded.question_id]
        by_id = dict(zip(encoded.option_ids, probs, strict=True))
        if isinstance(question, NoulQuestion):
            answered = "true" if by_id["true"] >= 0.5 else "false"
        elif isinstance(question, ChoiceQuestion):
            answered = max((str(key) for key in question.criteria), key=by_id.__getitem__)
        else:
            targets.append(AttributionTarget(number, None))
            continue
        targets.append(AttributionTarget(number, encoded.option_ids.index(answered)))
    return targets


def explain_row(
    head: JointSchemaHead,
    hidden: Tensor,
    layout: HeadLayout,
    option_lexical: Tensor,
    request: SystemOneRequest,
    record: EncodedRecord,
    images: Sequence[PreparedImage],
    probabilities: Sequence[Sequence[float]],
    tokenizer: Any,
    method: str,
) -> Explanation:
    """The evidence of one decided row (see the module docstring). ``tokenizer``: the encoder's (it gives
    the state tokens' character offsets); ``probabilities``: per question, per option in model order."""
    options = request.x_explain or ExplainOptions()
    rendered = render(request.state)
    kept = record.state_end - record.state_start
    state_ids, offsets = tokenizer.encode_with_offsets(rendered)
    if list(state_ids[:kept]) != list(record.input_ids[record.state_start : record.state_end]):
        raise RuntimeError("the state's tokens differ from the record's: offsets would point elsewhere")
    image_rows = [torch.arange(first, first + count) for first, count in record.image_blocks]
    rows = torch.cat([torch.arange(record.state_start, record.state_end), *image_rows])
    targets = answer_targets(request, record, probabilities)
    weights = row_attributions(head, hidden, layout, option_lexical, rows, targets, method)
    units = state_units(request.state, rendered, offsets[:kept], options.granularity)
    signed = method != "attention"
    evidence = {}
    for target, row_weights in zip(targets, weights, strict=True):
        # A score's target is a level, not a side: its strongest spans push it either way.
        by_magnitude = signed and target.option is None
        ranked = rank_units(units, row_weights[:kept].tolist(), options.top_k, by_magnitude=by_magnitude)
        items = [
            (weight, item) for (_, weight), item in zip(ranked, evidence_items(units, ranked), strict=True)
        ]
        items += _image_items(images, row_weights[kept:], options.granularity)
        strength = (lambda pair: -abs(pair[0])) if by_magnitude else (lambda pair: -pair[0])
        items.sort(key=strength)  # stable: text before images at equal weight
        question_id = record.questions[target.question].question_id
        evidence[question_id] = [item for _, item in items[: options.top_k]]
    explanation: dict[str, Any] = {
        "method": method,
        "granularity": options.granularity,
        "top_k": options.top_k,
        "weights": WEIGHT_MEANINGS[method],
    }
    if not isinstance(request.state, str):
        explanation["state_text"] = rendered
    return Explanation(evidence, explanation)


def _image_items(
    images: Sequence[PreparedImage], weights: Tensor, granularity: str
) -> list[tuple[float, dict[str, Any]]]:
    """Each image's evidence units: its merged patches (a whole image at ``field`` granularity), with the box
    they cover in the image's own pixels and the sum of their rows' weights."""
    items: list[tuple[float, dict[str, Any]]] = []
    first = 0
    for number, image in enumerate(images):
        rows, cols = image.pixels.merged_hw
        image_weights = weights[first : first + rows * cols].view(rows, cols)
        first += rows * cols
        width, height = image.pixel_size
        if granularity == "field":
            cells = [((0, 0, rows, cols), float(image_weights.sum()))]
        else:
            cells = [
                ((r, c, r + 1, c + 1), float(image_weights[r, c])) for r in range(rows) for c in range(cols)
            ]
        for (top, left, bottom, right), weight in cells:
            box = [
                round(left * width / cols),
                round(top * height / rows),
                round(right * width / cols),
                round(bottom * height / rows),
            ]
            items.append((weight, {"image": number, "box": box, "weight": significant(weight)}))
    return items
