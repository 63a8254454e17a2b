"""``functional(module, fn)``: a closure that runs a module as a function of values for its parameters, the form
that forward-mode products take (they run the model again with tangents attached to the values)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from optim import compiled
from optim.swap import swapped

Tensors = Sequence[Tensor]
Result = TypeVar("Result")

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
    ``fn`` must be deterministic (no dropout) for the products to be those of one matrix, and must reach
    the parameters through ``module``: a tensor it captured before (``w = model.weight; lambda: f(x @ w)``)
    is not replaced, so its derivatives would be zero. The first
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

