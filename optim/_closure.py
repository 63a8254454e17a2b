"""The closure that the optimizers evaluate: what it may return, and how it is called."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim import compiled
from optim import distributed as _dist
from optim.loss_hessians import CrossEntropyHessian, LossHessian, MSEHessian

Closure = Callable[..., Any]  # called without arguments, or with a slice of rows (NewtonCG's curvature_batch)
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


def evaluate(closure: Closure | None, owner: str, *, graph: bool = True, eager: bool = False) -> ClosureResult:
    """Call ``closure`` under ``torch.enable_grad()`` (or ``torch.no_grad()`` when ``graph`` is false) and parse it;
    with ``eager`` (a graph that will be differentiated twice) ``torch.compile``'d code in it runs its Python code
    (:func:`optim.compiled.eager`).

    Raises:
        RuntimeError: ``closure`` is ``None``, or ``graph`` is true and the loss has no autograd graph.
        TypeError: The closure returned something else than :data:`CLOSURE_CONTRACT` allows.
    """
    require_closure(closure, owner)
    with torch.enable_grad() if graph else torch.no_grad(), compiled.eager() if eager else nullcontext():
        result = parse(closure(), owner)
    if graph:
        check_graph(result, owner)
    return result


def require_closure(closure: Closure | None, owner: str) -> None:
    """Raise ``RuntimeError`` if ``closure`` is ``None``: the step needs one."""
    if closure is None:
        raise RuntimeError(f"{owner}.step needs a closure: opt.step(closure), where {CLOSURE_CONTRACT}")


def check_graph(result: ClosureResult, owner: str) -> None:
    """Raise ``RuntimeError`` if the closure's loss has no autograd graph (its gradient would read as zero)."""
    if not result.loss.requires_grad:
        raise RuntimeError(
            f"{owner}: the closure's loss has no autograd graph; run the forward inside the closure without "
            f"detaching it or calling .item() ({CLOSURE_CONTRACT})"
        )


@contextmanager
def graph_errors(owner: str):
    """Re-raise autograd's 'backward through the graph a second time' naming its likely cause, and PyTorch's errors for
    a ``torch.compile``'d graph differentiated twice naming torch.compile (:func:`optim.compiled.explained`)."""
    try:
        with compiled.explained(owner):
            yield
    except RuntimeError as error:
        if "second time" in str(error):
            raise RuntimeError(f"{owner}: the closure's graph was already freed; {CLOSURE_CONTRACT}") from error
        raise


def curvature_rows(
    owner: str, name: str, size: int | float | None, result: ClosureResult, closure: Callable[..., Any]
) -> tuple[slice | None, float]:
    r"""The rows ``closure(rows)`` evaluates the curvature on (``None``: the whole batch's graph), and how many
    rows the curvature sees (NaN if unknown), for the curvature mini-batch setting ``name`` of size ``size``.

    The batch has :math:`R` rows, the leading dimension of the closure's outputs or targets; a count
    :math:`m` takes the first :math:`m`, a fraction :math:`f` the first :math:`\max(1, \lfloor f R \rfloor)`.

    Raises:
        RuntimeError: ``size`` is a fraction and the closure returned neither outputs nor targets.
        TypeError: ``size`` is set and the closure takes no ``rows`` argument.
    """
    batch = next((t.shape[0] for t in (result.outputs, result.targets) if t is not None and t.dim() > 0), None)
    if size is None:
        return None, math.nan if batch is None else float(batch)
    if isinstance(size, float):
        if batch is None:
            raise RuntimeError(
                f"{owner}({name}={size}) takes the batch's rows from the leading dimension of the closure's "
                "outputs or targets, and the closure returned neither; return them, or give a count of rows"
            )
        size = max(1, math.floor(size * batch))
    try:
        inspect.signature(closure).bind(slice(0, size))
    except TypeError:
        raise TypeError(
            f"{owner}({name}=...) evaluates the curvature on closure(rows), rows a slice of the batch's "
            "leading dimension, but this closure takes no argument: write it as def closure(rows=slice(None)) "
            "and index the batch with rows"
        ) from None
    except ValueError:  # no signature to check (e.g. a builtin): the call will tell
        pass
    return slice(0, size), float(size if batch is None else min(size, batch))


def loss_without_update(closure: Closure | None, owner: str, group: _dist.Group) -> Tensor | None:
    """The closure's loss (rank average) for a step with nothing to update, ``None`` without a closure.

    With every parameter frozen, or none holding a gradient, a step changes nothing and returns
    what the closure returns, as ``torch.optim`` optimizers do; the closure runs without a graph.
    """
    if closure is None:
        return None
    return _dist.average_loss(evaluate(closure, owner, graph=False).loss, group)


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
