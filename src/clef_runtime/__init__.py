"""clef-runtime: run Cloudflare's Clef decision models on your own hardware.

`Clef` is imported lazily so that `clef encode` and the protocol layer never pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clef_runtime.version import __version__

__all__ = ["Clef", "__version__"]

if TYPE_CHECKING:
    from clef_runtime.engine.clef import Clef


def __getattr__(name: str) -> Any:
    if name == "Clef":
        from clef_runtime.engine.clef import Clef

        return Clef
    raise AttributeError(f"module 'clef_runtime' has no attribute {name!r}")
