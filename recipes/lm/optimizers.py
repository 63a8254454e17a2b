"""Optimizers the LM recipe can use, by name, and one training step.

AdamW gets gradients from ``loss.backward()``. The second-order optimizers (from the :mod:`optim`
package) compute what they need themselves: ``opt.step(closure)`` with a closure that runs the
forward pass and returns ``(loss, logits)`` without calling backward (NewtonCG and SophiaG build a
Gauss-Newton product or estimate from the logits; SophiaH and AdaHessian use the loss alone). The
closure takes an optional ``rows`` slice (NewtonCG's ``curvature_batch`` and Sophia's ``hessian_batch``
evaluate the curvature on ``closure(rows)``), and runs the model with its attention switched to the
twice-differentiable one only when the optimizer will differentiate that call's graph twice (its
``differentiates_twice(rows)``). The other passes run on the model's own attention (torch SDPA with
``model.attention=sdpa``), at the cost of a first-order pass; passes with forward-mode tangents switch by
themselves (:class:`~recipes.common.transformer.AttentionSwitch`).

Data parallel (``torchrun``), AdamW sees gradients that DDP averaged in ``backward``; the
second-order optimizers are built with ``distributed=True`` and average what they compute
themselves, because ``torch.autograd.grad`` bypasses DDP.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import ContextManager

import torch
from torch import nn

import optim
from recipes.common.config import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
#: ``forward(inputs, targets) -> (loss, logits)``
Forward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adahessian": optim.AdaHessian,
    "newtoncg": optim.NewtonCG,
    "sophiah": optim.SophiaH,
    "sophiag": optim.SophiaG,
}
FIRST_ORDER = (torch.optim.AdamW,)  # stepped after loss.backward(); every other optimizer through a closure


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class :data:`OPTIMIZERS` names ``name``, or a ``ValueError`` listing the known names."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name {name!r} is not known; choose one of {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name]


def is_second_order(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether ``cls`` steps through a closure (every optimizer but those of :data:`FIRST_ORDER`)."""
    return not issubclass(cls, FIRST_ORDER)


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict]:
    """Two groups: matrices of linear layers with ``weight_decay``; norms, biases and embeddings without.

    With ``decay_all`` every parameter decays. A tied embedding/head weight counts as an embedding.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if decay_all or (p.dim() >= 2 and id(p) not in embeddings) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, name: str, settings: dict, kwargs: dict, weight_decay: float,
                    decay_all: bool, *, distributed: bool = False) -> torch.optim.Optimizer:
    """Optimizer ``name`` over :func:`param_groups` of ``model``.

    ``settings`` (``lr``, ``betas``, ``eps``) are passed when the constructor takes them, so one
    config serves optimizers with different signatures, and so is ``module=model`` (NewtonCG's
    forward mode runs the model with tangents); ``kwargs`` are passed as given. With
    ``distributed`` (several processes), a second-order optimizer gets ``distributed=True``; one
    that does not take it cannot run data-parallel and raises ``ValueError``.
    """
    cls = optimizer_class(name)
    if "weight_decay" in kwargs:  # the param groups set their own, which override a constructor default
        raise ConfigError("build_optimizer: weight_decay goes in its weight_decay argument (per parameter group), "
                          "not in kwargs, where the groups' own values would override it")
    accepted = inspect.signature(cls).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ConfigError(f"optimizer.kwargs: {name} ({cls.__module__}.{cls.__qualname__}) takes no argument "
                              f"{', '.join(unknown)}; it takes {', '.join(a for a in accepted if a != 'params')}")
    chosen = {key: value for key, value in settings.items() if key in accepted}
    if "module" in accepted:
        chosen["module"] = model
    if distributed and is_second_order(cls):
        if "distributed" not in accepted:
            raise ValueError(f"optimizer {name} ({cls.__module__}.{cls.__qualname__}) takes no `distributed` argument, "
                             "so it cannot average its gradients and curvature over processes; run it in one process")
        chosen["distributed"] = True
    return cls(param_groups(model, weight_decay, decay_all), **chosen, **kwargs)


def optimizer_stats(opt: torch.optim.Optimizer) -> dict[str, float]:
    """The numbers in the optimizer's ``stats`` dict (if it keeps one), as floats, leaving out the NaNs: an
    optimizer writes NaN where a statistic has no value at that step (SophiaH's ``hessian_rows`` on a step
    without a refresh, NewtonCG's ``reduction_ratio`` without a line search), so the logs hold no placeholder."""
    stats = {}
    for key, value in getattr(opt, "stats", {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif isinstance(value, numbers.Real):
            value = float(value)
        else:
            continue
        if not math.isnan(value):
            stats[key] = value
    return stats


def no_switch(on: bool) -> ContextManager:
    """The attention switch of a model that has none: nothing to switch."""
    return contextlib.nullcontext()


def train_step(opt: torch.optim.Optimizer, forward: Forward, micro_batches: Sequence[Batch], grad_clip: float,
               no_sync: Callable[[], ContextManager] | None = None,
               for_curvature: Callable[[bool], ContextManager] = no_switch) -> tuple[float, dict[str, float]]:
    """One optimizer step over ``micro_batches``; returns this process's loss before the step and diagnostics.

    First order: gradients of the micro-batches' mean loss accumulate through ``backward``, are
    clipped to norm ``grad_clip`` (0: not clipped) and ``opt.step()`` applies them; ``no_sync``
    (DDP's) skips gradient averaging on all but the last micro-batch. Second order:
    ``opt.step(closure)`` on the single micro-batch; the returned loss is the closure's first value, read
    after the step (no host synchronisation in the middle of it). Each closure call runs in the grad mode the
    optimizer calls it in (its trial points record no graph) and inside ``for_curvature(on)`` (the model's
    :meth:`~recipes.common.transformer.AttentionSwitch.for_curvature`), ``on`` when the optimizer
    differentiates that call twice: ``opt.differentiates_twice(rows is not None)``, asked before the step (an
    optimizer without that method: every call).
    """
    opt.zero_grad(set_to_none=True)
    if is_second_order(type(opt)):
        (inputs, targets), = micro_batches
        first: list[torch.Tensor] = []
        twice = getattr(opt, "differentiates_twice", lambda rows: True)
        whole_twice, rows_twice = twice(False), twice(True)

        def closure(rows: slice | None = None):
            batch = (inputs, targets) if rows is None else (inputs[rows], targets[rows])
            with for_curvature(whole_twice if rows is None else rows_twice):
                loss, logits = forward(*batch)
            if not first:
                first.append(loss.detach())
            return loss, logits

        opt.step(closure)
        return first[0].item(), optimizer_stats(opt)
    total = 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
            loss, _ = forward(inputs, targets)
            (loss / len(micro_batches)).backward()
        total += loss.item() / len(micro_batches)
    params = [p for group in opt.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    opt.step()
    return total, {"grad_norm": grad_norm.item(), **optimizer_stats(opt)}
