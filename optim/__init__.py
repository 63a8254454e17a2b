"""Second-order optimizers and the curvature products they are built on."""

from optim.adahessian import AdaHessian
from optim.cg import CGResult, cg
from optim.checkpoint import KeptOutputs, checkpoint
from optim.diagonal import DiagonalEstimator, gauss_newton_bartlett, hutchinson_diagonal
from optim.functional import functional
from optim.loss_hessians import AutogradLossHessian, CrossEntropyHessian, LossGraphHessian, LossHessian, MSEHessian
from optim.newton_cg import NewtonCG
from optim.operators import CurvatureOperator, GGNOperator, HessianOperator
from optim.preconditioned_operator import PreconditionedOperator
from optim.products import ggnvp, hvp
from optim.sophia_g import SophiaG
from optim.sophia_h import SophiaH
from optim.spectrum import (
    Eigenpairs,
    SpectralDensity,
    eigenpairs,
    hutchpp_trace,
    power_iteration,
    spectral_density,
    trace,
)

__all__ = [
    "AdaHessian",
    "AutogradLossHessian",
    "CGResult",
    "CrossEntropyHessian",
    "CurvatureOperator",
    "DiagonalEstimator",
    "Eigenpairs",
    "GGNOperator",
    "HessianOperator",
    "KeptOutputs",
    "LossGraphHessian",
    "LossHessian",
    "MSEHessian",
    "NewtonCG",
    "PreconditionedOperator",
    "SophiaG",
    "SophiaH",
    "SpectralDensity",
    "cg",
    "checkpoint",
    "eigenpairs",
    "functional",
    "gauss_newton_bartlett",
    "ggnvp",
    "hutchinson_diagonal",
    "hutchpp_trace",
    "hvp",
    "power_iteration",
    "spectral_density",
    "trace",
]
