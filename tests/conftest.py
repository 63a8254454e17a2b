"""Shared test setup: where the Triton kernels run, fresh random inputs, and a fresh fallback state.

On a machine with CUDA the suite runs the kernels on the GPU; on a CPU-only machine it runs them in
Triton's interpreter. ``TRITON_INTERPRET`` must be set before ``triton`` is first imported, so it is
decided here (an explicit ``TRITON_INTERPRET`` in the environment wins). ``tests/helpers.py`` reads
the decision (``KERNEL_DEVICE``, ``needs_kernels``, ...).
"""

import os
import secrets
import tempfile

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# On a GPU, the configurations the tests' launches tune go to a throwaway cache, not the user's.
os.environ.setdefault("FLASHBOB_CACHE_DIR", tempfile.mkdtemp(prefix="flashbob-test-tuning-"))

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def sdpa_left_as_found():
    """A test that leaves ``F.scaled_dot_product_attention`` patched fails itself, and torch's function is put
    back, so the tests after it in the same process do not fail for it."""
    yield
    if F.scaled_dot_product_attention is not TORCH_SDPA:
        F.scaled_dot_product_attention = TORCH_SDPA
        pytest.fail("the test left F.scaled_dot_product_attention patched")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a fresh seed per test; the seed is printed so a failure can be replayed."""
    seed = secrets.randbits(31)
    print(f"{request.node.nodeid}: seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def fresh_fallback():
    """:mod:`flashbob.dropin` as at start-up around a test: no fallback warned about yet, strict mode
    from the environment (``flashbob.set_strict(None)``)."""
    from flashbob import dropin, set_strict  # imported here: triton only after TRITON_INTERPRET is set

    dropin._warned.clear()
    yield
    set_strict(None)
