"""Activation checkpointing that forward mode can differentiate through.

``checkpoint(module, *inputs)`` returns ``module(*inputs)`` and keeps only the inputs (and the module's
parameters, which exist anyway) for the backward, which runs the module again to rebuild what it needs. That
is what ``torch.utils.checkpoint`` does for reverse mode; this one also serves forward-over-reverse products
(``optim.hvp(..., mode="forward")``, forward-mode Gauss-Newton products, ``torch.autograd.forward_ad``):

- forward: with tangents ``ẋ`` (of the inputs) and ``ṗ`` (of the parameters) present, ``y`` and
  ``ẏ = J_x ẋ + J_p ṗ`` are computed in one forward-mode pass whose graph is dropped at the block's end, so
  neither the block's activations ``A`` nor their tangents ``Ȧ`` are kept; the output is ``y`` with tangent
  ``ẏ``. This first run happens under the conditions of the recomputation (grad enabled and, in reverse
  mode, the same tensors requiring grad), so that a module that branches on them (a nested ``checkpoint``
  taken only with grad enabled, a mask that takes another path when it requires grad, a layer's no-grad fast
  path) runs the same operations both times;
- backward, given the cotangent ``ȳ`` (and, in forward-over-reverse, its tangent ``ȳ̇``): the block runs
  again from ``(x + εẋ, p + εṗ)`` with a graph, and ``vjp`` of it gives ``x̄, p̄`` and their tangents
  ``x̄̇ = ∂_x(J^T ȳ)·ẋ + ∂_p(J^T ȳ)·ṗ + J^T ȳ̇``, the forward-over-reverse terms of this block. Under
  ``create_graph`` (reverse-over-reverse) the recomputation is recorded, so the gradient stays
  differentiable.

PyTorch's own checkpoint does not serve forward mode: in torch 2.11 it raises (no forward-mode rule), and in
2.13 it keeps the tangents of a checkpointed region's activations (pytorch/pytorch#129293), so a
forward-over-reverse product with it needs ~1.6x the memory of one without. With this one the block's
activations and tangents exist only while that block is recomputed. The cost is one more forward pass per
block (with tangents in forward mode), less what the caller keeps: with ``kept`` (a :class:`KeptOutputs`, such as
the recipes' kept attention outputs: ``O``, its row statistics and, in forward mode, their tangents, ``O(N·d)``
memory each) the outputs of the block's dear operations are kept from the first run and reused, so the
recomputation runs no ``O(N²·d)`` attention forward (it still runs the attention backward it needs); a
recomputation that calls them differently from the first run (its mode or attention implementation switched in
between) runs once more without them, with a warning. The kept outputs are freed by the backward (unless it
retains the graph).
The random-number state (dropout), the autocast state and the buffers (e.g. batch-norm statistics) of the first
run are restored for each recomputation, so every run computes the same function and the module's state is
updated once. Parameters and buffers are swapped by :func:`optim.swap.swapped`, so a module registered more
than once or shared by two parents, and weights tied across modules, stay as they were. A module whose output
is (a view of) one of its inputs or parameters runs plainly, so that the output stays an alias as without
checkpointing; the caller may modify any output in place. Under ``torch.no_grad`` it is ``module(*inputs)``:
there is no backward to recompute for; under ``torch.func`` transforms too, with a warning (its Function has no
functorch rules).

Refused with an error rather than computed wrong: a module that modifies one of its inputs in place (the
recomputation would start from the modified value), one that uses a tensor requiring grad that is neither an
input nor one of its parameters (a captured tensor: its gradient would be lost; pass it as an input), and
reverse mode through the output's tangent (reverse-over-forward: the tangent is computed without a graph).
As in ``torch.utils.checkpoint``, random numbers drawn from an explicit ``torch.Generator`` are not replayed,
a recomputation follows the module's training mode at the time of the backward, and forward hooks run again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states, set_device_states

from optim import _compat, swap


class KeptOutputs(Protocol):
    """Outputs that a checkpointed block's first run keeps so that its recomputation need not compute them again
    (selective activation checkpointing): the caller of :func:`checkpoint` makes one per call, for the operations it
    knows (the recipes keep flashbob's attention outputs).

    The first run runs inside :meth:`keeping`, each recomputation inside :meth:`reusing`. A recomputation that
    calls a kept operation differently from the first run raises :attr:`diverged` inside :meth:`reusing`; one that
    took fewer kept outputs than were kept is reported by :meth:`mismatch`. Either way the block runs once more,
    computing everything. ``flashbob.KeptAttention`` is one for flashbob's attention.
    """

    #: The exception :meth:`reusing` raises where a recomputation diverges from the first run.
    diverged: type[Exception]

    def keeping(self) -> AbstractContextManager[Any]:
        """The context of the first run: the operations inside keep their outputs here (and only here)."""
        ...

    def reusing(self) -> AbstractContextManager[Any]:
        """The context of a recomputation: the operations inside take the kept outputs, in the order they were
        kept, instead of computing them (or compute them, where a kept output was modified in place since)."""
        ...

    def mismatch(self) -> str | None:
        """After a recomputation: why the outputs it took may not be those it would have computed (it took fewer
        than were kept), or ``None``."""
        ...


@dataclass
class _Run:
    """How to run the block again as it ran first: the function of (inputs, parameters), and the states of the
    random-number generators, of autocast and of the module's buffers at the first run."""

    module: nn.Module
    names: list[str]
    n_inputs: int
    device_type: str
    autocast: tuple[bool, torch.dtype]
    cpu_rng: Tensor = field(default_factory=torch.get_rng_state)
    devices: list[int] = field(default_factory=list)
    device_rng: list[Tensor] = field(default_factory=list)
    buffers: dict[str, Tensor] = field(default_factory=dict)  # the first run's buffers it changed, as they were
    tangents: list[Tensor | None] | None = None  # of the inputs and parameters, in forward mode
    level: Tensor | None = None  # a dual tensor of the forward-mode level of the first run: alive while it is
    output: Tensor | None = None  # the first run's output, until the Function takes it
    kept: KeptOutputs | None = None  # the first run's outputs kept for the recomputations
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext  # what each recomputation runs in

    def __call__(self, tensors: list[Tensor], buffers: dict[str, Tensor] | None = None) -> Tensor:
        params = dict(zip(self.names, tensors[self.n_inputs:]))
        output = swap.call(self.module, {**params, **(buffers or {})}, *tensors[: self.n_inputs])
        if not isinstance(output, Tensor):
            raise TypeError(f"checkpoint: the module must return one tensor, got {type(output).__name__}")
        return output

    def first(self, primals: list[Tensor]) -> tuple[Tensor | None, Tensor | None]:
        """The first run, in the caller's random-number and autocast state, under the conditions of the
        recomputations (grad enabled, the same tangents and, in reverse mode, the same tensors requiring grad), so
        that a module that branches on them calls the same operations (and attention) in both; keeps the buffers
        it changes and the outputs :attr:`kept` keeps. Returns the output and its tangent, detached (the graph
        recorded is dropped), or ``(None, None)``, with the module's buffers and the random-number state as before it
        ran, where the output is (a view of) an input or a parameter. In forward mode no tensor requires grad: a
        graph recorded with tangents would hold itself (saved outputs keep their tangents, whose graph leads back)
        until a backward this run never gets."""
        record = self.tangents is None
        tensors = [t.detach().requires_grad_() if t.requires_grad and record else t.detach() for t in primals]
        # the inputs that require grad as non-leaf copies: a module that changes one in place is refused below,
        # not by autograd's error about leaves
        tensors[: self.n_inputs] = [t.clone() if t.requires_grad else t for t in tensors[: self.n_inputs]]
        versions = [_compat.version(t) for t in tensors]
        if self.tangents is not None:
            tensors = [t if d is None else fwAD.make_dual(t, d) for t, d in zip(tensors, self.tangents)]
        buffers = dict(self.module.named_buffers())
        before = {name: b.clone() for name, b in buffers.items()}
        with torch.enable_grad(), contextlib.nullcontext() if self.kept is None else self.kept.keeping():
            output = fwAD.unpack_dual(self(tensors))
        for i, (t, version) in enumerate(zip(tensors, versions)):
            if _compat.version(fwAD.unpack_dual(t).primal) != version:
                what = f"inputs[{i}]" if i < self.n_inputs else f"parameter {self.names[i - self.n_inputs]!r}"
                raise RuntimeError(f"checkpoint: the module modified {what} in place; the recomputation in the "
                                   "backward would start from the modified value (use out-of-place operations, "
                                   "e.g. inplace=False)")
        # by value: batch norm updates its running statistics inside the kernel, without a new version
        self.buffers = {name: copy for name, copy in before.items() if not torch.equal(buffers[name], copy)}
        if _shares_storage(output.primal, [fwAD.unpack_dual(t).primal for t in (*primals, *tensors)]):
            for name, copy in self.buffers.items():  # undone, for the plain run that follows
                buffers[name].copy_(copy)
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            return None, None
        tangent = output.tangent
        if tangent is not None:  # its own storage, so that the caller may modify the output in place
            tangent = tangent.detach().clone() if _shares_storage(tangent, self.tangents) else tangent.detach()
        return output.primal.detach(), tangent

    def again(self, tensors: list[Tensor]) -> Tensor:
        """A run that repeats the first (:meth:`_repeat`), reusing the kept outputs; where it called a kept
        operation differently from the first run, it runs once more without them."""
        if self.kept is None:
            return self._repeat(tensors, None)
        try:
            output = self._repeat(tensors, self.kept)
            reason = self.kept.mismatch()
            if reason is None:
                return output
        except self.kept.diverged as error:
            reason = str(error)
        warnings.warn(f"checkpoint: the recomputation of a block {reason}; it runs again without them (one more "
                      "forward of the block). A module whose attention differs between the forward and the "
                      "backward (its mode or implementation switched) does this; checkpoint(..., kept=None) avoids "
                      "the extra run", RuntimeWarning, stacklevel=2)
        return self._repeat(tensors, None)

    def _repeat(self, tensors: list[Tensor], kept: KeptOutputs | None) -> Tensor:
        """The block on ``tensors`` with the first run's random numbers, autocast, buffers and ``context``, taking
        the outputs ``kept`` kept (None: computing them); the caller's generators and the module's buffers are left
        as found."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type), \
                torch.autocast(self.device_type, dtype=self.autocast[1], enabled=self.autocast[0]), \
                self.context(), contextlib.nullcontext() if kept is None else kept.reusing():
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            return self(tensors, {name: b.clone() for name, b in self.buffers.items()})

    def in_forward_mode(self) -> bool:
        """Whether the backward runs inside the forward-mode level of the first run (not after it ended)."""
        return self.tangents is not None and fwAD.unpack_dual(self.level).tangent is not None


def _shares_storage(tensor: Tensor, others: list[Tensor | None]) -> bool:
    """Whether ``tensor`` is (a view of) one of ``others``."""
    pointer = tensor.untyped_storage().data_ptr()
    return pointer != 0 and any(t is not None and t.untyped_storage().data_ptr() == pointer for t in others)


def _refuse_captured(output: Tensor, wrt: list[Tensor]) -> None:
    """Raise if ``output``'s graph reaches a tensor requiring grad other than ``wrt`` (and what they came from):
    a tensor the module captured, whose gradient ``autograd.grad(output, wrt)`` would drop."""
    stop = {t.grad_fn for t in wrt if t.grad_fn is not None}
    leaves = {id(t) for t in wrt if t.grad_fn is None}
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in leaves:
            raise RuntimeError(f"checkpoint: the module uses a tensor of shape {tuple(variable.shape)} that requires "
                               "grad but is neither one of its inputs nor one of its parameters; its gradient would "
                               "be lost: pass it to checkpoint as an input")
        todo.extend(next_node for next_node, _ in node.next_functions)


class _NoReverseThroughTangent(torch.autograd.Function):
    """The output's tangent (handed over in a list, so that the Function returns a tensor of its own rather than
    a view of an input, which could not be modified in place), with a backward that refuses reverse-over-forward."""

    @staticmethod
    def forward(ctx, tangent: list[Tensor], *depends_on: Tensor) -> Tensor:
        return tangent.pop()

    @staticmethod
    def backward(ctx, grad: Tensor):
        raise RuntimeError("checkpoint: reverse mode through the tangent of a checkpointed block's output "
                           "(reverse-over-forward) is not supported: the tangent is computed without a graph. Use "
                           "forward-over-reverse (optim.hvp(..., mode='forward')) or no checkpointing")


class _Recomputed(torch.autograd.Function):
    """The block's output (computed by the first run), with a backward that runs the block again (see the
    module's docstring)."""

    @staticmethod
    def forward(ctx, run: _Run, *tensors: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(*tensors)
        output, run.output = run.output, None
        return output

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        run: _Run = ctx.run
        needs = ctx.needs_input_grad[1:]
        # Under create_graph the recomputation joins the graph through an alias of each saved tensor: were it the
        # saved tensor itself, a gradient with respect to one that another was computed from would include the
        # path through the other, which the engine then follows again (shared or tied inputs counted twice).
        create = torch.is_grad_enabled()
        with torch.enable_grad():
            tensors = [t.view_as(t) if create and need else t.detach().requires_grad_(need)
                       for t, need in zip(ctx.saved_tensors, needs, strict=True)]
            if run.in_forward_mode():
                tensors = [t if d is None else fwAD.make_dual(t, d) for t, d in zip(tensors, run.tangents)]
            output = run.again(tensors)
            wrt = [t for t, need in zip(tensors, needs) if need]
            if not output.requires_grad:  # the module's output does not depend on anything requiring grad
                return (None,) * (1 + len(needs))
            _refuse_captured(output, wrt)
            grads = iter(torch.autograd.grad(output, wrt, grad, allow_unused=True, create_graph=create))
        if not _compat.backward_keeps_graph():
            # this backward frees the graph's saved tensors: the kept outputs and the tangents go with them, not
            # when the last reference to the graph does (as torch.utils.checkpoint frees its own)
            run.kept = run.tangents = run.level = None
        return (None, *(next(grads) if need else None for need in needs))


def checkpoint(module: nn.Module, *inputs: Tensor, kept: KeptOutputs | None = None,
               context: Callable[[], AbstractContextManager] | None = None) -> Tensor:
    """``module(*inputs)`` (one tensor out), keeping only ``inputs`` for the backward, which runs ``module``
    again; differentiable in reverse mode (also twice) and in forward-over-reverse (module docstring).

    With ``kept`` (a :class:`KeptOutputs` of this call's own) the outputs it keeps (the recipes keep those of
    flashbob's attention calls: ``O`` and its row statistics, and in forward mode their tangents) are kept too and
    reused by the recomputation, which then skips their forward kernels: ``O(N·d)`` more memory per attention
    call for ``O(N²·d)`` less work.

    ``context``, if given, makes the context manager each recomputation runs in: a state that the first run ran
    in and the backward does not (e.g. the recipes' ``AttentionSwitch.for_curvature``), so that the recomputation
    computes what the first run did (as ``torch.utils.checkpoint``'s ``context_fn``)."""
    if not inputs:
        raise TypeError("checkpoint: inputs must hold at least one tensor (the block's input)")
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            raise TypeError(f"checkpoint: inputs[{i}] must be a tensor, got {type(x).__name__}; close over "
                            "other arguments in the module (a tensor that requires grad must be an input)")
    if not torch.is_grad_enabled():  # no graph, no backward: nothing to keep or recompute
        return module(*inputs)
    if _compat.functorch_transforms_active():
        warnings.warn("checkpoint: under torch.func transforms (grad, vjp, jvp, vmap, hessian) the module runs without "
                      "checkpointing (its activations are kept); use torch.autograd or optim.hvp to checkpoint",
                      RuntimeWarning, stacklevel=2)
        return module(*inputs)
    named = list(module.named_parameters())
    tensors = [*inputs, *(p for _, p in named)]
    device_type = inputs[0].device.type
    devices, device_rng = get_device_states(*inputs) if device_type != "cpu" else ([], [])
    run = _Run(module, [name for name, _ in named], len(inputs), device_type,
               (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)),
               devices=devices, device_rng=device_rng, kept=kept,
               context=context or contextlib.nullcontext)
    unpacked = [fwAD.unpack_dual(t) for t in tensors]
    primals, tangents = [u.primal for u in unpacked], [u.tangent for u in unpacked]
    if any(d is not None for d in tangents):
        run.tangents = tangents
        run.level = fwAD.make_dual(torch.zeros(()), torch.zeros(()))
    run.output, tangent = run.first(primals)
    if run.output is None:  # the output is (a view of) an input: nothing to recompute, and the caller may rely on
        return module(*inputs)  # the alias (an in-place change of the output changes the input)
    output = _Recomputed.apply(run, *primals)
    if tangent is None:
        return output
    differentiable = [t for t in (*primals, *tangents) if t is not None and t.requires_grad]
    if differentiable:
        tangent = _NoReverseThroughTangent.apply([tangent], *differentiable)
    return fwAD.make_dual(output, tangent)
