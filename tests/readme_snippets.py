"""The Python snippets of README.md, extracted so that tests can run them as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "http://127.0.0.1:8094"
"""The server address the README's snippets use; tests point it at their own server."""


def python_snippets(heading: str) -> list[str]:
    """The ```python blocks of the README section titled ``heading`` (up to the next heading of any level),
    in order. Raises AssertionError when the section or its snippets are missing."""
    section: list[str] | None = None
    fenced = False
    for line in README.read_text(encoding="utf-8").splitlines(keepends=True):
        # A line in a code block that starts with "# " (a shell or Python comment) is not a heading.
        heading_line = not fenced and re.match(r"#+ ", line) is not None
        if line.startswith("```"):
            fenced = not fenced
        if heading_line and section is not None:
            break
        if heading_line and line.rstrip("\n") == f"{line.split(' ', 1)[0]} {heading}":
            section = []
        elif section is not None:
            section.append(line)
    assert section is not None, f"README.md has no section {heading!r}"
    blocks = re.findall(r"^```python\n(.*?)^```", "".join(section), flags=re.S | re.M)
    assert blocks, f"README.md section {heading!r} has no python snippet"
    return blocks


def run_snippet(code: str, url: str | None = None) -> str:
    """Run ``code`` (with the README's server address replaced by ``url``) and return what it printed."""
    if url is not None:
        assert README_URL in code
        code = code.replace(README_URL, url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # dont_inherit: run as a script would, without this module's `from __future__ import annotations`
        # (under which a snippet's Pydantic models could not resolve their annotations)
        exec(compile(code, "README.md", "exec", dont_inherit=True), {"__name__": "__readme__"})
    return out.getvalue()
