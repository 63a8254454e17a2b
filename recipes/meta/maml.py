r"""MAML's inner and outer loops on torchopt's differentiable optimizers.

For a task with support loss :math:`\mathcal{L}^s` and query loss :math:`\mathcal{L}^q`, the inner
loop takes ``steps`` differentiable steps from the meta-parameters :math:`\theta` (SGD:
:math:`\theta_{t+1} = \theta_t - \alpha \nabla \mathcal{L}^s(\theta_t)`), and the meta-gradient is

.. math:: \nabla_\theta\, \mathcal{L}^q(\theta_T) = \Big(\prod_{t<T} (I - \alpha \nabla^2 \mathcal{L}^s(\theta_t))\Big)
          \nabla \mathcal{L}^q(\theta_T)

(second order). Its Hessian factors pass through the attention's backward, which is where
flashbob's closed-form backward-over-backward runs. First order drops them: the inner gradients
are detached, so :math:`\partial\theta_T / \partial\theta = I` and the meta-gradient is
:math:`\nabla \mathcal{L}^q(\theta_T)` (FOMAML).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
import torchopt
from torchopt.base import EmptyState, GradientTransformation

from recipes.common.transformer import compute_dtype
from recipes.meta.tasks import Task

Forward = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def stop_gradient() -> GradientTransformation:
    """A gradient transformation that detaches the incoming gradients (chained first: first-order MAML)."""

    def init(params):
        return EmptyState()

    def update(updates, state, *, params=None, inplace=True):
        return tuple(None if g is None else g.detach() for g in updates), state

    return GradientTransformation(init, update)


def inner_optimizer(model: torch.nn.Module, kind: str, lr: float, first_order: bool) -> torchopt.MetaOptimizer:
    """A differentiable optimizer over ``model``'s parameters: ``sgd`` (:class:`torchopt.MetaSGD`) or
    ``adam`` (:class:`torchopt.MetaAdam`); with ``first_order`` its gradients are detached."""
    if kind not in ("sgd", "adam"):
        raise ValueError(f"inner optimizer must be 'sgd' or 'adam', got {kind!r}")
    if not first_order:
        return torchopt.MetaSGD(model, lr=lr) if kind == "sgd" else torchopt.MetaAdam(model, lr=lr)
    rule = torchopt.sgd(lr) if kind == "sgd" else torchopt.adam(lr)
    return torchopt.MetaOptimizer(model, torchopt.chain(stop_gradient(), rule))


def plain_forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, in at least float32."""
    return F.cross_entropy(logits.to(compute_dtype(logits)), labels)


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(-1) == labels).float().mean().item()


def adapt(model: torch.nn.Module, inner: torchopt.MetaOptimizer, task: Task, steps: int,
          forward: Forward = plain_forward) -> None:
    """``steps`` inner-loop steps on the support set; ``model``'s parameters become the adapted ones."""
    for _ in range(steps):
        inner.step(task_loss(forward(model, task.support_x), task.support_y))


def meta_backward(model: torch.nn.Module, inner: torchopt.MetaOptimizer, tasks: Sequence[Task], steps: int,
                  forward: Forward = plain_forward) -> dict[str, float]:
    """Accumulate the meta-gradient of the mean query loss over ``tasks`` into ``model``'s ``.grad``.

    Each task starts from the meta-parameters (``extract_state_dict``), adapts, back-propagates its
    query loss through the inner loop, and restores them (``recover_state_dict``). Returns the
    mean query loss and accuracy after adaptation, and the query accuracy before it.
    """
    totals = {"loss": 0.0, "accuracy": 0.0, "accuracy_before": 0.0}
    for task in tasks:
        net_state = torchopt.extract_state_dict(model, by="reference")
        inner_state = torchopt.extract_state_dict(inner)
        with torch.no_grad():
            totals["accuracy_before"] += accuracy(forward(model, task.query_x), task.query_y)
        adapt(model, inner, task, steps, forward)
        logits = forward(model, task.query_x)
        loss = task_loss(logits, task.query_y)
        (loss / len(tasks)).backward()
        totals["loss"] += loss.item()
        totals["accuracy"] += accuracy(logits.detach(), task.query_y)
        torchopt.recover_state_dict(model, net_state)
        torchopt.recover_state_dict(inner, inner_state)
    return {key: value / len(tasks) for key, value in totals.items()}


def evaluate(model: torch.nn.Module, tasks: Sequence[Task], kind: str, lr: float, steps: int,
             forward: Forward = plain_forward) -> dict[str, float]:
    """Query loss and accuracy of ``tasks`` before and after ``steps`` (first-order) adaptation steps;
    the meta-parameters are left as they were."""
    inner = inner_optimizer(model, kind, lr, first_order=True)
    totals = {"loss_before": 0.0, "accuracy_before": 0.0, "loss": 0.0, "accuracy": 0.0}
    for task in tasks:
        net_state = torchopt.extract_state_dict(model, by="reference")
        inner_state = torchopt.extract_state_dict(inner)
        for suffix, n in (("_before", 0), ("", steps)):
            with torch.enable_grad():
                adapt(model, inner, task, n, forward)
            with torch.no_grad():
                logits = forward(model, task.query_x)
            totals["loss" + suffix] += task_loss(logits, task.query_y).item()
            totals["accuracy" + suffix] += accuracy(logits, task.query_y)
        torchopt.recover_state_dict(model, net_state)
        torchopt.recover_state_dict(inner, inner_state)
    return {key: value / len(tasks) for key, value in totals.items()}
