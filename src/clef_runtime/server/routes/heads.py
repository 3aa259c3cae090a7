"""``/v1/heads``: the heads this server answers with, each a name for one set of weights (its digest), and
the admin routes that load and unload them at run time.

``GET /v1/heads`` needs the ordinary API key (as ``/v1/models``). ``POST /v1/heads`` and ``DELETE
/v1/heads/{name}`` need an admin key (``--admin-key``): an ordinary API key gets 403, no key or a wrong one
401, and with no admin key configured they are not served at all (404), so a server started without one
cannot have its heads changed. Loading reads and moves the head's weights off the event loop and without the
model lock: decisions go on meanwhile, and the head answers from the next request prepared after the 201.
Unloading lets the requests already admitted finish on the head; later ones naming it get 404
``head_not_loaded``.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StringConstraints

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.plain_errors import validate_object
from clef_runtime.server.admission import authenticate
from clef_runtime.server.auth import KeyChecker
from clef_runtime.server.bodies import read_json_body
from clef_runtime.server.context import context_of
from clef_runtime.server.errors import ERROR_RESPONSES, ApiError, ClientGone, validation_error
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import client_gone_response
from clef_runtime.server.openapi import json_example
from clef_runtime.server.runtime import runtime_of

__all__ = ["FEATURE", "router"]

logger = logging.getLogger("clef_runtime.server")

router = APIRouter()

_HEAD_CARD = {
    "name": "billing",
    "digest": "3f2a9c1d0e4b7a65c0d1e2f3a4b5c6d7e8f90112233445566778899aabbccdd",
    "default": False,
    "source": "api",
    "path": "/srv/heads/billing",
    "calibration": None,
    "loaded_at": 1796544000.0,
}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: ERROR_RESPONSES[401],
    403: {**ERROR_RESPONSES[401], "description": "An API key, not an admin key (--admin-key)"},
    404: {**ERROR_RESPONSES[401], "description": "No admin key is configured (the route is not served)"},
    503: ERROR_RESPONSES[503],
}


class LoadHead(BaseModel):
    """The body of ``POST /v1/heads``."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    """What a request's ``model`` says to pick it."""
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    """The head's directory on the server's machine (``clef tune --out DIR``)."""


def authenticate_admin(request: Request) -> str:
    """The admin key's name, or an `ApiError`: 404 with no admin key configured, 401 without a key or with
    an unknown one, 403 with an ordinary API key."""
    runtime = runtime_of(request)
    if not runtime.admin_keys.enabled:
        raise ApiError(
            404,
            "not_found_error",
            f"no route {request.method} {request.url.path}: heads are loaded and unloaded at run time only "
            "on a server started with --admin-key",
        )
    challenge = {"WWW-Authenticate": 'Bearer realm="clef-admin"'}
    key = KeyChecker.presented_key(request.headers)
    if key is None:
        raise ApiError(
            401,
            "authentication_error",
            "missing admin key: send 'Authorization: Bearer <admin key>'",
            headers=challenge,
        )
    name = runtime.admin_keys.name_of(key)
    if name is not None:
        return name
    if runtime.keys.enabled and runtime.keys.name_of(key) is not None:
        raise ApiError(
            403,
            "permission_error",
            "this API key may decide but not change heads: send an admin key (--admin-key)",
        )
    raise ApiError(401, "authentication_error", "invalid admin key", headers=challenge)


@router.get(
    "/v1/heads",
    summary="The heads served: name, digest, source, calibration, loaded at",
    description="Every head this server answers with, the default head first (it answers any `model` that "
    "names no other head). A head's `digest` is the sha256 of a manifest of its weights, config and "
    "calibration files' sha256: the same digest means the same answers. A request pins one with "
    "`x_head_digest`; every answer names the head that computed it (`X-Clef-Head: name@digest12`, "
    "`x_head`).",
    responses={
        200: json_example("The heads", {"object": "list", "data": [_HEAD_CARD]}),
        401: ERROR_RESPONSES[401],
        503: ERROR_RESPONSES[503],
    },
)
async def list_heads(request: Request) -> dict[str, Any]:
    """``{"object": "list", "data": [head...]}``, the default head first."""
    authenticate(request)
    engine = runtime_of(request).require_ready()
    return {"object": "list", "data": [info.as_api() for info in engine.head_infos()]}


@router.post(
    "/v1/heads",
    summary="Load a head at run time (admin key)",
    description="Loads the head in directory `path` (on the server's machine, in the release's head layout: "
    "what `clef tune --out` writes) and serves it as `name` from the next request on; requests being "
    "answered go on meanwhile. A 422 names the field at fault (a malformed name, the model's own name, a "
    "directory that is not a head for this model); a name already served is a 409 (unload it first: a name "
    "means one set of weights).",
    status_code=201,
    responses={
        201: json_example("The head loaded", _HEAD_CARD),
        409: {**ERROR_RESPONSES[401], "description": "The name is served already, or the heads are fixed"},
        422: ERROR_RESPONSES[422],
        **_ADMIN_ERRORS,
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": LoadHead.model_json_schema(),
                    "examples": {
                        "tuned": {
                            "summary": "A head clef tune wrote",
                            "value": {"name": "billing", "path": "/srv/heads/billing"},
                        },
                        "calibrated": {
                            "summary": "A head with its own calibration.json (applied to its answers)",
                            "value": {"name": "fraud-v2", "path": "/srv/heads/fraud-v2"},
                        },
                    },
                }
            },
        }
    },
)
async def load_head(request: Request) -> Response:
    """Load a head: 201 with its card."""
    admin = authenticate_admin(request)
    engine = runtime_of(request).require_ready()
    try:
        data = await read_json_body(request)
    except ClientGone:
        return client_gone_response(request)
    try:
        body = validate_object(LoadHead, data)
    except RequestValidationError as exc:
        raise validation_error(exc.errors) from None
    info = await anyio.to_thread.run_sync(lambda: engine.load_head(body.name, body.path))
    context_of(request).head = info.identity.label
    logger.info("head %s loaded by admin key %s", info.identity.label, admin)
    return JSONResponse(info.as_api(), status_code=201)


@router.delete(
    "/v1/heads/{name}",
    summary="Unload a head (admin key)",
    description="Stops serving the head: requests already admitted finish on it; later requests naming it "
    "get 404 `head_not_loaded` (never another head's answer). The default head cannot be unloaded (409).",
    responses={
        200: json_example(
            "What was unloaded", {"name": "billing", "digest": _HEAD_CARD["digest"], "unloaded": True}
        ),
        409: {**ERROR_RESPONSES[401], "description": "The default head, or the heads are fixed"},
        **_ADMIN_ERRORS,
    },
)
async def unload_head(
    request: Request, name: str = Path(description="The head's name", examples=["billing"])
) -> dict[str, Any]:
    """Unload a head: ``{"name", "digest", "unloaded": true}``."""
    admin = authenticate_admin(request)
    engine = runtime_of(request).require_ready()
    info = engine.unload_head(name)
    context_of(request).head = info.identity.label
    logger.info("head %s unloaded by admin key %s", info.identity.label, admin)
    return {"name": info.name, "digest": info.digest, "unloaded": True}


FEATURE = Feature("heads", router)
"""``/v1/heads``: the heads served, loaded and unloaded at run time."""
