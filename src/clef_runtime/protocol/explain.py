"""The ``x_explain`` request option: which parts of the state drove each answer.

``x_explain`` is ``true`` (the defaults), ``false``/absent (off) or an object ``{"top_k": 1-20,
"granularity": "word" | "token" | "field"}``. With it, every answer gains ``x_evidence``: the ``top_k``
spans of the state that most support the answer given (see docs/explain.md for the method and what the
weights mean), and the response gains ``x_explain``: the method, the options used and, for a JSON state,
the rendered state text the spans' character offsets point into.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt
from pydantic_core import PydanticCustomError

from clef_runtime.protocol.plain_errors import validate_object

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_TOP_K",
    "EXPLAIN_DESCRIPTION",
    "GRANULARITIES",
    "MAX_TOP_K",
    "ExplainField",
    "ExplainOptions",
    "checked_explain",
    "explain_options",
    "explain_wire",
]

DEFAULT_TOP_K = 5
MAX_TOP_K = 20
GRANULARITIES = ("word", "token", "field")
Granularity = Literal["word", "token", "field"]
DEFAULT_GRANULARITY: Granularity = "word"


class ExplainOptions(BaseModel):
    """What an explanation reports: the ``top_k`` strongest units of the state, at ``granularity``
    (``word``: runs of letters and digits; ``token``: the model's tokens; ``field``: a JSON state's leaf
    values, or a text state's lines and sentences). Immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    top_k: StrictInt = Field(
        default=DEFAULT_TOP_K,
        ge=1,
        le=MAX_TOP_K,
        description=f"How many spans to report per answer (1-{MAX_TOP_K}).",
    )
    granularity: Granularity = Field(
        default=DEFAULT_GRANULARITY,
        description="word (runs of letters and digits), token (the model's tokens) or field (a JSON state's "
        "leaf values; a text state's lines and sentences).",
    )


def explain_options(value: Any) -> ExplainOptions | None:
    """``x_explain``'s value as options: None for off (``false``, null), the defaults for ``true``, the
    object validated otherwise. Raises pydantic's errors (``x_explain.top_k`` and so on) for a bad object,
    and ``explain_type`` for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return ExplainOptions()
    if isinstance(value, ExplainOptions):
        return value
    if isinstance(value, dict):
        return ExplainOptions.model_validate(value)
    raise PydanticCustomError(
        "explain_type", 'must be true, false or an object such as {"top_k": 5, "granularity": "word"}'
    )


ExplainField = Annotated[ExplainOptions | None, BeforeValidator(explain_options)]
"""A request field holding ``x_explain`` (off by default): the type every route's request model declares, so
that each validates it alike and names ``x_explain.top_k`` and so on in its errors."""

EXPLAIN_DESCRIPTION = (
    'Evidence for every answer: true, or {"top_k": 1-20 (5), "granularity": "word" | "token" | "field"}. '
    "Each answer gains x_evidence (the state spans that most support it); the response gains x_explain "
    "(the method and the options used). Off by default."
)
"""The OpenAPI description of a route's ``x_explain`` field."""


def explain_wire(options: ExplainOptions | None) -> dict[str, Any] | None:
    """``x_explain`` as a System One request body carries it (None: leave the field out)."""
    return None if options is None else options.model_dump()


class _ExplainArgument(BaseModel):
    """``x_explain`` alone, to validate an option given outside a request body (``Clef.decide(explain=)``,
    ``clef decide --explain-top-k``) exactly as the wire does."""

    x_explain: ExplainField = None


def checked_explain(value: Any) -> ExplainOptions | None:
    """``value`` (True, False/None, an options object or an ``ExplainOptions``) as options, validated as the
    request field ``x_explain``. Raises ``RequestValidationError`` naming ``x_explain.top_k`` and so on."""
    return validate_object(_ExplainArgument, {"x_explain": value}).x_explain
