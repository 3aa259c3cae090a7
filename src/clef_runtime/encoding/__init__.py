"""Token-exact Clef prompt encoding: tokenizer, ``render``, ``question_options``, ``Encoder``, and the
evidence units that explanations are reported on."""

from clef_runtime.encoding.encoder import (
    DEFAULT_MAX_LENGTH,
    EncodedQuestion,
    EncodedRecord,
    Encoder,
    question_options,
)
from clef_runtime.encoding.evidence import (
    EvidenceUnit,
    RenderedJson,
    StateUnits,
    evidence_items,
    rank_units,
    render_json_paths,
    state_units,
    token_char_offsets,
)
from clef_runtime.encoding.render import render

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "EncodedQuestion",
    "EncodedRecord",
    "Encoder",
    "EvidenceUnit",
    "RenderedJson",
    "StateUnits",
    "evidence_items",
    "question_options",
    "rank_units",
    "render",
    "render_json_paths",
    "state_units",
    "token_char_offsets",
]
