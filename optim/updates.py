r"""The optimizers' arithmetic, as functions of lists of tensors in the manner of torch.optim's functional forms
(``torch.optim.adamw.adamw``). Each computes the new values out of place, so that the optimizer can check that
they are finite before it writes them; the classes hold the state and the hyperparameters and call these."""

from __future__ import annotations

import torch
from torch import Tensor


def sophia(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    hessians: list[Tensor],
    estimates: list[Tensor | None],
    refreshes: list[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    bias_correction: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[int]]:
    r"""One Sophia step of a parameter group (Liu et al., 2023, Algorithm 3):

    .. math::
        m &\leftarrow \beta_1 m + (1 - \beta_1)\, g, \qquad
        h \leftarrow \beta_2 h + (1 - \beta_2)\, \hat h \ \text{where there is an estimate } \hat h, \\
        \theta &\leftarrow (1 - \eta \lambda)\, \theta - \eta\, \operatorname{clip}\!\big(m / \max(\rho\, h, \epsilon),
            \, 1\big),

    with :math:`g` negated if ``maximize`` and, with ``bias_correction``, :math:`\rho h / (1 - \beta_2^{n})` in
    place of :math:`\rho h`, :math:`n` the estimates averaged into :math:`h` (``refreshes``).

    ``torch._foreach`` operations do it in a few kernel launches per group (as torch's AdamW does).

    Returns:
        The new parameters, :math:`m` and :math:`h`, the clipped steps
        :math:`\operatorname{clip}(m / \max(\rho h, \epsilon), 1)` and the refresh counts.
    """
    m = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(m, torch._foreach_neg(grads) if maximize else grads, alpha=1 - beta1)
    h = hessians
    if all(e is not None for e in estimates):
        h = torch._foreach_mul(h, beta2)
        torch._foreach_add_(h, estimates, alpha=1 - beta2)
        refreshes = [n + 1 for n in refreshes]
    elif any(e is not None for e in estimates):  # some parameters of the group have no h yet
        h = [hi if e is None else torch.add(hi * beta2, e, alpha=1 - beta2) for hi, e in zip(h, estimates)]
        refreshes = [n if e is None else n + 1 for n, e in zip(refreshes, estimates)]
    if bias_correction:  # rho h / (1 - beta2^n): h is an average of n estimates, not a shrunk one
        step = torch._foreach_mul(h, [rho / (1 - beta2**n) if n else rho for n in refreshes])
    else:
        step = torch._foreach_mul(h, rho)
    torch._foreach_clamp_min_(step, eps)
    step = torch._foreach_div(m, step)
    torch._foreach_clamp_min_(step, -1.0)
    torch._foreach_clamp_max_(step, 1.0)
    new = torch._foreach_mul(params, 1 - lr * weight_decay)
    torch._foreach_add_(new, step, alpha=-lr)
    return new, m, h, step, refreshes


def adahessian(
    params: list[Tensor],
    grads: list[Tensor],
    diagonals: list[Tensor],
    exp_avgs: list[Tensor],
    exp_hessian_diag_sqs: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    hessian_power: float,
    spatial_average: bool,
    maximize: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    r"""One AdaHessian step (Yao et al., 2021) of each parameter, its step number :math:`t` counted from 1:

    .. math::
        m &\leftarrow \beta_1 m + (1 - \beta_1)\, g, \qquad v \leftarrow \beta_2 v + (1 - \beta_2)\, D \circ D, \\
        \theta &\leftarrow (1 - \eta\lambda)\,\theta
            - \eta\, \frac{m / (1 - \beta_1^t)}{\big(\sqrt{v / (1 - \beta_2^t)}\big)^{k} + \epsilon},

    with :math:`g` negated if ``maximize``, :math:`D` the Hessian diagonal estimate (averaged over the last two
    dimensions of a 4-D parameter with ``spatial_average``) and :math:`k` the ``hessian_power``.

    Returns:
        The new parameters, :math:`m` and :math:`v`.
    """
    new_params, new_exp_avgs, new_sqs = [], [], []
    for p, g, d, m, v, step in zip(params, grads, diagonals, exp_avgs, exp_hessian_diag_sqs, steps, strict=True):
        if spatial_average and d.dim() == 4:
            d = d.mean(dim=(2, 3), keepdim=True).expand_as(d)
        m = torch.add(m * beta1, -g if maximize else g, alpha=1 - beta1)
        v = torch.addcmul(v * beta2, d, d, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (v / bias2).sqrt().pow(hessian_power).add_(eps)
        new_params.append(torch.addcdiv(p * (1 - lr * weight_decay), m, denom, value=-lr / bias1))
        new_exp_avgs.append(m)
        new_sqs.append(v)
    return new_params, new_exp_avgs, new_sqs


def newton_cg(
    params: list[Tensor], directions: list[Tensor], lrs: list[float], weight_decays: list[float], step_size: float
) -> list[Tensor]:
    r"""The Newton-CG step of each parameter: :math:`\theta \leftarrow (1 - \eta\lambda)\,\theta + \alpha \eta x`,
    with :math:`x` the chosen CG iterate, :math:`\alpha` the line search's step size, and the learning rate
    :math:`\eta` and weight decay :math:`\lambda` of the parameter's group."""
    return [torch.add(p * (1 - lr * wd), x, alpha=step_size * lr)
            for p, x, lr, wd in zip(params, directions, lrs, weight_decays, strict=True)]
