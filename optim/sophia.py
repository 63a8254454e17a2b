"""Sophia (Liu et al., 2023): clipped steps preconditioned by an estimate of the Hessian's diagonal, refreshed every
few steps. What :class:`~optim.sophia_h.SophiaH` (Hutchinson's estimate) and :class:`~optim.sophia_g.SophiaG`
(Gauss-Newton-Bartlett's) share: the refresh schedule, the state and the update."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from optim import distributed as _dist
from optim import updates
from optim._closure import Closure, ClosureResult, curvature_rows
from optim._finite import all_finite, apply_if_finite, warn_skipped
from optim._gradients import check_dense, gradients
from optim.hyperparameters import BETAS, COUNT, NON_NEGATIVE, POSITIVE, Rule, check_flag, check_rows
from optim.optimizer import Evaluation, SecondOrderOptimizer, Update

Estimate = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]  # the gradient and the estimate, rank averages


@dataclass
class _Proposal:
    """A Sophia update, computed and not yet written: the parameters in ``order``, their new values, :math:`m`
    and :math:`h` (``refreshed``: the new :math:`h` of the parameters with a fresh estimate), and the estimates
    averaged into each :math:`h`."""

    order: list[Tensor]
    params: list[Tensor]
    m: list[Tensor]
    h: list[Tensor]
    refreshed: list[Tensor]
    refreshes: list[int]


class _Sophia(SecondOrderOptimizer):
    r"""The update shared by :class:`~optim.sophia_h.SophiaH` and :class:`~optim.sophia_g.SophiaG` (Liu et al.,
    2023, Algorithm 3).

    For step :math:`t = 1, 2, \dots` with gradient :math:`g_t` (negated with ``maximize``):

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \\
        h_t &= \beta_2 h_{t-k} + (1 - \beta_2)\, \hat h_t \quad \text{if } t \bmod k = 1,
              \text{ else } h_t = h_{t-1}, \\
        \theta_t &\leftarrow (1 - \eta \lambda)\, \theta_t, \qquad
        \theta_{t+1} = \theta_t - \eta\, \operatorname{clip}\!\big(m_t / \max(\rho\, h_t, \epsilon),\, 1\big),

    with :math:`m_0 = h_0 = 0` and :math:`\operatorname{clip}(z, 1) = \max(\min(z, 1), -1)` element-wise
    (:func:`optim.updates.sophia`). With ``bias_correction`` (not in the paper; off by default) the denominator
    is :math:`\max(\rho\, h_t / (1 - \beta_2^{n_t}), \epsilon)`, :math:`n_t` the estimates averaged into
    :math:`h` so far, as Adam corrects its moments. Where an estimate is negative the step is
    :math:`\eta \operatorname{sign}(m)`. See docs/optimizers.md for the choice of the denominator.
    :attr:`stats` reports ``unclipped_fraction``, the share of coordinates with
    :math:`|m / \max(\rho h, \epsilon)| < 1` (the paper's "win rate"), and ``clip_fraction`` :math:`= 1 -`
    that, ``hessian_refreshed``, ``hessian_rows``, ``loss`` and ``step_skipped``.

    Every hyperparameter may differ between parameter groups, ``update_period`` included: a
    group with period :math:`k` refreshes its :math:`h` at the steps :math:`t` with
    :math:`t \bmod k = 1`. A step on which any group is due computes :math:`\hat h` for all
    parameters (one estimate, as with a single group) and refreshes the groups that are due. A parameter
    without :math:`h` yet (in a group added, or a parameter unfrozen, after the first step) is due on its
    first step whatever its group's schedule.

    A step is skipped with a ``RuntimeWarning`` (parameters and state unchanged,
    ``step_skipped = 1``) when the loss, the gradient or :math:`\hat h` is not finite, or when
    the update would write a non-finite parameter or state value (e.g. a learning rate set to
    NaN by a scheduler; the constructor and ``add_param_group`` reject non-finite
    hyperparameters). With every parameter frozen, or none holding a gradient, a step changes
    nothing and returns the closure's loss. With a closure, a parameter its loss does not reach (on any
    rank) is skipped as one without ``p.grad`` is without a closure and in ``torch.optim``: no update, no
    weight decay, no state, ``p.grad`` set to ``None``. Sparse gradients are refused with an error.
    The loss, gradient, estimate and new values are checked together, after the update is computed and before
    it is written: one host synchronisation on a step without a refresh.

    Data parallel (``distributed``): each rank's closure returns the mean loss over its equal share
    of the batch; the optimizer averages the loss, the gradient and the fresh estimate
    :math:`\hat h` over the ranks (one all-reduce of :math:`n` elements per step, :math:`2n` on
    refresh steps, plus a scalar for the loss), so :math:`m`, :math:`h` and the parameters stay the
    same on every rank. Without a closure, ``p.grad`` is averaged too (redundant, but harmless, if
    a DDP-wrapped model's ``backward`` already did it); a parameter with a ``p.grad`` on some rank only
    counts on every rank, with zeros where it has none (one more all-reduce, of one number per
    parameter tensor).
    """

    _owner = "Sophia"
    _rules: ClassVar[dict[str, Rule]] = {
        "lr": NON_NEGATIVE, "betas": BETAS, "rho": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "eps": POSITIVE,
        "update_period": COUNT,
    }  # fmt: skip
    _checks_at_once = True
    _probes_per_rank = False  # the default generator's draws: alike on every rank, or independent per rank
    _plain_loop = ""  # how a loop without a closure provides the estimate, for the error on its first step

    def __init__(
        self, params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed,
        hessian_batch, bias_correction,
    ) -> None:
        betas = tuple(betas) if isinstance(betas, list) else betas  # a wrong kind is reported by the checks
        check_rows(self._owner, "hessian_batch", hessian_batch)
        check_flag(self._owner, "bias_correction", bias_correction)
        defaults = dict(
            lr=lr, betas=betas, rho=rho, weight_decay=weight_decay, eps=eps, update_period=update_period,
            maximize=maximize, bias_correction=bias_correction,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.group = _dist.resolve(distributed, self._owner)
        if generator is None and self.group is not None:
            device = self.param_groups[0]["params"][0].device
            generator = _dist.shared_generator(device, self.group, per_rank=self._probes_per_rank)
        self.generator = generator
        self.hessian_batch = hessian_batch

    # The shared state (:meth:`_global`): ``step``, the steps taken; ``unreached``, the positions in the
    # optimizer's parameter order (the keys of ``state_dict()["state"]``) of the trainable parameters the last step
    # skipped (its loss did not reach them; without a closure, they held no ``p.grad``); ``update_hessian``,
    # present from a call of ``update_hessian`` to the next step, whether that call refreshed h.

    def _positions(self) -> dict[int, int]:
        """Each parameter's position in the optimizer's parameter order, by ``id``."""
        return {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def _record_unreached(self, unreached: list[Tensor]) -> None:
        """Keep the positions of the parameters this step skipped in the shared state (:meth:`_global`)."""
        positions = self._positions()
        self._global()["unreached"] = sorted(positions[id(p)] for p in unreached)

    def _estimate(self, result: ClosureResult, call: Closure, params: list[Tensor],
                  groups: list[dict[str, Any]]) -> Estimate:  # fmt: skip
        r"""The gradient and the fresh estimate :math:`\hat h` of ``call()``, whose evaluation ``result`` is."""
        raise NotImplementedError

    def _diagonal(self, call: Closure, params: list[Tensor], groups: list[dict[str, Any]]) -> tuple[Tensor, ...]:
        r"""The estimate :math:`\hat h` alone of ``call()`` (the curvature rows)."""
        raise NotImplementedError

    def _estimate_from_grads(self, params: list[Tensor], groups: list[dict[str, Any]]) -> Estimate | None:
        r"""The gradient and :math:`\hat h` from the graph of ``p.grad``, where the subclass can take one; else
        ``None``."""
        return None

    def _initial_stats(self) -> dict[str, float]:
        return dict(loss=math.nan, hessian_refreshed=0.0, hessian_rows=math.nan, unclipped_fraction=math.nan,
                    clip_fraction=math.nan, step_skipped=1.0)  # fmt: skip

    def _differentiate(self, taken: Evaluation) -> None:
        r"""The gradient of ``closure()`` and, on a refresh step, :math:`\hat h`: from the same evaluation, or with
        ``hessian_batch`` from ``closure(rows)``, the first rows of the batch
        (:func:`optim._closure.curvature_rows`)."""
        due = self._due(taken.params, taken.groups)
        closure, rows = taken.closure, None
        if any(due):
            rows, counted = curvature_rows(self._owner, "hessian_batch", self.hessian_batch, taken.result, closure)
            self.stats["hessian_rows"] = counted
            if rows is None:
                self._take_estimate(taken, *self._estimate(taken.result, closure, taken.params, taken.groups), due)
                return
        grads = tuple(g.detach() for g in gradients(taken.result.loss, taken.params))
        check_dense(self._owner, grads)
        grads = _dist.all_average(grads, self.group)
        estimate = None
        if rows is not None:
            estimate = self._diagonal(functools.partial(closure, rows), taken.params, taken.groups)
        self._take_estimate(taken, grads, estimate, due)

    def _differentiate_gradients(self, taken: Evaluation) -> None:
        r"""``p.grad`` (rank averages) and, on a refresh step, :math:`\hat h` from its graph if the subclass can.

        Raises:
            RuntimeError: On the first step nothing provides an estimate, so :math:`h` would stay 0.
        """
        due = self._due(taken.params, taken.groups)
        check_dense(self._owner, (p.grad for p in taken.params))
        if any(due):
            estimated = self._estimate_from_grads(taken.params, taken.groups)
            if estimated is not None:
                self._take_estimate(taken, *estimated, due)
                return
            if self._global().get("step", 0) == 0:
                raise RuntimeError(
                    f"{self._owner}.step() without a closure found no Hessian estimate on its first step, so "
                    f"h would stay 0 and every coordinate be clipped: {self._plain_loop}"
                )
        self._take_estimate(taken, _dist.all_average(tuple(p.grad.detach() for p in taken.params), self.group),
                            None, due)  # fmt: skip

    @staticmethod
    def _take_estimate(taken: Evaluation, grads: tuple[Tensor, ...], estimate: tuple[Tensor, ...] | None,
                       due: list[bool]) -> None:  # fmt: skip
        """Keep the gradient and the estimate of the parameters that are due (``None`` for the others)."""
        taken.grads = grads
        taken.curvature = tuple(e if d and e is not None else None
                                for e, d in zip(estimate or (None,) * len(due), due))  # fmt: skip
        taken.checks = {"curvature (Hessian estimate)": [e for e in taken.curvature if e is not None]}

    def _due(self, params: list[Tensor], groups: list[dict[str, Any]]) -> list[bool]:
        """For each parameter, whether the next step refreshes its :math:`h` (not if :meth:`update_hessian` just did):
        on its group's schedule, or because it has no :math:`h` yet (a group added, or a parameter unfrozen, after
        the first step), so that it does not take clipped sign steps on :math:`h = 0` until its group's next refresh.
        A parameter that the last step skipped (``unreached`` in :meth:`_global`, so still without :math:`h`) is not
        due for that reason: a parameter the loss never reaches would otherwise make every step a refresh step.
        """
        shared = self._global()
        if "update_hessian" in shared:
            return [False] * len(params)
        count = shared.get("step", 0)
        unreached = set(shared.get("unreached", ()))
        positions = self._positions() if unreached else {}
        return [
            count % group["update_period"] == 0
            or ("hessian" not in self.state.get(p, {}) and positions.get(id(p)) not in unreached)
            for p, group in zip(params, groups)
        ]

    @property
    def refreshes_next_step(self) -> bool:
        """Whether the next step refreshes :math:`h` (of any group), taking a curvature estimate through the closure."""
        return any(self._due(*self._trainable()))

    def differentiates_twice(self, rows: bool = False) -> bool:
        """Whether the next step differentiates ``closure()`` (``rows`` false) or ``closure(rows)`` twice: the
        call of a refresh step's estimate, ``closure(rows)`` with ``hessian_batch``, else ``closure()``."""
        return self.refreshes_next_step and rows == (self.hessian_batch is not None)

    def _state(self, params: list[Tensor], key: str) -> list[Tensor]:
        """Each parameter's state ``key``, zeros where it has none yet."""
        zeros = torch.zeros_like
        return [self.state[p][key] if key in self.state[p] else zeros(p, memory_format=torch.preserve_format)
                for p in params]

    def _propose(self, taken: Evaluation) -> Update:
        """Every parameter's new value, :math:`m` and :math:`h` (:func:`optim.updates.sophia`, a few kernel
        launches per parameter group), and the number of coordinates whose step is not clipped; the new values
        are all alive until they are written."""
        members: dict[int, list[int]] = {}
        for i, group in enumerate(taken.groups):
            members.setdefault(id(group), []).append(i)
        proposal = _Proposal([], [], [], [], [], [])
        steps = []
        for indices in members.values():
            group = taken.groups[indices[0]]
            mine, fresh = [taken.params[i] for i in indices], [taken.curvature[i] for i in indices]
            new, m, h, step, refreshes = updates.sophia(
                mine, [taken.grads[i] for i in indices], self._state(mine, "exp_avg"), self._state(mine, "hessian"),
                fresh, [self.state[p].get("hessian_refreshes", 0) for p in mine], lr=group["lr"],
                beta1=group["betas"][0], beta2=group["betas"][1], rho=group["rho"], eps=group["eps"],
                weight_decay=group["weight_decay"], maximize=group["maximize"],
                bias_correction=group["bias_correction"],
            )  # fmt: skip
            for collected, part in ((proposal.order, mine), (proposal.params, new), (proposal.m, m),
                                    (proposal.h, h), (steps, step), (proposal.refreshes, refreshes)):  # fmt: skip
                collected += part
            proposal.refreshed += [hi for hi, e in zip(h, fresh) if e is not None]
        unclipped = torch.cat([step.reshape(-1) for step in steps]).abs_().lt(1).sum()
        return Update([proposal], lambda p: [*p.params, *p.m, *p.refreshed], self._commit, [unclipped])

    def _commit(self, proposal: _Proposal, values: list[Tensor]) -> None:
        torch._foreach_copy_(proposal.order, proposal.params)
        for p, m, h, n in zip(proposal.order, proposal.m, proposal.h, proposal.refreshes):
            self.state[p].update(exp_avg=m, hessian=h, hessian_refreshes=n)

    def _finish(self, taken: Evaluation, scalars: list[float]) -> None:
        shared = self._global()
        shared["step"] = shared.get("step", 0) + 1
        self._record_unreached(taken.unreached)
        fraction = scalars[0] / sum(p.numel() for p in taken.params)
        refreshed = bool(taken.checks["curvature (Hessian estimate)"])
        self.stats.update(
            hessian_refreshed=float(shared.pop("update_hessian", False) or refreshed), unclipped_fraction=fraction,
            clip_fraction=1 - fraction, step_skipped=0.0,
        )  # fmt: skip

    def _without_update(self, taken: Evaluation) -> None:
        super()._without_update(taken)
        self._record_unreached(taken.unreached)

    def _hessian(self, p: Tensor, group: dict[str, Any], estimate: Tensor) -> Tensor:
        r""":math:`\beta_2 h + (1 - \beta_2) \hat h` given an estimate :math:`\hat h` (out of place)."""
        h = self.state[p].get("hessian")
        h = torch.zeros_like(p, memory_format=torch.preserve_format) if h is None else h
        beta2 = group["betas"][1]
        return torch.add(h * beta2, estimate, alpha=1 - beta2)

    def _refresh(self, params: list[Tensor], groups: list[dict[str, Any]], estimate: tuple[Tensor, ...]) -> None:
        r""":math:`h \leftarrow \beta_2 h + (1 - \beta_2) \hat h` for :meth:`update_hessian`."""
        self._global()["update_hessian"] = False
        if not all_finite(estimate):
            warn_skipped(self._owner, "curvature (Hessian estimate)")
            return

        def commit(item: tuple, new: tuple[Tensor]) -> None:
            state = self.state[item[0]]
            state.update(hessian=new[0], hessian_refreshes=state.get("hessian_refreshes", 0) + 1)

        items = list(zip(params, groups, estimate))
        self._global()["update_hessian"] = apply_if_finite(
            self._owner, items, lambda item: (self._hessian(*item),), commit
        )
