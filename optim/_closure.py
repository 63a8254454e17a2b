"""What the second-order optimizers share: hyperparameter checks, closure evaluation, gradients and
the guards against non-finite values and inputs they cannot handle (frozen models, sparse gradients)."""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from optim import compiled
from optim import distributed as _dist
from optim.curvature import (
    CrossEntropyHessian,
    CurvatureOperator,
    LossHessian,
    MSEHessian,
    _vjp,
)


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


def check_mode(owner: str, mode: Any, module: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is ``"reverse"`` or ``"forward"``, and, for ``"forward"``, ``module`` is
    the ``nn.Module`` whose closure a forward-mode product runs again (through :func:`optim.functional`)."""
    if mode not in ("reverse", "forward"):
        raise ValueError(f"{owner}: mode must be 'reverse' or 'forward', got {mode!r}")
    if mode == "forward" and not isinstance(module, nn.Module):
        raise ValueError(
            f"{owner}(mode='forward') needs module=, the nn.Module that holds the parameters: forward mode runs "
            f"the closure again with tangents attached to them (through optim.functional); got {module!r}"
        )


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


class SecondOrderOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` whose hyperparameters are checked against :attr:`_rules`: the
    defaults in the constructor and each group's own values in :meth:`add_param_group`.

    Attributes:
        stats: The last step's statistics.
        group: The process group whose ranks the step averages over (``None``: one process).
    """

    _owner = "Optimizer"  # the name that errors and warnings start with
    _rules: ClassVar[Mapping[str, Rule]] = {}

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
            TypeError: A parameter is complex (the curvature estimates and updates assume real numbers: AdaHessian
                wrote a complex :math:`D_t^2` into its state and the parameters, then failed on its statistics).
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

    def _trainable(self) -> tuple[list[Tensor], list[dict[str, Any]]]:
        """The parameters that require grad, and the group of each."""
        pairs = [(p, group) for group in self.param_groups for p in group["params"] if p.requires_grad]
        return [p for p, _ in pairs], [group for _, group in pairs]

    def _reached(
        self, loss: Tensor, params: list[Tensor], groups: list[dict[str, Any]]
    ) -> tuple[list[Tensor], list[dict[str, Any]], list[Tensor]]:
        """The parameters that ``loss`` reaches (:func:`reached`, on any rank), their groups, and the others: a step
        skips those as ``torch.optim`` skips a parameter whose ``p.grad`` is ``None`` (no update, decay or state)."""
        mask = reached(loss, params, self.group)
        return *select(mask, params, groups), select([not r for r in mask], params)[0]

    def _with_grad(
        self, params: list[Tensor], groups: list[dict[str, Any]]
    ) -> tuple[list[Tensor], list[dict[str, Any]]]:
        """The parameters that hold a ``p.grad`` (a step without a closure skips the others), and their groups.

        Distributed, those that hold one on any rank (one all-reduce of one number per parameter tensor): a rank
        whose ``p.grad`` is ``None`` there gets zeros, its share of the average. Each rank keeping its own ones
        made :func:`~optim.distributed.all_average` pair different parameters (silently where sizes matched).
        """
        mask = _dist.on_any_rank([p.grad is not None for p in params], params[0].device, self.group) if params else []
        for p, anywhere in zip(params, mask):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
        return select(mask, params, groups)

    def _step_without_update(self, closure: Closure | None) -> Tensor | None:
        """A step with nothing to update: :func:`loss_without_update`, recorded in :attr:`stats`."""
        loss = loss_without_update(closure, self._owner, self.group)
        self.stats.update(loss=float("nan") if loss is None else float(loss), step_skipped=0.0)
        return loss

    def _evaluate_loss(self, closure: Closure | None) -> tuple[ClosureResult, Tensor, bool]:
        """The closure evaluated with its graph, its loss averaged over the ranks (also ``stats["loss"]``), and
        whether that loss is finite; a non-finite one is reported with :func:`warn_skipped` (the step is then skipped).
        """
        result = evaluate(closure, self._owner, eager=self.differentiates_twice())
        loss = _dist.average_loss(result.loss.detach(), self.group)
        self.stats["loss"] = float(loss)  # the step's one host synchronisation for the loss
        finite = math.isfinite(self.stats["loss"])
        if not finite:
            warn_skipped(self._owner, "loss", stacklevel=4)
        return result, loss, finite


Closure = Callable[..., Any]  # called without arguments, or with a slice of rows (NewtonCG's curvature_batch)
CLOSURE_CONTRACT = (
    "the closure runs the forward pass and returns the loss, a tuple (loss, outputs), or a dict with key "
    "'loss' and optionally 'outputs', 'targets', 'loss_hessian'; it must not call backward()"
)


@dataclass(frozen=True)
class ClosureResult:
    """What a closure returned: the scalar loss and, optionally, model outputs (logits) and per-batch extras."""

    loss: Tensor
    outputs: Tensor | None = None
    targets: Tensor | None = None
    loss_hessian: LossHessian | None = None


def parse(result: Any, owner: str) -> ClosureResult:
    """Check a closure's return value and bring it into :class:`ClosureResult` form."""
    if isinstance(result, Tensor):
        parsed = ClosureResult(result)
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        parsed = ClosureResult(*result)
    elif isinstance(result, dict) and "loss" in result:
        unknown = set(result) - {"loss", "outputs", "targets", "loss_hessian"}
        if unknown:
            raise TypeError(f"{owner}: unknown keys {sorted(unknown)} in the closure's dict; {CLOSURE_CONTRACT}")
        parsed = ClosureResult(**result)
    else:
        raise TypeError(f"{owner}: the closure returned {type(result).__name__}; {CLOSURE_CONTRACT}")
    if not isinstance(parsed.loss, Tensor) or parsed.loss.numel() != 1:
        raise TypeError(f"{owner}: the loss must be a one-element tensor, got {parsed.loss!r:.80}; {CLOSURE_CONTRACT}")
    if parsed.outputs is not None and not isinstance(parsed.outputs, Tensor):
        raise TypeError(f"{owner}: the outputs must be a tensor, got {type(parsed.outputs).__name__}")
    return parsed


def evaluate(closure: Closure | None, owner: str, *, graph: bool = True, eager: bool = False) -> ClosureResult:
    """Call ``closure`` under ``torch.enable_grad()`` (or ``torch.no_grad()`` when ``graph`` is false) and parse it;
    with ``eager`` (a graph that will be differentiated twice) ``torch.compile``'d code in it runs its Python code
    (:func:`optim.compiled.eager`).

    Raises:
        RuntimeError: ``closure`` is ``None``, or ``graph`` is true and the loss has no autograd graph.
        TypeError: The closure returned something else than :data:`CLOSURE_CONTRACT` allows.
    """
    if closure is None:
        raise RuntimeError(f"{owner}.step needs a closure: opt.step(closure), where {CLOSURE_CONTRACT}")
    with torch.enable_grad() if graph else torch.no_grad(), compiled.eager() if eager else nullcontext():
        result = parse(closure(), owner)
    if graph:
        check_graph(result, owner)
    return result


def check_graph(result: ClosureResult, owner: str) -> None:
    """Raise ``RuntimeError`` if the closure's loss has no autograd graph (its gradient would read as zero)."""
    if not result.loss.requires_grad:
        raise RuntimeError(
            f"{owner}: the closure's loss has no autograd graph; run the forward inside the closure without "
            f"detaching it or calling .item() ({CLOSURE_CONTRACT})"
        )


@contextmanager
def graph_errors(owner: str):
    """Re-raise autograd's 'backward through the graph a second time' naming its likely cause, and PyTorch's errors for
    a ``torch.compile``'d graph differentiated twice naming torch.compile (:func:`optim.compiled.explained`)."""
    try:
        with compiled.explained(owner):
            yield
    except RuntimeError as error:
        if "second time" in str(error):
            raise RuntimeError(f"{owner}: the closure's graph was already freed; {CLOSURE_CONTRACT}") from error
        raise


def gradients(
    loss: Tensor, params: Sequence[Tensor], *, retain_graph: bool = False, create_graph: bool = False
) -> tuple[Tensor, ...]:
    """:math:`\\nabla_\\theta L` for every parameter, zeros for those the loss does not depend on."""
    return torch.autograd.grad(
        loss, params, retain_graph=retain_graph, create_graph=create_graph, allow_unused=True, materialize_grads=True
    )


def select(mask: Sequence[bool], *columns: Sequence[Any]) -> tuple[list[Any], ...]:
    """The entries of each of the aligned ``columns`` where ``mask`` is true, one list per column."""
    return tuple([x for x, keep in zip(column, mask, strict=True) if keep] for column in columns)


def reached(loss: Tensor, params: Sequence[Tensor], group: _dist.Group = None) -> list[bool]:
    """For each parameter, whether ``loss`` depends on it through its autograd graph, i.e. whether
    ``loss.backward()`` would give it a gradient (a parameter it does not reach keeps ``p.grad`` ``None``, and
    ``torch.optim`` optimizers skip it).

    A walk over the nodes of the graph from ``loss`` (no arithmetic and, in one process, no host synchronisation).
    A path through an operation whose backward returns no gradient (``None``) for that input still counts. With
    ``group``, a parameter counts if it is reached on any rank (one all-reduce of ``len(params)`` numbers), so that
    every rank keeps the same parameters and the averages pair the same tensors (a rank that does not reach it
    contributes zeros).
    """
    targets: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        if p.requires_grad:
            targets.setdefault(torch.autograd.graph.get_gradient_edge(p).node, []).append(i)
    mask = [False] * len(params)
    if loss.requires_grad and targets:
        start = torch.autograd.graph.get_gradient_edge(loss).node
        stack, seen, left = [start], {start}, len(targets)
        while stack and left:
            node = stack.pop()
            if node in targets:
                for i in targets[node]:
                    mask[i] = True
                left -= 1
            for following, _ in node.next_functions:
                if following is not None and following not in seen:
                    seen.add(following)
                    stack.append(following)
    return _dist.on_any_rank(mask, params[0].device, group) if params else mask


def finite_flag(*groups: Iterable[Tensor]) -> Tensor:
    r"""A 0-d bool tensor: whether every entry of every tensor is finite, without a host synchronisation.

    With ``torch._foreach`` ops, a few kernel launches in all: :math:`\sum |0 \cdot x|` is 0 for a
    finite tensor and NaN for one with a NaN or an infinity (no overflow, unlike a norm of :math:`x`).
    """
    tensors = [t for group in groups for t in group]
    if not tensors:
        return torch.tensor(True)
    sums = torch._foreach_norm(torch._foreach_mul(tensors, 0.0), 1)
    return torch.isfinite(torch.stack(sums)).all()


def all_finite(*groups: Iterable[Tensor]) -> bool:
    """Whether every entry of every tensor is finite: :func:`finite_flag`, read with one host synchronisation."""
    return bool(finite_flag(*groups))


def warn_skipped(
    owner: str, cause: str, unchanged: str = "the parameters and optimizer state", *, stacklevel: int = 3
) -> None:
    """Warn that a step was skipped because ``cause`` (e.g. 'loss') was not finite, leaving ``unchanged`` as it was.

    ``stacklevel`` 3 points the warning at the caller of the function that calls this one (the user's ``step``).
    """
    warnings.warn(
        f"{owner}: non-finite {cause}; the step was skipped and {unchanged} left unchanged",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


Item = TypeVar("Item")


def apply_if_finite(
    owner: str,
    items: Sequence[Item],
    propose: Callable[[Item], Sequence[Tensor]],
    commit: Callable[[Item, Sequence[Tensor]], None],
) -> bool:
    """Apply an update only if every value it would write (parameters and state) is finite.

    ``propose(item)`` computes one item's new values out of place and ``commit(item, values)``
    writes them. ``propose`` runs twice per item, once to check and once to write, so that one
    item's new values are alive at a time rather than a second copy of the model and its state.
    A non-finite value anywhere skips the whole update with a warning (:func:`warn_skipped`).

    Returns:
        Whether the update was applied.
    """
    if not all_finite(value for item in items for value in propose(item)):
        warn_skipped(owner, "update (a new parameter or state value)")
        return False
    for item in items:
        commit(item, propose(item))
    return True


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


def curvature_rows(
    owner: str, name: str, size: int | float | None, result: ClosureResult, closure: Callable[..., Any]
) -> tuple[slice | None, float]:
    r"""The rows ``closure(rows)`` evaluates the curvature on (``None``: the whole batch's graph), and how many
    rows the curvature sees (NaN if unknown), for the curvature mini-batch setting ``name`` of size ``size``.

    The batch has :math:`R` rows, the leading dimension of the closure's outputs or targets; a count
    :math:`m` takes the first :math:`m`, a fraction :math:`f` the first :math:`\max(1, \lfloor f R \rfloor)`.

    Raises:
        RuntimeError: ``size`` is a fraction and the closure returned neither outputs nor targets.
        TypeError: ``size`` is set and the closure takes no ``rows`` argument.
    """
    batch = next((t.shape[0] for t in (result.outputs, result.targets) if t is not None and t.dim() > 0), None)
    if size is None:
        return None, math.nan if batch is None else float(batch)
    if isinstance(size, float):
        if batch is None:
            raise RuntimeError(
                f"{owner}({name}={size}) takes the batch's rows from the leading dimension of the closure's "
                "outputs or targets, and the closure returned neither; return them, or give a count of rows"
            )
        size = max(1, math.floor(size * batch))
    try:
        inspect.signature(closure).bind(slice(0, size))
    except TypeError:
        raise TypeError(
            f"{owner}({name}=...) evaluates the curvature on closure(rows), rows a slice of the batch's "
            "leading dimension, but this closure takes no argument: write it as def closure(rows=slice(None)) "
            "and index the batch with rows"
        ) from None
    except ValueError:  # no signature to check (e.g. a builtin): the call will tell
        pass
    return slice(0, size), float(size if batch is None else min(size, batch))


def check_dense(owner: str, grads: Iterable[Tensor]) -> None:
    """Raise ``RuntimeError`` if a gradient is sparse (e.g. from ``nn.Embedding(sparse=True)``)."""
    if any(g.layout != torch.strided for g in grads):
        raise RuntimeError(
            f"{owner} does not support sparse gradients (from nn.Embedding(sparse=True) or "
            "nn.EmbeddingBag(sparse=True)); build those modules with sparse=False"
        )


def loss_without_update(closure: Closure | None, owner: str, group: _dist.Group) -> Tensor | None:
    """The closure's loss (rank average) for a step with nothing to update, ``None`` without a closure.

    With every parameter frozen, or none holding a gradient, a step changes nothing and returns
    what the closure returns, as ``torch.optim`` optimizers do; the closure runs without a graph.
    """
    if closure is None:
        return None
    return _dist.average_loss(evaluate(closure, owner, graph=False).loss, group)


class GradientGraphHessian(CurvatureOperator):
    r"""The Hessian through gradients that carry their graph, as ``p.grad`` does after
    ``loss.backward(create_graph=True)``: :math:`H v = \nabla_\theta (g^\top v)`, the graph retained.

    It gives the same products as :class:`~optim.curvature.HessianOperator` on the loss itself.

    Args:
        grads: :math:`g = \nabla_\theta L`, one tensor per parameter; those without a graph are
            constants (zero rows of :math:`H`).
        params: The parameters :math:`\theta`.
    """

    def __init__(self, grads: Sequence[Tensor], params: Sequence[Tensor]) -> None:
        super().__init__(params)
        self._grads = tuple(grads)

    @property
    def gradient(self) -> tuple[Tensor, ...]:
        r""":math:`\nabla_\theta L`, detached."""
        return tuple(g.detach() for g in self._grads)

    def matvec(self, vec: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Return :math:`H v`, one tensor per parameter."""
        return _vjp(self._grads, self.params, vec, retain_graph=True)


def store_grads(params: Sequence[Tensor], grads: Sequence[Tensor], unreached: Iterable[Tensor] = ()) -> None:
    """Set ``p.grad`` to the (detached) gradients, for logging or clipping after the step, and to ``None`` for the
    ``unreached`` parameters (those the loss does not reach, as after ``zero_grad(); loss.backward()``)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.detach()
    for p in unreached:
        p.grad = None


def loss_hessian_for(spec: str | LossHessian, result: ClosureResult, ignore_index: int = -100) -> LossHessian:
    """The loss Hessian for this batch: the closure's own if it gave one, else ``spec`` resolved on its outputs.

    ``"cross_entropy"`` is the mean cross-entropy over the rows of the logits (all rows, or those
    whose ``targets`` differ from ``ignore_index`` when the closure returned targets); ``"mse"`` is
    the mean squared error.
    """
    if result.loss_hessian is not None:
        return result.loss_hessian
    if spec == "cross_entropy":
        outputs = result.outputs
        targets = result.targets
        if targets is None:
            targets = torch.zeros(outputs.shape[:-1], dtype=torch.long, device=outputs.device)
        return CrossEntropyHessian(targets, "mean", ignore_index)
    if spec == "mse":
        return MSEHessian("mean")
    if callable(spec):
        return spec
    raise ValueError(f"loss_hessian must be 'cross_entropy', 'mse' or a LossHessian, got {spec!r}")
