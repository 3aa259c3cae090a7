"""Tests of `benchmarks.lib`, the library every benchmark script shares."""
