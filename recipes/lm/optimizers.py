"""Optimizers the LM recipe can use, by name, the learning-rate schedule, and one training step.

First-order optimizers get gradients from ``loss.backward()``. Second-order ones (from the
:mod:`optim` package) compute what they need themselves: ``opt.step(closure)`` with a closure
that runs the forward pass and returns the loss (or ``(loss, logits)`` for those that build a
Gauss-Newton estimate or product from the logits) without calling backward. Entries for :mod:`optim` import
lazily, so the recipe runs with ``adamw`` before those classes exist.

Data parallel (``torchrun``), first-order optimizers see gradients that DDP averaged in
``backward``; second-order ones are built with ``distributed=True`` and average what they
compute themselves, because ``torch.autograd.grad`` bypasses DDP.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
#: ``forward(inputs, targets) -> (loss, logits)``
Forward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class OptimizerSpec:
    """Where an optimizer class lives and how a training step drives it."""

    module: str
    cls: str
    second_order: bool
    closure_returns_logits: bool = False

    def load(self) -> type[torch.optim.Optimizer]:
        """The optimizer class; ``NotImplementedError`` if its module does not define it yet."""
        try:
            return getattr(importlib.import_module(self.module), self.cls)
        except ModuleNotFoundError as error:
            if error.name != self.module:
                raise
            raise NotImplementedError(f"{self.module}.{self.cls} not implemented yet") from error
        except AttributeError as error:
            raise NotImplementedError(f"{self.module}.{self.cls} not implemented yet") from error


REGISTRY: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("torch.optim", "AdamW", second_order=False),
    "adahessian": OptimizerSpec("optim", "AdaHessian", second_order=True),
    "newtoncg": OptimizerSpec("optim", "NewtonCG", second_order=True, closure_returns_logits=True),  # GGN
    "sophiah": OptimizerSpec("optim", "SophiaH", second_order=True),
    "sophiag": OptimizerSpec("optim", "SophiaG", second_order=True, closure_returns_logits=True),
}


def spec(name: str) -> OptimizerSpec:
    """The registry entry for ``name``, or a ``ValueError`` listing the known names."""
    if name not in REGISTRY:
        raise ValueError(f"optimizer.name {name!r} is not known; choose one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


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
    config serves optimizers with different signatures; ``kwargs`` are passed as given. With
    ``distributed`` (several processes), a second-order optimizer gets ``distributed=True``; one
    that does not take it cannot run data-parallel and raises ``ValueError``.
    """
    entry = spec(name)
    cls = entry.load()
    accepted = inspect.signature(cls).parameters
    chosen = {key: value for key, value in settings.items() if key in accepted}
    if distributed and entry.second_order:
        if "distributed" not in accepted:
            raise ValueError(f"optimizer {name} ({entry.module}.{entry.cls}) takes no `distributed` argument, so it "
                             "cannot average its gradients and curvature over processes; run it in one process")
        chosen["distributed"] = True
    return cls(param_groups(model, weight_decay, decay_all), **chosen, **kwargs)


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up to 1 over ``warmup_steps``, then cosine to ``min_ratio``."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def build_scheduler(opt: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR | None:
    """:func:`warmup_cosine` as a ``LambdaLR``; ``None`` for an optimizer without a learning rate."""
    if not all("lr" in group for group in opt.param_groups):
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup_steps, total_steps, min_ratio))


def optimizer_stats(opt: torch.optim.Optimizer) -> dict[str, float]:
    """The numbers in the optimizer's ``stats`` dict (if it keeps one), as floats."""
    stats = {}
    for key, value in getattr(opt, "stats", {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            stats[key] = value.item()
        elif isinstance(value, numbers.Real):
            stats[key] = float(value)
    return stats


def train_step(opt: torch.optim.Optimizer, forward: Forward, micro_batches: Sequence[Batch],
               second_order: bool, closure_returns_logits: bool, grad_clip: float,
               no_sync: Callable[[], ContextManager] | None = None) -> tuple[float, dict[str, float]]:
    """One optimizer step over ``micro_batches``; returns this process's loss before the step and diagnostics.

    First order: gradients of the micro-batches' mean loss accumulate through ``backward``, are
    clipped to norm ``grad_clip`` (0: not clipped) and ``opt.step()`` applies them; ``no_sync``
    (DDP's) skips gradient averaging on all but the last micro-batch. Second order:
    ``opt.step(closure)`` on the single micro-batch; the returned loss is the closure's first value.
    """
    opt.zero_grad(set_to_none=True)
    if second_order:
        (inputs, targets), = micro_batches
        first: list[float] = []

        def closure():
            with torch.enable_grad():
                loss, logits = forward(inputs, targets)
            if not first:
                first.append(loss.item())
            return (loss, logits) if closure_returns_logits else loss

        opt.step(closure)
        return first[0], optimizer_stats(opt)
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
