"""Saved classifiers, the server side: what a name may be, how a saved definition is validated, who owns
it, and how a classifier's decide body becomes the System One request it stands for.

A classifier is ``questions`` (validated exactly as ``POST /v1/systemone`` validates them, by the protocol's
own `parse_request`), an optional ``head`` (what the System One body's top-level ``model`` is set to when
deciding, so the server answers with that tuned head; it must be one the server serves) and a
``description`` (shown to people and to agents, as the MCP tool's description). Deciding with it builds the
System One body from the stored definition and the caller's ``state`` / ``images`` and runs the System One
route's own flow: the answer is the one ``/v1/systemone`` gives for that body, plus ``x_classifier`` naming
what answered.

Ownership is the jobs': a digest of the API key the classifier was saved with (`owner_of`), so another key
sees none of them (404, never listed); with auth off every caller shares one owner.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from clef_runtime.engine.head_records import HeadInfo
from clef_runtime.jobs.classifier_store import Classifier, ClassifierStore, ClassifierStoreUnavailable
from clef_runtime.jobs.store import owner_of
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.plain_errors import validate_object
from clef_runtime.protocol.systemone import parse_request
from clef_runtime.protocol.values import check_text_before
from clef_runtime.server.errors import ApiError
from clef_runtime.server.flow import Reply, WireMapping
from clef_runtime.server.runtime import ServerRuntime
from clef_runtime.server.settings import ServerSettings

__all__ = [
    "DESCRIPTION_MAX_CHARS",
    "HEAD_MAX_CHARS",
    "NAME_MAX_CHARS",
    "NAME_PATTERN",
    "ClassifierDefinition",
    "caller_owner",
    "check_head",
    "decide_mapping",
    "name_problem",
    "open_store",
    "parse_definition",
    "pin_error",
    "pin_status",
    "served_head",
    "systemone_body",
    "unavailable_error",
]

logger = logging.getLogger("clef_runtime.server")

NAME_MAX_CHARS = 55
"""So that the MCP tool name ``classify_<name>`` fits the 64 characters agents' function-calling APIs allow
(OpenAI's and Anthropic's tool names: ``^[a-zA-Z0-9_-]{1,64}$``)."""
NAME_PATTERN = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{NAME_MAX_CHARS - 1}}}$")
"""Letters, digits, ``_`` and ``-``, starting with a letter or digit: safe in a URL and as a tool name."""
DESCRIPTION_MAX_CHARS = 2000
HEAD_MAX_CHARS = 256


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a classifier, or None when it can."""
    if NAME_PATTERN.match(name):
        return None
    return (
        f"a classifier name is 1-{NAME_MAX_CHARS} letters, digits, '_' or '-', starting with a letter or "
        f"digit (it is also the MCP tool name classify_<name>); got {name[:80]!r}"
    )


# Strings the tokenizer (and SQLite) can take: a lone surrogate is refused by name, before the length check.
_Head = Annotated[
    str, StringConstraints(min_length=1, max_length=HEAD_MAX_CHARS), BeforeValidator(check_text_before)
]
_Description = Annotated[
    str, StringConstraints(max_length=DESCRIPTION_MAX_CHARS), BeforeValidator(check_text_before)
]


class ClassifierDefinition(BaseModel):
    """The body of ``PUT /v1/classifiers/{name}`` (``questions`` checked by `parse_request` afterwards)."""

    model_config = ConfigDict(extra="forbid")

    questions: Any = Field(
        description="1 to 64 System One questions keyed by id, as /v1/systemone takes them."
    )
    head: _Head | None = Field(
        default=None,
        description="The head that answers: the System One body's `model` when deciding (absent: the "
        "release head); one this server serves (`check_head`).",
    )
    description: _Description | None = Field(default=None, description="What the classifier is for.")


def parse_definition(data: Any) -> ClassifierDefinition:
    """Validate a PUT body: its own fields, then ``questions`` and ``head`` as ``/v1/systemone`` validates
    ``questions`` and ``model``. Raises `RequestValidationError` with locations in the PUT body."""
    definition = validate_object(ClassifierDefinition, data)
    probe: dict[str, Any] = {"state": "", "questions": definition.questions}
    if definition.head is not None:
        probe["model"] = definition.head
    try:
        parse_request(probe)
    except RequestValidationError as exc:
        # The probe's `model` is the PUT body's `head`; every other location is the body's already.
        raise RequestValidationError(
            {**err, "loc": ("head", *err["loc"][1:]) if err["loc"][:1] == ("model",) else err["loc"]}
            for err in exc.errors
        ) from None
    return definition


def check_head(head: str, served: Sequence[str]) -> None:
    """Refuse a head this server does not serve (``served``: ``GET /v1/heads``'s names, the model's own name
    first, which picks the release head). ``/v1/systemone`` answers an unknown ``model`` with the default
    head, which for a saved classifier would hide a typo for as long as it is used. Raises
    `RequestValidationError` at ``head``."""
    if head in served:
        return
    engine_name, *tuned = served
    named = (
        f"the tuned heads {', '.join(repr(name) for name in sorted(tuned))} (GET /v1/heads lists them)"
        if tuned
        else "no tuned head (clef serve --head NAME=DIR or POST /v1/heads adds one)"
    )
    raise RequestValidationError.single(
        ("head",),
        f"unknown head {head!r}: this server serves {engine_name!r} (its default head) and {named}; leave "
        "head out for the default head",
        "unknown_head",
    )


def served_head(classifier: Classifier, heads: Sequence[HeadInfo]) -> HeadInfo | None:
    """The head served now under the classifier's head name (its ``head``, else the default head), or None
    when no head of that name is served."""
    for info in heads:
        if (info.name == classifier.head) if classifier.head is not None else info.default:
            return info
    return None


def pin_status(classifier: Classifier, heads: Sequence[HeadInfo]) -> dict[str, Any]:
    """Whether the classifier's pinned head is the one served (the list's ``head_status``): ``status`` is
    ``ok``, ``head_changed`` (another digest, or none recorded) or ``head_not_loaded``, with the digest
    served (None when not loaded)."""
    info = served_head(classifier, heads)
    if info is None:
        return {"status": "head_not_loaded", "digest_served": None}
    changed = classifier.head_digest is None or classifier.head_digest != info.digest
    return {"status": "head_changed" if changed else "ok", "digest_served": info.digest}


def pin_error(classifier: Classifier, heads: Sequence[HeadInfo]) -> ApiError | None:
    """Why the classifier cannot be decided with now (None: it can): 503 ``head_not_loaded`` when no head of
    its head's name is served, 409 ``head_changed`` when the head served has another digest than the one it
    was saved with. Never a silent answer by another head. Both name the head, the digest recorded and the
    digest served, and what to do."""
    info = served_head(classifier, heads)
    head = classifier.head if classifier.head is not None else "the default head"
    recorded = classifier.head_digest
    extra = {"classifier": classifier.name, "head": classifier.head, "digest_recorded": recorded}
    if info is None:
        return ApiError(
            503,
            "head_not_loaded",
            f"classifier {classifier.name!r} answers with head {head!r}, which this server does not serve: "
            f"load it again (clef serve --head {classifier.head}=DIR, or POST /v1/heads), or PUT the "
            "classifier with another head",
            extra={**extra, "digest_served": None, "served": [h.name for h in heads]},
        )
    if recorded == info.digest:
        return None
    saved = f"saved with digest {recorded}" if recorded is not None else "saved before head digests were kept"
    return ApiError(
        409,
        "head_changed",
        f"classifier {classifier.name!r} was {saved}, but head {info.name!r} is served now with digest "
        f"{info.digest}: serve the head it was saved with again, or PUT /v1/classifiers/{classifier.name} "
        "again to accept the head served now",
        extra={**extra, "digest_served": info.digest},
    )


def caller_owner(runtime: ServerRuntime, headers: Any) -> str:
    """The owner id of the caller's classifiers (the request must be authenticated already): the jobs'
    digest of its key, "" for every caller with auth off."""
    keys = runtime.keys
    return owner_of(keys.presented_key(headers) if keys.enabled else None)


# Fields of a decide body that belong to the classifier: sending them is a mistake, never silently overridden.
_SAVED_FIELDS = {
    "questions": "the questions are the classifier's own; change them with PUT /v1/classifiers/{name}",
    "model": "the classifier answers with its saved head; change it with PUT /v1/classifiers/{name}",
    "x_head_digest": "the classifier pins the digest of the head it was saved with",
}


def systemone_body(classifier: Classifier, data: Any) -> dict[str, Any]:
    """The System One request a decide body stands for: the body's ``state``, ``images`` and any other
    field (``x_`` extras pass through) with the classifier's questions and, when it has one, its head as
    ``model``. Raises `RequestValidationError` for a body that is not an object or sends a saved field."""
    if not isinstance(data, dict):
        raise RequestValidationError.single(
            (), "the request body must be a JSON object with a 'state' (and optional 'images')", "model_type"
        )
    problems = [
        {"loc": (field,), "msg": why, "type": "extra_forbidden"}
        for field, why in _SAVED_FIELDS.items()
        if field in data
    ]
    if problems:
        raise RequestValidationError(problems)
    body = {**data, "questions": classifier.questions}
    if classifier.head is not None:
        body["model"] = classifier.head
    if classifier.head_digest is not None:
        # The engine checks the pin again when it resolves the head: a head reloaded between the route's
        # check and this request's admission is refused too.
        body["x_head_digest"] = classifier.head_digest
    return body


def decide_mapping(classifier: Classifier) -> WireMapping[None]:
    """The wire mapping of ``POST /v1/classifiers/{name}/decide`` for ``classifier``: the body's fields are
    the System One body's (errors point at them unchanged), and the answer gains ``x_classifier``."""

    def to_systemone(data: Any) -> tuple[dict[str, Any], None]:
        return systemone_body(classifier, data), None

    def from_systemone(answer: dict[str, Any], plan: None, reply: Reply) -> dict[str, Any]:
        return {**answer, "x_classifier": {"name": classifier.name, "version": classifier.version}}

    return WireMapping(to_systemone=to_systemone, from_systemone=from_systemone, classifier=classifier.name)


def unavailable_error(exc: ClassifierStoreUnavailable) -> ApiError:
    """The 503 of a classifier request whose database cannot be read or written now (decisions go on)."""
    return ApiError(
        503,
        "classifiers_unavailable",
        f"saved classifiers are unavailable: {exc}",
        headers={"Retry-After": "30"},
    )


def open_store(settings: ServerSettings) -> ClassifierStore:
    """Open the classifiers database of ``settings`` (raises `ClassifierStoreError` for a damaged or foreign
    file: the server must not start on it)."""
    former = settings.former_classifiers_db_path
    if former is not None and former.exists():
        # Classifiers saved before the shared default are still there: say where, never hide them silently.
        logger.warning(
            "saved classifiers found beside --jobs-db at %s are no longer read by default (the default is "
            "now %s): pass --classifiers-db %s to keep using them",
            former,
            settings.classifiers_db_path,
            former,
        )
    store = ClassifierStore(settings.classifiers_db_path)
    logger.info("saved classifiers stored in %s", store.path)
    return store
