"""Second-order optimizers and the curvature products they are built on."""

from optim.adahessian import AdaHessian
from optim.cg import CGResult, cg
from optim.checkpoint import checkpoint
from optim.curvature import (AutogradLossHessian, CrossEntropyHessian, CurvatureOperator, GGNOperator, HessianOperator,
                             LossGraphHessian, LossHessian, MSEHessian, functional, ggnvp, hutchinson_diagonal, hvp,
                             power_iteration, trace)
from optim.newton_cg import NewtonCG
from optim.sophia import SophiaG, SophiaH, gauss_newton_bartlett

__all__ = [
    "AdaHessian",
    "AutogradLossHessian",
    "CGResult",
    "CrossEntropyHessian",
    "CurvatureOperator",
    "GGNOperator",
    "HessianOperator",
    "LossGraphHessian",
    "LossHessian",
    "MSEHessian",
    "NewtonCG",
    "SophiaG",
    "SophiaH",
    "cg",
    "checkpoint",
    "functional",
    "gauss_newton_bartlett",
    "ggnvp",
    "hutchinson_diagonal",
    "hvp",
    "power_iteration",
    "trace",
]
