"""Second-order optimizers and the curvature products they are built on."""

from optim.curvature import (
    AutogradLossHessian,
    CrossEntropyHessian,
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    LossHessian,
    MSEHessian,
    ggnvp,
    hutchinson_diagonal,
    hvp,
    power_iteration,
    trace,
)

__all__ = [
    "AutogradLossHessian",
    "CrossEntropyHessian",
    "CurvatureOperator",
    "GGNOperator",
    "HessianOperator",
    "LossHessian",
    "MSEHessian",
    "ggnvp",
    "hutchinson_diagonal",
    "hvp",
    "power_iteration",
    "trace",
]
