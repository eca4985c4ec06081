"""Shared fixtures: one GPU device for the whole test session (device creation and the first pipeline
cost ~0.5 s on lavapipe; wgpu.md §5)."""

import numpy as np
import pytest


@pytest.fixture(scope="session")
def gpu():
    from ddl_wgpu.gpu import Gpu

    return Gpu()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
