"""The checks of the optimizers' settings: each value against its rule, with an error that names it."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass(frozen=True)
class Rule:
    """The values a hyperparameter may take: a finite number (an integer if ``integer``) in an interval.

    With ``size`` the hyperparameter is a sequence of that many such numbers (``betas``).
    """

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    size: int | None = None

    def allows(self, value: Any) -> bool:
        """Whether ``value`` (a number or a one-element tensor) satisfies the rule."""
        if not isinstance(value, (numbers.Real, Tensor)) or (isinstance(value, Tensor) and value.numel() != 1):
            return False
        if self.integer:
            try:
                operator.index(value)
            except TypeError:
                return False
        x = float(value)
        above = x > self.low if self.low_open else x >= self.low
        below = x < self.high if self.high_open else x <= self.high
        return math.isfinite(x) and above and below

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.high == math.inf:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{kind} in {left}{self.low:g}, {self.high:g}{right}"


NON_NEGATIVE = Rule(0.0)
POSITIVE = Rule(0.0, low_open=True)
UNIT_INTERVAL = Rule(0.0, 1.0)
DECAY = Rule(0.0, 1.0, high_open=True)  # an EMA coefficient, [0, 1)
BETAS = Rule(0.0, 1.0, high_open=True, size=2)
COUNT = Rule(1, integer=True)


def check_hyperparameters(owner: str, values: Mapping[str, Any], rules: Mapping[str, Rule]) -> None:
    """Check every hyperparameter in ``values`` that ``rules`` names.

    Raises:
        ValueError: A value breaks its rule (NaN and infinities always do); the message names it.
    """
    for name, rule in rules.items():
        if name not in values:
            continue
        value = values[name]
        if rule.size is None:
            entries = [(name, value)]
        elif isinstance(value, (tuple, list)) and len(value) == rule.size:
            entries = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        else:
            raise ValueError(f"{owner}: invalid {name}: {value!r}; expected {rule.size} numbers, each {rule}")
        for label, v in entries:
            if not rule.allows(v):
                raise ValueError(f"{owner}: invalid {label}: {v!r}; expected {rule}")


def check_flag(owner: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless the setting ``name`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: invalid {name}: {value!r}; expected True or False")


def check_count(name: str, value: object, of: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive integer (any integer type but ``bool``), a count of
    ``of``."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value < 1:
        raise ValueError(f"{name} must be a positive integer ({of}), got {value!r}")


def check_mode(mode: Any, owner: str | None = None) -> None:
    """Raise ``ValueError`` unless ``mode`` is ``"reverse"`` or ``"forward"``; the message starts with ``owner``."""
    if mode not in ("reverse", "forward"):
        raise ValueError(f"{owner + ': ' if owner else ''}mode must be 'reverse' or 'forward', got {mode!r}")


def check_optimizer_mode(owner: str, mode: Any, module: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is ``"reverse"`` or ``"forward"``, and, for ``"forward"``, ``module`` is
    the ``nn.Module`` whose closure a forward-mode product runs again (through :func:`optim.functional`)."""
    check_mode(mode, owner)
    if mode == "forward" and not isinstance(module, nn.Module):
        raise ValueError(
            f"{owner}(mode='forward') needs module=, the nn.Module that holds the parameters: forward mode runs "
            f"the closure again with tangents attached to them (through optim.functional); got {module!r}"
        )


def check_rows(owner: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless the curvature mini-batch setting ``name`` is ``None``, a count >= 1 or a
    fraction in (0, 1)."""
    count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    fraction = isinstance(value, float) and 0 < value < 1
    if value is not None and not (count or fraction):
        raise ValueError(
            f"{owner}: invalid {name}: {value!r}; expected None (every row), a count of rows >= 1 "
            "or a fraction in (0, 1)"
        )
