"""The learning-rate schedule of the recipes: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier of step ``step`` (0-based): linear warm-up to 1 over ``warmup_steps``, then cosine
    from 1 (step ``warmup_steps``) to ``min_ratio`` at the last step, ``total_steps - 1``."""
    decay_steps = total_steps - 1 - warmup_steps

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 0.0
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


class LambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's ``LambdaLR`` (same name, so checkpoints of either load into the other) whose :meth:`load_state_dict`
    sets the optimizer's learning rates from this run's schedule at the restored step.

    torch's restores only the step count, so the first step after a resume ran the lr that the checkpoint's optimizer
    state held, from the saved run's schedule, where ``train.steps`` or the warm-up changed. Load the optimizer first.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, base_lr, multiplier in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base_lr * multiplier(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_scheduler(opt: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR | None:
    """:func:`warmup_cosine` as a :class:`LambdaLR`; ``None`` for an optimizer without a learning rate."""
    if not all("lr" in group for group in opt.param_groups):
        return None
    return LambdaLR(opt, warmup_cosine(warmup_steps, total_steps, min_ratio))
