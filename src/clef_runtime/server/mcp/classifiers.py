"""The caller's saved classifiers as MCP tools over HTTP (``POST /mcp``): ``classify_<name>`` for each one,
listed after ``decide`` by ``tools/list`` and answered like ``POST /v1/classifiers/{name}/decide``.

The tools are per API key, as the classifiers are: ``tools/list`` reads the caller's classifiers on every
call (a saved or deleted classifier shows at the next listing), and another key's classifier is an unknown
tool. A tool's input is the classifier decide body (``state``, optional ``images``; the System One request's
fields without ``questions`` and ``model``), its description the classifier's own plus its questions, its
result the System One response with ``x_classifier``. A call runs the decision flow with the caller's
request, so it is authenticated, rate-limited (one request per call; listing is free) and measured like
the HTTP route.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from starlette.requests import Request

from clef_runtime.jobs.classifier_store import Classifier, ClassifierStore, ClassifierStoreUnavailable
from clef_runtime.server.classifiers.service import (
    caller_owner,
    decide_mapping,
    name_problem,
    pin_error,
    unavailable_error,
)
from clef_runtime.server.flow import WireMapping
from clef_runtime.server.mcp.tool import DECIDE_TOOL
from clef_runtime.server.runtime import runtime_of

__all__ = ["TOOL_PREFIX", "AnswerInTheFlow", "ClassifierTools", "classifier_tool"]

logger = logging.getLogger("clef_runtime.server")

TOOL_PREFIX = "classify_"

AnswerInTheFlow = Callable[
    [WireMapping[Any], dict[str, Any], ServerRequestContext[Any, Any]], Awaitable[dict[str, Any]]
]
"""How the transport answers a call through the decision flow: ``(mapping, arguments, context) -> body``."""

# What a caller sends: the decide tool's own fields (their agent-facing descriptions included), without the
# two that the classifier fixes.
_SAVED = ("questions", "model")
_INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What to classify: a `state` and optional `images` (the questions are the classifier's).",
    "properties": {
        name: copy.deepcopy(prop)
        for name, prop in DECIDE_TOOL.input_schema["properties"].items()
        if name not in _SAVED
    },
    "required": ["state"],
}
_OUTPUT_SCHEMA: dict[str, Any] = {
    **copy.deepcopy(DECIDE_TOOL.output_schema or {}),
    "description": "The System One response for the classifier's questions, with x_classifier (its name and "
    "version) and the server's other x_ extras.",
}

# Bounds on what one tool's description shows (64 questions of 255 options each would drown an agent's
# context): the options and instructions beyond them are cut, the full definition stays on the server.
_OPTIONS_SHOWN = 20
_OPTION_CHARS = 40
_INSTRUCTIONS_CHARS = 300
_DESCRIPTION_CHARS = 6000


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _question_line(question_id: str, question: dict[str, Any]) -> str:
    """``- `refund` (yes/no): Is a refund requested?`` for one saved question."""
    kind = question.get("type")
    criteria = question.get("criteria")
    if kind == "choice" and isinstance(criteria, dict):
        options = list(criteria)
        shown = ", ".join(_short(option, _OPTION_CHARS) for option in options[:_OPTIONS_SHOWN])
        more = f" and {len(options) - _OPTIONS_SHOWN} more" if len(options) > _OPTIONS_SHOWN else ""
        what = f"one of {shown}{more}"
    elif kind == "score" and isinstance(criteria, list):
        what = f"a score from 0 to {len(criteria) - 1}: {_short(_as_text(criteria[0]), 60)} .. " + _short(
            _as_text(criteria[-1]), 60
        )
    else:
        what = "yes/no, answered with noul = P(yes)"
    instructions = question.get("instructions")
    # Without instructions the model reads the question id itself, already shown.
    asked = "" if instructions is None else ": " + _short(_as_text(instructions), _INSTRUCTIONS_CHARS)
    return f"- `{question_id}` ({what}){asked}"


def _description(classifier: Classifier) -> str:
    lines = [classifier.description or f"The saved classifier {classifier.name!r}.", ""]
    # The description is at most 2,000 characters, so the first lines always fit the budget below.
    questions = list(classifier.questions.items())
    lines.append(
        f"Answers {len(questions)} question(s) about a `state` (text, JSON and/or images) with a probability "
        "for every option, in one pass of a Clef decision model (no text is generated):"
    )
    closing = (
        f"Send only `state` (and optional `images`): the questions are saved with the classifier (version "
        f"{classifier.version}). The result is the System One response, `answers` keyed by the question ids."
    )
    budget = _DESCRIPTION_CHARS - len(closing) - 200  # room for the closing line and the "more" line
    used = sum(len(line) + 1 for line in lines)
    for shown, (qid, question) in enumerate(questions):
        line = _question_line(qid, question)
        if used + len(line) > budget:
            lines.append(
                f"- ... and {len(questions) - shown} more question(s): GET /v1/classifiers/{classifier.name} "
                "lists them"
            )
            break
        lines.append(line)
        used += len(line) + 1
    lines.append(closing)
    return "\n".join(lines)


def classifier_tool(classifier: Classifier) -> types.Tool:
    """The MCP tool of a saved classifier."""
    title = f"Classify: {classifier.name}"
    return types.Tool(
        name=TOOL_PREFIX + classifier.name,
        title=title,
        description=_description(classifier),
        input_schema=copy.deepcopy(_INPUT_SCHEMA),
        output_schema=copy.deepcopy(_OUTPUT_SCHEMA),
        annotations=types.ToolAnnotations(
            title=title,
            read_only_hint=True,
            destructive_hint=False,
            idempotent_hint=True,
            open_world_hint=False,
        ),
    )


def _http_request(ctx: ServerRequestContext[Any, Any]) -> Request:
    request = ctx.request
    if not isinstance(request, Request):
        raise TypeError(f"an MCP call over HTTP carries its Starlette request, got {type(request).__name__}")
    return request


def _store_and_owner(request: Request) -> tuple[ClassifierStore, str]:
    store: ClassifierStore = request.app.state.classifiers
    return store, caller_owner(runtime_of(request), request.headers)


class ClassifierTools:
    """The `clef_runtime.server.mcp.tool.ToolSource` of ``POST /mcp``: the caller's classifiers."""

    instructions = (
        f"Each classifier saved under your API key is a tool too, `{TOOL_PREFIX}<name>`, which asks its "
        "saved questions about the state you send; tools/list shows yours (none until one is saved with "
        "PUT /v1/classifiers/{name})."
    )

    def __init__(self, answer: AnswerInTheFlow) -> None:
        self._answer = answer

    async def list_tools(self, ctx: ServerRequestContext[Any, Any]) -> list[types.Tool]:
        store, owner = _store_and_owner(_http_request(ctx))
        try:
            classifiers = await anyio.to_thread.run_sync(store.list, owner)
        except ClassifierStoreUnavailable as exc:
            # The decide tool still works: list it alone rather than fail the listing.
            logger.warning("tools/list without the saved classifiers: %s", exc)
            return []
        return [classifier_tool(classifier) for classifier in classifiers]

    def input_schema(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(_INPUT_SCHEMA) if name.startswith(TOOL_PREFIX) else None

    async def call_tool(
        self, name: str, arguments: dict[str, Any], ctx: ServerRequestContext[Any, Any]
    ) -> dict[str, Any] | None:
        classifier_name = name.removeprefix(TOOL_PREFIX)
        if not name.startswith(TOOL_PREFIX) or name_problem(classifier_name) is not None:
            return None
        request = _http_request(ctx)
        store, owner = _store_and_owner(request)
        try:
            classifier = await anyio.to_thread.run_sync(store.get, owner, classifier_name)
        except ClassifierStoreUnavailable as exc:
            raise unavailable_error(exc) from None
        if classifier is None:
            return None
        refused = pin_error(classifier, runtime_of(request).require_ready().head_infos())
        if refused is not None:
            raise refused  # the head it was saved with is not the one served: never another head's answer
        return await self._answer(decide_mapping(classifier), arguments, ctx)
