"""flashbob.attention: the autograd chain (exact first and second derivatives), checks and dispatch."""

import inspect

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import flashbob
from flashbob import reference
from tests.helpers import BACKENDS, assert_matches, attention_inputs, exact_tolerance, needs_interpreter, on_backend

VARIANTS = [  # (heads, kv_heads, N, M, causal)
    (2, 2, 5, 5, False),
    (2, 2, 7, 7, True),
    (4, 2, 6, 3, True),
    (2, 1, 3, 7, False),
    (2, 1, 9, 4, True),
]


# Gradient checks through Triton's interpreter are slow: all variants on the blocked backend, the
# hardest one (causal, GQA, N > M) through the kernels.
GRADCHECK_CASES = [("blocked", *variant) for variant in VARIANTS]
GRADCHECK_CASES.append(pytest.param("triton", 2, 1, 4, 3, True, marks=needs_interpreter))


@pytest.mark.parametrize("backend,heads,kv_heads,n,m,causal", GRADCHECK_CASES)
def test_gradcheck_and_gradgradcheck(gen, backend, heads, kv_heads, n, m, causal):
    q, k, v, _ = attention_inputs(gen, batch=1, heads=heads, kv_heads=kv_heads, n=n, m=m, head_dim=4)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return flashbob.attention(q, k, v, causal=causal, scale=0.6, backend=backend)

    assert gradcheck(f, inputs)
    assert gradgradcheck(f, inputs)


def _second_order(attention, q, k, v, causal):
    """A scalar built from the first derivatives (with some of dQ/dK/dV unused) and its gradient."""
    out = attention(q, k, v, causal=causal)
    loss = (out.sin() * out).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v), create_graph=True)
    inner = (dq.square()).sum() + (dv * v).sum()  # dK unused: its cotangent is absent
    return torch.autograd.grad(inner, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_second_derivative_matches_naive_autograd(gen, backend, causal):
    q, k, v, _ = attention_inputs(gen, heads=4, kv_heads=2, n=11, m=11, head_dim=8)
    inputs = [t.requires_grad_() for t in on_backend(backend, q, k, v)]
    got = _second_order(lambda *a, **kw: flashbob.attention(*a, backend=backend, **kw), *inputs, causal)
    want = _second_order(reference.attention, *(t.detach().double().requires_grad_() for t in inputs), causal)
    for name, g, w in zip("qkv", got, want):
        assert_matches(g, w, exact_tolerance(g), name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_requires_grad(gen, backend):
    """Only q is differentiated: the Hessian-vector product in q alone is still exact."""
    q, k, v, _ = attention_inputs(gen, heads=2, kv_heads=2, n=6, m=9, head_dim=4)
    vec = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    q, k, v, vec = on_backend(backend, q, k, v, vec)

    def hvp(attention, q, k, v, vec):
        q = q.detach().requires_grad_()
        (g,) = torch.autograd.grad(attention(q, k, v).pow(3).sum(), q, create_graph=True)
        return torch.autograd.grad(g, q, vec)[0]

    got = hvp(lambda *a: flashbob.attention(*a, backend=backend), q, k, v, vec)
    want = hvp(reference.attention, *(t.double() for t in (q, k, v, vec)))
    assert_matches(got, want, exact_tolerance(got))


def test_third_derivative_raises_clearly(gen):
    q, k, v, _ = attention_inputs(gen, n=4, m=4, head_dim=4)
    q.requires_grad_()
    (g,) = torch.autograd.grad(flashbob.attention(q, k, v).pow(2).sum(), q, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable twice, not three times"):
        torch.autograd.grad(h.sum(), q)


def test_output_and_default_scale(gen):
    q, k, v, _ = attention_inputs(gen, n=5, m=8, head_dim=16, dtype=torch.float32)
    out = flashbob.attention(q, k, v, causal=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_matches(out, sdpa, 1e-5)


def _bad(**changes):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    args = {"q": q, "k": k, "v": v} | changes
    return args


@pytest.mark.parametrize(
    "args,error,message",
    [
        (_bad(q=torch.randn(4, 5, 8)), ValueError, "q must have 4 dimensions"),
        (_bad(k=torch.randn(2, 2, 6, 8, 1)), ValueError, "k must have 4 dimensions"),
        (_bad(v=torch.randint(0, 3, (2, 2, 6, 8))), TypeError, "v must be float16, bfloat16, float32 or float64"),
        (_bad(k=torch.randn(2, 2, 6, 8, dtype=torch.float64)), TypeError, r"k.dtype \(torch.float64\) must match"),
        (_bad(k=torch.randn(3, 2, 6, 8)), ValueError, "k has batch size 3 but q has 2"),
        (_bad(v=torch.randn(2, 2, 6, 4)), ValueError, "v has head_dim 4 but q has 8"),
        (_bad(v=torch.randn(2, 2, 7, 8)), ValueError, "v must have k's heads and length"),
        (_bad(k=torch.randn(2, 3, 6, 8), v=torch.randn(2, 3, 6, 8)), ValueError, "multiple of k's and v's 3 heads"),
        (_bad(q=torch.randn(2, 4, 0, 8)), ValueError, "q has sequence length 0"),
        (_bad(q=[1.0]), TypeError, "q must be a torch.Tensor"),
        (_bad(q=torch.randn(2, 4, 5, 8, device="meta")), ValueError, "k is on cpu but q is on meta"),
    ],
)
def test_bad_inputs_name_the_argument(args, error, message):
    with pytest.raises(error, match=message):
        flashbob.attention(**args)


def test_bad_options():
    q, k, v = _bad().values()
    with pytest.raises(ValueError, match="scale must be a finite number"):
        flashbob.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="backend must be 'auto', 'triton' or 'blocked'"):
        flashbob.attention(q, k, v, backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _bad().values()
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        flashbob.attention(q, k, v, backend="triton")


def test_the_interpreter_refuses_bfloat16(monkeypatch):
    """Triton's interpreter gets tl.dot on bfloat16 operands wrong (errors of 1e9 seen with Triton 3.9)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="does not take bfloat16"):
        flashbob.attention(q, k, v, backend="triton")


def test_float64_cuda_tensors_take_the_blocked_backend():
    """Triton cannot compile float64 kernels for Hopper: auto picks the blocked backend, triton refuses."""
    from flashbob.attention import BLOCKED, select_backend

    cuda_like = type("CudaLike", (), {"is_cuda": True, "dtype": torch.float64, "device": "cuda:0"})()
    assert select_backend(cuda_like, "auto") is BLOCKED
    with pytest.raises(ValueError, match="does not take float64 CUDA tensors"):
        select_backend(cuda_like, "triton")


def test_functions_skip_the_argument_binding_outside_transforms(monkeypatch, gen):
    """Outside torch.func transforms the autograd Functions are applied without ``Function.apply``'s per-call
    ``inspect.signature`` binding (host time of every call); under a transform, through ``Function.apply``."""
    bound = []
    signature = inspect.signature

    def recorded(fn, *args, **kwargs):
        bound.append(fn)
        return signature(fn, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", recorded)
    q, k, v, do = attention_inputs(gen, batch=1, heads=2, kv_heads=1, n=5, m=7, head_dim=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = flashbob.attention(q, k, v, causal=True)
    dq, _, _ = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    torch.autograd.grad(dq.square().sum(), (q, k, v))
    assert bound == []
    expected = torch.autograd.grad((flashbob.attention(q, k, v) * do).sum(), q)[0]
    under_grad = torch.func.grad(lambda q: (flashbob.attention(q, k, v) * do).sum())(q)
    assert bound
    torch.testing.assert_close(under_grad, expected, rtol=1e-12, atol=1e-12)
