"""LeanLinearTangents (the forward-mode J v of GGNOperator): F.linear and a @ b take the same tangents as
PyTorch's own forward-mode rules, for every subset of tangents, input rank and layout, in float64 and under
autocast; other products, and anything run with gradients enabled, are left to PyTorch."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F


from optim._tangent_products import LeanLinearTangents
from tests.helpers import OperationRecorder

DTYPE = torch.float64


def dual_call(fn, primals, tangents, *, lean: bool, grad: bool = False):
    """``fn(*duals)``'s value and tangent (None when it has none), with or without the lean rules."""
    with torch.set_grad_enabled(grad), fwAD.dual_level():
        duals = [p if t is None else fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        if lean:
            with LeanLinearTangents():
                out = fn(*duals)
        else:
            out = fn(*duals)
        value, tangent = fwAD.unpack_dual(out)
        return value.detach().clone(), None if tangent is None else tangent.detach().clone()


def subsets(n: int):
    return [mask for mask in itertools.product((False, True), repeat=n) if any(mask)]


class OutOfPlaceSums(OperationRecorder):
    """Records the sizes (elements) of the out-of-place sums (``aten.add.Tensor``) that run under it."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def record(self, func, outputs: list[torch.Tensor]) -> None:
        if func is torch.ops.aten.add.Tensor:
            self.sizes.append(outputs[0].numel())


def assert_same(fn, primals, tangents, *, lean_sums: int | None = 0, **close):
    """Same value and tangent as PyTorch's rules; with ``lean_sums`` set, the lean rules form that many sums the
    size of the result (their point: PyTorch's rule adds two product-sized terms into a third tensor)."""
    expected = dual_call(fn, primals, tangents, lean=False)
    with OutOfPlaceSums() as sums:
        got = dual_call(fn, primals, tangents, lean=True)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], **close)
    if lean_sums is not None:
        assert sums.sizes.count(got[0].numel()) == lean_sums, sums.sizes


@pytest.mark.parametrize("input_shape", [(7,), (4, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_tangents_equal_pytorchs_rule(gen, input_shape, bias):
    shapes = [input_shape, (5, 7)] + ([(5,)] if bias else [])
    primals = [torch.randn(s, generator=gen, dtype=DTYPE) for s in shapes]
    for mask in subsets(len(shapes)):
        tangents = [torch.randn(s, generator=gen, dtype=DTYPE) if on else None for s, on in zip(shapes, mask)]
        assert_same(F.linear, primals, tangents, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("spelling", ["torch.matmul", "method", "operator"])
@pytest.mark.parametrize("a_shape", [(4, 7), (2, 3, 7), (3, 7, 2)])  # the last one transposed: not contiguous
def test_matmul_tangents_equal_pytorchs_rule(gen, spelling, a_shape):
    product = {"torch.matmul": torch.matmul, "method": torch.Tensor.matmul, "operator": lambda a, b: a @ b}[spelling]
    transposed = a_shape[-1] != 7

    def layer(a, b):
        return product(a.transpose(-1, -2) if transposed else a, b)

    shapes = [a_shape, (7, 5)]
    primals = [torch.randn(s, generator=gen, dtype=DTYPE) for s in shapes]
    for mask in subsets(2):
        tangents = [torch.randn(s, generator=gen, dtype=DTYPE) if on else None for s, on in zip(shapes, mask)]
        assert_same(layer, primals, tangents, rtol=1e-12, atol=1e-13)


def test_other_products_and_gradient_mode_are_pytorchs(gen):
    """Batched and matrix-vector products, F.linear called by keywords, and any product with gradients enabled, run
    PyTorch's rules."""
    x, w = torch.randn(3, 4, generator=gen, dtype=DTYPE), torch.randn(5, 4, generator=gen, dtype=DTYPE)
    assert_same(lambda x, w: F.linear(input=x, weight=w), [x, w], [torch.randn_like(x), torch.randn_like(w)],
                lean_sums=None, rtol=0, atol=0)  # fmt: skip
    cases = [((2, 3, 4), (2, 4, 5)), ((3, 4), (4,)), ((4,), (4, 3))]
    for a_shape, b_shape in cases:
        primals = [torch.randn(s, generator=gen, dtype=DTYPE) for s in (a_shape, b_shape)]
        tangents = [torch.randn_like(p) for p in primals]
        assert_same(torch.matmul, primals, tangents, lean_sums=None, rtol=0, atol=0)
    primals = [torch.randn(2, 3, 4, generator=gen, dtype=DTYPE), torch.randn(4, 5, generator=gen, dtype=DTYPE)]
    tangents = [torch.randn_like(p) for p in primals]
    with_grad = dual_call(torch.matmul, primals, tangents, lean=True, grad=True)
    plain = dual_call(torch.matmul, primals, tangents, lean=False, grad=True)
    torch.testing.assert_close(with_grad, plain, rtol=0, atol=0)


def test_linear_tangent_under_autocast_has_the_value_dtype(gen):
    """Under bf16 autocast (a float32 layer, as in the LM recipe) the tangent is bf16 like the value and equals
    PyTorch's to bf16 rounding."""
    primals = [torch.randn(6, 9, generator=gen), torch.randn(11, 9, generator=gen), torch.randn(11, generator=gen)]
    tangents = [torch.randn_like(p) for p in primals]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = dual_call(F.linear, primals, tangents, lean=False)
        got = dual_call(F.linear, primals, tangents, lean=True)
    assert got[0].dtype == got[1].dtype == expected[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1].float(), expected[1].float(), rtol=2e-2, atol=5e-2)


class TripledLinear(torch.Tensor):
    """A weight whose ``F.linear`` is its own (three times PyTorch's): its tangent must go through it too."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear:
            with torch._C.DisableTorchFunctionSubclass():
                return F.linear(args[0], 3 * args[1], *args[2:], **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def test_subclass_with_its_own_product_keeps_it_for_the_tangent(gen):
    """Both tangents on: the lean rule's addmm_ would add x dW^T past the subclass's F.linear (a wrong tangent)."""
    primals = [torch.randn(4, 7, generator=gen, dtype=DTYPE), torch.randn(5, 7, generator=gen, dtype=DTYPE)]
    tangents = [torch.randn_like(p) for p in primals]
    assert_same(lambda x, w: F.linear(x, w.as_subclass(TripledLinear)), primals, tangents, lean_sums=None,
                rtol=1e-12, atol=1e-13)  # fmt: skip


def test_vmap_over_one_operands_tangent_runs_pytorchs_rules(gen):
    """Under torch.func.vmap the first term may be unbatched and the second batched: no in-place sum (it raised)."""
    x, w, b = (torch.randn(s, generator=gen, dtype=DTYPE) for s in ((3, 4), (4, 5), (5,)))
    x_dot, b_dots, w_dots = torch.randn_like(x), torch.randn(2, 5, dtype=DTYPE), torch.randn(2, 4, 5, dtype=DTYPE)
    cases = [(lambda t: torch.func.jvp(torch.matmul, (x, w), (x_dot, t))[1], w_dots),
             (lambda t: torch.func.jvp(F.linear, (x, w.t(), b), (x_dot, torch.zeros_like(w.t()), t))[1], b_dots)]
    for fn, batch in cases:
        with torch.no_grad():
            expected = torch.func.vmap(fn)(batch)
            with LeanLinearTangents():
                got = torch.func.vmap(fn)(batch)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shapes", [[(4, 7), (0, 7)], [(4, 0), (5, 0)], [(0, 7), (5, 7)]])
def test_linear_tangents_with_an_empty_dimension(gen, shapes):
    primals = [torch.randn(s, generator=gen, dtype=DTYPE) for s in shapes]
    assert_same(F.linear, primals, [torch.randn_like(p) for p in primals], lean_sums=None, rtol=0, atol=0)
