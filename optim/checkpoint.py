"""Activation checkpointing that forward mode can differentiate through.

``checkpoint(module, *inputs)`` returns ``module(*inputs)`` and keeps only the inputs (and the module's
parameters, which exist anyway) for the backward, which runs the module again to rebuild what it needs. That
is what ``torch.utils.checkpoint`` does for reverse mode; this one also serves forward-over-reverse products
(``optim.hvp(..., mode="forward")``, forward-mode Gauss-Newton products, ``torch.autograd.forward_ad``):

- forward: with tangents ``ẋ`` (of the inputs) and ``ṗ`` (of the parameters) present, ``y`` and
  ``ẏ = J_x ẋ + J_p ṗ`` are computed in one forward-mode pass without recording a graph, so neither the
  block's activations ``A`` nor their tangents ``Ȧ`` are kept; the output is ``y`` with tangent ``ẏ``;
- backward, given the cotangent ``ȳ`` (and, in forward-over-reverse, its tangent ``ȳ̇``): the block runs
  again from ``(x + εẋ, p + εṗ)`` with a graph, and ``vjp`` of it gives ``x̄, p̄`` and their tangents
  ``x̄̇ = ∂_x(J^T ȳ)·ẋ + ∂_p(J^T ȳ)·ṗ + J^T ȳ̇``, the forward-over-reverse terms of this block. Under
  ``create_graph`` (reverse-over-reverse) the recomputation is recorded, so the gradient stays
  differentiable.

PyTorch's own checkpoint does not serve forward mode: in torch 2.11 it raises (no forward-mode rule), and in
2.13 it keeps the tangents of a checkpointed region's activations (pytorch/pytorch#129293), so a
forward-over-reverse product with it needs ~1.6x the memory of one without. With this one the block's
activations and tangents exist only while that block is recomputed. The cost is one more forward pass per
block (with tangents in forward mode). The random-number state (dropout) and the autocast state of the first
run are restored for each recomputation, so every run computes the same function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import get_device_states, set_device_states


@dataclass
class _Run:
    """How to run the block again as it ran first: the function of (inputs, parameters), and the states of the
    random-number generators and of autocast at the first run."""

    module: nn.Module
    names: list[str]
    n_inputs: int
    device_type: str
    autocast: tuple[bool, torch.dtype]
    cpu_rng: Tensor = field(default_factory=torch.get_rng_state)
    devices: list[int] = field(default_factory=list)
    device_rng: list[Tensor] = field(default_factory=list)
    tangents: list[Tensor | None] | None = None  # of the inputs and parameters, in forward mode
    output: Tensor | None = None  # the first run's output, where it was computed before the Function

    def __call__(self, tensors: list[Tensor]) -> Tensor:
        """The first run, in the caller's random-number and autocast state."""
        params = dict(zip(self.names, tensors[self.n_inputs:]))
        output = functional_call(self.module, params, tuple(tensors[: self.n_inputs]))
        if not isinstance(output, Tensor):
            raise TypeError(f"checkpoint: the module must return one tensor, got {type(output).__name__}")
        return output

    def again(self, tensors: list[Tensor]) -> Tensor:
        """A run that repeats the first: its random numbers and autocast, the caller's generators left as found."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type), \
                torch.autocast(self.device_type, dtype=self.autocast[1], enabled=self.autocast[0]):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            return self(tensors)


class _Recomputed(torch.autograd.Function):
    """The block's output, with a backward that runs the block again (see the module's docstring)."""

    @staticmethod
    def forward(ctx, run: _Run, *tensors: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(*tensors)
        output, run.output = run.output, None
        return run(list(tensors)) if output is None else output

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        run: _Run = ctx.run
        needs = ctx.needs_input_grad[1:]
        create = torch.is_grad_enabled()  # under create_graph the recomputation joins the graph
        with torch.enable_grad():
            tensors = [t if create and need else t.detach().requires_grad_(need)
                       for t, need in zip(ctx.saved_tensors, needs, strict=True)]
            if run.tangents is not None:
                tensors = [t if d is None else fwAD.make_dual(t, d) for t, d in zip(tensors, run.tangents)]
            output = run.again(tensors)
            wrt = [t for t, need in zip(tensors, needs) if need]
            grads = iter(torch.autograd.grad(output, wrt, grad, allow_unused=True, create_graph=create))
        return (None, *(next(grads) if need else None for need in needs))


def checkpoint(module: nn.Module, *inputs: Tensor) -> Tensor:
    """``module(*inputs)`` (one tensor out), keeping only ``inputs`` for the backward, which runs ``module``
    again; differentiable in reverse mode (also twice) and in forward-over-reverse (module docstring)."""
    if not inputs:
        raise TypeError("checkpoint: inputs must hold at least one tensor (the block's input)")
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            raise TypeError(f"checkpoint: inputs[{i}] must be a tensor, got {type(x).__name__}; close over "
                            "other arguments in the module")
    named = list(module.named_parameters())
    tensors = [*inputs, *(p for _, p in named)]
    device_type = inputs[0].device.type
    devices, device_rng = get_device_states(*inputs) if device_type != "cpu" else ([], [])
    run = _Run(module, [name for name, _ in named], len(inputs), device_type,
               (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)),
               devices=devices, device_rng=device_rng)
    unpacked = [fwAD.unpack_dual(t) for t in tensors]
    tangents = [u.tangent for u in unpacked]
    if all(d is None for d in tangents):
        return _Recomputed.apply(run, *tensors)
    with torch.no_grad():  # y and its tangent, nothing recorded
        dual_output = fwAD.unpack_dual(run(tensors))
    run.tangents, run.output = tangents, dual_output.primal
    output = _Recomputed.apply(run, *(u.primal for u in unpacked))
    return output if dual_output.tangent is None else fwAD.make_dual(output, dual_output.tangent)
