"""Measuring decisions on labelled cases: ``clef eval``, ``clef calibrate`` and ``clef compare``."""
