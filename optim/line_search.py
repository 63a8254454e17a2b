r"""What a Newton-CG step does with its CG solve (Martens, 2010, sections 4.1 and 4.6): backtracking over the saved
CG iterates, the reduction ratio and the Levenberg-Marquardt damping it sets, and an Armijo line search.

They read the objective at trial points, ``f(alpha, index)``: :math:`f(\theta + \alpha s_i)` for the step
:math:`s_i` of saved iterate ``index`` (``math.inf`` where it is not finite), and the model decreases
``models[i]`` :math:`= q(s_i) - q(0)` of the quadratic model :math:`q`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

ARMIJO_C, ARMIJO_SHRINK, ARMIJO_TRIALS = 1e-2, 0.8, 10  # Martens (2010), section 4.6
DAMPING_DOWN, DAMPING_UP = 2 / 3, 3 / 2  # Levenberg-Marquardt factors (Martens, 2010, section 4.1)

TrialObjective = Callable[[float, int], float]


def backtrack(f: TrialObjective, models: Sequence[float], f0: float, *, accept: bool) -> tuple[int, float]:
    r"""The saved iterate to step to, and :math:`f` there: from the last backwards while :math:`f` falls. With
    ``accept``, it stops at the first iterate whose actual decrease reaches the model decrease of every earlier
    one, :math:`f(\theta + s_i) - f(\theta) \le \min_{j < i} (q(s_j) - q(0))`, without evaluating those."""
    chosen = len(models) - 1
    best = f(1.0, chosen)
    while chosen > 0 and not (accept and best - f0 <= min(models[:chosen])):
        previous = f(1.0, chosen - 1)
        if previous >= best:
            break
        chosen, best = chosen - 1, previous
    return chosen, best


def reduction_ratio(value: float, f0: float, model: float) -> float:
    r""":math:`\rho = (f(\theta + s) - f(\theta)) / (q(s) - q(0))`, the actual decrease over the model's; where
    the model predicts none, 0 if :math:`f` did not rise and :math:`-\infty` if it did."""
    return (value - f0) / model if model < 0 else (0.0 if value <= f0 else -math.inf)


def levenberg_marquardt(damping: float, ratio: float) -> float:
    r"""The damping after a step of reduction ratio :math:`\rho`: :math:`\tfrac32 \lambda` if
    :math:`\rho < \tfrac14`, :math:`\tfrac23 \lambda` if :math:`\rho > \tfrac34`, else :math:`\lambda`."""
    if ratio < 0.25:
        return damping * DAMPING_UP
    if ratio > 0.75:
        return damping * DAMPING_DOWN
    return damping


def armijo(f: Callable[[float], float], value: float, f0: float, slope: float) -> float:
    r"""The step size :math:`\alpha \in \{1, 0.8, 0.8^2, \dots\}` (at most 10 trials), the first with
    :math:`f(\theta + \alpha s) \le f(\theta) + 10^{-2} \alpha\, g^\top s`; 0 if none is, or if :math:`s` is no
    descent direction (``slope`` :math:`= g^\top s \ge 0`, where the test would let :math:`f` rise). ``value`` is
    :math:`f` at :math:`\alpha = 1`, ``f(alpha)`` at the others."""
    if slope >= 0:
        return 0.0
    alpha, trials = 1.0, 1
    while value > f0 + ARMIJO_C * alpha * slope:
        if trials == ARMIJO_TRIALS:
            return 0.0
        alpha *= ARMIJO_SHRINK
        value, trials = f(alpha), trials + 1
    return alpha
