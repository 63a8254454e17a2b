"""Helpers shared by the tests: where the kernels run, random attention inputs and relative errors."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Triton's interpreter runs the kernels on CPU tensors (``tests/conftest.py`` turns it on without CUDA).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Where ``backend="triton"`` runs: the CPU in the interpreter, else the GPU; None when neither is there.
KERNEL_DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)
#: The dtype in which the kernels' exactness is checked against the float64 oracle: float64 in the
#: interpreter; float32 (no TF32) on a GPU, since Triton 3.6 does not compile float64 kernels for Hopper.
KERNEL_EXACT_DTYPE = torch.float64 if INTERPRETED else torch.float32
#: Relative error allowed for an exact computation in that dtype.
EXACT_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}

needs_kernels = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="the Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 to run on the CPU"
)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="float64 through the Triton kernels runs in the interpreter only (Triton 3.6 does "
    "not compile float64 kernels for Hopper)"
)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: Both backends as a parametrisation; the Triton one skips where the kernels cannot run.
BACKENDS = ["blocked", pytest.param("triton", marks=needs_kernels)]


def on_backend(backend: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The float64 test tensors where ``backend`` runs: on the CPU in float64 for the blocked backend
    and in the interpreter, on the GPU in :data:`KERNEL_EXACT_DTYPE` for the kernels there."""
    if backend != "triton":
        return tensors
    return tuple(t.to(KERNEL_DEVICE, KERNEL_EXACT_DTYPE) for t in tensors)


def exact_tolerance(x: torch.Tensor) -> float:
    """The relative error allowed for an exact result computed in ``x``'s dtype."""
    return EXACT_TOLERANCE[x.dtype]


def attention_inputs(gen, *, batch=2, heads=4, kv_heads=2, n=13, m=9, head_dim=8, dtype=torch.float64):
    """Random ``q, k, v, do`` shaped as SDPA expects (``do`` is the output cotangent, shaped like ``q``)."""
    q = torch.randn(batch, heads, n, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, m, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, m, head_dim, generator=gen, dtype=torch.float64)
    do = torch.randn(batch, heads, n, head_dim, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64; ``expected`` must not be all zero."""
    expected = expected.double()
    norm = expected.norm().item()
    assert norm > 0, "reference is all zero: the comparison could not fail"
    return (actual.double() - expected).norm().item() / norm


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "") -> None:
    """Shapes equal and relative error below ``tol``; against an all-zero reference, ``max |x| <= tol``."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if not expected.any():
        assert actual.abs().max() <= tol, f"{name}: expected zeros, max |x| = {actual.abs().max().item():.3g}"
        return
    err = relative_error(actual, expected)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:.3g}"


def assert_terms_match(outputs: dict, refs: dict, tolerance: float) -> list[str]:
    """Each ``outputs[name]`` finite and within ``tolerance`` of ``refs[name]`` (float64), relative to its norm;
    returns the names so compared.

    A reference that is zero in exact arithmetic (below 1e-12) is a sum of terms of the size of the
    largest entry of any reference that cancel, so its rounding scales with that size: the output is
    held to ``tolerance`` times it.
    """
    term_size = max(1.0, *(ref.abs().max().item() for ref in refs.values()))
    compared = []
    for name, ref in refs.items():
        assert torch.isfinite(outputs[name]).all(), f"{name}: non-finite values"
        if ref.abs().max() < 1e-12:
            largest = outputs[name].double().abs().max()
            assert largest < tolerance * term_size, f"{name} should be zero: max |x| = {largest:.2e}"
        else:
            error = relative_error(outputs[name], ref)
            assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance:.0e}"
            compared.append(name)
    return compared


class OperationRecorder(TorchDispatchMode):
    """Calls :meth:`record` with every aten operation run inside it and the tensors it produced."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.record(func, [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)])
        return out

    def record(self, func, outputs: list[torch.Tensor]) -> None:
        raise NotImplementedError
