"""instructor against a live clef server, run by tests/clients/test_instructor.py in instructor's own pinned
environment (tests/clients/envs/instructor.txt; it cannot share the repository's openai pin).

usage: instructor_client.py MODE BASE_URL API_KEY
MODE: tools (instructor's default), tools_strict, json_schema, responses_tools, or retry / responses_retry
(Mode.TOOLS / RESPONSES_TOOLS with a validator that rejects the first answer, so instructor asks again with
the failed answer in the history).

Prints one JSON line: {"ticket": the returned model as JSON, "validations": how often the retry validator
ran, "versions": {instructor, openai}}.
"""

from __future__ import annotations

import json
import sys
import warnings
from enum import Enum
from importlib.metadata import version
from typing import Literal

import instructor
from openai import OpenAI
from pydantic import BaseModel, Field, field_validator

SYSTEM = "You route support tickets."
USER = "I was charged twice for my subscription and need this fixed today."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


class Mood(Enum):
    calm = "calm"
    annoyed = "annoyed"
    furious = "furious"


class Ticket(BaseModel):
    """A routed support ticket."""

    team: Literal["billing", "tech", "sales"] = Field(description="Which team handles it?")
    mood: Mood = Field(description="How does the customer feel?")
    refund: bool = Field(description="Is a refund requested?")
    urgency: int = Field(ge=1, le=3, description="How urgent, 1 to 3")


VALIDATIONS = 0


class RetriedTicket(Ticket):
    """A routed support ticket, whose first answer is refused."""

    @field_validator("team")
    @classmethod
    def refuse_the_first_answer(cls, team: str) -> str:
        global VALIDATIONS
        VALIDATIONS += 1
        if VALIDATIONS == 1:
            raise ValueError("check the team again")
        return team


MODES = {
    "tools": instructor.Mode.TOOLS,
    "tools_strict": instructor.Mode.TOOLS_STRICT,
    "json_schema": instructor.Mode.JSON_SCHEMA,
    "responses_tools": instructor.Mode.RESPONSES_TOOLS,
    "retry": instructor.Mode.TOOLS,
    "responses_retry": instructor.Mode.RESPONSES_TOOLS,
}


def main() -> None:
    mode, base_url, api_key = sys.argv[1:]
    # 1.17 deprecates Mode.TOOLS_STRICT as an alias of Mode.TOOLS (the same request, no "strict" in it).
    warnings.simplefilter("ignore", DeprecationWarning)
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key=api_key), mode=MODES[mode])
    ticket = client.chat.completions.create(
        model="tiny",
        response_model=RetriedTicket if mode.endswith("retry") else Ticket,
        messages=MESSAGES,
        max_retries=2 if mode.endswith("retry") else 1,
    )
    versions = {name: version(name) for name in ("instructor", "openai")}
    print(
        json.dumps(
            {"ticket": ticket.model_dump(mode="json"), "validations": VALIDATIONS, "versions": versions}
        )
    )


if __name__ == "__main__":
    main()
