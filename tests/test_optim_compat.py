"""Each private torch API that optim relies on (``optim._compat``) still exists and behaves as optim expects, on a
tiny case; a failure names the API that the installed torch release removed or changed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.utils.checkpoint
from torch import nn

from optim import _compat

ROOT = Path(__file__).resolve().parent.parent


def require(path: str) -> None:
    """Fail, naming ``path`` (``torch.a.b``), if the installed torch has no such attribute."""
    owner = torch
    for part in path.split(".")[1:]:
        assert hasattr(owner, part), f"torch {torch.__version__} has no {path}, which optim._compat relies on"
        owner = getattr(owner, part)


def broke(api: str, function: str) -> str:
    return f"torch {torch.__version__}: {api} no longer behaves as optim._compat.{function} expects"


def test_peek_interpreter_stack_tells_a_torch_func_transform():
    require("torch._C._functorch.peek_interpreter_stack")
    inside = []
    torch.func.vmap(lambda x: inside.append(_compat.inside_functorch_transform()) or x)(torch.ones(2))
    assert inside == [True] and not _compat.inside_functorch_transform(), broke(
        "torch._C._functorch.peek_interpreter_stack", "inside_functorch_transform")


def test_are_functorch_transforms_active_tells_a_torch_func_transform():
    require("torch._C._are_functorch_transforms_active")
    inside = []
    torch.func.grad(lambda x: inside.append(_compat.functorch_transforms_active()) or x.sum())(torch.ones(2))
    assert inside == [True] and not _compat.functorch_transforms_active(), broke(
        "torch._C._are_functorch_transforms_active", "functorch_transforms_active")


def test_disabled_torch_function_impl_is_the_default_of_plain_tensors_and_parameters():
    require("torch._C._disabled_torch_function_impl")

    class Custom(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    plain, parameter = torch.ones(2), nn.Parameter(torch.ones(2))
    assert _compat.torch_function_is_default(plain) and _compat.torch_function_is_default(parameter), broke(
        "torch._C._disabled_torch_function_impl", "torch_function_is_default")
    assert not _compat.torch_function_is_default(torch.ones(2).as_subclass(Custom))


class Double(torch.autograd.Function):
    """:math:`x \mapsto 2x` without a forward-mode rule; its backward records whether the backward running keeps
    the graph."""

    keeps_graph: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        Double.keeps_graph.append(_compat.backward_keeps_graph())
        return grad * 2


def test_get_current_graph_task_keep_graph_tells_retain_graph():
    require("torch._C._autograd._get_current_graph_task_keep_graph")
    Double.keeps_graph.clear()
    y = Double.apply(torch.ones(2, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert Double.keeps_graph == [True, False], broke("torch._C._autograd._get_current_graph_task_keep_graph",
                                                      "backward_keeps_graph")


def test_version_counter_advances_on_an_in_place_change():
    x = torch.ones(2)
    before = _compat.version(x)
    x.mul_(2)
    assert _compat.version(x) > before, broke("Tensor._version", "version")


def test_modules_hold_their_tensors_in_parameter_and_buffer_slots():
    norm = nn.BatchNorm1d(2)
    parameters, buffers = _compat.slots(norm)
    assert parameters["weight"] is norm.weight and buffers["running_mean"] is norm.running_mean, broke(
        "nn.Module._parameters and _buffers", "slots")


def test_a_missing_forward_mode_rule_of_torch_checkpoint_is_told_by_its_traceback():
    """The reentrant ``torch.utils.checkpoint`` applies an autograd Function without a forward-mode rule: its error
    comes from torch/utils/checkpoint.py (and names forward AD, which optim.forward_mode_checks reads); a user's
    Function without one is not taken for it."""
    errors = []
    for run in (lambda x: torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=True), Double.apply):
        with fwAD.dual_level(), pytest.raises(NotImplementedError) as error:
            run(fwAD.make_dual(torch.ones(2), torch.ones(2)))
        errors.append(error.value)
    from_checkpoint, from_user = errors
    assert _compat.raised_in_torch_checkpoint(from_checkpoint), broke(
        "the traceback of torch.utils.checkpoint's errors (torch/utils/checkpoint.py)", "raised_in_torch_checkpoint")
    assert not _compat.raised_in_torch_checkpoint(from_user)
    assert all(re.search(r"forward[- ](mode )?AD", str(e)) for e in errors), (
        f"torch {torch.__version__}: the error of a missing forward-mode rule no longer names forward AD, which "
        "optim.forward_mode_checks.forward_mode_errors reads")


def test_every_foreach_operation_optim_calls_exists():
    used = sorted({name for path in (ROOT / "optim").glob("*.py")
                   for name in re.findall(r"torch\.(_foreach_\w+)", path.read_text())})
    missing = [name for name in used if not hasattr(torch, name)]
    assert used and not missing, f"torch {torch.__version__} has no torch.{', torch.'.join(missing)}, which optim calls"


def test_compat_is_the_only_module_that_reaches_into_torch_private_apis():
    """``torch._C`` and the like (``torch._foreach_*`` aside, checked above) appear nowhere else in optim."""
    others = {path.name: re.findall(r"torch\._(?!_|foreach)\w+", path.read_text())
              for path in sorted((ROOT / "optim").glob("*.py")) if path.name != "_compat.py"}
    assert not {name: found for name, found in others.items() if found}
