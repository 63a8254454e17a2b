"""The base class of the second-order optimizers: hyperparameters checked against rules, and the one step they all
take. A subclass says how it takes its curvature (:meth:`~SecondOrderOptimizer._differentiate`) and what update
it makes of it (:meth:`~SecondOrderOptimizer._propose`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim import distributed as _dist
from optim._closure import Closure, ClosureResult, evaluate, graph_errors, loss_without_update, require_closure
from optim._finite import NON_FINITE_UPDATE, all_finite, apply_if_finite, finite_flag, warn_skipped
from optim._gradients import reached, select, store_grads
from optim.hyperparameters import Rule, check_hyperparameters


@dataclass
class Evaluation:
    """What a step takes before it updates.

    Attributes:
        params: The parameters it updates (those its loss reaches; without a closure, those that hold ``p.grad``).
        groups: The group of each.
        unreached: The trainable parameters it skips, as ``torch.optim`` skips one whose ``p.grad`` is ``None``.
        closure: The step's closure (``None``: the step takes ``p.grad``).
        result: The closure's evaluation, with its graph, until the step has differentiated it.
        rows: The rows of the batch the curvature runs on, ``closure(rows)`` (``None``: the whole batch's graph).
        loss: Its loss, the rank average (``None`` without a closure).
        grads: The gradient, the rank average, one tensor per parameter.
        curvature: The optimizer's own: an estimate of the diagonal, an operator, or what it made of one.
        checks: The curvature values that must be finite, by the cause a warning names.
    """

    params: list[Tensor]
    groups: list[dict[str, Any]]
    unreached: list[Tensor]
    closure: Closure | None = None
    result: ClosureResult | None = None
    rows: slice | None = None
    loss: Tensor | None = None
    grads: tuple[Tensor, ...] = ()
    curvature: Any = None
    checks: dict[str, Sequence[Tensor]] = field(default_factory=dict)


@dataclass
class Update:
    """An update computed out of place and not written yet: ``propose(item)`` gives the new values (parameters and
    state) of each of ``items``, ``commit(item, values)`` writes them; ``scalars`` are 0-d tensors that the step
    reads together with its finiteness checks (with :attr:`SecondOrderOptimizer._checks_at_once`)."""

    items: Sequence[Any]
    propose: Callable[[Any], Sequence[Tensor]]
    commit: Callable[[Any, Sequence[Tensor]], None]
    scalars: Sequence[Tensor] = ()


class SecondOrderOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` whose hyperparameters are checked against :attr:`_rules` (the defaults in the
    constructor and each group's own values in :meth:`add_param_group`), with the step of :meth:`step`.

    Attributes:
        stats: The last step's statistics.
        group: The process group whose ranks the step averages over (``None``: one process).
    """

    _owner = "Optimizer"  # the name that errors and warnings start with
    _rules: ClassVar[Mapping[str, Rule]] = {}
    _needs_closure = False  # whether a step needs a closure (else it may take p.grad)
    #: Whether the step checks the loss, gradient, curvature and update for finiteness in one host synchronisation
    #: after proposing the update (else each as it comes, the loss before anything is differentiated)
    _checks_at_once = False

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        check_hyperparameters(self._owner, defaults, self._rules)
        super().__init__(params, defaults)
        self.stats: dict[str, float] = {}
        self.group: _dist.Group = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Check the group's hyperparameters (its own and the defaults it takes) and that its parameters are
        real, then add it.

        Raises:
            ValueError: A hyperparameter breaks its rule.
            TypeError: A parameter is complex (the curvature estimates and updates assume real numbers).
        """
        if isinstance(param_group, dict):
            check_hyperparameters(self._owner, {**self.defaults, **param_group}, self._rules)
            params = param_group.get("params")
            if params is not None and not isinstance(params, (Tensor, set)):
                param_group["params"] = params = list(params)  # as torch does; a generator is read once
            listed = [params] if isinstance(params, Tensor) else params or ()
            if any(isinstance(p, Tensor) and p.is_complex() for p in listed):
                raise TypeError(
                    f"{self._owner} does not support complex parameters: its curvature estimates and updates assume "
                    "real ones; hold the real and imaginary parts as two real parameters"
                )
        super().add_param_group(param_group)

    @property
    def refreshes_next_step(self) -> bool:
        """Whether the next step takes curvature (products or a diagonal estimate): true unless the subclass takes
        it on some steps only (Sophia's refresh steps)."""
        return True

    def differentiates_twice(self, rows: bool = False) -> bool:
        r"""Whether the next ``step(closure)`` differentiates the graph of ``closure()`` (``rows`` false) or of
        ``closure(rows)`` (``rows`` true: a curvature mini-batch) twice, reverse over reverse.

        A recipe may run every other call through an attention that is differentiable once (torch's fused
        SDPA): the gradient, the trial points, and the graphs that a Gauss-Newton product or estimate
        differentiates once (its :math:`J^\top u`). Passes that carry forward-mode tangents (``mode="forward"``)
        need an attention with a forward-mode rule whatever this says. True for every call unless the
        subclass knows better.
        """
        return True

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Tensor | None:  # type: ignore[override]
        """One step; returns the closure's loss (``None`` without a closure).

        1. The parameters: those that require grad and, without a closure, hold a ``p.grad``. With none, the step
           changes nothing and returns the closure's loss.
        2. With a closure (which runs the forward and returns the loss, ``(loss, outputs)`` or a dict with
           ``loss`` and optionally ``outputs``, ``targets`` and ``loss_hessian``, without calling backward):
           evaluate it with its graph, average its loss over the ranks, and leave out the parameters the loss does
           not reach (on any rank; their ``p.grad`` is set to ``None``).
        3. The gradient and the curvature (:meth:`_differentiate`, or :meth:`_differentiate_gradients` from
           ``p.grad``), rank averages; the gradient goes to ``p.grad``.
        4. The update, computed out of place (:meth:`_propose`) and written only if the loss, the gradient, the
           curvature and every new value are finite: otherwise the step is skipped with a ``RuntimeWarning`` and
           leaves the parameters and the state as they were.
        """
        self.stats = self._initial_stats()
        params, groups = self._trainable()
        unreached: list[Tensor] = []
        if closure is None and params:
            if self._needs_closure:
                require_closure(closure, self._owner)
            params, groups, unreached = self._with_grad(params, groups)
        if not params:
            return self._step_without_update(closure)
        self._prepare(params)
        taken = Evaluation(params, groups, unreached, closure)
        if closure is not None:
            if not self._take(taken):
                return taken.loss
        else:
            with torch.enable_grad(), graph_errors(self._owner):
                self._differentiate_gradients(taken)
        if self._checks_at_once:
            self._update_at_once(taken)
        else:
            self._update(taken)
        return taken.loss

    def _take(self, taken: Evaluation) -> bool:
        """Evaluate the closure into ``taken`` (its result, loss and the parameters it reaches) and differentiate
        it (:meth:`_differentiate`); whether the step goes on (not if the loss is not finite, read here unless
        :attr:`_checks_at_once`, or reaches no parameter)."""
        taken.result = evaluate(taken.closure, self._owner, eager=self.differentiates_twice())
        taken.loss = _dist.average_loss(taken.result.loss.detach(), self.group)
        finite = True
        if not self._checks_at_once:
            self.stats["loss"] = float(taken.loss)  # the step's one host synchronisation for the loss
            finite = math.isfinite(self.stats["loss"])
            if not finite:
                warn_skipped(self._owner, "loss")
        self._evaluated(taken)
        if not finite:
            return False
        taken.params, taken.groups, taken.unreached = self._reached(taken.result.loss, taken.params, taken.groups)
        if not taken.params:  # the loss reaches no parameter: nothing to update
            self._without_update(taken)
            return False
        with torch.enable_grad(), graph_errors(self._owner):
            self._differentiate(taken)
        taken.result = None  # the closure's graph goes before the update
        return True

    def _update(self, taken: Evaluation) -> None:
        """Store the gradient; check the gradient and the curvature, then every new value (each with a host
        synchronisation of its own), and write the update (:func:`optim._finite.apply_if_finite`)."""
        store_grads(taken.params, taken.grads, taken.unreached)
        for cause, tensors in {"gradient": taken.grads, **taken.checks}.items():
            if not all_finite(tensors):
                warn_skipped(self._owner, cause)
                return
        update = self._propose(taken)
        if update is not None and apply_if_finite(self._owner, update.items, update.propose, update.commit):
            self._finish(taken, [])

    def _update_at_once(self, taken: Evaluation) -> None:
        """Propose the update, then check the loss, the gradient, the curvature and every new value, and read the
        loss and the update's scalars, in one host synchronisation; store the gradient (unless the loss is not
        finite) and write the update."""
        update = self._propose(taken)
        checks = {"loss": [] if taken.loss is None else [taken.loss], "gradient": taken.grads, **taken.checks,
                  NON_FINITE_UPDATE: [value for item in update.items for value in update.propose(item)]}
        checked = [cause for cause, tensors in checks.items() if tensors]
        loss = taken.grads[0].new_tensor(math.nan, dtype=torch.float64) if taken.loss is None else taken.loss
        read = torch.stack([loss.double().reshape(()), *(finite_flag(checks[cause]).double() for cause in checked),
                            *(scalar.double() for scalar in update.scalars)]).tolist()
        self.stats["loss"], finite, scalars = read[0], read[1 : 1 + len(checked)], read[1 + len(checked) :]
        cause = next((cause for cause, ok in zip(checked, finite) if not ok), None)
        if cause != "loss":
            store_grads(taken.params, taken.grads, taken.unreached)
        if cause is not None:
            warn_skipped(self._owner, cause)
            return
        for item in update.items:
            update.commit(item, update.propose(item))
        self._finish(taken, scalars)

    def _initial_stats(self) -> dict[str, float]:
        """The statistics of a step that changes nothing, which the step then fills in."""
        return {}

    def _prepare(self, params: list[Tensor]) -> None:
        """Checks before the step evaluates anything (none here)."""

    def _evaluated(self, taken: Evaluation) -> None:
        """What the subclass takes from the closure's evaluation before the parameters it reaches (nothing here)."""

    def _differentiate(self, taken: Evaluation) -> None:
        """Set ``taken``'s gradient and curvature (and the curvature's ``checks``) from the closure's evaluation."""
        raise NotImplementedError

    def _differentiate_gradients(self, taken: Evaluation) -> None:
        """Set ``taken``'s gradient and curvature from ``p.grad`` (a step without a closure)."""
        raise NotImplementedError

    def _propose(self, taken: Evaluation) -> Update | None:
        """The update, out of place; ``None`` where the subclass skipped the step (with a warning)."""
        raise NotImplementedError

    def _finish(self, taken: Evaluation, scalars: list[float]) -> None:
        """The state and statistics after the update was written (with :attr:`_checks_at_once`, the values of the
        update's ``scalars``)."""
        self.stats.update(step_skipped=0.0)

    def _without_update(self, taken: Evaluation) -> None:
        """A step whose loss reaches no parameter: ``p.grad`` of the others set to ``None``, nothing updated."""
        store_grads((), (), taken.unreached)
        if self._checks_at_once:
            self.stats["loss"] = float(taken.loss)
        self.stats.update(step_skipped=0.0)

    def _global(self) -> dict[str, Any]:
        """State shared by all parameters (the subclass says which), kept in the first parameter's state, as
        ``torch.optim.LBFGS`` keeps its own, so that ``state_dict`` carries it."""
        return self.state[self.param_groups[0]["params"][0]]

    def _trainable(self) -> tuple[list[Tensor], list[dict[str, Any]]]:
        """The parameters that require grad, and the group of each."""
        pairs = [(p, group) for group in self.param_groups for p in group["params"] if p.requires_grad]
        return [p for p, _ in pairs], [group for _, group in pairs]

    def _reached(
        self, loss: Tensor, params: list[Tensor], groups: list[dict[str, Any]]
    ) -> tuple[list[Tensor], list[dict[str, Any]], list[Tensor]]:
        """The parameters that ``loss`` reaches (:func:`optim._gradients.reached`, on any rank), their groups, and
        the others: a step skips those as ``torch.optim`` skips a parameter whose ``p.grad`` is ``None`` (no
        update, decay or state)."""
        mask = reached(loss, params, self.group)
        return *select(mask, params, groups), select([not r for r in mask], params)[0]

    def _with_grad(
        self, params: list[Tensor], groups: list[dict[str, Any]]
    ) -> tuple[list[Tensor], list[dict[str, Any]], list[Tensor]]:
        """The parameters that hold a ``p.grad`` (a step without a closure skips the others), their groups, and
        the others.

        Distributed, those that hold one on any rank (one all-reduce of one number per parameter tensor): a rank
        whose ``p.grad`` is ``None`` there gets zeros, its share of the average, so that every rank averages the
        same parameters (:func:`~optim.distributed.all_average` pairs them by position).
        """
        mask = _dist.on_any_rank([p.grad is not None for p in params], params[0].device, self.group)
        for p, anywhere in zip(params, mask):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
        return *select(mask, params, groups), select([not m for m in mask], params)[0]

    def _step_without_update(self, closure: Closure | None) -> Tensor | None:
        """A step with nothing to update: :func:`~optim._closure.loss_without_update`, recorded in :attr:`stats`."""
        loss = loss_without_update(closure, self._owner, self.group)
        self.stats.update(loss=float("nan") if loss is None else float(loss), step_skipped=0.0)
        return loss
