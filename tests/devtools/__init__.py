"""Tests of `devtools`, the library the tests, benchmarks and scripts share."""
