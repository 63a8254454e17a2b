"""torch.func over flashbob.attention: grad, vjp, vmap over the batch (per-sample gradients and
HVPs, reverse-over-reverse and forward-over-reverse), jacrev, per-sample jvp. Blocked backend, plus a
Triton-interpreter case."""

import pytest
import torch
from torch.func import grad, jacrev, jvp, vjp, vmap

import flashbob
from flashbob import reference
from flashbob.kernels import configs
from tests.helpers import INTERPRETED, KERNEL_DEVICE, needs_kernels, on_backend


def inputs(gen, samples=3, batch=1, heads=2, kv_heads=1, n=6, m=5, d=4):
    q = torch.randn(samples, batch, heads, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(samples, batch, kv_heads, m, d, generator=gen, dtype=torch.float64)
    v = torch.randn(samples, batch, kv_heads, m, d, generator=gen, dtype=torch.float64)
    keys = torch.rand(samples, batch, m, generator=gen) > 0.3
    keys[..., 0] = True
    return q, k, v, keys


def fns(backend, causal=False):
    bob = lambda q, k, v, keys: flashbob.attention(q, k, v, causal=causal, key_mask=keys, backend=backend)  # noqa
    ref = lambda q, k, v, keys: reference.attention(q, k, v, causal=causal, key_mask=keys)  # noqa: E731
    return bob, ref


def loss(fn):
    return lambda q, k, v, keys: fn(q, k, v, keys).sin().sum()


def close(a, b, tol=1e-10):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_grad_vjp_jacrev(gen, causal):
    q, k, v, keys = (x[0] for x in inputs(gen))
    bob, ref = fns("blocked", causal)
    close(grad(loss(bob), argnums=(0, 1, 2))(q, k, v, keys), grad(loss(ref), argnums=(0, 1, 2))(q, k, v, keys))
    out, pullback = vjp(lambda q, k, v: bob(q, k, v, keys), q, k, v)
    out_ref, pullback_ref = vjp(lambda q, k, v: ref(q, k, v, keys), q, k, v)
    close(out, out_ref)
    close(pullback(torch.ones_like(out)), pullback_ref(torch.ones_like(out)))
    close(jacrev(bob)(q, k, v, keys), jacrev(ref)(q, k, v, keys))


def test_vmap_forward_per_sample_grads_and_hvps(gen):
    q, k, v, keys = inputs(gen)
    bob, ref = fns("blocked", causal=True)
    close(vmap(bob)(q, k, v, keys), vmap(ref)(q, k, v, keys))
    close(vmap(bob, in_dims=(0, None, None, None))(q, k[0], v[0], keys[0]),
          vmap(ref, in_dims=(0, None, None, None))(q, k[0], v[0], keys[0]))
    per_sample = lambda fn: vmap(grad(loss(fn), argnums=(0, 1, 2)))(q, k, v, keys)  # noqa: E731
    close(per_sample(bob), per_sample(ref))

    def hvp(fn, q, k, v, keys, tangent):  # reverse-over-reverse: grad, then vjp of grad
        _, pullback = vjp(lambda q: grad(loss(fn))(q, k, v, keys), q)
        return pullback(tangent)[0]

    tangent = torch.randn_like(q)
    close(vmap(lambda *a: hvp(bob, *a))(q, k, v, keys, tangent), vmap(lambda *a: hvp(ref, *a))(q, k, v, keys, tangent))


@needs_kernels
def test_triton_kernels_grad_and_vmap(gen):
    q, k, v, keys = inputs(gen, samples=2, n=20, m=18, d=16)
    bob, ref = fns("triton", causal=True)
    with configs.override(block_m=16, block_n=16):
        got = vmap(grad(loss(bob), argnums=(0, 1, 2)))(*on_backend("triton", q, k, v), keys.to(KERNEL_DEVICE))
    want = vmap(grad(loss(ref), argnums=(0, 1, 2)))(q, k, v, keys)
    close(tuple(x.cpu().double() for x in got), want, tol=1e-10 if INTERPRETED else 1e-5)


def test_vmap_over_samples_of_forward_mode(gen):
    """Per-sample jvp and forward-over-reverse HVPs: primals, tangents and masks all batched by vmap
    (tests/test_forward_mode.py checks forward mode itself)."""
    q, k, v, keys = inputs(gen)
    tangents = tuple(torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in (q, k, v))
    for causal in (False, True):
        bob, ref = fns("blocked", causal)

        def per_sample_jvp(fn):
            return vmap(lambda q, k, v, keys, *t: jvp(lambda *a: fn(*a, keys), (q, k, v), t))(q, k, v, keys, *tangents)

        def per_sample_hvp(fn):
            def hvp(q, k, v, keys, *t):
                return jvp(lambda *a: grad(loss(fn), argnums=(0, 1, 2))(*a, keys), (q, k, v), t)[1]
            return vmap(hvp)(q, k, v, keys, *tangents)

        close(per_sample_jvp(bob), per_sample_jvp(ref))
        close(per_sample_hvp(bob), per_sample_hvp(ref))


@pytest.mark.parametrize("backend", ["blocked", pytest.param("triton", marks=needs_kernels)])
def test_vmap_wider_than_the_kernel_grid_runs_in_chunks(gen, backend, monkeypatch):
    """jacfwd and hessian vmap over one tangent per input element, folded into the batch: more than the Triton
    grid's 65,535 programs at realistic sizes (2 heads of 64 x 256 already). The rules split the vmapped dimension
    so that every call fits; here the limit is lowered to 5 programs (the kernels' own check lowered with it) and
    the results must equal one unchunked call's and the reference's."""
    import flashbob.autograd
    import flashbob.inputs

    q, k, v, keys = (x[0] for x in inputs(gen, samples=1, n=3, m=4, d=2))  # q: 2 heads x 3 x 2 = 12 tangents
    bob, ref = fns(backend, causal=True)
    want = torch.func.jacfwd(lambda q: ref(q, k, v, keys))(q)
    q_run, k_run, v_run = on_backend(backend, q, k, v)
    attend = lambda q: bob(q, k_run, v_run, keys.to(q.device))  # noqa: E731
    whole = torch.func.jacfwd(attend)(q_run)
    calls = []
    original = flashbob.autograd.apply

    def counted(function, *args):
        calls.append(args[0].shape[0] * args[0].shape[1])
        return original(function, *args)

    monkeypatch.setattr(flashbob.inputs, "MAX_GRID_Y", 5)
    monkeypatch.setattr(flashbob.autograd, "MAX_GRID_Y", 5)
    monkeypatch.setattr(flashbob.autograd, "apply", counted)
    chunked = torch.func.jacfwd(attend)(q_run)
    # the primal once (2 programs), then 12 tangents x 2 heads in chunks of 2 tangents (4 programs)
    assert max(calls) <= 5 and calls.count(4) == 6
    close(chunked.cpu().double(), whole.cpu().double(), tol=0)
    close(chunked.cpu().double(), want, tol=1e-10 if backend == "blocked" or INTERPRETED else 1e-5)


def test_an_empty_vmap_gives_empty_results(gen):
    """jacfwd of an empty batch, vmap over no tangents: empty results, as eager attention gives (an einops reshape
    failed on them: ZeroDivisionError, 'cannot reshape tensor of 0 elements')."""
    q, k, v, _ = (x[0] for x in inputs(gen, samples=1))
    empty = torch.randn(0, *q.shape[1:], dtype=q.dtype)
    jacobian = torch.func.jacfwd(lambda a: flashbob.attention(a, empty[:, :1, :5], empty[:, :1, :5],
                                                               backend="blocked"))(empty)
    assert jacobian.shape == (*empty.shape, *empty.shape)
    none = torch.randn(0, *q.shape, dtype=q.dtype)
    k_all, v_all = (x.expand(*q.shape[:2], *x.shape[2:]) for x in (k, v))  # sdpa: as many key heads as query heads
    for attend in (lambda a: flashbob.attention(a, k, v, backend="blocked"),
                   lambda a: flashbob.sdpa(a, k_all, v_all, backend="blocked")):
        out = vmap(lambda t: jvp(attend, (q,), (t,))[1])(none)
        assert out.shape == (0, *q.shape)
