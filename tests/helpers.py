"""Helpers shared by the tests: random attention inputs and relative errors."""

from __future__ import annotations

import torch


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
