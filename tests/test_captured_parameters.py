"""Parameters that a closure reaches around its module (refused in forward mode), and parameters that join a Sophia
run after its first step (refreshed on their first step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from optim import MSEHessian, SophiaH, functional, ggnvp, hvp
from tests.models import MLP

DTYPE = torch.float64


def test_sophia_h_forward_mode_refuses_a_closure_that_bypasses_the_module(gen):
    """Forward mode runs the closure with the module's parameters swapped for tangent-carrying copies; a closure
    that captured a parameter tensor would otherwise get a zero gradient and h on refresh steps, silently."""
    x, y = torch.randn(8, 4, generator=gen, dtype=DTYPE), torch.randint(0, 3, (8,), generator=gen)
    layer = nn.Linear(4, 3, dtype=DTYPE)
    weight, bias = layer.weight, layer.bias
    opt = SophiaH(layer.parameters(), mode="forward", module=layer)
    with pytest.raises(RuntimeError, match="uses the parameter tensors themselves"):
        opt.step(lambda: F.cross_entropy(F.linear(x, weight, bias), y))
    assert "step" not in opt.state[weight]
    opt.step(lambda: F.cross_entropy(layer(x), y))  # through the module: accepted
    assert layer.weight.grad.abs().sum() > 0


def test_functional_refuses_a_captured_parameter_in_forward_mode(gen):
    """hvp(mode="forward") of a functional whose fn uses a parameter tensor it captured (not through the module):
    that parameter's block of Hv would be zero; a RuntimeError names it. Through the module it equals reverse mode."""
    x = torch.randn(6, 4, generator=gen, dtype=DTYPE)
    model = MLP([4, 5, 3])
    params = list(model.parameters())
    vec = [torch.randn(p.shape, generator=gen, dtype=DTYPE) for p in params]
    first_weight = model[0].weight
    captured = functional(model, lambda: (torch.tanh(F.linear(x, first_weight, model[0].bias)) @ model[2].weight.T)
                          .square().sum(), params)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"uses the parameter tensors themselves \(0.weight\)"):
        hvp(captured, params, vec, mode="forward")
    outputs = functional(model, lambda: F.linear(torch.tanh(model[0](x)), model[2].weight) + model[2].bias, params)
    captured_outputs = functional(model, lambda: F.linear(torch.tanh(model[0](x)), second_weight) + model[2].bias,
                                  params)  # fmt: skip
    second_weight = model[2].weight
    for lean in (False, True):  # J v in forward mode runs without a graph: the watch sees the tensor itself
        with pytest.raises(RuntimeError, match=r"uses the parameter tensors themselves \(2.weight\)"):
            ggnvp(None, captured_outputs, params, vec, MSEHessian(), mode="forward", lean_tangents=lean)
        captured_outputs = functional(model, lambda: F.linear(torch.tanh(model[0](x)), second_weight), params)
    ggnvp(None, outputs, params, vec, MSEHessian(), mode="forward")
    through = functional(model, lambda: model(x).square().sum(), params)
    expected = hvp(model(x).square().sum(), params, vec)
    for a, b in zip(hvp(through, params, vec, mode="forward"), expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_functional_watches_each_place_that_makes_fn_not_only_the_first(gen):
    """The watch runs once per module and per place in the code that makes fn: after a closure through the module
    was accepted, another closure on the same module that captured a parameter is still refused (keyed by the type
    of fn, every lambda would share the first one's pass and the second's block of Hv would be silently zero)."""
    x = torch.randn(6, 4, generator=gen, dtype=DTYPE)
    model = MLP([4, 5, 3])
    params = list(model.parameters())
    vec = [torch.randn(p.shape, generator=gen, dtype=DTYPE) for p in params]
    hvp(functional(model, lambda: model(x).square().sum(), params), params, vec, mode="forward")
    first_weight = model[0].weight
    captured = functional(model, lambda: (torch.tanh(F.linear(x, first_weight, model[0].bias)) @ model[2].weight.T)
                          .square().sum(), params)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"uses the parameter tensors themselves \(0.weight\)"):
        hvp(captured, params, vec, mode="forward")


@pytest.mark.parametrize("how", ["in_a_list", "as_a_keyword"])
def test_functional_watch_sees_a_captured_parameter_in_a_list_or_a_keyword(gen, how):
    """A captured parameter that reaches a torch function inside a list (torch.cat([w, ...])) or as a keyword
    argument (F.linear(x, weight=w)) is refused like a positional one; unseen, its block of Hv would be zero."""
    x = torch.randn(6, 4, generator=gen, dtype=DTYPE)
    model = MLP([4, 5, 3])
    params = list(model.parameters())
    vec = [torch.randn(p.shape, generator=gen, dtype=DTYPE) for p in params]
    weight = model[0].weight
    if how == "in_a_list":
        fn = lambda: (x @ torch.cat([weight, model[0].weight]).T).square().sum()  # noqa: E731
    else:
        fn = lambda: F.linear(x, weight=weight).square().sum() + model(x).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=r"uses the parameter tensors themselves \(0.weight\)"):
        hvp(functional(model, fn, params), params, vec, mode="forward")


@pytest.mark.parametrize("how", ["add_param_group", "unfreeze"])
def test_sophia_refreshes_a_parameter_without_h_on_its_first_step(gen, how):
    """A group added (or a parameter unfrozen) after the first step gets h = (1 - b2) u * (H u) on its first step,
    not h = 0 (clipped sign steps) until its group's next scheduled refresh; the others keep their schedule."""
    x, y = torch.randn(8, 4, generator=gen, dtype=DTYPE), torch.randint(0, 3, (8,), generator=gen)
    model = MLP([4, 5, 3])
    first, second = list(model[0].parameters()), list(model[2].parameters())
    lr, (b1, b2), rho, wd, eps = 0.05, (0.9, 0.95), 20.0, 0.1, 1e-12
    probes = torch.Generator().manual_seed(1)
    if how == "unfreeze":
        for p in second:
            p.requires_grad_(False)
    opt = SophiaH(first if how == "add_param_group" else model.parameters(), lr=lr, betas=(b1, b2), rho=rho,
                  weight_decay=wd, eps=eps, update_period=10, generator=probes)  # fmt: skip
    closure = lambda: F.cross_entropy(model(x), y)
    for _ in range(3):
        opt.step(closure)
    if how == "add_param_group":
        opt.add_param_group({"params": second})
    else:
        for p in second:
            p.requires_grad_(True)
    params, names = first + second, ["0.weight", "0.bias", "2.weight", "2.bias"]
    values = tuple(p.detach().clone() for p in params)
    reference = torch.Generator().set_state(probes.get_state())
    u = tuple(torch.randn(p.shape, generator=reference, dtype=DTYPE) for p in params)
    loss = lambda *v: F.cross_entropy(functional_call(model, dict(zip(names, v)), (x,)), y)
    g = torch.autograd.functional.jacobian(loss, values)
    hu = torch.autograd.functional.hvp(loss, values, u)[1]
    h_first = [opt.state[p]["hessian"].clone() for p in first]
    opt.step(closure)
    for i in (2, 3):
        h = (1 - b2) * u[i] * hu[i]
        torch.testing.assert_close(opt.state[params[i]]["hessian"], h, rtol=1e-12, atol=1e-15)
        expected = values[i] * (1 - lr * wd) - lr * ((1 - b1) * g[i] / (rho * h).clamp_min(eps)).clamp(-1, 1)
        torch.testing.assert_close(params[i].detach(), expected, rtol=1e-12, atol=1e-15)
        assert opt.state[params[i]]["hessian_refreshes"] == 1
    for p, h in zip(first, h_first):
        assert torch.equal(opt.state[p]["hessian"], h) and opt.state[p]["hessian_refreshes"] == 1
    assert not opt.refreshes_next_step
