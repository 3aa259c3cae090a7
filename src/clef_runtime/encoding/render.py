"""``render``: how the reference turns a JSON value into prompt text.

A string is used as is; anything else becomes compact JSON with sorted keys and non-ASCII kept raw, using
Python's own number formatting (``1250`` vs ``1250.0``). Re-implementations in other languages had to copy
CPython's float repr and code-point key order to stay token-exact; here we simply use CPython's ``json``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["render"]

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def render(value: Any) -> str:
    """Return the prompt text of ``value``: the string itself, or compact sorted JSON.

    Raises ``TypeError``/``ValueError`` when ``value`` is not JSON-serialisable (only reachable from the
    Python API; wire requests are JSON by construction).
    """
    if isinstance(value, str):
        return value
    return _ENCODER.encode(value)
