"""Cloudflare Workers AI's REST route for Clef, served locally.

``POST /client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/clef-flash`` (the model segment also as
``@cf/cloudflare/clef``; any account id) takes the System One body and answers in Cloudflare's API
envelope, so tools written against Workers AI run against a local server by changing the base URL:

* success: ``{"result": <System One response>, "success": true, "errors": [], "messages": []}``;
* error: ``{"result": null, "success": false, "errors": [{"code": <int>, "message": <text>}],
  "messages": []}`` with the HTTP status of the failure.

Internal codes follow Cloudflare's published Workers AI error table (developers.cloudflare.com/workers-ai/
platform/errors): 5007 no such model (400), 3006 request too large (413), 3040 out of capacity (429),
3003 incomplete request (400); 10000 is the Cloudflare API's authentication error. Validation errors keep
the 422 that the hosted clef-flash returns for an invalid body (as observed in
github.com/sidmohan0/browser-use-clef-flash ``docs/clef-verification.md``) with code 5006, and their
message names the field. Pure: no HTTP framework.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_PATHS", "error_code", "error_envelope", "success_envelope"]

MODEL_PATHS = ("@cf/cloudflare/clef-flash", "@cf/cloudflare/clef")
"""The model path segments answered (by whatever model is loaded)."""

_CODES = {400: 3003, 401: 10000, 403: 10000, 413: 3006, 415: 3003, 422: 5006, 429: 3040}


def error_code(status: int, error_type: str = "") -> int:
    """Cloudflare's internal error code for an error's HTTP status and type (the status itself when none
    applies)."""
    if error_type == "no_such_model":
        return 5007
    return _CODES.get(status, 3040 if status == 503 else status)


def success_envelope(result: dict[str, Any]) -> dict[str, Any]:
    """``{"result": result, "success": true, "errors": [], "messages": []}``."""
    return {"result": result, "success": True, "errors": [], "messages": []}


def error_envelope(code: int, message: str) -> dict[str, Any]:
    """``{"result": null, "success": false, "errors": [{"code", "message"}], "messages": []}``."""
    return {"result": None, "success": False, "errors": [{"code": code, "message": message}], "messages": []}
