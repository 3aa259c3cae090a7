"""The OpenAPI document: what /docs and /redoc show a person.

Each router carries its own descriptions and examples (request examples for the decision routes, response
examples for the operational ones: the route functions' docstrings are for us); this module holds what they
share (the example ticket and image, the shape of a documented request body and of a JSON example) and
publishes the request schemas that the routes validate by hand. Every request example is sent to a server by
tests/server/test_openapi_docs.py, so none can drift from what the server accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from clef_runtime.protocol.images import add_image_fields
from clef_runtime.protocol.systemone import SystemOneRequest

__all__ = [
    "PHOTO_MESSAGE_INPUT",
    "PNG_BASE64",
    "PNG_DATA_URL",
    "SUPPORT_TICKET",
    "TICKET_QUESTIONS",
    "install_openapi",
    "json_example",
    "request_body_doc",
]

# A 1x1 transparent PNG: the smallest image the server accepts, for the examples.
PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
PNG_DATA_URL = "data:image/png;base64," + PNG_BASE64

SUPPORT_TICKET = "I was charged twice for order #1042 and it still has not arrived. Please refund me."

TICKET_QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "topic": {
        "type": "choice",
        "instructions": "What is the ticket mainly about?",
        "criteria": {"billing": "Charges and refunds", "shipping": "Delivery", "other": None},
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["Can wait", "Today", "Now"],
    },
}
"""System One questions about the ticket, one of each type."""

PHOTO_MESSAGE_INPUT: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Customer photo of the item they received."},
            {"type": "input_image", "image_url": PNG_DATA_URL},
        ],
    }
]
"""An OpenAI-shaped ``input``: a user message with a text part and an ``input_image`` part."""


def request_body_doc(schema: str, description: str, examples: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {
                "application/json": {
                    "schema": {"$ref": f"#/components/schemas/{schema}"},
                    "examples": examples,
                }
            },
        }
    }


def json_example(description: str, example: Any) -> dict[str, Any]:
    """A ``responses`` entry documenting a JSON 200 with one example."""
    return {"description": description, "content": {"application/json": {"example": example}}}


def install_openapi(app: FastAPI, request_models: tuple[type[BaseModel], ...]) -> None:
    """Publish the request schemas that the routes validate by hand (they read raw bodies to support
    compression and limits, so FastAPI cannot infer them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        ref_template = "#/components/schemas/{model}"
        for model in request_models:
            model_schema = model.model_json_schema(ref_template=ref_template)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        # The images are taken out of the body by hand (each error names its image): publish their shapes.
        components.update(add_image_fields(components[SystemOneRequest.__name__], ref_template))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
