"""Sophia (Liu et al., 2023): clipped steps preconditioned by a Hutchinson or Gauss-Newton-Bartlett Hessian diagonal."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from optim import _closure
from optim import distributed as _dist
from optim.curvature import (
    DEFAULT_CHUNK_ELEMENTS,
    CurvatureOperator,
    Distribution,
    HessianOperator,
    Mode,
    _vjp,
    functional,
    hutchinson_diagonal,
    logit_rows,
    row_chunks,
)


@dataclass
class _Update:
    """A Sophia update, computed and not yet written: the parameters in ``order``, their new values, :math:`m`
    and :math:`h` (``refreshed``: the new :math:`h` of the groups that refreshed it), and the number of
    coordinates whose step was not clipped (a tensor)."""

    order: list[Tensor]
    params: list[Tensor]
    m: list[Tensor]
    h: list[Tensor]
    refreshed: list[Tensor]
    unclipped: Tensor | None
    refreshes: list[int] = field(default_factory=list)  # per parameter: estimates averaged into h so far


class _Sophia(_closure.SecondOrderOptimizer):
    r"""The update shared by :class:`SophiaH` and :class:`SophiaG` (Liu et al., 2023, Algorithm 3).

    For step :math:`t = 1, 2, \dots` with gradient :math:`g_t` (negated with ``maximize``):

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \\
        h_t &= \beta_2 h_{t-k} + (1 - \beta_2)\, \hat h_t \quad \text{if } t \bmod k = 1,
              \text{ else } h_t = h_{t-1}, \\
        \theta_t &\leftarrow (1 - \eta \lambda)\, \theta_t, \qquad
        \theta_{t+1} = \theta_t - \eta\, \operatorname{clip}\!\big(m_t / \max(\rho\, h_t, \epsilon),\, 1\big),

    with :math:`m_0 = h_0 = 0` and :math:`\operatorname{clip}(z, 1) = \max(\min(z, 1), -1)`
    element-wise. With ``bias_correction`` (not in the paper; off by default) the denominator is
    :math:`\max(\rho\, h_t / (1 - \beta_2^{n_t}), \epsilon)`, :math:`n_t` the estimates averaged into :math:`h`
    so far: the EMA started at 0 is then an average of them rather than :math:`(1 - \beta_2^{n_t})` times one, as
    Adam corrects its moments. Without it, in a run of a few hundred refreshes (at :math:`\beta_2 = 0.99`: 0.10 of
    the estimate after 10, 0.63 after 100) most steps start clipped, i.e. sign steps of size :math:`\eta`. This
    is the paper's form with :math:`\gamma = \rho`; the released PyTorch code
    writes the denominator as :math:`\rho \cdot \text{bs} \cdot h + \epsilon` with :math:`h` an EMA
    of :math:`\hat g \circ \hat g` and ``bs`` the tokens per batch, which equals ours for
    SophiaG because our :math:`\hat h` already carries the factor :math:`B` (so no batch size need be
    passed to :meth:`step`). The :math:`\max` (not :math:`+\epsilon`) keeps the update pointing
    along :math:`m` where a Hutchinson estimate is negative: there the step is
    :math:`\eta \operatorname{sign}(m)`. :attr:`stats` reports ``unclipped_fraction``, the share
    of coordinates with :math:`|m / \max(\rho h, \epsilon)| < 1` (the paper's "win rate"), and
    ``clip_fraction`` :math:`= 1 -` that, ``hessian_refreshed``, ``loss`` and ``step_skipped``.

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
    _rules: ClassVar[dict[str, _closure.Rule]] = {
        "lr": _closure.NON_NEGATIVE, "betas": _closure.BETAS, "rho": _closure.NON_NEGATIVE,
        "weight_decay": _closure.NON_NEGATIVE, "eps": _closure.POSITIVE, "update_period": _closure.COUNT,
    }  # fmt: skip
    _probes_per_rank = False  # the default generator's draws: alike on every rank, or independent per rank
    _plain_loop = ""  # how a loop without a closure provides the estimate, for the error on its first step

    def __init__(
        self, params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed,
        hessian_batch, bias_correction,
    ) -> None:
        betas = tuple(betas) if isinstance(betas, list) else betas  # a wrong kind is reported by the checks
        _closure.check_rows(self._owner, "hessian_batch", hessian_batch)
        if not isinstance(bias_correction, bool):
            raise ValueError(f"{self._owner}: invalid bias_correction: {bias_correction!r}; expected True or False")
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

    def _global(self) -> dict[str, Any]:
        """State shared by all parameters, kept (as in ``torch.optim.LBFGS``) in the first parameter's state, so that
        ``state_dict`` carries it: ``step``, the steps taken; ``unreached``, the positions in the optimizer's parameter
        order (the keys of ``state_dict()["state"]``) of the trainable parameters the last step skipped (its loss did
        not reach them; without a closure, they held no ``p.grad``); ``update_hessian``, present from a call of
        :meth:`update_hessian` to the next step, whether that call refreshed :math:`h`."""
        return self.state[self.param_groups[0]["params"][0]]

    def _positions(self) -> dict[int, int]:
        """Each parameter's position in the optimizer's parameter order, by ``id``."""
        return {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def _record_unreached(self, unreached: list[Tensor]) -> None:
        """Keep the positions of the parameters this step skipped in the shared state (:meth:`_global`)."""
        positions = self._positions()
        self._global()["unreached"] = sorted(positions[id(p)] for p in unreached)

    def _estimate(
        self, result: _closure.ClosureResult, call: _closure.Closure, params: list[Tensor],
        groups: list[dict[str, Any]],
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Gradient and fresh diagonal estimate :math:`\\hat h` of ``call()``, whose evaluation ``result`` is, averaged
        over the ranks."""
        raise NotImplementedError

    def _diagonal(
        self, call: _closure.Closure, params: list[Tensor], groups: list[dict[str, Any]]
    ) -> tuple[Tensor, ...]:
        """The estimate :math:`\\hat h` alone of ``call()`` (the curvature rows), averaged over the ranks."""
        raise NotImplementedError

    def _estimate_from_grads(
        self, params: list[Tensor], groups: list[dict[str, Any]]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None:
        """Gradient and :math:`\\hat h` from the graph of ``p.grad``, where the subclass can take one; else ``None``."""
        return None

    @torch.no_grad()
    def step(self, closure: _closure.Closure | None = None) -> Tensor | None:  # type: ignore[override]
        """One Sophia step; returns the closure's loss (``None`` without a closure).

        With a closure (which runs the forward and returns what the subclass needs, without
        calling backward) the optimizer takes the gradient itself (parameters the loss does not reach
        are skipped), and every ``update_period``-th step (the first included) refreshes :math:`h`:
        from the same forward, or with ``hessian_batch`` from ``closure(rows)``, the first rows of the
        batch. Without one it uses
        ``p.grad`` from the caller's ``loss.backward()`` (parameters without a gradient are
        skipped) and the estimate from the last :meth:`update_hessian` (SophiaH also takes it
        from the graph of ``p.grad`` after ``loss.backward(create_graph=True)``).

        The loss, gradient, estimate and new values are checked for finiteness together, after the
        update is computed and before it is written: one host synchronisation on a step without a refresh.
        """
        params, groups = self._trainable()
        unreached = []
        if closure is None:
            trainable = params
            params, groups = self._with_grad(params, groups)
            kept = {id(p) for p in params}
            unreached = [p for p in trainable if id(p) not in kept]
        self.stats = dict(loss=float("nan"), hessian_refreshed=0.0, hessian_rows=float("nan"),
                          unclipped_fraction=float("nan"), clip_fraction=float("nan"), step_skipped=1.0)  # fmt: skip
        if not params:
            return self._step_without_update(closure)
        count = self._global().get("step", 0)
        loss, estimate = None, None
        if closure is not None:
            loss, params, groups, unreached, due, grads, estimate = self._closure_step(closure, params, groups)
            if not params:  # the loss reaches no parameter: nothing to update
                _closure.store_grads((), (), unreached)
                self._record_unreached(unreached)
                self.stats.update(loss=float(loss), step_skipped=0.0)
                return loss
        else:
            due = self._due(params, groups)
            grads, estimate = self._grads_without_closure(params, groups, any(due), first=count == 0)
        estimate = tuple(e if d and e is not None else None for e, d in zip(estimate or (None,) * len(params), due))
        update = self._propose_all(params, groups, grads, estimate)
        fresh = [e for e in estimate if e is not None]
        checks = {"loss": [] if loss is None else [loss], "gradient": grads, "curvature (Hessian estimate)": fresh,
                  "update (a new parameter or state value)": [*update.params, *update.m, *update.refreshed]}
        flags = [_closure.finite_flag(tensors).double() for tensors in checks.values() if tensors]
        loss_value, *finite, unclipped = torch.stack(
            [loss.double().reshape(()) if loss is not None else grads[0].new_tensor(math.nan, dtype=torch.float64),
             *flags, update.unclipped.double()]
        ).tolist()  # the step's one host synchronisation, unless its estimate needed more
        self.stats["loss"] = loss_value
        failed = iter(cause for cause, ok in zip((c for c, t in checks.items() if t), finite) if not ok)
        cause = next(failed, None)
        if cause != "loss":
            _closure.store_grads(params, grads, unreached)
        if cause is not None:
            _closure.warn_skipped(self._owner, cause)
            return loss
        torch._foreach_copy_(update.order, update.params)
        for p, m, h, n in zip(update.order, update.m, update.h, update.refreshes):
            self.state[p].update(exp_avg=m, hessian=h, hessian_refreshes=n)
        shared = self._global()
        shared["step"] = count + 1
        self._record_unreached(unreached)
        fraction = unclipped / sum(p.numel() for p in params)
        self.stats.update(
            hessian_refreshed=float(shared.pop("update_hessian", False) or bool(fresh)), unclipped_fraction=fraction,
            clip_fraction=1 - fraction, step_skipped=0.0,
        )  # fmt: skip
        return loss

    def _closure_step(
        self, closure: _closure.Closure, params: list[Tensor], groups: list[dict[str, Any]], refresh: bool = True
    ) -> tuple[Tensor, list[Tensor], list[dict[str, Any]], list[Tensor], list[bool], tuple[Tensor, ...],
               tuple[Tensor, ...] | None]:  # fmt: skip
        """The loss of ``closure()`` (rank average); the parameters it reaches (on any rank), their groups, the
        parameters it does not reach (skipped, as ``torch.optim`` skips one without a gradient), and for the
        reached ones whether each is due (none unless ``refresh``), the gradient and, on a refresh step,
        :math:`\\hat h`; rank averages."""
        result = _closure.evaluate(closure, self._owner, eager=self.differentiates_twice())
        loss = _dist.average_loss(result.loss.detach(), self.group)
        params, groups, unreached = self._reached(result.loss, params, groups)
        due = self._due(params, groups) if refresh else [False] * len(params)
        if not params:
            return loss, params, groups, unreached, due, (), None
        with torch.enable_grad(), _closure.graph_errors(self._owner):
            grads, estimate = self._gradient_and_estimate(closure, result, params, groups, any(due))
        return loss, params, groups, unreached, due, grads, estimate

    def _gradient_and_estimate(
        self, closure: _closure.Closure, result: _closure.ClosureResult, params: list[Tensor],
        groups: list[dict[str, Any]], refresh: bool,
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...] | None]:
        """The gradient of ``closure()`` and, on a refresh step, :math:`\\hat h`: from the same evaluation, or with
        ``hessian_batch`` from ``closure(rows)`` (:func:`optim._closure.curvature_rows`); rank averages."""
        rows = None
        if refresh:
            rows, counted = _closure.curvature_rows(self._owner, "hessian_batch", self.hessian_batch, result, closure)
            self.stats["hessian_rows"] = counted
            if rows is None:
                return self._estimate(result, closure, params, groups)
        grads = tuple(g.detach() for g in _closure.gradients(result.loss, params))
        _closure.check_dense(self._owner, grads)
        grads = _dist.all_average(grads, self.group)
        if rows is None:
            return grads, None
        return grads, self._diagonal(functools.partial(closure, rows), params, groups)

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

    def _grads_without_closure(
        self, params: list[Tensor], groups: list[dict[str, Any]], refresh: bool, first: bool
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...] | None]:
        """``p.grad`` (rank averages) and, on a refresh step, :math:`\\hat h` from its graph if the subclass can.

        Raises:
            RuntimeError: On the first step nothing provides an estimate, so :math:`h` would stay 0.
        """
        _closure.check_dense(self._owner, (p.grad for p in params))
        if refresh:
            with torch.enable_grad(), _closure.graph_errors(self._owner):
                taken = self._estimate_from_grads(params, groups)
            if taken is not None:
                return taken
            if first:
                raise RuntimeError(
                    f"{self._owner}.step() without a closure found no Hessian estimate on its first step, so "
                    f"h would stay 0 and every coordinate be clipped: {self._plain_loop}"
                )
        return _dist.all_average(tuple(p.grad.detach() for p in params), self.group), None

    def _hessian(self, p: Tensor, group: dict[str, Any], estimate: Tensor | None) -> Tensor:
        r""":math:`h`, or :math:`\beta_2 h + (1 - \beta_2) \hat h` given an estimate :math:`\hat h` (out of place)."""
        h = self.state[p].get("hessian")
        h = torch.zeros_like(p, memory_format=torch.preserve_format) if h is None else h
        if estimate is None:
            return h
        beta2 = group["betas"][1]
        return torch.add(h * beta2, estimate, alpha=1 - beta2)

    def _state(self, params: list[Tensor], key: str) -> list[Tensor]:
        """Each parameter's state ``key``, zeros where it has none yet."""
        zeros = torch.zeros_like
        return [self.state[p][key] if key in self.state[p] else zeros(p, memory_format=torch.preserve_format)
                for p in params]

    def _propose_all(
        self, params: list[Tensor], groups: list[dict[str, Any]], grads: tuple[Tensor, ...],
        estimate: tuple[Tensor | None, ...],
    ) -> _Update:
        """Every parameter's new value, :math:`m` and :math:`h`, computed out of place (nothing is written).

        ``torch._foreach`` ops do it in a few kernel launches per parameter group (as in torch's AdamW)
        rather than about a dozen per parameter, so that a step without a refresh costs about an AdamW
        step; the new values are all alive until they are written.
        """
        members: dict[int, list[int]] = {}
        for i, group in enumerate(groups):
            members.setdefault(id(group), []).append(i)
        update = _Update([], [], [], [], [], None)
        steps = []
        for indices in members.values():
            mine, fresh = [params[i] for i in indices], [estimate[i] for i in indices]
            new, m, h, step, refreshes = self._propose(groups[indices[0]], mine, [grads[i] for i in indices], fresh)
            for collected, part in ((update.order, mine), (update.params, new), (update.m, m), (update.h, h),
                                    (steps, step), (update.refreshes, refreshes)):  # fmt: skip
                collected += part
            update.refreshed += [hi for hi, e in zip(h, fresh) if e is not None]
        update.unclipped = torch.cat([step.reshape(-1) for step in steps]).abs_().lt(1).sum()
        return update

    def _propose(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], estimate: list[Tensor | None]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[int]]:
        """One group's new parameters, :math:`m`, :math:`h` (refreshed where due, i.e. where there is an estimate),
        clipped steps and refresh counts, out of place."""
        beta1, beta2 = group["betas"]
        m = torch._foreach_mul(self._state(params, "exp_avg"), beta1)
        torch._foreach_add_(m, torch._foreach_neg(grads) if group["maximize"] else grads, alpha=1 - beta1)
        h = self._state(params, "hessian")
        refreshes = [self.state[p].get("hessian_refreshes", 0) for p in params]
        if all(e is not None for e in estimate):
            h = torch._foreach_mul(h, beta2)
            torch._foreach_add_(h, estimate, alpha=1 - beta2)
            refreshes = [n + 1 for n in refreshes]
        elif any(e is not None for e in estimate):  # some parameters of the group have no h yet (see _due)
            h = [hi if e is None else torch.add(hi * beta2, e, alpha=1 - beta2) for hi, e in zip(h, estimate)]
            refreshes = [n if e is None else n + 1 for n, e in zip(refreshes, estimate)]
        if group["bias_correction"]:  # rho h / (1 - beta2^n): h is an average of n estimates, not a shrunk one
            step = torch._foreach_mul(h, [group["rho"] / (1 - beta2**n) if n else group["rho"] for n in refreshes])
        else:
            step = torch._foreach_mul(h, group["rho"])
        torch._foreach_clamp_min_(step, group["eps"])
        step = torch._foreach_div(m, step)
        torch._foreach_clamp_min_(step, -1.0)
        torch._foreach_clamp_max_(step, 1.0)
        new = torch._foreach_mul(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(new, step, alpha=-group["lr"])
        return new, m, h, step, refreshes

    def _refresh(self, params: list[Tensor], groups: list[dict[str, Any]], estimate: tuple[Tensor, ...]) -> None:
        r""":math:`h \leftarrow \beta_2 h + (1 - \beta_2) \hat h` for :meth:`update_hessian`."""
        self._global()["update_hessian"] = False
        if not _closure.all_finite(estimate):
            _closure.warn_skipped(self._owner, "curvature (Hessian estimate)")
            return

        def commit(item: tuple, new: tuple[Tensor]) -> None:
            state = self.state[item[0]]
            state.update(hessian=new[0], hessian_refreshes=state.get("hessian_refreshes", 0) + 1)

        items = list(zip(params, groups, estimate))
        self._global()["update_hessian"] = _closure.apply_if_finite(
            self._owner, items, lambda item: (self._hessian(*item),), commit
        )


class SophiaH(_Sophia):
    r"""Sophia with Hutchinson's estimate of the Hessian diagonal (Sophia-H).

    .. math:: \hat h = u \circ (H u), \qquad u \sim \mathcal N(0, I)\ \text{(the paper) or Rademacher},

    by :func:`~optim.curvature.hutchinson_diagonal` on the closure's loss; the update is that of
    the Sophia class docstring (:class:`SophiaG` shows it in full). A refresh step costs one
    ``create_graph`` backward and one Hessian-vector product, reusing the step's forward; other
    steps cost one ordinary gradient.

    Example:
        >>> opt = SophiaH(model.parameters(), lr=6e-4)
        >>> loss = opt.step(lambda: F.cross_entropy(model(x).flatten(0, -2), y.flatten()))

    In a loop that calls ``backward`` itself, either keep the gradient's graph, as other Sophia-H
    and AdaHessian packages do: on refresh steps :meth:`step` takes :math:`H u` through the graph
    of ``p.grad`` (the same estimate as the closure's, probe for probe: in both, as in ``torch.optim``, a
    parameter the loss does not reach, whose ``p.grad`` is ``None``, is skipped and takes no probe), then
    detaches ``p.grad``::

        loss_fn(model(x), y).backward(create_graph=True)   # create_graph needed on refresh steps only
        opt.step()

    or refresh the estimate yourself before ``backward`` (it keeps the graph)::

        loss = loss_fn(model(x), y)
        if step % 10 == 0:
            opt.update_hessian(loss)
        loss.backward()
        opt.step()

    A first step that finds neither raises ``RuntimeError`` rather than run with :math:`h = 0`.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate :math:`\eta` (the largest per-coordinate step).
        betas: :math:`(\beta_1, \beta_2)` of the gradient and Hessian EMAs (paper: 0.965, 0.99).
        rho: :math:`\rho` (:math:`\gamma` in the paper); 0.01 is the authors' Sophia-H value (levanter).
        weight_decay: Decoupled weight decay :math:`\lambda` (paper's GPT-2 runs: 0.1-0.2).
        eps: :math:`\epsilon` (paper: 1e-15).
        update_period: :math:`k`, steps between Hessian refreshes (paper: 10).
        maximize: Maximise the loss.
        distribution: Hutchinson probes, ``"gaussian"`` (paper) or ``"rademacher"``.
        num_samples: Probes per refresh.
        generator: Source of the probes (the global one if ``None``). Data parallel, the probes must
            be the same on every rank (:math:`\hat h = u \circ \frac1R \sum_r H_r u`, the whole
            batch's estimate): a generator seeded alike, or ``None`` for
            :func:`optim.distributed.shared_generator`.
        distributed: ``True`` (the default process group) or a process group: average over its
            ranks (see the Sophia class docstring). ``False``: one process.
        hessian_batch: Rows of the batch the refresh's estimate runs on: ``None`` (all, on the gradient's
            own forward), a count :math:`m \ge 1` or a fraction :math:`f \in (0, 1)` of the :math:`R` rows
            (the leading dimension of the closure's outputs, or targets; :math:`m = \max(1, \lfloor f R
            \rfloor)`), as NewtonCG's ``curvature_batch``: a refresh step then takes the gradient from
            ``closure()`` (differentiated once) and :math:`\hat h` from ``closure(slice(0, m))``, the estimate of
            the mean loss over those rows (Liu et al. estimate on a subset of the batch too). The closure takes
            ``rows``: ``def closure(rows=slice(None))``. ``stats["hessian_rows"]`` reports :math:`m`.
        mode: How the Hessian-vector products of the estimate differentiate: ``"reverse"`` (reverse over
            reverse: a ``create_graph`` backward of the closure's graph, then a backward of it) or ``"forward"``
            (forward over reverse, :func:`~optim.curvature.hvp`: the closure runs again with the probe as the
            parameters' tangent, then one backward that carries tangents; no gradient graph is kept). Forward
            mode needs a closure and ``module`` and every operation to have a forward-mode rule of its
            backward; on the GPU it took 0.79-0.91x reverse mode's time in a 4-layer GPT at 8K-32K context
            (docs/forward_mode.md). With ``hessian_batch`` ``None`` a refresh step runs no plain pass: the
            loss and gradient are the values of the first probe's pass.
        module: The ``nn.Module`` whose parameters are optimised, for ``mode="forward"`` (run through
            :func:`~optim.curvature.functional`). With dropout each probe's pass draws its own mask, so the
            estimate is one of the Hessian averaged over masks (each probe is still unbiased for it), and
            a BatchNorm's running statistics advance once per probe.
        bias_correction: Divide :math:`h` by :math:`1 - \beta_2^{n}` in the update, :math:`n` the refreshes so
            far (see the Sophia class docstring; not in the paper, whose runs are long enough for it not to matter).
    """

    _owner = "SophiaH"
    _plain_loop = (
        "call loss.backward(create_graph=True) before opt.step() (the estimate is then taken through p.grad), or "
        "opt.update_hessian(loss) before loss.backward(), or pass a closure: opt.step(lambda: loss_fn(model(x), y))"
    )

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 6e-4,
        betas: tuple[float, float] = (0.965, 0.99), rho: float = 0.01, weight_decay: float = 0.1, eps: float = 1e-15,
        *, update_period: int = 10, maximize: bool = False, distribution: Distribution = "gaussian",
        num_samples: int = 1, generator: torch.Generator | None = None, distributed: _dist.Distributed = False,
        hessian_batch: int | float | None = None, mode: Mode = "reverse", module: nn.Module | None = None,
        bias_correction: bool = False,
    ) -> None:  # fmt: skip
        _closure.check_hyperparameters(self._owner, {"num_samples": num_samples}, {"num_samples": _closure.COUNT})
        _closure.check_mode("SophiaH", mode, module)
        super().__init__(params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed,
                         hessian_batch, bias_correction)
        self.distribution, self.num_samples = distribution, num_samples
        self.mode, self.module = mode, module

    def _hutchinson(
        self, operator: CurvatureOperator, groups: list[dict[str, Any]], gradient: bool = False
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The estimate of ``operator``'s diagonal and, if ``gradient``, the gradient the operator is taken at
        (read after the products, which in forward mode bring it), averaged over the ranks in one all-reduce."""
        _dist.check_alike(self.generator, operator.params[0].device, self.group, self._owner)
        estimate = hutchinson_diagonal(operator, self.num_samples, self.distribution, self.generator)
        grads = operator.gradient if gradient else ()
        _closure.check_dense(self._owner, grads)
        signed = tuple(-e if group["maximize"] else e for e, group in zip(estimate, groups))
        # The probes are alike on every rank, so averaging u * H_r u averages H_r u; one all-reduce for both.
        averaged = _dist.all_average((*grads, *signed), self.group)
        return averaged[: len(grads)], averaged[len(grads) :]

    def _reverse_operator(self, loss: Tensor, params: list[Tensor]) -> HessianOperator:
        operator = HessianOperator(loss, params)
        _closure.check_dense(self._owner, operator.gradient)
        return operator

    def _forward_operator(self, call: _closure.Closure, params: list[Tensor], rows: list | None = None,
                          reached: list | None = None) -> HessianOperator:  # fmt: skip
        """Forward-over-reverse products of ``call()``'s loss: ``call`` runs again with tangents on the parameters;
        ``rows`` (a list) receives the batch rows of each run (``stats["hessian_rows"]``), ``reached`` (a list)
        which parameters the first run's loss reaches on any rank (:func:`optim._closure.reached`)."""

        def loss() -> Tensor:
            result = _closure.parse(call(), self._owner)
            _closure.check_graph(result, self._owner)
            if rows is not None:
                rows.append(_closure.curvature_rows(self._owner, "hessian_batch", None, result, call)[1])
            return result.loss

        run = functional(self.module, loss, params)

        def tracked(values: list[Tensor]) -> Tensor:
            value = run(values)
            if reached is not None and not reached:
                reached.append(_closure.reached(value, values, self.group))
            return value

        return HessianOperator(tracked, params, mode="forward")

    def _closure_step(self, closure, params, groups, refresh=True):
        """In forward mode a refresh on the whole batch runs no pass of its own for the loss and gradient: they
        are the values of the first probe's forward-over-reverse pass (whose tangents give :math:`H u`). Which
        parameters the loss reaches is then known only after that pass: whether the step refreshes is decided
        on every trainable parameter (a parameter without :math:`h` that the last step skipped does not make it
        due), the probes cover them all, and the unreached ones are left out afterwards."""
        if self.mode == "reverse" or self.hessian_batch is not None:
            return super()._closure_step(closure, params, groups, refresh)
        due = self._due(params, groups)
        if not (refresh and any(due)):
            return super()._closure_step(closure, params, groups, refresh=False)
        rows, reached = [], []
        with torch.enable_grad(), _closure.graph_errors(self._owner):
            operator = self._forward_operator(closure, params, rows, reached)
            grads, estimate = self._hutchinson(operator, groups, gradient=True)
        self.stats["hessian_rows"] = rows[0]
        mask = reached[0]
        (unreached,) = _closure.select([not r for r in mask], params)
        params, groups, due = _closure.select(mask, params, groups, due)
        grads, estimate = map(tuple, _closure.select(mask, grads, estimate))
        return _dist.average_loss(operator.value, self.group), params, groups, unreached, due, grads, estimate

    def _estimate(self, result, call, params, groups):
        operator = self._reverse_operator(result.loss, params)  # forward mode takes _closure_step's path
        return self._hutchinson(operator, groups, gradient=True)

    def _diagonal(self, call, params, groups):
        if self.mode == "reverse":
            operator = self._reverse_operator(_closure.evaluate(call, self._owner, eager=True).loss, params)
        else:
            operator = self._forward_operator(call, params)
        return self._hutchinson(operator, groups)[1]

    def _estimate_from_grads(self, params, groups):
        self._check_reverse("a step without a closure")
        grads = tuple(p.grad for p in params)
        if not any(g.requires_grad for g in grads):
            return None
        operator = _closure.GradientGraphHessian(grads, params)
        return self._hutchinson(operator, groups, gradient=True)

    def _check_reverse(self, what: str) -> None:
        if self.mode == "forward":
            raise RuntimeError(
                f"SophiaH(mode='forward') takes its estimate through a closure, which it runs again with tangents; "
                f"{what} has only a graph to differentiate in reverse mode: pass opt.step(closure), or use "
                "mode='reverse'"
            )

    def differentiates_twice(self, rows: bool = False) -> bool:
        """As for any Sophia in reverse mode; in forward mode no call is (the products run on passes with tangents)."""
        return self.mode == "reverse" and super().differentiates_twice(rows)

    @torch.no_grad()
    def update_hessian(self, loss: Tensor) -> None:
        r"""Refresh :math:`h` from a loss with its graph (kept, so ``loss.backward()`` may follow).

        A parameter the loss does not reach keeps its :math:`h` (none if it has none), as :meth:`step` skips it.

        With ``maximize`` the estimate is that of :math:`-\text{loss}`. A non-finite estimate is
        discarded with a warning.

        Raises:
            TypeError: ``loss`` is not a one-element tensor (logits go to :meth:`SophiaG.update_hessian`).
            RuntimeError: ``loss`` has no autograd graph.
        """
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise TypeError(
                f"SophiaH.update_hessian takes the scalar loss with its graph (before loss.backward()), got {shape}; "
                "logits are what SophiaG.update_hessian takes"
            )
        if not loss.requires_grad:
            raise RuntimeError("SophiaH.update_hessian: the loss has no autograd graph (call it before backward)")
        self._check_reverse("update_hessian(loss)")
        params, groups, _ = self._reached(loss, *self._trainable())
        if not params:  # every parameter frozen, or none reached: nothing to refresh
            return
        with torch.enable_grad(), _closure.graph_errors(self._owner):
            _, estimate = self._hutchinson(self._reverse_operator(loss, params), groups)
        self._refresh(params, groups, estimate)


def _sampled_loss_gradient(
    rows: Tensor, counted: Tensor, count: int, generator: torch.Generator | None, chunk_elements: int
) -> Tensor | None:
    r"""The gradient w.r.t. the logits of the loss at labels sampled from the model, a chunk of rows at a time.

    For the counted rows :math:`r` (``counted``), :math:`\hat y_r \sim p_r = \operatorname{softmax}(z_r)`
    and :math:`\hat L = \frac1c \sum_r \ell_{CE}(z_r, \hat y_r)`, whose gradient has the rows

    .. math:: \nabla_{z_r} \hat L = \frac{p_r - e_{\hat y_r}}{c},

    and zeros in the rows that do not count (which never reach the sampler). Each chunk of
    :func:`~optim.curvature.row_chunks` takes its softmax in at least float32, samples its labels
    (``torch.multinomial`` on float32 probabilities) and writes its rows, so besides the result
    (shaped and typed like ``rows``) only a chunk's temporaries are held. On the CPU the draws do
    not depend on the chunk size; on CUDA they may.

    Returns:
        The gradient, or ``None`` when the softmax of a counted row is not finite.
    """
    gradient = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device)
    for chunk in row_chunks(rows.shape[0], rows.shape[1], chunk_elements):
        mask = counted[chunk]
        z = rows[chunk][mask]
        if z.shape[0] == 0:
            continue
        p = torch.softmax(z, dim=-1, dtype=torch.promote_types(z.dtype, torch.float32))
        if not bool(torch.isfinite(p).all()):
            return None
        sampled = torch.multinomial(p.float(), 1, generator=generator).squeeze(-1)
        p[torch.arange(z.shape[0], device=p.device), sampled] -= 1
        gradient[chunk][mask] = p.div_(count).to(rows.dtype)
    return gradient


def gauss_newton_bartlett(
    logits: Tensor,
    targets: Tensor | None,
    params: list[Tensor],
    *,
    ignore_index: int = -100,
    generator: torch.Generator | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    group: _dist.Group = None,
    owner: str = "gauss_newton_bartlett",
) -> tuple[Tensor, ...]:
    r"""The Gauss-Newton-Bartlett estimate of the diagonal of the cross-entropy's Gauss-Newton matrix (Sophia-G's).

    With the logits :math:`z_b` of the :math:`B` counted rows (targets not ``ignore_index``), labels
    :math:`\hat y_b \sim \operatorname{softmax}(z_b)` sampled from the model and
    :math:`\hat g = \nabla_\theta \frac1B \sum_b \ell_{CE}(z_b, \hat y_b)`,

    .. math:: \hat h = B\, \hat g \circ \hat g, \qquad
              \mathbb{E}[\hat h] = \operatorname{diag} \tfrac1B \textstyle\sum_b J_b^\top H_b J_b,

    the diagonal of the Gauss-Newton matrix of the mean loss (Bartlett's identity: the cross terms of
    different rows vanish in expectation). One backward through the graph of ``logits`` (kept); the
    labels are drawn a chunk of rows at a time (:func:`_sampled_loss_gradient`). With ``group``, the
    ranks' gradients are combined, weighted by their counted rows :math:`B_r`, into the whole batch's
    :math:`\hat g = \sum_r B_r \hat g_r / \sum_r B_r` before squaring. Non-finite logits in counted rows
    give a NaN estimate.
    """
    rows, counted = logit_rows(logits, targets, ignore_index, owner)
    count = max(int(counted.sum()), 1)
    cotangent = _sampled_loss_gradient(rows.detach(), counted, count, generator, chunk_elements)
    if cotangent is not None:
        sampled_grads = _vjp([logits], params, [cotangent.view(logits.shape)], retain_graph=True)
    else:  # the estimate at non-finite logits is not finite: the caller skips it with a warning
        sampled_grads = tuple(torch.full_like(p, math.nan) for p in params)
    if group is not None:  # the whole batch's gradient: rank sums of B_r g_r and of B_r
        size = _dist.dist.get_world_size(group)
        local = (*(count * g for g in sampled_grads), logits.new_full((1,), float(count), dtype=torch.float64))
        summed = tuple(size * t for t in _dist.all_average(local, group))
        count = float(summed[-1])
        sampled_grads = tuple(t / count for t in summed[:-1])
    return tuple(count * g * g for g in sampled_grads)


class SophiaG(_Sophia):
    r"""Sophia with the Gauss-Newton-Bartlett estimate of the Hessian diagonal (Sophia-G), for softmax cross-entropy.

    With logits :math:`z_b` of the :math:`B` counted rows (tokens), labels
    :math:`\hat y_b \sim \operatorname{softmax}(z_b)` sampled from the model itself and
    :math:`\hat L = \frac1B \sum_b \ell_{CE}(z_b, \hat y_b)`,

    .. math:: \hat g = \nabla_\theta \hat L, \qquad \hat h = B\, \hat g \circ \hat g,

    an unbiased-in-expectation estimate of the Gauss-Newton diagonal (Bartlett's identity). Then

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \qquad
        h_t = \beta_2 h_{t-k} + (1 - \beta_2)\, \hat h_t \ \text{every } k \text{ steps (the first included)}, \\
        \theta_{t+1} &= (1 - \eta\lambda)\,\theta_t
            - \eta\, \operatorname{clip}\!\big(m_t / \max(\rho\, h_t, \epsilon),\, 1\big).

    The closure returns ``(loss, logits)`` (classes in the last dimension) or a dict with
    ``loss``, ``outputs`` and optionally ``targets`` (rows whose target is ``ignore_index`` are not
    sampled, and never reach the sampler, so NaN logits there do no harm). A refresh step costs
    one more ordinary backward (of :math:`\hat L`) on the same forward; other steps cost one
    gradient, and may return the loss alone. Non-finite logits in counted rows give a non-finite
    estimate: the refresh is skipped with a warning.

    Example:
        >>> opt = SophiaG(model.parameters(), lr=6e-4)
        >>> def closure():
        ...     logits = model(x)
        ...     return F.cross_entropy(logits.flatten(0, -2), y.flatten()), logits
        >>> loss = opt.step(closure)

    In a loop that calls ``backward`` itself (a first step without an estimate raises ``RuntimeError``)::

        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        if step % 10 == 0:
            opt.update_hessian(logits)   # samples labels; keeps the graph
        loss.backward()
        opt.step()

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate :math:`\eta` (the largest per-coordinate step).
        betas: :math:`(\beta_1, \beta_2)` (paper: 0.965, 0.99).
        rho: :math:`\rho` (:math:`\gamma` in the paper); 0.04 is the released code's default
            (its GPT-2 small config uses 0.05).
        weight_decay: Decoupled weight decay :math:`\lambda` (released default 0.1).
        eps: :math:`\epsilon` (paper: 1e-15).
        update_period: :math:`k` (paper: 10).
        maximize: Maximise the loss (the estimate, a Gauss-Newton diagonal, is unchanged).
        ignore_index: Target value of rows that are not sampled, when the closure gives ``targets``.
        generator: Source of the sampled labels (the global one if ``None``; in distributed mode, a
            generator seeded differently on each rank, from one broadcast seed).
        distributed: ``True`` (the default process group) or a process group. Each rank samples
            labels for its own rows; the ranks' sampled-loss gradients are combined, weighted by
            their counted rows :math:`B_r`, into the whole batch's
            :math:`\hat g = \sum_r B_r \hat g_r / \sum_r B_r` before squaring (one all-reduce
            of :math:`n + 1` elements on refresh steps besides the gradient's).
        chunk_elements: Logits per chunk of the label sampling: the softmax and the sampled
            loss's gradient w.r.t. the logits are formed a chunk of rows at a time, so a refresh
            holds one tensor the size of the logits (that gradient) besides a chunk's float32
            temporaries (see :func:`~optim.curvature.row_chunks`).
        hessian_batch: Rows of the batch the label sampling runs on, as in :class:`SophiaH`: ``None`` (all),
            a count or a fraction; the closure then takes ``rows`` and returns ``(loss, logits)`` of those rows.
        bias_correction: Divide :math:`h` by :math:`1 - \beta_2^{n}` in the update (see :class:`_Sophia`; not in
            the paper, whose runs are long enough for it not to matter).
    """

    _owner = "SophiaG"
    _probes_per_rank = True  # each rank samples labels for its own rows
    _plain_loop = (
        "call opt.update_hessian(logits) before loss.backward() every update_period steps, or pass a closure that "
        "returns (loss, logits)"
    )

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 6e-4,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 0.1,
        eps: float = 1e-15,
        *,
        update_period: int = 10,
        maximize: bool = False,
        ignore_index: int = -100,
        generator: torch.Generator | None = None,
        distributed: _dist.Distributed = False,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        hessian_batch: int | float | None = None,
        bias_correction: bool = False,
    ) -> None:
        _closure.check_hyperparameters(
            self._owner, {"chunk_elements": chunk_elements}, {"chunk_elements": _closure.COUNT}
        )
        super().__init__(params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed,
                         hessian_batch, bias_correction)
        self.ignore_index, self.chunk_elements = ignore_index, chunk_elements

    def _counted_rows(self, logits: Tensor, targets: Tensor | None) -> tuple[Tensor, Tensor]:
        """The logits as rows ``(B, V)`` and the mask of those that count (target not ``ignore_index``)."""
        if not isinstance(logits, Tensor) or logits.dim() < 1 or logits.shape[-1] < 2:
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"SophiaG takes logits with at least 2 classes in the last dimension, got {got} (a loss goes to "
                "SophiaH.update_hessian)"
            )
        return logit_rows(logits, targets, self.ignore_index, self._owner)

    def _bartlett(self, logits: Tensor, targets: Tensor | None, params: list[Tensor]) -> tuple[Tensor, ...]:
        self._counted_rows(logits, targets)
        return gauss_newton_bartlett(
            logits, targets, params, ignore_index=self.ignore_index, generator=self.generator,
            chunk_elements=self.chunk_elements, group=self.group, owner=self._owner,
        )  # fmt: skip

    def _estimate(self, result, call, params, groups):
        grads = tuple(g.detach() for g in _closure.gradients(result.loss, params, retain_graph=True))
        _closure.check_dense(self._owner, grads)
        grads = _dist.all_average(grads, self.group)
        return grads, self._bartlett_of(result, params)

    def _diagonal(self, call, params, groups):
        return self._bartlett_of(_closure.evaluate(call, self._owner), params)

    def _bartlett_of(self, result: _closure.ClosureResult, params: list[Tensor]) -> tuple[Tensor, ...]:
        if result.outputs is None:
            raise RuntimeError(
                "SophiaG refreshes its estimate from the logits: on refresh steps the closure must return "
                "(loss, logits) or a dict with 'outputs'"
            )
        return self._bartlett(result.outputs, result.targets, params)

    def differentiates_twice(self, rows: bool = False) -> bool:
        """False: the Gauss-Newton-Bartlett estimate differentiates the graph once (a backward of the loss at
        sampled labels), so every call may run a once-differentiable attention."""
        return False

    @torch.no_grad()
    def update_hessian(self, logits: Tensor, targets: Tensor | None = None) -> None:
        """Refresh :math:`h` from logits with their graph (kept, so ``loss.backward()`` may follow).

        A parameter the logits do not reach keeps its :math:`h` (none if it has none), as :meth:`step` skips it.

        Args:
            logits: Model outputs, classes in the last dimension.
            targets: Optional labels shaped like ``logits`` without its last dimension; rows equal
                to ``ignore_index`` are not sampled.

        Raises:
            ValueError: ``logits`` is not a tensor with at least 2 classes in the last dimension
                (a loss goes to :meth:`SophiaH.update_hessian`), or ``targets`` do not match its rows.
            RuntimeError: ``logits`` has no autograd graph.
        """
        self._counted_rows(logits, targets)
        if not logits.requires_grad:
            raise RuntimeError("SophiaG.update_hessian: the logits have no autograd graph (call it before backward)")
        params, groups, _ = self._reached(logits, *self._trainable())
        if not params:  # every parameter frozen, or none reached: nothing to refresh
            return
        with torch.enable_grad():
            estimate = self._bartlett(logits, targets, params)
        self._refresh(params, groups, estimate)
