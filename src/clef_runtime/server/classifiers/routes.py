"""``/v1/classifiers``: saved classifiers (a name for a set of System One questions and the head that answers
them), created or replaced with PUT, listed, read, deleted, and decided with ``POST .../{name}/decide``.

Classifiers belong to the API key that saved them, as jobs do: another key gets 404 and never sees them
listed. Every request counts one request of the caller's ``--rate-limit`` (`admit_caller`); a decide call is
charged by the decision flow itself, once. The CRUD routes work while the model loads: the questions are
checked by the protocol layer, not the engine.

A saved head must be one this server serves (its default head by the model's name, or a tuned head of
``GET /v1/heads``): ``/v1/systemone`` answers an unknown ``model`` with the default head, which for a saved
classifier would hide a typo for as long as it is used. A classifier pins its head: PUT records the digest
of the head it names (the default head without one), so a PUT waits for the model to load (503 with
Retry-After until then). Deciding checks the pin (`pin_error`): a head no longer served is a 503
``head_not_loaded``, a head served with other weights a 409 ``head_changed``, never an answer by another
head; the engine checks it again when it admits the request (``x_head_digest``). Listing and reading show
the pin's state in ``head_status``.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, Response

from clef_runtime.jobs.classifier_store import Classifier, ClassifierStore, ClassifierStoreUnavailable
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import add_image_fields
from clef_runtime.protocol.systemone import SystemOneRequest, SystemOneResponse
from clef_runtime.server.admission import admit_caller, authenticate
from clef_runtime.server.bodies import read_json_body
from clef_runtime.server.classifiers.service import (
    DESCRIPTION_MAX_CHARS,
    HEAD_MAX_CHARS,
    NAME_MAX_CHARS,
    NAME_PATTERN,
    caller_owner,
    check_head,
    decide_mapping,
    name_problem,
    open_store,
    parse_definition,
    pin_error,
    pin_status,
    unavailable_error,
)
from clef_runtime.server.errors import ERROR_RESPONSES, ApiError, ClientGone, validation_error
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import answer_decision, client_gone_response, decision_route_doc
from clef_runtime.server.openapi import TICKET_QUESTIONS, json_example
from clef_runtime.server.runtime import Engine, runtime_of

__all__ = ["CLASSIFIER_EXAMPLES", "DECIDE_EXAMPLES", "FEATURE", "router"]

router = APIRouter()

# ------------------------------------------------------------------------------------------ documentation

_REF = "#/components/schemas/{model}"
_SYSTEMONE_SCHEMA = SystemOneRequest.model_json_schema(ref_template=_REF)
add_image_fields(_SYSTEMONE_SCHEMA, _REF)  # the definitions it needs are published by the app already

CLASSIFIER_EXAMPLES: dict[str, dict[str, Any]] = {
    "triage": {
        "summary": "A support-ticket triage: one question of each type",
        "value": {"questions": TICKET_QUESTIONS, "description": "Routes a support ticket."},
    },
    "with_head": {
        "summary": "One question, answered by a tuned head",
        "value": {
            "questions": {"fraud": {"type": "noul", "instructions": "Is this order likely fraudulent?"}},
            "head": "fraud-v2",
            "description": "Flags orders for a manual review.",
        },
    },
}
DECIDE_EXAMPLES: dict[str, dict[str, Any]] = {
    "text": {
        "summary": "A text state",
        "value": {"state": "I was charged twice for order #1042. Please refund me today."},
    },
    "json_state": {
        "summary": "A JSON state",
        "value": {"state": {"subject": "Where is my parcel?", "body": "Ordered 3 weeks ago, nothing yet."}},
    },
}
_CLASSIFIER = {
    "name": "support-triage",
    "version": 3,
    "questions": TICKET_QUESTIONS,
    "head": None,
    "description": "Routes a support ticket.",
    "created_at": "2026-12-01T09:00:00.000Z",
    "updated_at": "2026-12-03T14:20:05.118Z",
}
_NAME_DOC = (
    f"The classifier's name: 1-{NAME_MAX_CHARS} letters, digits, `_` or `-`, starting with a letter or digit "
    "(it is also its MCP tool's name, `classify_<name>`)."
)
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: ERROR_RESPONSES[401],
    404: {**ERROR_RESPONSES[401], "description": "No classifier of that name for this API key"},
    422: ERROR_RESPONSES[422],
    429: ERROR_RESPONSES[429],
    503: {**ERROR_RESPONSES[503], "description": "The classifiers database is unavailable; see Retry-After"},
}


def _body_doc(description: str, schema: dict[str, Any], examples: dict[str, Any]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/json": {"schema": schema, "examples": examples}},
        }
    }


_PUT_BODY = _body_doc(
    "The questions (exactly as `POST /v1/systemone` takes them), an optional head and a description.",
    {
        "type": "object",
        "required": ["questions"],
        "additionalProperties": False,
        "properties": {
            "questions": copy.deepcopy(_SYSTEMONE_SCHEMA["properties"]["questions"]),
            "head": {
                "type": "string",
                "minLength": 1,
                "maxLength": HEAD_MAX_CHARS,
                "description": "The head that answers: deciding sends it as the System One body's `model` "
                "(absent: the release head). It must be a head this server serves: the model's own name "
                "or a tuned head that `GET /v1/models` lists (422 otherwise; 503 while the model loads).",
            },
            "description": {
                "type": "string",
                "maxLength": DESCRIPTION_MAX_CHARS,
                "description": "What it is for (shown on the page and to agents).",
            },
        },
    },
    CLASSIFIER_EXAMPLES,
)
_DECIDE_BODY = _body_doc(
    "A state and optional images, as in `POST /v1/systemone`; the questions and the head are the "
    "classifier's. The System One request's other fields (such as `x_independent`) are passed on.",
    {
        "type": "object",
        "required": ["state"],
        # The System One request's fields but the two the classifier fixes.
        "properties": {
            name: copy.deepcopy(prop)
            for name, prop in _SYSTEMONE_SCHEMA["properties"].items()
            if name not in ("questions", "model")
        },
    },
    DECIDE_EXAMPLES,
)

# ------------------------------------------------------------------------------------------------ helpers


def _store(request: Request) -> ClassifierStore:
    store: ClassifierStore = request.app.state.classifiers
    return store


def _check_name(name: str) -> None:
    """A 422 at ``["path", "name"]`` (FastAPI's location for a path parameter) for a name that cannot be."""
    problem = name_problem(name)
    if problem is not None:
        raise FastAPIValidationError(
            [{"loc": ("path", "name"), "msg": problem, "type": "string_pattern_mismatch"}]
        )


def _owner(request: Request) -> str:
    return caller_owner(runtime_of(request), request.headers)


async def _store_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except ClassifierStoreUnavailable as exc:
        raise unavailable_error(exc) from None


def _with_status(request: Request, classifier: Classifier) -> dict[str, Any]:
    """The classifier as the API shows it, with ``head_status``: whether the head it pinned is the one
    served (`pin_status`; ``unknown`` while the model loads)."""
    engine = runtime_of(request).engine
    status = pin_status(classifier, engine.head_infos()) if engine is not None else {"status": "unknown"}
    return {**classifier.as_api(), "head_status": status}


def _not_found(name: str) -> ApiError:
    return ApiError(404, "not_found_error", f"no classifier {name!r} for this key")


def _engine_for_heads(request: Request) -> Engine:
    """The loaded engine, whose heads a saved head is checked against; 503 while it loads."""
    try:
        return runtime_of(request).require_ready()
    except ApiError as exc:
        raise ApiError(
            503,
            "not_ready",
            f"a classifier records the digest of the head it answers with, known once the model is loaded "
            f"({exc.message}); retry shortly",
            headers={"Retry-After": exc.headers.get("Retry-After", "2")},
        ) from None


async def _classifier_or_404(request: Request, name: str) -> Classifier:
    _check_name(name)
    classifier: Classifier | None = await _store_call(_store(request).get, _owner(request), name)
    if classifier is None:
        raise _not_found(name)
    return classifier


_NAME = Path(
    description=_NAME_DOC, examples=["support-triage"], json_schema_extra={"pattern": NAME_PATTERN.pattern}
)

# ------------------------------------------------------------------------------------------------- routes


@router.put(
    "/v1/classifiers/{name}",
    summary="Save a classifier: create it (201, version 1) or replace it (200, version + 1)",
    description="Stores a set of System One questions under a name, with the head that answers them and a "
    "description. The questions are validated exactly as `POST /v1/systemone` validates them (a 422 names "
    'the field: `["body", "questions", "q1", "criteria"]`); a `head` must be one this server serves (`GET '
    "/v1/models`). Replacing a classifier raises its version by one; concurrent replaces each get their own "
    "version. Classifiers belong to the API key that saved them and survive restarts.",
    responses={
        200: json_example("The replaced classifier", _CLASSIFIER),
        201: json_example("The new classifier", {**_CLASSIFIER, "version": 1}),
        400: ERROR_RESPONSES[400],
        413: ERROR_RESPONSES[413],
        415: ERROR_RESPONSES[415],
        **_ERRORS,
    },
    openapi_extra=_PUT_BODY,
)
async def put_classifier(request: Request, name: str = _NAME) -> Response:
    """Create (201) or replace (200) the caller's classifier ``name``."""
    admit_caller(request)
    _check_name(name)
    try:
        data = await read_json_body(request)
    except ClientGone:
        return client_gone_response(request)
    try:
        definition = parse_definition(data)
        # The digest of the head it names (the default head without one) is recorded with it: known once
        # the model is loaded.
        heads = _engine_for_heads(request).head_infos()
        if definition.head is not None:
            check_head(definition.head, [info.name for info in heads])
    except RequestValidationError as exc:
        raise validation_error(exc.errors) from None
    pinned = next(
        info
        for info in heads
        if (info.name == definition.head if definition.head is not None else info.default)
    )
    classifier, created = await _store_call(
        _store(request).put,
        _owner(request),
        name,
        questions=definition.questions,
        head=definition.head,
        head_digest=pinned.digest,
        description=definition.description,
    )
    return JSONResponse(_with_status(request, classifier), status_code=201 if created else 200)


@router.get(
    "/v1/classifiers",
    summary="The caller's saved classifiers, by name",
    description="Every classifier saved with the caller's API key (all of them when the server has no "
    "keys), sorted by name, each with its questions, head, description and version.",
    responses={200: json_example("The classifiers", {"object": "list", "data": [_CLASSIFIER]}), **_ERRORS},
)
async def list_classifiers(request: Request) -> dict[str, Any]:
    """``{"object": "list", "data": [classifier...]}``, by name."""
    admit_caller(request)
    classifiers = await _store_call(_store(request).list, _owner(request))
    return {"object": "list", "data": [_with_status(request, classifier) for classifier in classifiers]}


@router.get(
    "/v1/classifiers/{name}",
    summary="A saved classifier: its questions, head, description and version",
    description="The classifier as it was last saved. Another API key's classifier is a 404, as if it did "
    "not exist.",
    responses={200: json_example("The classifier", _CLASSIFIER), **_ERRORS},
)
async def get_classifier(request: Request, name: str = _NAME) -> dict[str, Any]:
    """The caller's classifier ``name``, or 404."""
    admit_caller(request)
    classifier = await _classifier_or_404(request, name)
    return _with_status(request, classifier)


@router.delete(
    "/v1/classifiers/{name}",
    summary="Delete a saved classifier",
    description="Deletes the classifier (its questions, head and description are erased). Saving the name "
    "again continues its versions, so a name and version always identify one definition.",
    responses={
        200: json_example("What was deleted", {"name": "support-triage", "version": 3, "deleted": True}),
        **_ERRORS,
    },
)
async def delete_classifier(request: Request, name: str = _NAME) -> dict[str, Any]:
    """Delete the caller's classifier ``name``: ``{"name", "version", "deleted": true}``, or 404."""
    admit_caller(request)
    _check_name(name)
    deleted = await _store_call(_store(request).delete, _owner(request), name)
    if deleted is None:
        raise _not_found(name)
    return {"name": deleted.name, "version": deleted.version, "deleted": True}


_DECIDE_DOC = decision_route_doc(
    _DECIDE_BODY,
    SystemOneResponse,
    "One answer per question id of the classifier, and `x_classifier` (its name and version)",
    "Answers the classifier's questions about a `state` (and optional `images`): exactly what `POST "
    "/v1/systemone` answers for the same state with the classifier's questions and `model` set to its head, "
    'plus `x_classifier: {name, version}`. Validation errors point at this body\'s fields (`["body", '
    '"state"]`, `["body", "images", 0]`); sending `questions` or `model` is a 422 (they are the '
    "classifier's). Rate limits, queueing, caching and headers are the System One route's.",
)
_DECIDE_DOC["responses"][404] = {
    **_ERRORS[404],
    "description": "No classifier of that name for this API key (or its head was unloaded as it was "
    "admitted)",
}
_DECIDE_DOC["responses"][409] = {
    **_ERRORS[404],
    "description": "`head_changed`: the head served under the classifier's head name is not the one it was "
    "saved with (its digest differs, or none was recorded); PUT it again to accept the head served now",
}
_DECIDE_DOC["responses"][503] = {
    **ERROR_RESPONSES[503],
    "description": "`head_not_loaded`: the classifier's head is not served; or the model is loading, the "
    "server is shutting down or the request waited past --queue-timeout-ms (see Retry-After)",
}


@router.post(
    "/v1/classifiers/{name}/decide",
    summary="Decide with a saved classifier: its questions about your state",
    **_DECIDE_DOC,
)
async def decide_with_classifier(request: Request, name: str = _NAME) -> Response:
    """The System One answer for the classifier's questions and head about the body's state."""
    authenticate(request)  # a wrong key learns nothing about which classifiers exist
    try:
        classifier = await _classifier_or_404(request, name)
    except (ApiError, FastAPIValidationError):
        # A call to a classifier that is not there counts against the rate limit like any other call (the
        # flow charges the calls that are answered, once).
        admit_caller(request)
        raise
    refused = pin_error(classifier, runtime_of(request).require_ready().head_infos())
    if refused is not None:
        admit_caller(request)  # counted like any call that is answered
        raise refused
    return await answer_decision(request, decide_mapping(classifier))


def _open_classifiers(app: FastAPI, resources: ExitStack) -> None:
    """Open the classifiers database now: a damaged or foreign one stops the server before it listens."""
    store = open_store(app.state.settings)
    app.state.classifiers = store
    resources.callback(store.close)


DESCRIPTION = """\
**Saved classifiers** (`/v1/classifiers`): save a set of System One questions (and the head that answers
them) once under a name with `PUT /v1/classifiers/{name}`, then send only a state to
`POST /v1/classifiers/{name}/decide`, which answers what `POST /v1/systemone` answers for the saved questions.
Each API key sees only its own classifiers. More: the README's "Saved classifiers" and `docs/classifiers.md`.
"""

FEATURE = Feature("classifiers", router, attach=_open_classifiers, description=DESCRIPTION)
"""``/v1/classifiers``: saved question sets, answered by name."""
