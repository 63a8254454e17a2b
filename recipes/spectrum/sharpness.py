r"""Adam's preconditioned sharpness at a checkpoint, against its edge-of-stability threshold.

Torch's AdamW steps :math:`\theta \leftarrow \theta - \eta\, \hat m / (\sqrt{\hat v} + \epsilon)` with
:math:`\hat m = m / (1 - \beta_1^t)`, :math:`\hat v = v / (1 - \beta_2^t)` and :math:`m` the moving average
:math:`m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t`. Written as :math:`\theta \leftarrow \theta - P^{-1} m` its
preconditioner, the learning rate folded in, is the diagonal

.. math:: P = \frac{1 - \beta_1^t}{\eta} \big(\operatorname{diag}(\sqrt{\hat v}) + \epsilon I\big).

Cohen et al. (2022), "Adaptive gradient methods at the edge of stability": with :math:`P` frozen, on a quadratic
of Hessian :math:`H`, this iteration is stable exactly when every eigenvalue of :math:`P^{-1} H` is below

.. math:: \frac{2 + 2\beta_1}{1 - \beta_1} \quad (38 \text{ for } \beta_1 = 0.9),

and in full-batch training the preconditioned sharpness :math:`\lambda_1(P^{-1} H)` rises to that threshold and
hovers there. (The paper keeps :math:`\eta` out of :math:`P`: its :math:`\lambda_1(P^{-1}H)` is this one over
:math:`\eta`, its threshold :math:`38/\eta`.) Left out: the decoupled weight decay (a shrink by :math:`1 - \eta
\lambda_{wd}` per step) and the gradient clipping of the LM recipe. The learning rate is the one the checkpoint's
optimizer would take at its next step (after the schedule's step), per parameter group.
"""

from __future__ import annotations

import torch
from torch import Tensor

import optim
from optim import CurvatureOperator


def threshold(beta1: float) -> float:
    r"""The stability threshold :math:`(2 + 2\beta_1) / (1 - \beta_1)` of :math:`\lambda_1(P^{-1} H)`."""
    return (2 + 2 * beta1) / (1 - beta1)


def inverse_preconditioner(opt: torch.optim.Optimizer, params: list[Tensor]) -> list[Tensor]:
    r""":math:`P^{-1} = \eta / \big((1 - \beta_1^t)(\sqrt{\hat v} + \epsilon)\big)` for each of ``params`` from the
    state of ``opt`` (an Adam or AdamW; with ``amsgrad`` the running maximum of :math:`v`).

    Raises:
        ValueError: a parameter of ``params`` has no Adam state (a checkpoint before the first step) or is in no
            group of ``opt``.
    """
    groups = {id(p): group for group in opt.param_groups for p in group["params"]}
    inverse = []
    for i, p in enumerate(params):
        state = opt.state.get(p, {})
        if id(p) not in groups or "exp_avg_sq" not in state:
            raise ValueError(f"parameter {i} {tuple(p.shape)} has no Adam state in the checkpoint (written before "
                             "the first step?), so there is no preconditioner")
        group = groups[id(p)]
        (beta1, beta2), eps, lr = group["betas"], group["eps"], float(group["lr"])
        step = float(state["step"])
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        denominator = (1 - beta1**step) * ((v / (1 - beta2**step)).sqrt() + eps)
        inverse.append((lr / denominator).to(p.device, p.dtype))
    return inverse


def preconditioned_sharpness(hessian: CurvatureOperator, opt: torch.optim.Optimizer, *, tol: float,
                             generator: torch.Generator | None = None) -> dict[str, float]:
    r""":math:`\lambda_1(H)`, :math:`\lambda_1(P^{-1} H)` (:class:`optim.PreconditionedOperator`, its largest
    eigenvalue by :func:`optim.eigenpairs`), the threshold, their ratio, and :math:`\eta` and :math:`\beta_1` of the
    first parameter group."""
    group = opt.param_groups[0]
    beta1 = group["betas"][0]
    top = float(optim.eigenpairs(hessian, 1, tol=tol, generator=generator).values[0])
    preconditioned = optim.PreconditionedOperator(hessian, inverse_preconditioner(opt, list(hessian.params)))
    sharpness = float(optim.eigenpairs(preconditioned, 1, tol=tol, generator=generator).values[0])
    edge = threshold(beta1)
    return {"lr": float(group["lr"]), "beta1": beta1, "top_eigenvalue": top, "preconditioned_sharpness": sharpness,
            "threshold": edge, "sharpness_over_threshold": sharpness / edge}
