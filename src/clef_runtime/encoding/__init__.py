"""Token-exact Clef prompt encoding: tokenizer, ``render``, ``question_options``, ``encode_record``."""

from clef_runtime.encoding.encoder import (
    DEFAULT_MAX_LENGTH,
    EncodedQuestion,
    EncodedRecord,
    Encoder,
    encode_record,
    question_options,
)
from clef_runtime.encoding.render import render

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "EncodedQuestion",
    "EncodedRecord",
    "Encoder",
    "encode_record",
    "question_options",
    "render",
]
