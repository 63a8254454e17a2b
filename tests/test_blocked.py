"""The blocked PyTorch backend against autograd through the naive float64 math."""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashbob import blocked, reference
from tests.helpers import assert_matches, attention_inputs, relative_error

SHAPES = [  # (heads, kv_heads, N, M, block): odd lengths, N != M both ways, GQA, ragged panels
    (2, 2, 1, 1, None),
    (2, 2, 13, 13, 4),
    (4, 2, 17, 9, 5),
    (4, 1, 6, 23, 4),
    (3, 3, 33, 31, None),
]
COTANGENTS = [c for c in itertools.product((False, True), repeat=3) if any(c)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads,n,m,block", SHAPES)
def test_forward_and_backward(gen, causal, heads, kv_heads, n, m, block):
    q, k, v, do = attention_inputs(gen, heads=heads, kv_heads=kv_heads, n=n, m=m)
    scale = 0.37
    o, lse = blocked.forward(q, k, v, causal=causal, scale=scale, block=block)
    assert_matches(o, reference.attention(q, k, v, causal=causal, scale=scale), 1e-13, "o")
    assert_matches(lse, reference.log_sum_exp(q, k, causal=causal, scale=scale), 1e-13, "lse")
    dq, dk, dv, delta = blocked.backward(q, k, v, o, lse, do, causal=causal, scale=scale, block=block)
    for name, got, want in zip("qkv", (dq, dk, dv), reference.attention_backward(q, k, v, do, causal=causal, scale=scale)):
        assert_matches(got, want, 1e-13, f"d{name}")
    assert_matches(delta, (do * o).sum(-1), 1e-14, "delta")


@pytest.mark.parametrize("present", COTANGENTS, ids=lambda c: "".join("UWZ"[i] if f else "-" for i, f in enumerate(c)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads,n,m,block", SHAPES[1:])
def test_bob_each_output(gen, present, causal, heads, kv_heads, n, m, block):
    q, k, v, do = attention_inputs(gen, heads=heads, kv_heads=kv_heads, n=n, m=m)
    bars = [torch.randn(x.shape, generator=gen, dtype=x.dtype) if p else None for x, p in zip((q, k, v), present)]
    scale = 0.37
    o, lse = blocked.forward(q, k, v, causal=causal, scale=scale, block=block)
    *_, delta = blocked.backward(q, k, v, o, lse, do, causal=causal, scale=scale, block=block)
    got = blocked.bob(q, k, v, do, o, lse, delta, *bars, causal=causal, scale=scale, block=block)
    want = reference.backward_over_backward(q, k, v, do, *bars, causal=causal, scale=scale)
    for name, g, w in zip(("q_bar", "k_bar", "v_bar", "do_bar"), got, want):
        assert_matches(g, w, 1e-12, name)  # V̄ is exactly zero when only Z̄ is present


def test_bob_without_cotangents_is_zero(gen):
    q, k, v, do = attention_inputs(gen)
    o, lse = blocked.forward(q, k, v, causal=False, scale=0.5)
    *_, delta = blocked.backward(q, k, v, o, lse, do, causal=False, scale=0.5)
    for out, like in zip(blocked.bob(q, k, v, do, o, lse, delta, None, None, None, causal=False, scale=0.5), (q, k, v, do)):
        assert out.shape == like.shape and not out.any()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs(gen, dtype, tol):
    q, k, v, do = attention_inputs(gen, n=20, m=20, head_dim=16)
    low = [t.to(dtype) for t in (q, k, v, do)]
    o, lse = blocked.forward(*low[:3], causal=True, scale=0.25)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert relative_error(o, reference.attention(*(t.to(dtype).double() for t in (q, k, v)), causal=True, scale=0.25)) < tol


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_memory_is_linear_in_length(gen, causal, monkeypatch):
    """fwd + bwd + BoB never create a tensor bigger than one panel, whose size is linear in N."""
    monkeypatch.setattr(blocked, "PANEL_ELEMENTS", 2**14)
    largest = {}
    for n in (256, 1024):
        q, k, v, do = attention_inputs(gen, batch=1, heads=2, kv_heads=1, n=n, m=n, head_dim=16)
        bars = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in (q, k, v)]
        with LargestTensor() as probe:
            o, lse = blocked.forward(q, k, v, causal=causal, scale=0.25)
            *_, delta = blocked.backward(q, k, v, o, lse, do, causal=causal, scale=0.25)
            blocked.bob(q, k, v, do, o, lse, delta, *bars, causal=causal, scale=0.25)
        largest[n] = probe.largest
        assert probe.largest <= max(2**14 + n * 2, 2 * n * 16), (n, probe.largest)  # a panel, or q itself
    assert largest[1024] < 16 * largest[256] / 2  # quadrupling N does not grow the peak 16x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_autocast_does_not_lower_the_precision(gen, dtype):
    """Under bf16 autocast every pass computes as without it (in float32): before, the panels' matrix
    products ran in bfloat16: float32 inputs got ~1e-2 relative error instead of ~1e-7, float16 ones ~5x more."""
    import flashbob

    q, k, v, do = (t.to(dtype) for t in attention_inputs(gen, n=12, m=10, head_dim=16))
    tangents = tuple(torch.randn(t.shape, generator=gen).to(dtype) for t in (q, k, v))

    def results():
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flashbob.attention(*ins, causal=True, backend="blocked")
        grads = torch.autograd.grad(o, ins, do, create_graph=True)
        second = torch.autograd.grad(sum((g.float() ** 2).sum() for g in grads), ins)
        o_dot = torch.func.jvp(lambda *x: flashbob.attention(*x, causal=True, backend="blocked"), (q, k, v), tangents)[1]
        return (o, *grads, *second, o_dot)

    plain = results()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = results()
    for name, got, want in zip(("o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "o_dot"), autocast, plain):
        assert got.dtype == want.dtype and torch.equal(got, want), name
