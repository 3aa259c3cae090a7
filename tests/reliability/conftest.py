"""Reuse the server tests' fixtures (fake engine in-process or on a loopback socket), and give every test
IEEE subnormals: loading a model turns on flush-to-zero for the loading thread
(``clef_runtime.model.kernels.configure_cpu_threads``), and hypothesis (and so Schemathesis) refuses to
generate floats in a thread that flushes subnormals."""

from collections.abc import Iterator

import pytest
import torch

from tests.server.conftest import live_fake, serve_fake

__all__ = ["live_fake", "serve_fake"]


@pytest.fixture(autouse=True)
def ieee_subnormals() -> Iterator[None]:
    torch.set_flush_denormal(False)
    yield
