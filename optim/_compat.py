"""The private torch APIs that optim relies on, each behind one function that says why it is needed.

Each is in use with torch 2.11 and 2.13, the releases this package is tested with. ``tests/test_optim_compat.py``
checks every one of them on a tiny case, with the installed torch, and names the API that a release broke: a
function here is then the one place to mend.

Not wrapped: ``torch._foreach_*``, the multi-tensor operations that torch.optim's own optimizers are built on
(documented under "Foreach Operations" in torch's reference); the test checks that each one optim calls exists.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch import Tensor, nn

#: ``__torch_function__`` of the tensor types whose operations are torch's own (plain tensors, parameters)
_DEFAULT_TORCH_FUNCTIONS = (Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def inside_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ...) is running, by its interpreter stack
    (``torch._C._functorch.peek_interpreter_stack``; torch has no public query). The lean tangent rules of linear
    layers write into a tangent buffer in place, which a ``vmap`` over tangents (a batched operand, an unbatched
    buffer) cannot hold, so they step aside there."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def functorch_transforms_active() -> bool:
    """Whether ``torch.func`` transforms are active (``torch._C._are_functorch_transforms_active``): the
    checkpoint's autograd Function has no functorch rules, so it runs the module plainly under them."""
    return torch._C._are_functorch_transforms_active()


def torch_function_is_default(value: object) -> bool:
    """Whether ``value``'s type leaves ``__torch_function__`` to torch (``Tensor``'s own, or
    ``torch._C._disabled_torch_function_impl``, which ``nn.Parameter`` and tensors built without a subclass use).
    A subclass that overrides it (say to compute ``F.linear`` its own way) must see every product of a tangent, so
    the lean tangent rules leave its operations to torch."""
    function = getattr(type(value), "__torch_function__", None)
    return getattr(function, "__func__", function) in _DEFAULT_TORCH_FUNCTIONS


def backward_keeps_graph() -> bool:
    """Whether the backward running now retains the graph (``retain_graph=True``), by
    ``torch._C._autograd._get_current_graph_task_keep_graph`` (torch has no public query; ``torch.utils.checkpoint``
    uses it too). A checkpointed block frees what it kept for its recomputation when the backward frees the graph,
    not when the last reference to the graph goes."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def version(tensor: Tensor) -> int:
    """The version counter of ``tensor``'s storage (``Tensor._version``), which every in-place operation advances:
    how a checkpoint notices that a module modified its input in place (autograd's saved tensors check it too)."""
    return tensor._version


def slots(module: nn.Module) -> tuple[dict[str, Tensor | None], dict[str, Tensor | None]]:
    """The dicts in which ``module`` itself holds its parameters and its buffers (``_parameters``, ``_buffers``),
    as ``torch.nn.utils.stateless`` and ``torch.func.functional_call`` use them: swapping a tensor in its slot, not
    by ``setattr`` (which would refuse a plain tensor for a parameter), keeps every name that reaches it."""
    return module._parameters, module._buffers


def raised_in_torch_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` came from an autograd Function that ``torch.utils.checkpoint`` itself applies, not from one
    the checkpointed code applied: the last frame of its traceback outside ``torch/autograd/function.py`` is in
    ``torch/utils/checkpoint.py``. The error of a missing forward-mode rule names no operation, so this is how
    forward mode tells that activation checkpointing (without a forward-mode rule in torch 2.11) is the cause."""
    callers = [Path(frame.filename).parts[-3:] for frame in traceback.extract_tb(error.__traceback__)
               if Path(frame.filename).parts[-3:] != ("torch", "autograd", "function.py")]
    return bool(callers) and callers[-1] == ("torch", "utils", "checkpoint.py")
