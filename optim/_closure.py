"""Closure evaluation, gradients and non-finite guards shared by the second-order optimizers."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim.curvature import CrossEntropyHessian, LossHessian, MSEHessian

Closure = Callable[[], Any]
CLOSURE_CONTRACT = (
    "the closure runs the forward pass and returns the loss, a tuple (loss, outputs), or a dict with key "
    "'loss' and optionally 'outputs', 'targets', 'loss_hessian'; it must not call backward()"
)


@dataclass(frozen=True)
class ClosureResult:
    """What a closure returned: the scalar loss and, optionally, model outputs (logits) and per-batch extras."""

    loss: Tensor
    outputs: Tensor | None = None
    targets: Tensor | None = None
    loss_hessian: LossHessian | None = None


def parse(result: Any, owner: str) -> ClosureResult:
    """Check a closure's return value and bring it into :class:`ClosureResult` form."""
    if isinstance(result, Tensor):
        parsed = ClosureResult(result)
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        parsed = ClosureResult(*result)
    elif isinstance(result, dict) and "loss" in result:
        unknown = set(result) - {"loss", "outputs", "targets", "loss_hessian"}
        if unknown:
            raise TypeError(f"{owner}: unknown keys {sorted(unknown)} in the closure's dict; {CLOSURE_CONTRACT}")
        parsed = ClosureResult(**result)
    else:
        raise TypeError(f"{owner}: the closure returned {type(result).__name__}; {CLOSURE_CONTRACT}")
    if not isinstance(parsed.loss, Tensor) or parsed.loss.numel() != 1:
        raise TypeError(f"{owner}: the loss must be a one-element tensor, got {parsed.loss!r:.80}; {CLOSURE_CONTRACT}")
    if parsed.outputs is not None and not isinstance(parsed.outputs, Tensor):
        raise TypeError(f"{owner}: the outputs must be a tensor, got {type(parsed.outputs).__name__}")
    return parsed


def evaluate(closure: Closure | None, owner: str, *, graph: bool = True) -> ClosureResult:
    """Call ``closure`` under ``torch.enable_grad()`` (or ``torch.no_grad()`` when ``graph`` is false) and parse it.

    Raises:
        RuntimeError: ``closure`` is ``None``, or ``graph`` is true and the loss has no autograd graph.
        TypeError: The closure returned something else than :data:`CLOSURE_CONTRACT` allows.
    """
    if closure is None:
        raise RuntimeError(f"{owner}.step needs a closure: opt.step(closure), where {CLOSURE_CONTRACT}")
    with torch.enable_grad() if graph else torch.no_grad():
        result = parse(closure(), owner)
    if graph and not result.loss.requires_grad:
        raise RuntimeError(
            f"{owner}: the closure's loss has no autograd graph; run the forward inside the closure without "
            f"detaching it or calling .item() ({CLOSURE_CONTRACT})"
        )
    return result


@contextmanager
def graph_errors(owner: str):
    """Re-raise autograd's 'backward through the graph a second time' naming its likely cause."""
    try:
        yield
    except RuntimeError as error:
        if "second time" in str(error):
            raise RuntimeError(f"{owner}: the closure's graph was already freed; {CLOSURE_CONTRACT}") from error
        raise


def gradients(
    loss: Tensor, params: Sequence[Tensor], *, retain_graph: bool = False, create_graph: bool = False
) -> tuple[Tensor, ...]:
    """:math:`\\nabla_\\theta L` for every parameter, zeros for those the loss does not depend on."""
    return torch.autograd.grad(
        loss, params, retain_graph=retain_graph, create_graph=create_graph, allow_unused=True, materialize_grads=True
    )


def all_finite(*groups: Iterable[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one host synchronisation)."""
    flags = [torch.isfinite(t).all() for group in groups for t in group]
    return bool(torch.stack(flags).all()) if flags else True


def warn_skipped(owner: str, cause: str) -> None:
    """Warn that a step was skipped because ``cause`` (e.g. 'loss') was not finite."""
    warnings.warn(
        f"{owner}: non-finite {cause}; the step was skipped and the parameters and optimizer state left unchanged",
        RuntimeWarning,
        stacklevel=3,
    )


def store_grads(params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """Set ``p.grad`` to the (detached) gradients, for logging or clipping after the step."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.detach()


def loss_hessian_for(spec: str | LossHessian, result: ClosureResult, ignore_index: int = -100) -> LossHessian:
    """The loss Hessian for this batch: the closure's own if it gave one, else ``spec`` resolved on its outputs.

    ``"cross_entropy"`` is the mean cross-entropy over the rows of the logits (all rows, or those
    whose ``targets`` differ from ``ignore_index`` when the closure returned targets); ``"mse"`` is
    the mean squared error.
    """
    if result.loss_hessian is not None:
        return result.loss_hessian
    if spec == "cross_entropy":
        outputs = result.outputs
        targets = result.targets
        if targets is None:
            targets = torch.zeros(outputs.shape[:-1], dtype=torch.long, device=outputs.device)
        return CrossEntropyHessian(targets, "mean", ignore_index)
    if spec == "mse":
        return MSEHessian("mean")
    if callable(spec):
        return spec
    raise ValueError(f"loss_hessian must be 'cross_entropy', 'mse' or a LossHessian, got {spec!r}")
