"""The gradients of a step: which parameters the loss reaches, the gradient itself, and ``p.grad``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from optim import distributed as _dist


def gradients(
    loss: Tensor, params: Sequence[Tensor], *, retain_graph: bool = False, create_graph: bool = False
) -> tuple[Tensor, ...]:
    r""":math:`\nabla_\theta L` for every parameter, zeros for those the loss does not depend on."""
    return torch.autograd.grad(
        loss, params, retain_graph=retain_graph, create_graph=create_graph, allow_unused=True, materialize_grads=True
    )


def select(mask: Sequence[bool], *columns: Sequence[Any]) -> tuple[list[Any], ...]:
    """The entries of each of the aligned ``columns`` where ``mask`` is true, one list per column."""
    return tuple([x for x, keep in zip(column, mask, strict=True) if keep] for column in columns)


def reached(loss: Tensor, params: Sequence[Tensor], group: _dist.Group = None) -> list[bool]:
    """For each parameter, whether ``loss`` depends on it through its autograd graph, i.e. whether
    ``loss.backward()`` would give it a gradient (a parameter it does not reach keeps ``p.grad`` ``None``, and
    ``torch.optim`` optimizers skip it).

    A walk over the nodes of the graph from ``loss`` (no arithmetic and, in one process, no host synchronisation).
    A path through an operation whose backward returns no gradient (``None``) for that input still counts. With
    ``group``, a parameter counts if it is reached on any rank (one all-reduce of ``len(params)`` numbers), so that
    every rank keeps the same parameters and the averages pair the same tensors (a rank that does not reach it
    contributes zeros).
    """
    targets: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        if p.requires_grad:
            targets.setdefault(torch.autograd.graph.get_gradient_edge(p).node, []).append(i)
    mask = [False] * len(params)
    if loss.requires_grad and targets:
        start = torch.autograd.graph.get_gradient_edge(loss).node
        stack, seen, left = [start], {start}, len(targets)
        while stack and left:
            node = stack.pop()
            if node in targets:
                for i in targets[node]:
                    mask[i] = True
                left -= 1
            for following, _ in node.next_functions:
                if following is not None and following not in seen:
                    seen.add(following)
                    stack.append(following)
    return _dist.on_any_rank(mask, params[0].device, group) if params else mask


def check_dense(owner: str, grads: Iterable[Tensor]) -> None:
    """Raise ``RuntimeError`` if a gradient is sparse (e.g. from ``nn.Embedding(sparse=True)``)."""
    if any(g.layout != torch.strided for g in grads):
        raise RuntimeError(
            f"{owner} does not support sparse gradients (from nn.Embedding(sparse=True) or "
            "nn.EmbeddingBag(sparse=True)); build those modules with sparse=False"
        )


def store_grads(params: Sequence[Tensor], grads: Sequence[Tensor], unreached: Iterable[Tensor] = ()) -> None:
    """Set ``p.grad`` to the (detached) gradients, for logging or clipping after the step, and to ``None`` for the
    ``unreached`` parameters (those the loss does not reach, as after ``zero_grad(); loss.backward()``)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.detach()
    for p in unreached:
        p.grad = None

