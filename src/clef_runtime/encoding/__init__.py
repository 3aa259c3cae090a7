"""Token-exact Clef prompt encoding: tokenizer, ``render``, ``question_options``, ``Encoder``."""

from clef_runtime.encoding.encoder import (
    DEFAULT_MAX_LENGTH,
    EncodedQuestion,
    EncodedRecord,
    Encoder,
    question_options,
)
from clef_runtime.encoding.render import render

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "EncodedQuestion",
    "EncodedRecord",
    "Encoder",
    "question_options",
    "render",
]
