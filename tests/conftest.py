"""Suite-wide settings: keep every cache the tests create out of the user's home directory."""

from __future__ import annotations

import os
from pathlib import Path

# The built-in tokenizer and the tiny checkpoint are built once into this directory and reused between
# local runs; a fresh clone (CI) builds them once per run. Set before any clef_runtime import reads it.
os.environ.setdefault(
    "CLEF_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "clef-cache")
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
