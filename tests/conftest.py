"""Shared test setup: Triton's interpreter for CPU runs of the kernels, and fresh random inputs."""

import os
import secrets

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a fresh seed per test; the seed is printed so a failure can be replayed."""
    seed = secrets.randbits(31)
    print(f"{request.node.nodeid}: seed {seed}")
    return torch.Generator().manual_seed(seed)
