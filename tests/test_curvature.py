"""Curvature products and estimators of optim against dense torch.func references in float64."""

from __future__ import annotations

import gc
import importlib.util
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp

import flashbob
from optim import (
    AutogradLossHessian,
    CrossEntropyHessian,
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    LossHessian,
    MSEHessian,
    NewtonCG,
    functional,
    ggnvp,
    hutchinson_diagonal,
    hvp,
    power_iteration,
    trace,
)
from optim.forward_mode_checks import active_dropout
from recipes.common.transformer import Transformer
from tests.helpers import assert_matches, needs_interpreter
from tests.models import MLP

DTYPE = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}


def flatten(tensors: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    return [c.view_as(t) for c, t in zip(torch.split(flat, [t.numel() for t in like]), like)]


@dataclass
class Problem:
    """A model whose products go through ``model`` and whose references go through ``reference``.

    ``reference`` has the same parameter values (for an MLP it is the model itself) but naive attention,
    so torch.func can differentiate it in any mode; the products under test never touch it.
    """

    model: nn.Module
    reference: nn.Module
    inputs: Tensor
    targets: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    loss_hessian: LossHessian

    @property
    def params(self) -> list[Tensor]:
        return list(self.model.parameters())

    @property
    def n(self) -> int:
        return sum(p.numel() for p in self.params)

    def outputs(self) -> Tensor:
        return self.model(self.inputs)

    def loss(self) -> Tensor:
        return self.loss_fn(self.outputs(), self.targets)

    def loss_function(self) -> Callable[[tuple[Tensor, ...]], Tensor]:
        """The loss as a function of parameter values (what ``mode="forward"`` takes)."""
        return functional(self.model, self.loss, self.params)

    def outputs_function(self) -> Callable[[tuple[Tensor, ...]], Tensor]:
        return functional(self.model, self.outputs, self.params)

    def theta(self) -> Tensor:
        return flatten([p.detach() for p in self.reference.parameters()])

    def reference_outputs(self, theta: Tensor) -> Tensor:
        names = [name for name, _ in self.reference.named_parameters()]
        values = unflatten(theta, list(self.reference.parameters()))
        return functional_call(self.reference, dict(zip(names, values)), (self.inputs,))

    def reference_loss(self, theta: Tensor) -> Tensor:
        return self.loss_fn(self.reference_outputs(theta), self.targets)

    def dense_hessian(self) -> Tensor:
        """Forward-over-reverse, column by column.

        Not torch.func.hessian (jacfwd of jacrev): in torch 2.13 its vmapped reverse-over-reverse through
        F.layer_norm is wrong (an asymmetric result) when both the input and the weight depend on theta.
        """
        return jacfwd(grad(self.reference_loss))(self.theta())

    def reference_hvp(self, vec: Tensor) -> Tensor:
        """``H v`` for a flat ``v``, forward-over-reverse through torch.func on the reference model."""
        return jvp(grad(self.reference_loss), (self.theta(),), (vec,))[1]

    def reference_ggn(self, vec: Tensor) -> Tensor:
        """``G v = J^T H_L J v`` for a flat ``v``, each factor by torch.func on the reference model."""
        theta = self.theta()
        outputs, jv = jvp(self.reference_outputs, (theta,), (vec,))
        hjv = jvp(grad(lambda z: self.loss_fn(z, self.targets)), (outputs,), (jv,))[1]
        return torch.func.vjp(self.reference_outputs, theta)[1](hjv)[0]

    def dense_ggn(self) -> Tensor:
        theta = self.theta()
        outputs = self.reference_outputs(theta)
        jacobian = jacrev(self.reference_outputs)(theta).reshape(outputs.numel(), -1)
        loss_hessian = hessian(lambda z: self.loss_fn(z, self.targets))(outputs.detach())
        loss_hessian = loss_hessian.reshape(outputs.numel(), outputs.numel())
        return jacobian.T @ loss_hessian @ jacobian

    def random_vec(self, seed: int = 0) -> list[Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(p.shape, generator=generator, dtype=DTYPE) for p in self.params]


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """``F.mse_loss(outputs, targets)``, spelled out: torch.func's jvp of grad of F.mse_loss raises (ZeroTensor)."""
    return (outputs - targets).pow(2).mean()


def cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits, targets, reduction="sum")


def lm_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def mlp_problem(loss: str) -> Problem:
    torch.manual_seed(0)
    width = 2 if loss == "mse" else 4
    model = MLP([3, 5, width])
    inputs = torch.randn(7, 3, dtype=DTYPE)
    if loss == "mse":
        return Problem(model, model, inputs, torch.randn(7, width, dtype=DTYPE), mse, MSEHessian())
    targets = torch.randint(0, width, (7,))
    return Problem(model, model, inputs, targets, cross_entropy_sum, CrossEntropyHessian(targets, reduction="sum"))


def transformer_problem(heads: int, kv_heads: int, layers: int) -> Problem:
    torch.manual_seed(0)
    config = dict(vocab_size=7, n_outputs=7, d_model=8, n_heads=heads, n_kv_heads=kv_heads, n_layers=layers)
    model = Transformer(**config, attention=flashbob.attention).double()
    reference = Transformer(**config, attention=flashbob.reference.attention).double()
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 7, (2, 5))
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 1] = targets[1, 4] = -100
    return Problem(model, reference, tokens, targets, lm_cross_entropy, CrossEntropyHessian(targets))


PROBLEMS = {
    "mlp-mse": lambda: mlp_problem("mse"),
    "mlp-ce": lambda: mlp_problem("ce"),
    "transformer-gqa": lambda: transformer_problem(heads=4, kv_heads=2, layers=1),
    "transformer-mqa-2layer": lambda: transformer_problem(heads=2, kv_heads=1, layers=2),
}


@pytest.fixture(params=list(PROBLEMS), scope="module")
def problem(request: pytest.FixtureRequest) -> Problem:
    return PROBLEMS[request.param]()


@pytest.fixture(scope="module")
def mlp() -> Problem:
    return mlp_problem("mse")


@pytest.fixture(scope="module")
def mlp_hessian(mlp: Problem) -> Tensor:
    return mlp.dense_hessian()


class DenseOperator(CurvatureOperator):
    """A given symmetric matrix as an operator, recording every vector it is applied to."""

    def __init__(self, matrix: Tensor, params: list[Tensor]) -> None:
        super().__init__(params)
        self.matrix = matrix
        self.seen: list[Tensor] = []

    def matvec(self, vec):
        self.seen.append(flatten(vec))
        return tuple(unflatten(self.matrix @ flatten(vec), list(self.params)))


# --- Hessian-vector products -------------------------------------------------------------------


def test_hvp_matches_forward_over_reverse(problem: Problem) -> None:
    vec = problem.random_vec()
    expected = jvp(grad(problem.reference_loss), (problem.theta(),), (flatten(vec),))[1]
    torch.testing.assert_close(flatten(hvp(problem.loss(), problem.params, vec)), expected, **TOL)


def test_hessian_operator_matches_dense_hessian(problem: Problem) -> None:
    dense = problem.dense_hessian()
    columns = torch.randn(problem.n, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(HessianOperator(problem.loss(), problem.params) @ columns, dense @ columns, **TOL)


def test_hessian_operator_builds_the_dense_hessian(mlp: Problem, mlp_hessian: Tensor) -> None:
    op = HessianOperator(mlp.loss(), mlp.params)
    assert op.shape == (mlp.n, mlp.n)
    torch.testing.assert_close(op @ torch.eye(mlp.n, dtype=DTYPE), mlp_hessian, **TOL)


def test_matmul_accepts_flat_vectors_and_parameter_lists(mlp: Problem, mlp_hessian: Tensor) -> None:
    op = HessianOperator(mlp.loss(), mlp.params)
    vec = mlp.random_vec()
    as_list = op @ vec
    assert [t.shape for t in as_list] == [p.shape for p in mlp.params]
    torch.testing.assert_close(flatten(as_list), mlp_hessian @ flatten(vec), **TOL)
    torch.testing.assert_close(op @ flatten(vec), mlp_hessian @ flatten(vec), **TOL)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_hvp_treats_frozen_and_unused_params_as_constants(mode: str) -> None:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, dtype=DTYPE, generator=generator, requires_grad=True)
    frozen = torch.randn(4, dtype=DTYPE, generator=generator)
    unused = torch.randn(2, dtype=DTYPE, generator=generator, requires_grad=True)
    x = torch.randn(5, 3, dtype=DTYPE, generator=generator)

    def loss_of(values: tuple[Tensor, ...]) -> Tensor:
        weight, bias, _ = values
        return torch.tanh(x @ weight + bias).pow(3).sum()

    params = [w, frozen, unused]
    vec = [torch.randn(p.shape, dtype=DTYPE, generator=generator) for p in params]
    loss = loss_of(params) if mode == "reverse" else loss_of  # forward mode needs the function
    hw, hfrozen, hunused = hvp(loss, params, vec, mode=mode)
    expected = hessian(lambda flat: loss_of((flat.view(3, 4), frozen, unused)))(w.detach().reshape(-1))
    torch.testing.assert_close(hw.reshape(-1), expected @ vec[0].reshape(-1), **TOL)
    assert not hfrozen.any() and not hunused.any()


def test_hvp_of_a_loss_linear_in_the_params_is_zero() -> None:
    w = torch.randn(4, dtype=DTYPE, requires_grad=True)
    (product,) = hvp((3.0 * w).sum(), [w], [torch.ones(4, dtype=DTYPE)])
    assert product.shape == (4,) and not product.any()


def test_precomputed_grads_serve_many_products(mlp: Problem, mlp_hessian: Tensor) -> None:
    loss = mlp.loss()
    grads = torch.autograd.grad(loss, mlp.params, create_graph=True)
    for seed in range(3):
        vec = mlp.random_vec(seed)
        product = hvp(loss, mlp.params, vec, grads=grads, retain_graph=True)
        torch.testing.assert_close(flatten(product), mlp_hessian @ flatten(vec), **TOL)


def test_precomputed_grads_may_hold_none_for_unused_params(mlp: Problem, mlp_hessian: Tensor) -> None:
    unused = torch.ones(3, dtype=DTYPE, requires_grad=True)
    loss = mlp.loss()
    grads = torch.autograd.grad(loss, [*mlp.params, unused], create_graph=True, allow_unused=True)
    assert grads[-1] is None
    vec = [*mlp.random_vec(), torch.ones(3, dtype=DTYPE)]
    *product, unused_block = hvp(loss, [*mlp.params, unused], vec, grads=grads)
    torch.testing.assert_close(flatten(product), mlp_hessian @ flatten(vec[:-1]), **TOL)
    assert not unused_block.any()


def test_hvp_frees_the_graph_like_backward(mlp: Problem) -> None:
    loss = mlp.loss()
    hvp(loss, mlp.params, mlp.random_vec())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_hessian_operator_gradient_and_products_under_no_grad(mlp: Problem, mlp_hessian: Tensor) -> None:
    loss = mlp.loss()
    expected_gradient = flatten(torch.autograd.grad(loss, mlp.params, retain_graph=True))
    with torch.no_grad():  # as inside torch.optim.Optimizer.step
        op = HessianOperator(loss, mlp.params)
        products = [op @ mlp.random_vec(seed) for seed in range(2)]
    torch.testing.assert_close(flatten(op.gradient), expected_gradient, **TOL)
    for seed, product in enumerate(products):
        torch.testing.assert_close(flatten(product), mlp_hessian @ flatten(mlp.random_vec(seed)), **TOL)


@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "autograd"])
def test_ggn_products_under_no_grad(mlp: Problem, closed_form: bool) -> None:
    loss_hessian = mlp.loss_hessian if closed_form else AutogradLossHessian(lambda z: mlp.loss_fn(z, mlp.targets))
    outputs, vec = mlp.outputs(), flatten(mlp.random_vec())
    with torch.no_grad():
        product = GGNOperator(outputs, mlp.params, loss_hessian) @ vec
    torch.testing.assert_close(product, mlp.dense_ggn() @ vec, **TOL)


# --- Memory hygiene: saved tensors are packed into objects only the graph refers to -------------------


class _Packed:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


@contextmanager
def tracked_saved_tensors() -> Iterator[list[weakref.ref]]:
    """Weak references to one object per tensor saved for backward while active; dead once its node is freed."""
    refs: list[weakref.ref] = []

    def pack(tensor: Tensor) -> _Packed:
        packed = _Packed(tensor.detach())  # autograd reattaches grad_fn on unpack; keeping it would be a cycle
        refs.append(weakref.ref(packed))
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed.tensor):
        yield refs


def alive(refs: list[weakref.ref]) -> int:
    return sum(ref() is not None for ref in refs)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Only reference counting frees objects, so a reference cycle keeps its graph alive."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.usefixtures("no_gc")
def test_hvp_keeps_no_graph_alive(problem: Problem) -> None:
    with tracked_saved_tensors() as refs:
        loss = problem.loss()
        forward = len(refs)
        hvp(loss, problem.params, problem.random_vec(), retain_graph=True)
    assert len(refs) > forward, "the double backward saved nothing: the check below would be vacuous"
    assert alive(refs[forward:]) == 0, "the gradient graph outlived hvp"
    assert alive(refs[:forward]) == forward, "the forward graph was retained, so it must still be there"
    del loss
    assert alive(refs) == 0, "the forward graph outlived the loss"


@pytest.mark.usefixtures("no_gc")
def test_leak_check_catches_backward_with_create_graph(mlp: Problem) -> None:
    with tracked_saved_tensors() as refs:
        loss = mlp.loss()
        loss.backward(create_graph=True)  # the known cycle: param.grad -> graph -> param
    del loss
    assert alive(refs) > 0
    for p in mlp.params:
        p.grad = None
    assert alive(refs) == 0


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize("kind", ["hessian", "ggn"])
def test_operator_graph_lives_exactly_as_long_as_the_operator(problem: Problem, kind: str) -> None:
    with tracked_saved_tensors() as refs:
        outputs = problem.outputs()
        if kind == "hessian":
            op = HessianOperator(problem.loss_fn(outputs, problem.targets), problem.params)
        else:
            op = GGNOperator(outputs, problem.params, problem.loss_hessian)
        del outputs
        for seed in range(2):
            op @ problem.random_vec(seed)
    assert alive(refs) > 0
    del op
    assert alive(refs) == 0


# --- Loss Hessians and generalised Gauss-Newton products ------------------------------------------


def ce(reduction: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda z, t: F.cross_entropy(z.flatten(0, -2), t.flatten(), reduction=reduction, ignore_index=-100)


def mse_with(reduction: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda z, t: F.mse_loss(z, t, reduction=reduction)


LOSS_CASES = {
    "ce-mean-lm-ignore": (ce("mean"), lambda t: CrossEntropyHessian(t), (2, 3, 5), "ignore"),
    "ce-sum-lm-ignore": (ce("sum"), lambda t: CrossEntropyHessian(t, reduction="sum"), (2, 3, 5), "ignore"),
    "ce-mean-2d": (ce("mean"), lambda t: CrossEntropyHessian(t), (4, 6), "classes"),
    "ce-ignore-index-3": (
        lambda z, t: F.cross_entropy(z, t, ignore_index=3),
        lambda t: CrossEntropyHessian(t, ignore_index=3),
        (6, 4),
        "classes",
    ),
    "mse-mean": (mse_with("mean"), lambda t: MSEHessian(), (3, 4), "real"),
    "mse-sum": (mse_with("sum"), lambda t: MSEHessian("sum"), (3, 4), "real"),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_hessians_match_dense_hessian_of_the_loss(case: str) -> None:
    loss_fn, make, shape, target_kind = LOSS_CASES[case]
    generator = torch.Generator().manual_seed(0)
    outputs = torch.randn(shape, dtype=DTYPE, generator=generator)
    if target_kind == "real":
        targets = torch.randn(shape, dtype=DTYPE, generator=generator)
    else:
        targets = torch.randint(0, shape[-1], shape[:-1], generator=generator)
        if target_kind == "ignore":
            targets.view(-1)[[1, 4]] = -100
    u = torch.randn(shape, dtype=DTYPE, generator=generator)
    dense = hessian(lambda z: loss_fn(z, targets))(outputs).reshape(outputs.numel(), -1)
    expected = (dense @ u.reshape(-1)).view(shape)
    torch.testing.assert_close(make(targets)(outputs, u), expected, **TOL)
    torch.testing.assert_close(AutogradLossHessian(lambda z: loss_fn(z, targets))(outputs, u), expected, **TOL)


def test_cross_entropy_hessian_with_every_target_ignored_is_zero() -> None:
    logits, u = torch.randn(2, 3, 5, dtype=DTYPE), torch.randn(2, 3, 5, dtype=DTYPE)
    assert not CrossEntropyHessian(torch.full((2, 3), -100))(logits, u).any()


def test_ggnvp_matches_dense_jacobian_product(problem: Problem) -> None:
    vec = problem.random_vec()
    product = ggnvp(None, problem.outputs(), problem.params, vec, problem.loss_hessian)
    torch.testing.assert_close(flatten(product), problem.dense_ggn() @ flatten(vec), **TOL)


def test_ggnvp_from_the_loss_graph_matches_dense_jacobian_product(problem: Problem) -> None:
    """Without a closed form, H_L comes from double backward through the loss's own graph."""
    vec = problem.random_vec()
    outputs = problem.outputs()
    product = ggnvp(problem.loss_fn(outputs, problem.targets), outputs, problem.params, vec)
    torch.testing.assert_close(flatten(product), problem.dense_ggn() @ flatten(vec), **TOL)


def test_ggnvp_needs_a_loss_or_a_loss_hessian(mlp: Problem) -> None:
    with pytest.raises(ValueError, match="needs the loss and the outputs it was computed from, or a loss_hessian"):
        ggnvp(None, mlp.outputs(), mlp.params, mlp.random_vec())


def test_ggn_with_autograd_loss_hessian_matches_closed_form(problem: Problem) -> None:
    outputs = problem.outputs()
    generic = AutogradLossHessian(lambda z: problem.loss_fn(z, problem.targets))
    closed = GGNOperator(outputs, problem.params, problem.loss_hessian)
    autograd = GGNOperator(outputs, problem.params, generic)
    columns = torch.randn(problem.n, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(closed @ columns, autograd @ columns, **TOL)


def test_ggn_jvp_matches_forward_mode(problem: Problem) -> None:
    vec = problem.random_vec()
    op = GGNOperator(problem.outputs(), problem.params, problem.loss_hessian)
    expected = jvp(problem.reference_outputs, (problem.theta(),), (flatten(vec),))[1]
    torch.testing.assert_close(op.jvp(vec), expected, **TOL)


def test_ggn_equals_hessian_for_a_linear_model() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3, dtype=DTYPE)
    inputs, targets = torch.randn(6, 4, dtype=DTYPE), torch.randint(0, 3, (6,))
    outputs = model(inputs)
    ggn = GGNOperator(outputs, list(model.parameters()), CrossEntropyHessian(targets))
    hess = HessianOperator(F.cross_entropy(outputs, targets), list(model.parameters()))
    eye = torch.eye(ggn.shape[0], dtype=DTYPE)
    torch.testing.assert_close(ggn @ eye, hess @ eye, **TOL)


# --- Forward mode (forward-over-reverse HVP, forward-mode J v) --------------------------------------
# The transformer problems run flashbob.attention's forward-mode rules (blocked backend).

MODES = ["reverse", "forward"]


@pytest.mark.parametrize("mode", MODES)
def test_hvp_modes_match_torch_func(problem: Problem, mode: str) -> None:
    vec = problem.random_vec()
    product = hvp(problem.loss_function(), problem.params, vec, mode=mode)
    torch.testing.assert_close(flatten(product), problem.reference_hvp(flatten(vec)), **TOL)


def test_hvp_modes_agree(problem: Problem) -> None:
    vec = problem.random_vec(3)
    forward = hvp(problem.loss_function(), problem.params, vec, mode="forward")
    reverse = hvp(problem.loss(), problem.params, vec)
    assert_matches(flatten(forward), flatten(reverse), 1e-12, "forward-over-reverse vs reverse-over-reverse")


@pytest.mark.parametrize("mode", MODES)
def test_hessian_operator_modes_match_torch_func(problem: Problem, mode: str) -> None:
    op = HessianOperator(problem.loss_function(), problem.params, mode=mode)
    columns = torch.randn(problem.n, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(4))
    expected = torch.stack([problem.reference_hvp(column) for column in columns.T], dim=1)
    torch.testing.assert_close(op @ columns, expected, **TOL)
    expected_gradient = grad(problem.reference_loss)(problem.theta())
    torch.testing.assert_close(flatten(op.gradient), expected_gradient, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_ggn_operator_modes_match_torch_func(problem: Problem, mode: str) -> None:
    op = GGNOperator(problem.outputs_function(), problem.params, problem.loss_hessian, mode=mode)
    vec = problem.random_vec(5)
    expected_jvp = jvp(problem.reference_outputs, (problem.theta(),), (flatten(vec),))[1]
    torch.testing.assert_close(op.jvp(vec), expected_jvp, **TOL)
    columns = torch.randn(problem.n, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
    expected = torch.stack([problem.reference_ggn(column) for column in columns.T], dim=1)
    torch.testing.assert_close(op @ columns, expected, **TOL)


def test_ggnvp_modes_agree(problem: Problem) -> None:
    vec = problem.random_vec(7)
    forward = ggnvp(None, problem.outputs_function(), problem.params, vec, problem.loss_hessian, mode="forward")
    reverse = ggnvp(None, problem.outputs(), problem.params, vec, problem.loss_hessian)
    assert_matches(flatten(forward), flatten(reverse), 1e-12, "forward-mode GGN vs double-vjp GGN")


def test_forward_mode_jv_of_an_affine_map_treats_a_frozen_bias_as_constant() -> None:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, dtype=DTYPE, generator=generator, requires_grad=True)
    frozen = torch.randn(4, dtype=DTYPE, generator=generator)
    x = torch.randn(5, 3, dtype=DTYPE, generator=generator)
    vec = [torch.randn(p.shape, dtype=DTYPE, generator=generator) for p in (w, frozen)]
    affine = GGNOperator(lambda values: x @ values[0] + values[1], [w, frozen], MSEHessian(), mode="forward")
    torch.testing.assert_close(affine.jvp(vec), x @ vec[0], **TOL)


def test_forward_mode_hvp_of_a_loss_linear_in_the_params_is_zero() -> None:
    w = torch.randn(4, dtype=DTYPE, requires_grad=True)
    (product,) = hvp(lambda values: (3.0 * values[0]).sum(), [w], [torch.ones(4, dtype=DTYPE)], mode="forward")
    assert product.shape == (4,) and not product.any()


def test_forward_mode_leaves_the_parameters_alone(problem: Problem) -> None:
    before = [p.detach().clone() for p in problem.params]
    hvp(problem.loss_function(), problem.params, problem.random_vec(), mode="forward")
    GGNOperator(problem.outputs_function(), problem.params, problem.loss_hessian, mode="forward") @ problem.random_vec()
    for p, old in zip(problem.params, before):
        assert p.requires_grad and p.is_leaf and p.grad is None
        torch.testing.assert_close(p.detach(), old, rtol=0, atol=0)
    assert not problem.loss().isnan()  # the module still runs on its own parameters


def test_forward_mode_operator_takes_the_loss_and_gradient_from_its_first_product(problem: Problem) -> None:
    """A forward-mode HessianOperator's products are passes whose values are L and its gradient: after the first,
    ``value`` and ``gradient`` are those (no further pass: the loss function runs once per product)."""
    runs = []
    loss_function = problem.loss_function()
    op = HessianOperator(lambda values: runs.append(1) or loss_function(values), problem.params, mode="forward")
    assert op.value is None
    product = op.matvec(problem.random_vec())
    torch.testing.assert_close(flatten(product), problem.reference_hvp(flatten(problem.random_vec())), **TOL)
    torch.testing.assert_close(op.value, problem.loss().detach(), rtol=1e-13, atol=0)
    expected = torch.autograd.grad(problem.loss(), problem.params)
    for got, want in zip(op.gradient, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert got.grad_fn is None
    op.matvec(problem.random_vec(seed=1))
    assert len(runs) == 2 and op.value is not None


@pytest.mark.usefixtures("no_gc")
def test_forward_mode_hvp_keeps_no_graph_alive(problem: Problem) -> None:
    with tracked_saved_tensors() as refs:
        product = hvp(problem.loss_function(), problem.params, problem.random_vec(), mode="forward")
    assert len(refs) > 0, "nothing was saved: the check below would be vacuous"
    assert alive(refs) == 0, "a graph outlived the forward-over-reverse product"
    assert all(h.grad_fn is None for h in product)


@pytest.mark.usefixtures("no_gc")
def test_forward_mode_ggn_jvp_saves_nothing_and_the_operator_holds_only_the_forward_graph(problem: Problem) -> None:
    with tracked_saved_tensors() as refs:
        op = GGNOperator(problem.outputs_function(), problem.params, problem.loss_hessian, mode="forward")
        forward = len(refs)
        op.jvp(problem.random_vec())
        assert len(refs) == forward, "the forward-mode J v saved tensors for a backward"
        op @ problem.random_vec(1)
        assert alive(refs) == forward, "a product left a graph behind"
    assert forward > 0
    del op
    assert alive(refs) == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda p: hvp(p.loss(), p.params, p.random_vec(), mode="sideways"),
        lambda p: HessianOperator(p.loss(), p.params, mode="backward"),
        lambda p: GGNOperator(p.outputs(), p.params, p.loss_hessian, mode="Forward"),
        lambda p: ggnvp(None, p.outputs(), p.params, p.random_vec(), p.loss_hessian, mode=None),
    ],
    ids=["hvp", "HessianOperator", "GGNOperator", "ggnvp"],
)
def test_unknown_mode_is_rejected(mlp: Problem, call) -> None:
    with pytest.raises(ValueError, match="mode must be 'reverse' or 'forward', got"):
        call(mlp)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: hvp(p.loss(), p.params, p.random_vec(), mode="forward"),
        lambda p: HessianOperator(p.loss(), p.params, mode="forward"),
        lambda p: GGNOperator(p.outputs(), p.params, p.loss_hessian, mode="forward"),
    ],
    ids=["hvp", "HessianOperator", "GGNOperator"],
)
def test_forward_mode_refuses_a_computed_tensor(mlp: Problem, call) -> None:
    with pytest.raises(TypeError, match=r"mode='forward'\) needs the (loss|outputs) as a function of the parameter values"):
        call(mlp)


def test_forward_mode_hvp_refuses_reverse_mode_options(mlp: Problem) -> None:
    loss = mlp.loss_function()
    with pytest.raises(ValueError, match="grads and retain_graph are for mode='reverse'"):
        hvp(loss, mlp.params, mlp.random_vec(), grads=[None] * len(mlp.params), mode="forward")
    with pytest.raises(ValueError, match="grads and retain_graph are for mode='reverse'"):
        hvp(loss, mlp.params, mlp.random_vec(), retain_graph=True, mode="forward")


class _NoForwardRule(torch.autograd.Function):
    """``x ** 2`` with a backward but no ``jvp``: an operation without a forward-mode rule."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x**2

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output


def test_forward_mode_explains_an_operation_without_a_forward_rule() -> None:
    w = torch.randn(3, dtype=DTYPE, requires_grad=True)
    vec = [torch.ones(3, dtype=DTYPE)]
    with pytest.raises(NotImplementedError, match="mode='forward' needs a forward-mode derivative") as error:
        hvp(lambda values: _NoForwardRule.apply(values[0]).sum(), [w], vec, mode="forward")
    assert "jvp" in str(error.value.__cause__)  # PyTorch's own message is kept as the cause
    op = GGNOperator(lambda values: _NoForwardRule.apply(values[0]), [w], MSEHessian(), mode="forward")
    with pytest.raises(NotImplementedError, match="Use mode='reverse'"):
        op.jvp(vec)


CHECKPOINT_WITHOUT_FORWARD_RULE = """
import torch


class _NoopSaveInputs(torch.autograd.Function):  # as torch 2.11's checkpoint applies it: no jvp
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


def checkpoint(fn, x):
    return fn(_NoopSaveInputs.apply(x))


def run(fn, x):  # a checkpoint that applies nothing of its own
    return fn(x)
"""


def test_forward_mode_explains_checkpointing_without_a_forward_rule(tmp_path) -> None:
    """torch 2.11's non-reentrant checkpoint applies a Function without a jvp (H200, 2026-12-02): the error names
    checkpointing, and only when the Function is checkpoint's own, not one that the checkpointed code applies."""
    path = tmp_path / "torch" / "utils" / "checkpoint.py"
    path.parent.mkdir(parents=True)
    path.write_text(CHECKPOINT_WITHOUT_FORWARD_RULE)
    spec = importlib.util.spec_from_file_location("old_checkpoint", path)
    old_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old_checkpoint)
    w = torch.randn(3, dtype=DTYPE, requires_grad=True)
    vec = [torch.ones(3, dtype=DTYPE)]
    with pytest.raises(NotImplementedError, match=r"activation checkpointing \(torch.utils.checkpoint\)") as error:
        hvp(lambda values: old_checkpoint.checkpoint(torch.sin, values[0]).sum(), [w], vec, mode="forward")
    assert "jvp" in str(error.value.__cause__)
    with pytest.raises(NotImplementedError, match="mode='forward' needs a forward-mode derivative"):
        hvp(lambda values: old_checkpoint.run(lambda x: _NoForwardRule.apply(x), values[0]).sum(), [w], vec,
            mode="forward")


def test_forward_mode_explains_a_zero_tangent_written_in_place() -> None:
    """torch 2.13's forward-over-reverse through F.mse_loss writes into an immutable zero tangent: the error says
    what to do; the same loss written from simpler ops gives reverse mode's product."""
    torch.manual_seed(0)
    w = torch.randn(3, 2, dtype=DTYPE, requires_grad=True)
    x, y, vec = torch.randn(4, 3, dtype=DTYPE), torch.randn(4, 2, dtype=DTYPE), [torch.randn(3, 2, dtype=DTYPE)]
    try:
        product = hvp(lambda p: F.mse_loss(x @ p[0], y), [w], vec, mode="forward")
    except RuntimeError as error:
        assert "F.mse_loss(o, y) as (o - y).square().mean()" in str(error) and "ZeroTensors" in str(error.__cause__)
    else:  # a torch whose rule no longer does this
        torch.testing.assert_close(product, hvp(F.mse_loss(x @ w, y), [w], vec))
    simple = hvp(lambda p: (x @ p[0] - y).square().mean(), [w], vec, mode="forward")
    torch.testing.assert_close(simple, hvp(F.mse_loss(x @ w, y), [w], vec), rtol=1e-12, atol=1e-14)


def test_ggnvp_with_an_outputs_function_needs_a_loss_hessian(mlp: Problem) -> None:
    with pytest.raises(ValueError, match="or a loss_hessian"):
        ggnvp(mlp.loss(), mlp.outputs_function(), mlp.params, mlp.random_vec(), mode="forward")


def test_functional_keeps_tied_parameters_tied() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(5, 3, dtype=DTYPE)
    head = nn.Linear(3, 5, bias=False, dtype=DTYPE)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    tokens = torch.tensor([0, 3, 4])
    outputs = functional(model, lambda: model(tokens))
    (weight,) = model.parameters()
    other = torch.randn_like(weight)
    torch.testing.assert_close(outputs([other]), other[tokens] @ other.T, rtol=0, atol=0)
    torch.testing.assert_close(model(tokens), weight[tokens] @ weight.T, rtol=0, atol=0)


def test_functional_rejects_tensors_that_are_not_parameters_of_the_module(mlp: Problem) -> None:
    with pytest.raises(ValueError, match=r"params \[1\] are not parameters of the module MLP"):
        functional(mlp.model, mlp.outputs, [mlp.params[0], torch.zeros(3)])
    with pytest.raises(ValueError, match=f"expected {len(mlp.params)} values, one per parameter, got 1"):
        mlp.outputs_function()(mlp.params[:1])


# --- Hutchinson diagonal and trace -----------------------------------------------------------------


@pytest.fixture
def separable() -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """A loss whose Hessian is diagonal, its parameters (one frozen, one unused) and that diagonal."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, dtype=DTYPE, generator=generator, requires_grad=True)
    b = torch.randn(5, dtype=DTYPE, generator=generator, requires_grad=True)
    frozen = torch.randn(3, 4, dtype=DTYPE, generator=generator)
    unused = torch.randn(2, dtype=DTYPE, generator=generator, requires_grad=True)
    weights = torch.rand(3, 4, dtype=DTYPE, generator=generator)
    loss = (weights * a.exp()).sum() + b.pow(4).sum() + (frozen * a).sum()
    diagonal = [weights * a.detach().exp(), 12 * b.detach() ** 2, torch.zeros_like(frozen), torch.zeros_like(unused)]
    return loss, [a, b, frozen, unused], diagonal


def test_rademacher_recovers_a_diagonal_hessian_from_one_sample(separable) -> None:
    loss, params, diagonal = separable
    op = HessianOperator(loss, params)
    estimate = hutchinson_diagonal(op, num_samples=1)
    torch.testing.assert_close(flatten(estimate), flatten(diagonal), **TOL)
    assert trace(op, num_samples=1) == pytest.approx(float(flatten(diagonal).sum()), rel=1e-12)
    gaussian = hutchinson_diagonal(op, num_samples=1, distribution="gaussian")
    assert not torch.allclose(flatten(gaussian), flatten(diagonal))


def test_trace_of_an_indefinite_hessian_keeps_the_signs_of_its_diagonal() -> None:
    """The fixtures' Hessians have positive diagonals, where summing |z * Az| gave the same trace; on a diagonal
    Hessian with negative entries one Rademacher probe gives the signed trace exactly."""
    x = torch.tensor([0.5, -1.0, 2.0, -0.25], dtype=DTYPE, requires_grad=True)
    curvature = torch.tensor([3.0, -2.0, 0.5, -4.0], dtype=DTYPE)
    op = HessianOperator((curvature * x**2).sum() / 2, [x])
    assert trace(op, num_samples=1, generator=torch.Generator().manual_seed(0)) == pytest.approx(-2.5, rel=1e-12)


def test_hutchinson_accepts_a_loss_and_params_pair(separable) -> None:
    loss, params, diagonal = separable
    torch.testing.assert_close(flatten(hutchinson_diagonal((loss, params))), flatten(diagonal), **TOL)


def _sample_variance(matrix: Tensor, distribution: str) -> Tensor:
    """Per-entry variance of z * (A z) for one probe: sum_{j != i} A_ij^2, plus 2 A_ii^2 if Gaussian."""
    off_diagonal = (matrix**2).sum(dim=1) - matrix.diagonal() ** 2
    return off_diagonal + (2 * matrix.diagonal() ** 2 if distribution == "gaussian" else 0)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_hutchinson_diagonal_is_unbiased(mlp: Problem, mlp_hessian: Tensor, distribution: str) -> None:
    samples = 3000
    op = HessianOperator(mlp.loss(), mlp.params)
    generator = torch.Generator().manual_seed(0)
    estimate = flatten(hutchinson_diagonal(op, samples, distribution, generator))
    sigma = (_sample_variance(mlp_hessian, distribution) / samples).sqrt()
    error = (estimate - mlp_hessian.diagonal()).abs()
    assert (error <= 5 * sigma + 1e-12).all(), (error / sigma).max()
    assert (error > 0).any(), "exact on a non-diagonal Hessian: the probes are not random"


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_trace_is_unbiased(mlp: Problem, mlp_hessian: Tensor, distribution: str) -> None:
    samples = 2000
    op = HessianOperator(mlp.loss(), mlp.params)
    estimate = trace(op, samples, distribution, torch.Generator().manual_seed(0))
    diag_sq = (mlp_hessian.diagonal() ** 2).sum()
    variance = 2 * ((mlp_hessian**2).sum() - diag_sq) + (2 * diag_sq if distribution == "gaussian" else 0)
    assert abs(estimate - float(mlp_hessian.trace())) <= 5 * float((variance / samples).sqrt())


def test_rademacher_probes_take_both_signs_evenly() -> None:
    params = [torch.zeros(40, 50, dtype=DTYPE), torch.zeros(1000, dtype=DTYPE)]
    op = DenseOperator(torch.eye(3000, dtype=DTYPE), params)
    estimate = hutchinson_diagonal(op, num_samples=2, generator=torch.Generator().manual_seed(0))
    probes = torch.stack(op.seen)
    assert ((probes == 1) | (probes == -1)).all()
    assert 0.45 < (probes == 1).double().mean() < 0.55
    assert not torch.equal(probes[0], probes[1])
    torch.testing.assert_close(flatten(estimate), torch.ones(3000, dtype=DTYPE))


def test_gaussian_probes_are_standard_normal() -> None:
    op = DenseOperator(torch.eye(4000, dtype=DTYPE), [torch.zeros(4000, dtype=DTYPE)])
    hutchinson_diagonal(op, distribution="gaussian", generator=torch.Generator().manual_seed(0))
    (probe,) = op.seen
    assert abs(float(probe.mean())) < 0.1 and abs(float(probe.std()) - 1) < 0.05
    assert (probe.abs() != 1).all()


def test_probes_follow_the_generator(mlp: Problem) -> None:
    op = HessianOperator(mlp.loss(), mlp.params)
    first, second = (hutchinson_diagonal(op, 2, generator=torch.Generator().manual_seed(7)) for _ in range(2))
    torch.testing.assert_close(flatten(first), flatten(second), rtol=0, atol=0)


def test_unknown_distribution_is_rejected(mlp: Problem) -> None:
    with pytest.raises(ValueError, match="rademacher"):
        hutchinson_diagonal(HessianOperator(mlp.loss(), mlp.params), distribution="uniform")


# --- Power iteration ---------------------------------------------------------------------------------


def _assert_top_eigenpair(eigenvalue: float, vector: tuple[Tensor, ...], matrix: Tensor) -> None:
    eigenvalues = torch.linalg.eigvalsh(matrix)
    top = float(eigenvalues[eigenvalues.abs().argmax()])
    assert eigenvalue == pytest.approx(top, rel=1e-6)
    v = flatten(vector)
    assert float(v.norm()) == pytest.approx(1.0, rel=1e-12)
    assert float((matrix @ v - top * v).norm()) <= 1e-4 * abs(top)


def test_power_iteration_finds_the_top_hessian_eigenpair(mlp: Problem, mlp_hessian: Tensor) -> None:
    op = HessianOperator(mlp.loss(), mlp.params)
    eigenvalue, vector = power_iteration(op, max_iter=1000, tol=1e-6, generator=torch.Generator().manual_seed(0))
    _assert_top_eigenpair(eigenvalue, vector, mlp_hessian)


def test_power_iteration_finds_the_top_ggn_eigenpair(mlp: Problem) -> None:
    op = GGNOperator(mlp.outputs(), mlp.params, mlp.loss_hessian)
    eigenvalue, vector = power_iteration(op, max_iter=1000, tol=1e-6, generator=torch.Generator().manual_seed(0))
    _assert_top_eigenpair(eigenvalue, vector, mlp.dense_ggn())


def test_power_iteration_finds_a_dominant_negative_eigenvalue() -> None:
    generator = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(6, 6, dtype=DTYPE, generator=generator))
    matrix = basis @ torch.diag(torch.tensor([-5.0, 3.0, 2.0, 1.0, 0.5, -0.1], dtype=DTYPE)) @ basis.T
    op = DenseOperator(matrix, [torch.zeros(2, 3, dtype=DTYPE)])
    eigenvalue, vector = power_iteration(op, max_iter=500, tol=1e-8, generator=generator)
    _assert_top_eigenpair(eigenvalue, vector, matrix)
    assert vector[0].shape == (2, 3)


def test_power_iteration_tolerance_is_relative_to_a_small_eigenvalue() -> None:
    """Eigenvalues of order 1e-4 (a Hessian of a small loss): the residual is held to tol times |lambda|, not to
    tol itself, which the random start already met, so that its Rayleigh quotient (a mix of the eigenvalues) came
    back."""
    generator = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(5, 5, dtype=DTYPE, generator=generator))
    matrix = basis @ torch.diag(torch.tensor([4.0, 2.0, 1.0, 0.5, 0.2], dtype=DTYPE) * 1e-4) @ basis.T
    op = DenseOperator(matrix, [torch.zeros(5, dtype=DTYPE)])
    eigenvalue, vector = power_iteration(op, max_iter=500, tol=1e-6, generator=generator)
    _assert_top_eigenpair(eigenvalue, vector, matrix)


def test_power_iteration_stops_at_max_iter() -> None:
    matrix = torch.diag(torch.tensor([2.0, 1.9, 0.1], dtype=DTYPE))
    op = DenseOperator(matrix, [torch.zeros(3, dtype=DTYPE)])
    with pytest.warns(RuntimeWarning, match=r"power_iteration did not converge in 3 products: relative residual"):
        eigenvalue, (vector,) = power_iteration(op, max_iter=3, tol=0.0, generator=torch.Generator().manual_seed(0))
    assert len(op.seen) == 3
    assert eigenvalue == pytest.approx(float(vector @ matrix @ vector), rel=1e-12)


def test_power_iteration_says_when_it_returns_no_eigenvalue() -> None:
    """A saddle's eigenvalues +2 and -2 have one magnitude: the iteration does not converge, and it returned a
    Rayleigh quotient of 1.86 (residual 0.74) as if it were the top eigenvalue; now with a RuntimeWarning."""
    op = DenseOperator(torch.diag(torch.tensor([2.0, -2.0], dtype=DTYPE)), [torch.zeros(2, dtype=DTYPE)])
    with pytest.warns(RuntimeWarning, match="need not be an eigenvalue"):
        power_iteration(op, max_iter=50, generator=torch.Generator().manual_seed(0))


def test_to_scipy_keeps_each_parameters_dtype() -> None:
    """The float64 input was cast to the first parameter's dtype (float32) for every block: 2 + 1e-10 became 2."""
    params = [torch.zeros(1, dtype=torch.float32), torch.zeros(2, dtype=DTYPE)]
    op = DenseOperator(torch.diag(torch.tensor([2.0, 3.0, 3.0], dtype=DTYPE)), params)
    op.matvec = lambda vec: (2 * vec[0], 3 * vec[1])
    got = op.to_scipy().matvec(np.array([1.0, 1.0 + 1e-10, 1.0]))
    np.testing.assert_array_equal(got, np.array([2.0, 3.0 * (1.0 + 1e-10), 3.0]))


# --- SciPy export ------------------------------------------------------------------------------------


def test_to_scipy_matches_the_dense_hessian(mlp: Problem, mlp_hessian: Tensor) -> None:
    from scipy.sparse.linalg import eigsh

    scipy_op = HessianOperator(mlp.loss(), mlp.params).to_scipy()
    assert scipy_op.shape == (mlp.n, mlp.n) and scipy_op.dtype == np.float64
    x = np.random.default_rng(0).standard_normal((mlp.n, 2))
    np.testing.assert_allclose(scipy_op @ x, mlp_hessian.numpy() @ x, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(scipy_op.matvec(x[:, 0]), mlp_hessian.numpy() @ x[:, 0], rtol=1e-9, atol=1e-11)
    (top,) = eigsh(scipy_op, k=1, which="LA", return_eigenvectors=False)
    assert top == pytest.approx(float(torch.linalg.eigvalsh(mlp_hessian)[-1]), rel=1e-8)


@needs_interpreter
def test_products_through_the_triton_kernels_match_naive_attention() -> None:
    """HVP and GGN products of a GQA transformer whose attention runs the Triton kernels (in the
    interpreter) equal those of the same weights with naive attention, in float64."""
    torch.manual_seed(1)
    config = dict(vocab_size=7, n_outputs=7, d_model=8, n_heads=4, n_kv_heads=2, n_layers=1)
    def kernels(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        return flashbob.attention(q, k, v, causal=causal, backend="triton")

    model = Transformer(**config, attention=kernels).double()
    naive = Transformer(**config, attention=flashbob.reference.attention).double()
    naive.load_state_dict(model.state_dict())
    tokens, targets = torch.randint(0, 7, (2, 5)), torch.randint(0, 7, (2, 5))
    vec = [torch.randn_like(p) for p in model.parameters()]

    def products(net: nn.Module) -> Tensor:
        params = list(net.parameters())
        logits = net(tokens)
        hv = hvp(lm_cross_entropy(logits, targets), params, vec, retain_graph=True)
        gv = ggnvp(None, logits, params, vec, CrossEntropyHessian(targets))
        return torch.cat([flatten(hv), flatten(gv)])

    got, want = products(model), products(naive)
    assert want.norm() > 0
    assert ((got - want).norm() / want.norm()).item() < 1e-10


def test_forward_mode_products_refuse_a_model_with_active_dropout() -> None:
    """A forward-mode GGN product runs the model again: with dropout its J v saw another mask than the graph's
    J^T (u.Gv != v.Gu, no error); NewtonCG's CG would see another matrix per product. Both refuse, naming the
    layer; in eval mode, or with rate 0, they run. nn.MultiheadAttention's own dropout counts too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    params = list(model.parameters())
    outputs = functional(model, lambda: model(x))
    vec = [torch.randn_like(p) for p in params]
    with pytest.raises(RuntimeError, match=r"GGNOperator: forward mode runs the model again .* its '2' draws a new"):
        GGNOperator(outputs, params, CrossEntropyHessian(y), mode="forward").matvec(vec)
    with pytest.raises(RuntimeError, match=r"NewtonCG: forward mode runs the model again .* its '2' draws a new"):
        NewtonCG(params, mode="forward", module=model).step(lambda: (F.cross_entropy(model(x), y), model(x)))
    model.eval()
    GGNOperator(outputs, params, CrossEntropyHessian(y), mode="forward").matvec(vec)
    model.train()
    model[2].p = 0.0
    GGNOperator(outputs, params, CrossEntropyHessian(y), mode="forward").matvec(vec)
    attention = nn.MultiheadAttention(4, 2, dropout=0.1)
    assert active_dropout(nn.Sequential(attention)) == "0" and active_dropout(attention.eval()) is None


def test_functional_refuses_a_tied_weight_listed_twice() -> None:
    """Both entries of a tied weight got one name, and functional_call kept only the last value: forward mode
    ignored the first entry's direction (hvp block 0.966 in reverse mode, 0 in forward mode; an asymmetric GGN)."""
    embed = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    with pytest.raises(ValueError, match=r"params 0 and 1 are the same tensor \(a tied weight listed twice\)"):
        functional(model, lambda: model(torch.arange(4)), [embed.weight, head.weight])
    functional(model, lambda: model(torch.arange(4)))  # model.parameters() lists it once


@pytest.mark.parametrize("make", [lambda r: CrossEntropyHessian(torch.zeros(3, dtype=torch.long), r), MSEHessian])
@pytest.mark.parametrize("reduction", ["none", "avg", "Mean"])
def test_loss_hessians_refuse_an_unknown_reduction(make, reduction) -> None:
    """Any reduction but "mean" was taken as "sum": "none" or a typo gave a product R (or R * V) times too large."""
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        make(reduction)


@pytest.mark.parametrize("num_samples", [0, -1, 1.5, True])
def test_hutchinson_and_trace_refuse_a_count_of_probes_below_one(mlp: Problem, num_samples) -> None:
    """num_samples=0 returned NaN (0 / 0) and a negative count zeros (-0.0), without an error."""
    op = HessianOperator(mlp.loss(), mlp.params)
    for estimator in (hutchinson_diagonal, trace):
        with pytest.raises(ValueError, match="num_samples must be a positive integer"):
            estimator(op, num_samples)


@pytest.mark.parametrize("max_iter", [0, -3])
def test_power_iteration_refuses_max_iter_below_one(max_iter) -> None:
    """max_iter=0 ran no product and failed with UnboundLocalError ('eigenvalue')."""
    op = DenseOperator(torch.diag(torch.tensor([2.0, 1.0], dtype=DTYPE)), [torch.zeros(2, dtype=DTYPE)])
    with pytest.raises(ValueError, match="max_iter must be a positive integer"):
        power_iteration(op, max_iter=max_iter)
