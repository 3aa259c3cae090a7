"""The files an engine's options name (``--calibration``, ``--head``), read and checked once before the model
loads.

``clef serve`` loads its model in the background, after it listens: a bad file must fail before that, as a
usage error (exit status 2) rather than a load failure seen only in the log. It checks the files here and
hands what it read to ``Clef.load``, which then reads neither again (the heads themselves load with the
model).
"""

from __future__ import annotations

from dataclasses import dataclass

from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.heads import check_head_specs
from clef_runtime.options import EngineOptions, HeadSpec, parse_head_specs

__all__ = ["EngineFiles", "check_engine_files"]


@dataclass(frozen=True)
class EngineFiles:
    """What `check_engine_files` read for one set of options."""

    calibration_path: str | None
    """The ``--calibration`` value it was read from."""
    head_values: tuple[str, ...]
    """The ``--head`` values the head directories were checked for."""
    calibration: Calibration | None
    """The ``--calibration`` file's temperatures (None without one)."""
    heads: tuple[HeadSpec, ...]
    """The ``--head`` values, parsed, each a checked head directory."""

    def belongs_to(self, options: EngineOptions) -> bool:
        """Whether these are the files ``options`` name."""
        return options.calibration == self.calibration_path and tuple(options.head) == self.head_values


def check_engine_files(options: EngineOptions) -> EngineFiles:
    """Read ``options``' calibration file and check each head directory (its config, weights file and own
    calibration). Raises `OptionsError` (a ``CalibrationError`` for the calibration file) naming the flag
    and the file."""
    calibration = Calibration.load(options.calibration) if options.calibration else None
    heads = parse_head_specs(options.head)
    check_head_specs(heads)
    return EngineFiles(
        calibration_path=options.calibration,
        head_values=tuple(options.head),
        calibration=calibration,
        heads=tuple(heads),
    )
