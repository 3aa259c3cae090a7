"""Maintenance scripts, run from the repository root as ``python -m scripts.<name>``."""
