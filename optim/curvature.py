"""Exact curvature products (Hessian, generalised Gauss-Newton) and randomised estimators built on them."""

from __future__ import annotations

import re
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from optim import compiled
from optim._tangent_products import LeanLinearTangents
from optim.swap import swapped

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

Tensors = Sequence[Tensor]
Distribution = Literal["rademacher", "gaussian"]
Reduction = Literal["mean", "sum"]
Mode = Literal["reverse", "forward"]
ParamFunction = Callable[[tuple[Tensor, ...]], Tensor]
"""A function of parameter values: called with one tensor per parameter, in order (see :func:`functional`)."""
Result = TypeVar("Result")


def _check_mode(mode: str) -> None:
    """Raise unless ``mode`` is ``"reverse"`` or ``"forward"``."""
    if mode not in ("reverse", "forward"):
        raise ValueError(f"mode must be 'reverse' or 'forward', got {mode!r}")


def _function_of_params(fn: Tensor | ParamFunction, argument: str, caller: str) -> ParamFunction:
    """``fn`` if it is a function of the parameter values; a clear error for a computed tensor."""
    if callable(fn) and not isinstance(fn, Tensor):
        return fn
    raise TypeError(
        f"{caller}(mode='forward') needs {argument} as a function of the parameter values, e.g. "
        f"optim.functional(model, closure), not a computed {type(fn).__name__}: forward mode runs the model "
        "again with tangents attached to the parameters"
    )


def _vjp(
    outputs: Sequence[Tensor | None],
    inputs: Tensors,
    cotangents: Sequence[Tensor | None],
    *,
    retain_graph: bool,
    create_graph: bool = False,
) -> tuple[Tensor, ...]:
    r"""Vector-Jacobian product :math:`\sum_k (\partial y_k / \partial x_i)^\top c_k` for every input :math:`x_i`.

    Outputs that are ``None`` or have no graph contribute nothing; inputs that do not require grad,
    or that no output depends on, get zeros, so the result never holds ``None``.
    """
    pairs = [(y, c) for y, c in zip(outputs, cotangents, strict=True) if y is not None and y.requires_grad]
    active = [x for x in inputs if x.requires_grad]
    if not pairs or not active:
        return tuple(torch.zeros_like(x) for x in inputs)
    ys, cs = zip(*pairs)
    with compiled.explained("optim"):
        grads = iter(torch.autograd.grad(ys, active, cs, retain_graph=retain_graph, create_graph=create_graph,
                                         allow_unused=True, materialize_grads=True))
    return tuple(next(grads) if x.requires_grad else torch.zeros_like(x) for x in inputs)


def _gradient(loss: Tensor, params: Tensors) -> tuple[Tensor, ...]:
    r"""The gradient :math:`\nabla_\theta L` of a scalar loss, differentiable once more (``create_graph=True``)."""
    return _vjp([loss], params, [None], retain_graph=True, create_graph=True)


def _flatten(tensors: Tensors) -> Tensor:
    """Concatenate tensors into one vector, in order."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, like: Tensors) -> tuple[Tensor, ...]:
    """Split a vector into tensors shaped like ``like`` (the inverse of :func:`_flatten`)."""
    chunks = torch.split(flat, [t.numel() for t in like])
    return tuple(c.view_as(t) for c, t in zip(chunks, like, strict=True))


#: Per module, the code objects of the ``fn`` whose first run with replaced values :class:`_ParameterWatch` saw
_WATCHED: weakref.WeakKeyDictionary[nn.Module, set[object]] = weakref.WeakKeyDictionary()


class _ParameterWatch(TorchFunctionMode):
    """Records which of ``params`` a torch function receives (directly, or in a list or tuple argument)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        super().__init__()
        self.ids = {id(p): p for p in params}
        self.seen: dict[int, Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in (*args, *kwargs.values()):
            for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                if id(item) in self.ids:
                    self.seen[id(item)] = item
        return func(*args, **kwargs)


def functional(
    module: nn.Module, fn: Callable[[], Result], params: Tensors | None = None
) -> Callable[[Tensors], Result]:
    r"""A closure that runs ``module``, as a function of values for its parameters.

    ``functional(model, fn, params)(values)`` runs ``fn()`` with ``values[i]`` in place of
    ``params[i]`` inside ``model`` (by :func:`optim.swap.swapped`: tied parameters stay tied, a
    submodule registered more than once is swapped once, buffers are the module's own) and returns what
    ``fn`` returns; the module holds its own parameters again afterwards. ``torch.compile``'d code in
    ``fn`` runs eagerly (:mod:`optim.compiled`): a compiled graph cannot be differentiated twice. This
    is the form ``mode="forward"`` needs: it runs the model again with tangents attached to the values.
    ``fn`` must be deterministic (no dropout) for the products to be those of one matrix, and must reach the parameters through ``module``: a tensor it captured before
    (``w = model.weight; lambda: f(x @ w)``) is not replaced, so its derivatives would be zero. The first
    call with other values, per module and per place in the code that makes ``fn``, runs ``fn`` under a
    watch (a ``TorchFunctionMode``: host time on every torch call, hence once) that refuses such a tensor.

    Example: ``loss = functional(model, lambda: F.cross_entropy(model(x), y))``, then
    ``hvp(loss, list(model.parameters()), vec, mode="forward")``.

    Args:
        module: The module whose parameters are replaced; ``fn`` must reach them through it.
        fn: A closure without arguments, e.g. ``lambda: model(x)`` or a loss of it.
        params: Parameters of ``module`` that the values stand for, in order (default: all of
            ``module.parameters()``).

    Returns:
        ``values -> fn()`` with ``values`` in place of ``params``.

    Raises:
        ValueError: A tensor in ``params`` is not a parameter of ``module`` or is listed twice (here), or
            the number of values is not that of ``params`` (when called).
        RuntimeError: ``fn`` uses a tensor of ``params`` itself, not through ``module`` (when called, above).
    """
    names = {id(p): name for name, p in module.named_parameters()}
    params = tuple(module.parameters()) if params is None else tuple(params)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"params {missing} are not parameters of the module {type(module).__name__}")
    first = {}
    for i, p in enumerate(params):
        if first.setdefault(id(p), i) != i:  # one slot for both: only one value could go in it
            raise ValueError(f"params {first[id(p)]} and {i} are the same tensor (a tied weight listed twice): "
                             "list it once, as module.parameters() does")
    keys = [names[id(p)] for p in params]
    site = getattr(fn, "__code__", type(fn))  # the watch runs once per module and place in the code that makes fn

    def run(values: Tensors) -> Result:
        if len(values) != len(keys):
            raise ValueError(f"expected {len(keys)} values, one per parameter, got {len(values)}")
        replaced = [p for p, value in zip(params, values) if value is not p]
        with swapped(module, dict(zip(keys, values))), compiled.eager():
            if not replaced or site in _WATCHED.get(module, ()):
                return fn()
            with _ParameterWatch(replaced) as watch:  # a mode: host time on every torch call, hence once
                result = fn()
        if watch.seen:
            raise RuntimeError(
                f"functional({type(module).__name__}, fn): fn uses the parameter tensors themselves "
                f"({', '.join(names[id(p)] for p in watch.seen.values())}), not through the module: fn runs with the "
                "module's parameters replaced by the values it is given (e.g. copies that carry forward-mode "
                "tangents), so a tensor fn captured before (w = model.weight; lambda: f(x @ w)) would stay "
                "constant and its derivatives would be silently zero; reach the parameters through the module "
                "inside fn (model.weight, or call the model)"
            )
        _WATCHED.setdefault(module, set()).add(site)
        return result

    run.module = module  # for the products that must see one deterministic function (active_dropout)
    return run


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def active_dropout(module: nn.Module) -> str | None:
    """The name of the first submodule of ``module`` that draws a random mask in its forward (a dropout layer,
    or ``nn.MultiheadAttention`` with a dropout rate, in training mode with a rate above 0); ``None`` if none
    does. Dropout called as a function (``F.dropout``) cannot be seen."""
    for name, sub in module.named_modules():
        if isinstance(sub, _DROPOUTS):
            rate = sub.p
        elif isinstance(sub, nn.MultiheadAttention):
            rate = sub.dropout
        else:
            continue
        if sub.training and rate > 0:
            return name or type(module).__name__
    return None


def check_deterministic(owner: str, module: nn.Module | None) -> None:
    """Raise ``RuntimeError`` if ``module`` would run with dropout (:func:`active_dropout`): products that run it
    again (forward mode) would each see another mask, so they would not be products of one matrix."""
    name = None if module is None else active_dropout(module)
    if name is not None:
        raise RuntimeError(
            f"{owner}: forward mode runs the model again for each curvature product, and its {name!r} draws a new "
            "dropout mask on every run, so the products would not be those of one matrix (a Gauss-Newton product "
            "would not even be symmetric); call model.eval() or set the dropout rate to 0 for the curvature, or "
            "use mode='reverse', which differentiates the closure's own graph"
        )


def _tangent(dual: Tensor) -> Tensor:
    """The tangent of ``dual`` at the current dual level (zeros when it has none), without a graph."""
    tangent = fwAD.unpack_dual(dual).tangent
    return torch.zeros_like(dual) if tangent is None else tangent.detach()


def _dual_params(params: Tensors, vec: Tensors, *, requires_grad: bool) -> tuple[Tensor, ...]:
    """Inside a dual level: every parameter that requires grad as a dual tensor with tangent ``vec``
    (a leaf of its own that requires grad if ``requires_grad``); the others as constants."""
    return tuple(
        fwAD.make_dual(p.detach().requires_grad_(requires_grad), v) if p.requires_grad else p.detach()
        for p, v in zip(params, vec, strict=True)
    )


CHECKPOINT_WITHOUT_FORWARD_RULE = "activation checkpointing (torch.utils.checkpoint)"  # named by the error below


def _raised_in_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` came from an autograd Function that ``torch.utils.checkpoint`` itself applies (not from
    one applied by the checkpointed code)."""
    callers = [Path(frame.filename).parts[-3:] for frame in traceback.extract_tb(error.__traceback__)
               if Path(frame.filename).parts[-3:] != ("torch", "autograd", "function.py")]
    return bool(callers) and callers[-1] == ("torch", "utils", "checkpoint.py")


@contextmanager
def _forward_mode_errors() -> Iterator[None]:
    """Turn PyTorch's error for an operation without a forward-mode rule into one that says what to do."""
    try:
        yield
    except NotImplementedError as error:
        if not re.search(r"forward[- ](mode )?AD", str(error)):
            raise
        if _raised_in_checkpoint(error):
            raise NotImplementedError(
                f"mode='forward' runs through {CHECKPOINT_WITHOUT_FORWARD_RULE}, which has no "
                f"forward-mode rule in torch {torch.__version__} (torch 2.11 has none, 2.13 has one). Turn "
                "checkpointing off for curvature products, or use mode='reverse'"
            ) from error
        raise NotImplementedError(
            "mode='forward' needs a forward-mode derivative of every operation of the model (and, for Hessian "
            "products, of its backward), and PyTorch has none for one of them (below). Use mode='reverse', or "
            "write that operation from simpler ones (e.g. F.silu as x * torch.sigmoid(x))"
        ) from error
    except RuntimeError as error:
        if "ZeroTensors are immutable" not in str(error):
            raise
        raise RuntimeError(
            "mode='forward' ran into a PyTorch forward-mode rule that writes into a zero tangent (below; in torch "
            "2.13 the backward of F.mse_loss, for Hessian products). Use mode='reverse', or write that operation "
            "from simpler ones (e.g. F.mse_loss(o, y) as (o - y).square().mean())"
        ) from error


def _primal(dual: Tensor) -> Tensor:
    """The value of ``dual`` at the current dual level, without its tangent or a graph."""
    return fwAD.unpack_dual(dual).primal.detach()


def _forward_over_reverse(
    loss_fn: ParamFunction, params: Tensors, vec: Tensors
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...]]:
    r"""``(L, grad L, H v)``: one forward pass with tangents, then one backward (without ``create_graph``)
    whose every step also carries its tangent; :math:`Hv` is the tangent of :math:`\nabla_\theta L` along
    :math:`v`, and the loss and gradient at :math:`\theta` come with it as the pass's values."""
    with torch.enable_grad(), fwAD.dual_level(), _forward_mode_errors():
        duals = _dual_params(params, vec, requires_grad=True)
        loss = loss_fn(duals)
        grads = _vjp([loss], duals, [None], retain_graph=False)
        return _primal(loss), tuple(_primal(g) for g in grads), tuple(_tangent(g) for g in grads)


def _forward_jvp(outputs_fn: ParamFunction, params: Tensors, vec: Tensors, *, lean: bool = False) -> Tensor:
    r""":math:`Jv`, the tangent of the outputs along :math:`v`, by one forward pass with tangents and
    no autograd graph (nothing is saved for a backward); with ``lean``, linear layers write both terms
    of their tangents into one buffer (:class:`~optim._tangent_products.LeanLinearTangents`)."""
    with torch.no_grad(), fwAD.dual_level(), _forward_mode_errors(), LeanLinearTangents() if lean else nullcontext():
        return _tangent(outputs_fn(_dual_params(params, vec, requires_grad=False)))


def hvp(
    loss: Tensor | ParamFunction,
    params: Tensors,
    vec: Tensors,
    *,
    grads: Sequence[Tensor | None] | None = None,
    retain_graph: bool = False,
    mode: Mode = "reverse",
) -> tuple[Tensor, ...]:
    r"""Exact Hessian-vector product :math:`Hv`, :math:`H = \nabla^2_\theta L(\theta)`.

    ``mode="reverse"`` (reverse-over-reverse) differentiates the gradient once more:

    .. math:: H v = \nabla_\theta \big( \nabla_\theta L(\theta)^\top v \big),

    a backward with ``create_graph=True`` (whose graph, the size of the whole model's backward,
    is kept until the second backward has run) and a backward through that graph.

    ``mode="forward"`` (forward-over-reverse) takes the directional derivative of the gradient:

    .. math:: H v = \frac{\mathrm{d}}{\mathrm{d}\varepsilon}
              \nabla_\theta L(\theta + \varepsilon v) \Big|_{\varepsilon = 0},

    one forward pass that carries the tangent :math:`v` (``torch.autograd.forward_ad``), then one
    ordinary backward (no ``create_graph``) whose every step also carries its tangent. It needs
    ``loss`` as a function of the parameter values, since the model must run again with the
    tangents attached (:func:`functional` makes one from a module and a closure), and every
    operation to have a forward-mode rule of its backward. No gradient graph is built; instead the
    forward pass keeps the tangent of every activation it saves (and PyTorch also records the tangent
    computations), so what it saves depends on the model: about what reverse mode needs with flashbob
    attention (1.01-1.02x on a 4-layer GPT on the H200; 0.75-1.0x on small GPTs on the CPU), about 40%
    more with attention that materialises its scores, and about 1.6x with activation checkpointing
    (docs/forward_mode.md). The FLOPs are about equal (attention: 48 against 52 :math:`NMd` per head).

    Args:
        loss: The scalar loss :math:`L(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only), or a function that computes it from parameter values, called with
            one tensor per parameter in the order of ``params`` (either mode).
        params: Parameters :math:`\theta = (\theta_1, \dots, \theta_m)`. Those that do not require
            grad are constants: their rows and columns of :math:`H` are zero, so their blocks of the
            result are zero and their blocks of ``vec`` are ignored.
        vec: :math:`v`, one tensor shaped like each parameter.
        grads: :math:`\nabla_\theta L` from ``torch.autograd.grad(loss, params, create_graph=True)``
            (``None`` entries mean zero). When given, ``loss`` is not differentiated again, so one
            gradient graph serves many products; pass ``retain_graph=True`` to keep it for the next.
            ``"reverse"`` only.
        retain_graph: Keep the graphs for further differentiation, as in :func:`torch.autograd.grad`.
            By default they are freed, as by ``loss.backward()``. ``"reverse"`` only.
        mode: ``"reverse"`` (reverse-over-reverse) or ``"forward"`` (forward-over-reverse).

    Returns:
        :math:`H v`, one tensor per parameter, holding no graph.

    Raises:
        ValueError: ``mode`` is neither, or ``grads``/``retain_graph`` are given with ``"forward"``.
        TypeError: ``mode="forward"`` with ``loss`` a computed tensor.
        NotImplementedError: ``mode="forward"`` through an operation that PyTorch (or a custom
            ``autograd.Function``) gives no forward-mode rule, e.g. the backward of ``F.silu`` in torch 2.13.
    """
    _check_mode(mode)
    if mode == "forward":
        if grads is not None or retain_graph:
            raise ValueError("hvp(mode='forward') builds no gradient graph: grads and retain_graph are for mode='reverse'")
        return _forward_over_reverse(_function_of_params(loss, "the loss", "hvp"), params, vec)[2]
    if grads is None:
        grads = _gradient(_evaluate(loss, params), params)
    return _vjp(grads, params, vec, retain_graph=retain_graph)


def _evaluate(fn: Tensor | ParamFunction, params: Tensors) -> Tensor:
    """``fn`` if it is a computed tensor, else ``fn`` called (with autograd on) on the parameters themselves."""
    if isinstance(fn, Tensor):
        return fn
    with torch.enable_grad():
        return fn(tuple(params))


class LossHessian(Protocol):
    r"""Hessian-vector product :math:`H_L u = \nabla^2_z \ell(z)\, u` of a loss w.r.t. the model outputs :math:`z`."""

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` for outputs :math:`z` and a tangent :math:`u` shaped like them."""
        ...


DEFAULT_CHUNK_ELEMENTS = 2**24
"""Logits per chunk of the cross-entropy curvature (:class:`CrossEntropyHessian`, SophiaG's label sampling):
16,777,216, so each float32 temporary of a chunk takes 64 MiB (512 rows at :math:`V = 32768`)."""


def check_reduction(reduction: str, owner: str) -> None:
    """Raise ``ValueError`` unless ``reduction`` is ``"mean"`` or ``"sum"`` (any other value was taken as ``"sum"``)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{owner}: reduction must be 'mean' or 'sum', got {reduction!r}")


def check_chunk_elements(chunk_elements: int) -> None:
    """Raise ``ValueError`` unless ``chunk_elements`` (logits per chunk) is a positive integer."""
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive integer (logits per chunk), got {chunk_elements!r}")


def check_count(name: str, value: object, of: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive integer (any integer type but ``bool``), a count of ``of``."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value < 1:
        raise ValueError(f"{name} must be a positive integer ({of}), got {value!r}")


def row_chunks(rows: int, classes: int, chunk_elements: int) -> list[slice]:
    """Consecutive slices covering ``range(rows)``, of ``max(1, chunk_elements // classes)`` rows each
    (the last may be shorter)."""
    check_chunk_elements(chunk_elements)
    step = max(1, chunk_elements // max(classes, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def logit_rows(logits: Tensor, targets: Tensor | None, ignore_index: int, owner: str) -> tuple[Tensor, Tensor]:
    """The logits as rows ``(R, V)`` (a view where the layout allows) and the mask of the rows that count.

    A row counts unless its target is ``ignore_index``; without ``targets`` every row counts.

    Raises:
        ValueError: ``logits`` has no class dimension; ``targets`` has not one entry per row, or is shaped
            neither like the logits without their last dimension nor flat (e.g. ``(T, B)`` targets for
            ``(B, T, V)`` logits, whose rows would be matched to the wrong targets).
    """
    if logits.dim() < 1:
        raise ValueError(f"{owner}: the logits need the classes in their last dimension, got a scalar")
    rows = logits.reshape(-1, logits.shape[-1])
    if targets is None:
        return rows, torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    if targets.numel() != rows.shape[0]:
        raise ValueError(
            f"{owner}: {targets.numel()} targets for the {rows.shape[0]} rows of the logits {tuple(logits.shape)}"
        )
    if targets.dim() > 1 and logits.dim() > 2 and targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"{owner}: targets {tuple(targets.shape)} do not line up with the logits {tuple(logits.shape)}: "
            f"expected them shaped {tuple(logits.shape[:-1])}, or flattened"
        )
    return rows, targets.reshape(-1).to(rows.device) != ignore_index


@dataclass(frozen=True)
class CrossEntropyHessian:
    r"""Hessian of ``F.cross_entropy`` w.r.t. the logits, in closed form, a chunk of rows at a time.

    Logits :math:`z` have the classes in the last dimension (``(B, V)``, or ``(B, T, V)`` for a
    language model, i.e. ``F.cross_entropy(z.flatten(0, -2), targets.flatten())``). For every row
    :math:`r` with :math:`p_r = \operatorname{softmax}(z_r)`,

    .. math:: (H_L u)_r = \frac{m_r}{c} \big(\operatorname{diag}(p_r) - p_r p_r^\top\big) u_r
              = \frac{m_r}{c}\, p_r \circ \big(u_r - p_r^\top u_r\big),

    where :math:`m_r = [\text{targets}_r \ne \text{ignore\_index}]` and :math:`c = \sum_r m_r`
    for ``reduction="mean"`` (at least 1), :math:`c = 1` for ``"sum"``. The targets enter only
    through :math:`m`; ignored rows are exactly zero (even where their logits are not finite).

    Rows are independent, so the product runs over chunks of ``chunk_elements // V`` rows:
    softmax is taken in at least float32 for one chunk at a time and each chunk's result is
    written into the output (dtype of ``u``). Beyond the output, a product holds a few float32
    chunks (about ``4 * chunk_elements * 4`` bytes), not float32 copies of all :math:`R \cdot V`
    logits; the result is the same for every chunk size (each row's arithmetic is unchanged).

    Args:
        targets: Class indices, one per row of the logits (shaped like them without their last
            dimension, or flattened).
        reduction: ``"mean"`` or ``"sum"``, as passed to ``F.cross_entropy``.
        ignore_index: Target value whose rows do not count.
        chunk_elements: Logits per chunk (rounded down to whole rows, at least one row).

    Raises:
        ValueError: ``reduction`` is neither ``"mean"`` nor ``"sum"``, or ``chunk_elements`` is not a
            positive integer; at a product, ``targets`` has not one entry per row, or ``out`` is not a
            contiguous tensor shaped like ``vec``.
    """

    targets: Tensor
    reduction: Reduction = "mean"
    ignore_index: int = -100
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        check_reduction(self.reduction, "CrossEntropyHessian")
        check_chunk_elements(self.chunk_elements)

    def __call__(self, outputs: Tensor, vec: Tensor, *, out: Tensor | None = None) -> Tensor:
        """Return :math:`H_L u` for logits ``outputs`` and tangent ``vec``.

        ``out`` receives the result (and is returned); it may be ``vec`` itself, which is then
        overwritten chunk by chunk, each chunk read before it is written.
        """
        logits, counted = logit_rows(outputs, self.targets, self.ignore_index, "CrossEntropyHessian")
        tangent = vec.reshape(logits.shape)
        if out is None:
            out = torch.empty(vec.shape, dtype=vec.dtype, device=vec.device)
        elif out.shape != vec.shape or out.dtype != vec.dtype or not out.is_contiguous():
            raise ValueError(
                f"CrossEntropyHessian: out must be a contiguous {vec.dtype} tensor of shape {tuple(vec.shape)}, got "
                f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
            )
        count = counted.sum().clamp_min(1) if self.reduction == "mean" else 1  # a tensor: no host synchronisation
        result = out.view(logits.shape)
        for rows in row_chunks(logits.shape[0], logits.shape[1], self.chunk_elements):
            z, u = logits[rows], tangent[rows]
            p = torch.softmax(z, dim=-1, dtype=torch.promote_types(z.dtype, torch.float32))
            hv = (u - (p * u).sum(dim=-1, keepdim=True)).mul_(p)
            result[rows] = hv.masked_fill_(~counted[rows, None], 0).div_(count)
        return out


@dataclass(frozen=True)
class MSEHessian:
    r"""Hessian of ``F.mse_loss`` w.r.t. the predictions: :math:`H_L u = \frac{2}{c} u`.

    :math:`c` is the number of prediction entries for ``reduction="mean"`` and 1 for ``"sum"``.

    Args:
        reduction: ``"mean"`` or ``"sum"``, as passed to ``F.mse_loss``.

    Raises:
        ValueError: ``reduction`` is neither.
    """

    reduction: Reduction = "mean"

    def __post_init__(self) -> None:
        check_reduction(self.reduction, "MSEHessian")

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` for predictions ``outputs`` and tangent ``vec``."""
        count = outputs.numel() if self.reduction == "mean" else 1
        return vec * (2.0 / count)


@dataclass(frozen=True)
class AutogradLossHessian:
    r"""Any twice-differentiable loss of the outputs, by autograd: :math:`H_L u = \nabla_z (\nabla_z \ell(z)^\top u)`.

    Args:
        loss_fn: Scalar loss :math:`\ell(z)` of the outputs alone (targets closed over), e.g.
            ``lambda z: F.cross_entropy(z.flatten(0, 1), y.flatten())``.
    """

    loss_fn: Callable[[Tensor], Tensor]

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` on a detached copy of ``outputs``, leaving the model graph alone."""
        with torch.enable_grad():
            z = outputs.detach().requires_grad_()
            return hvp(self.loss_fn(z), [z], [vec])[0]


class CurvatureOperator:
    r"""A symmetric :math:`n \times n` matrix on the flattened parameters, known through its products.

    ``op @ x`` takes a flat vector of length :math:`n` (parameters concatenated in order, each
    flattened row-major), an :math:`n \times k` matrix (column by column), or a sequence of
    tensors shaped like the parameters, and returns the same kind. Subclasses implement
    :meth:`matvec`.

    Args:
        params: The parameters :math:`\theta` that index rows and columns.
    """

    def __init__(self, params: Tensors) -> None:
        self.params = tuple(params)
        n = sum(p.numel() for p in self.params)
        self.shape = (n, n)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        """Return the product with ``vec``, one tensor per parameter."""
        raise NotImplementedError

    def __matmul__(self, x: Tensor | Tensors) -> Tensor | tuple[Tensor, ...]:
        if not isinstance(x, Tensor):
            return self.matvec(x)
        if x.dim() == 2:
            return torch.stack([self @ column for column in x.T], dim=1)
        return _flatten(self.matvec(_unflatten(x, self.params)))

    def to_scipy(self) -> LinearOperator:
        """A ``scipy.sparse.linalg.LinearOperator`` with float64 NumPy input and output."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def matvec(x: np.ndarray) -> np.ndarray:
            v = torch.from_numpy(np.asarray(x, dtype=np.float64).reshape(-1))
            parts = [part.to(self.device, p.dtype) for part, p in zip(_unflatten(v, self.params), self.params)]
            product = self.matvec(parts)  # each parameter's block in its own dtype (not all in the first one's)
            return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in product]).numpy()

        return LinearOperator(self.shape, matvec=matvec, rmatvec=matvec, dtype=np.float64)


class HessianOperator(CurvatureOperator):
    r"""The Hessian :math:`H = \nabla^2_\theta L(\theta)`.

    ``mode="reverse"``: the constructor runs one backward with ``create_graph=True``; each product
    is then one more vector-Jacobian product of that gradient (:func:`hvp` with ``grads``), retaining
    the graph, which lives as long as the operator does. Each product costs one backward of the
    backward; the memory of the gradient graph is held between products.

    ``mode="forward"``: nothing is kept; each product is a fresh forward-over-reverse pass
    (:func:`hvp` with ``mode="forward"``: a forward with tangents and a backward), so a product
    costs about twice a reverse-mode one, but no graph outlives it. The pass's values are the loss
    and the gradient at :math:`\theta`: the first product keeps them (:attr:`value`,
    :attr:`gradient`), so an estimator that needs the gradient too (Sophia's refresh) takes it
    without a pass of its own.

    Args:
        loss: Scalar loss :math:`L(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only), or a function of the parameter values (see :func:`functional`).
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        mode: ``"reverse"`` (reverse-over-reverse) or ``"forward"`` (forward-over-reverse).

    Attributes:
        value: :math:`L(\theta)`, detached: in reverse mode from the constructor, in forward mode from
            the first product (``None`` before it).
    """

    def __init__(self, loss: Tensor | ParamFunction, params: Tensors, *, mode: Mode = "reverse") -> None:
        _check_mode(mode)
        super().__init__(params)
        self.mode = mode
        self.value: Tensor | None = None
        if mode == "forward":
            self._loss_fn = _function_of_params(loss, "the loss", "HessianOperator")
        else:
            evaluated = _evaluate(loss, self.params)
            self.value = evaluated.detach()
            self._grads = _gradient(evaluated, self.params)

    @cached_property
    def gradient(self) -> tuple[Tensor, ...]:
        r""":math:`\nabla_\theta L`, detached: the gradient the products are taken at (in forward mode the
        first product's, or, asked before any product, one ordinary backward's)."""
        if self.mode == "reverse":
            return tuple(g.detach() for g in self._grads)
        return _vjp([_evaluate(self._loss_fn, self.params)], self.params, [None], retain_graph=False)

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        """Return :math:`H v`, one tensor per parameter."""
        if self.mode == "forward":
            value, gradient, product = _forward_over_reverse(self._loss_fn, self.params, vec)
            if self.value is None:
                self.value = value
                self.__dict__.setdefault("gradient", gradient)  # the cached property's slot
            return product
        return _vjp(self._grads, self.params, vec, retain_graph=True)


class GGNOperator(CurvatureOperator):
    r"""The generalised Gauss-Newton matrix :math:`G = J^\top H_L J`.

    :math:`J = \partial z / \partial \theta` is the Jacobian of the model outputs and :math:`H_L`
    the Hessian of the loss w.r.t. the outputs. Every product is :math:`J^\top (H_L (J v))`: a
    Jacobian-vector product, an :math:`H_L` product and a vector-Jacobian product through the graph
    of the outputs, which the operator keeps. The modes differ in how :math:`J v` is taken:

    ``mode="reverse"``: by the double-vjp trick. The constructor forms :math:`g(u) = J^\top u` for a
    dummy cotangent :math:`u` with ``create_graph=True``, and :math:`J v = \nabla_u (g(u)^\top v)`,
    which runs the double backward of every layer (attention included). A product costs two
    backwards and the operator holds the forward graph and the ``create_graph`` backward graph.

    ``mode="forward"``: by forward mode, :math:`J v = \frac{\mathrm{d}}{\mathrm{d}\varepsilon}
    z(\theta + \varepsilon v)|_{\varepsilon=0}` (as curvlinops computes it): each product runs the
    model once more with tangents and without autograd (nothing saved), then one backward. The
    operator holds only the forward graph, so it needs less memory; a product costs a forward and
    a backward, about the same as in reverse mode. ``outputs`` must then be a function of the
    parameter values, deterministic (no dropout), so that the extra forward passes agree with the
    graph. PyTorch's forward-mode rule of a matrix product forms :math:`\dot x W` and :math:`x \dot W`
    as tensors of their own and adds them into a third, so at a language model's head :math:`J v`
    holds the logits four times at once; ``lean_tangents=True`` runs linear layers (``F.linear``,
    ``x @ W``) through :class:`~optim._tangent_products.LeanLinearTangents`, which accumulates the
    second term into the first: the value and one tangent, half the memory. It is off by default
    because it is a ``TorchFunctionMode``, whose dispatch (a few microseconds per torch call) slows a
    forward whose time is set by the host, not the GPU (on the CPU a tiny GPT's :math:`J v` took
    about 1.45x as long).

    Args:
        outputs: Model outputs :math:`z(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only), or a function of the parameter values (see :func:`functional`).
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        loss_hessian: :math:`u \mapsto H_L u`, e.g. :class:`CrossEntropyHessian`, :class:`MSEHessian`
            or :class:`AutogradLossHessian`.
        mode: ``"reverse"`` (double-vjp) or ``"forward"`` (forward-mode :math:`J v`).
        evaluated: ``"forward"`` only: the outputs already computed at the parameters' current values,
            with their graph (what ``outputs(params)`` would return); spares the constructor that forward.
        lean_tangents: ``"forward"`` only: take :math:`J v` with the lean rules of linear layers (above).

    Raises:
        ValueError: ``mode`` is neither; ``evaluated`` or ``lean_tangents`` with ``"reverse"``, or
            ``lean_tangents`` not a bool.
    """

    def __init__(
        self,
        outputs: Tensor | ParamFunction,
        params: Tensors,
        loss_hessian: LossHessian,
        *,
        mode: Mode = "reverse",
        evaluated: Tensor | None = None,
        lean_tangents: bool = False,
    ) -> None:
        _check_mode(mode)
        if not isinstance(lean_tangents, bool):
            raise ValueError(f"GGNOperator: invalid lean_tangents: {lean_tangents!r}; expected True or False")
        super().__init__(params)
        self.mode = mode
        self.loss_hessian = loss_hessian
        self.lean_tangents = lean_tangents
        if mode == "forward":
            self._outputs_fn = _function_of_params(outputs, "the outputs", "GGNOperator")
        elif evaluated is not None:
            raise ValueError("GGNOperator: evaluated is for mode='forward' (in reverse mode pass the outputs)")
        elif lean_tangents:
            raise ValueError("GGNOperator: lean_tangents is for mode='forward' (reverse mode takes J v by backward)")
        self.outputs = _evaluate(outputs, self.params) if evaluated is None else evaluated
        if mode == "reverse":
            self._dummy = torch.zeros_like(self.outputs, requires_grad=True)
            self._transposed = _vjp([self.outputs], self.params, [self._dummy], retain_graph=True, create_graph=True)

    def jvp(self, vec: Tensors) -> Tensor:
        r"""Return :math:`J v`, shaped like the outputs.

        Raises:
            RuntimeError: ``"forward"`` with outputs from :func:`functional` of a module that would run with
                dropout (:func:`check_deterministic`).
        """
        if self.mode == "forward":
            check_deterministic("GGNOperator", getattr(self._outputs_fn, "module", None))
            return _forward_jvp(self._outputs_fn, self.params, vec, lean=self.lean_tangents)
        return _vjp(self._transposed, [self._dummy], vec, retain_graph=True)[0]

    def vjp(self, cotangent: Tensor) -> tuple[Tensor, ...]:
        r"""Return :math:`J^\top c`, one tensor per parameter."""
        return _vjp([self.outputs], self.params, [cotangent], retain_graph=True)

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        r"""Return :math:`G v = J^\top H_L J v`, one tensor per parameter.

        A :class:`CrossEntropyHessian` writes :math:`H_L J v` over :math:`J v` when that is a
        buffer of the product's own (not a view of ``vec``), so the product holds one tensor the
        size of the outputs where it would hold two.
        """
        tangent = self.jvp(vec)
        if isinstance(self.loss_hessian, CrossEntropyHessian) and _own_buffer(tangent, vec):
            return self.vjp(self.loss_hessian(self.outputs.detach(), tangent, out=tangent))
        return self.vjp(self.loss_hessian(self.outputs.detach(), tangent))


def _own_buffer(tensor: Tensor, others: Tensors) -> bool:
    """Whether ``tensor`` may be overwritten: contiguous, without a graph, sharing memory with none of ``others``."""
    storage = tensor.untyped_storage().data_ptr()
    return (
        tensor.is_contiguous()
        and not tensor.requires_grad
        and all(other.untyped_storage().data_ptr() != storage for other in others)
    )


class LossGraphHessian:
    r"""The Hessian of an already computed ``loss`` w.r.t. the ``outputs`` it was computed from,
    by double backward through the loss's own graph: :math:`H_L u = \nabla_z (\nabla_z L^\top u)`.

    The gradient :math:`\nabla_z L` is formed once (``create_graph=True``); each product is one
    more vector-Jacobian product on it. Used by :func:`ggnvp` when no closed form is given.
    """

    def __init__(self, loss: Tensor, outputs: Tensor) -> None:
        self.outputs = outputs
        (self.gradient,) = _vjp([loss], [outputs], [None], retain_graph=True, create_graph=True)

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u`; ``outputs`` is ignored (the product runs on the loss's own graph)."""
        return _vjp([self.gradient], [self.outputs], [vec], retain_graph=True)[0]


def ggnvp(
    loss: Tensor | None,
    outputs: Tensor | ParamFunction,
    params: Tensors,
    vec: Tensors,
    loss_hessian: LossHessian | None = None,
    *,
    mode: Mode = "reverse",
    lean_tangents: bool = False,
) -> tuple[Tensor, ...]:
    r"""Generalised Gauss-Newton-vector product :math:`G v = J^\top H_L J v` (see :class:`GGNOperator`).

    Args:
        loss: The scalar loss computed from ``outputs`` (a tensor); :math:`H_L` is its Hessian w.r.t.
            the outputs, by double backward through its graph, unless ``loss_hessian`` gives it
            (then ``loss`` may be None). Its graph is kept.
        outputs: Model outputs :math:`z(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only; the graph is kept), or a function of the parameter values (see
            :func:`functional`; then ``loss_hessian`` is needed).
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        vec: :math:`v`, one tensor shaped like each parameter.
        loss_hessian: :math:`u \mapsto H_L u`, e.g. ``CrossEntropyHessian(targets)`` or ``MSEHessian()``
            in closed form (faster than autograd), or :class:`AutogradLossHessian`.
        mode: ``"reverse"`` (:math:`J v` by double-vjp) or ``"forward"`` (by forward mode).
        lean_tangents: ``"forward"`` only: linear layers' tangents in one buffer (:class:`GGNOperator`).

    Returns:
        :math:`G v`, one tensor per parameter.
    """
    _check_mode(mode)
    if loss_hessian is None:
        if loss is None or not isinstance(outputs, Tensor):
            raise ValueError(
                "ggnvp needs the loss and the outputs it was computed from, or a loss_hessian such as "
                "CrossEntropyHessian(targets) or AutogradLossHessian(loss_of_outputs) (always with mode='forward')"
            )
        loss_hessian = LossGraphHessian(loss, outputs)
    return GGNOperator(outputs, params, loss_hessian, mode=mode, lean_tangents=lean_tangents).matvec(vec)


OperatorLike = CurvatureOperator | tuple[Tensor, Tensors]


def _as_operator(operator: OperatorLike) -> CurvatureOperator:
    """An operator as given, or the Hessian of a ``(loss, params)`` pair."""
    if isinstance(operator, CurvatureOperator):
        return operator
    loss, params = operator
    return HessianOperator(loss, params)


def _probe(params: Tensors, distribution: Distribution, generator: torch.Generator | None) -> tuple[Tensor, ...]:
    """Random tensors shaped like ``params`` with i.i.d. zero-mean, unit-variance entries."""
    if distribution == "rademacher":
        signs = (torch.randint(0, 2, p.shape, generator=generator, device=p.device) for p in params)
        return tuple(s.to(p.dtype) * 2 - 1 for s, p in zip(signs, params))
    if distribution == "gaussian":
        return tuple(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) for p in params)
    raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")


def hutchinson_diagonal(
    operator: OperatorLike,
    num_samples: int = 1,
    distribution: Distribution = "rademacher",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, ...]:
    r"""Hutchinson's estimate of the diagonal of a curvature matrix :math:`A`.

    .. math:: \widehat{\operatorname{diag}}(A) = \frac{1}{S} \sum_{s=1}^{S} z_s \circ A z_s,
              \qquad \mathbb{E}\big[\widehat{\operatorname{diag}}(A)\big] = \operatorname{diag}(A),

    with probes :math:`z_s` of i.i.d. Rademacher (:math:`\pm 1`) or standard normal entries. With
    Rademacher probes :math:`z_i^2 = 1`, so a diagonal :math:`A` is recovered exactly from one sample.

    Args:
        operator: A :class:`CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        num_samples: Number of probes :math:`S`.
        distribution: ``"rademacher"`` or ``"gaussian"``.
        generator: Source of the probes (on the parameters' device); the global one if ``None``.

    Returns:
        The estimate, one tensor per parameter.

    Raises:
        ValueError: ``num_samples`` is not a positive integer (0 gave NaN, a negative count zeros).
    """
    check_count("num_samples", num_samples, "probes")
    op = _as_operator(operator)
    total = [torch.zeros_like(p) for p in op.params]
    for _ in range(num_samples):
        z = _probe(op.params, distribution, generator)
        for acc, zi, azi in zip(total, z, op.matvec(z), strict=True):
            acc.add_(zi * azi)
    return tuple(acc / num_samples for acc in total)


def trace(
    operator: OperatorLike,
    num_samples: int = 1,
    distribution: Distribution = "rademacher",
    generator: torch.Generator | None = None,
) -> float:
    r"""Hutchinson's estimate of the trace of a curvature matrix :math:`A`.

    .. math:: \widehat{\operatorname{tr}}(A) = \frac{1}{S} \sum_{s=1}^{S} z_s^\top A z_s,
              \qquad \mathbb{E}\big[\widehat{\operatorname{tr}}(A)\big] = \operatorname{tr}(A),

    the sum of :func:`hutchinson_diagonal` over all entries; arguments are as there.
    """
    diagonal = hutchinson_diagonal(operator, num_samples, distribution, generator)
    return float(sum(d.sum() for d in diagonal))


def power_iteration(
    operator: OperatorLike,
    *,
    max_iter: int = 100,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
) -> tuple[float, tuple[Tensor, ...]]:
    r"""The eigenvalue of largest magnitude of a curvature matrix :math:`A`, and its eigenvector.

    From a random unit :math:`v_0`, iterates :math:`v_{k+1} = A v_k / \lVert A v_k \rVert` and
    returns the Rayleigh quotient :math:`\lambda = v_k^\top A v_k` with :math:`v_k` once the residual
    satisfies :math:`\lVert A v_k - \lambda v_k \rVert \le \text{tol}\, |\lambda|`, or after
    ``max_iter`` products, with a ``RuntimeWarning`` that gives the residual: then :math:`\lambda` need not
    be an eigenvalue (it does not converge when :math:`|\lambda_2| = |\lambda_1|`, e.g. a saddle with
    eigenvalues :math:`\pm\lambda`). Convergence is geometric in :math:`|\lambda_2 / \lambda_1|`.

    Args:
        operator: A :class:`CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        max_iter: Maximum number of matrix-vector products (at least 1).
        tol: Relative residual at which to stop.
        generator: Source of :math:`v_0` (on the parameters' device); the global one if ``None``.

    Returns:
        :math:`\lambda` and :math:`v` (unit norm over all parameters, one tensor per parameter).

    Raises:
        ValueError: ``max_iter`` is not a positive integer.
    """
    check_count("power_iteration: max_iter", max_iter, "products")
    op = _as_operator(operator)
    v = torch.randn(op.shape[0], generator=generator, device=op.device, dtype=op.dtype)
    v = v / torch.linalg.vector_norm(v)
    for step in range(max_iter):
        w = op @ v
        eigenvalue = torch.dot(v, w)
        residual = torch.linalg.vector_norm(w - eigenvalue * v)
        if residual <= tol * eigenvalue.abs():
            break
        if step == max_iter - 1:
            warnings.warn(
                f"power_iteration did not converge in {max_iter} products: relative residual "
                f"{float(residual / eigenvalue.abs()):.3g} > tol {tol}, so {float(eigenvalue):.6g} need not be an "
                "eigenvalue (the two largest eigenvalues may have equal magnitude); raise max_iter or check A",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
            break
        v = w / torch.linalg.vector_norm(w)
    return float(eigenvalue), _unflatten(v, op.params)
