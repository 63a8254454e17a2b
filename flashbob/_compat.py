"""The private PyTorch and Triton APIs flashbob relies on, in one place.

Each function wraps one private API, says why no public one does the job, and names the versions checked:
torch 2.11 and 2.13, Triton 3.6 and 3.9. ``tests/test_compat.py`` exercises every one of them, so a release that
removes or changes one fails there with the API's name rather than deep inside an attention call.
"""

from __future__ import annotations

import torch
from torch._C._functorch import is_functorch_wrapped_tensor, is_legacy_batchedtensor
from torch._functorch.utils import unwrap_dead_wrappers
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor


def is_legacy_batched(x) -> bool:
    """Whether ``x`` is a tensor batched by PyTorch's legacy vmap (``torch._vmap_internals``), which
    ``torch.autograd.grad(..., is_grads_batched=True)``, ``torch.autograd.functional.jacobian``/``hessian`` with
    ``vectorize=True`` and gradcheck's batched checks use. That vmap does not call ``Function.vmap`` rules, and
    nothing public tells its tensors apart (``torch._C._functorch.is_legacy_batchedtensor``)."""
    return isinstance(x, torch.Tensor) and is_legacy_batchedtensor(x)


def legacy_vmap_level() -> int:
    """The nesting depth of the legacy vmap, which is the level of its innermost batched tensors: read by
    incrementing and decrementing its nesting counter (``torch._C._vmapmode_increment_nesting``), its only
    accessor."""
    depth = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    return depth


def remove_legacy_batch_dim(x: torch.Tensor, level: int, batch_size: int) -> torch.Tensor:
    """The plain tensor under a legacy-batched ``x``, its batch dimension first (``torch._remove_batch_dim``);
    ``batch_size`` 0 leaves an unbatched tensor as it is (used to read the batch size)."""
    return torch._remove_batch_dim(x, level, batch_size, 0)


def add_legacy_batch_dim(x: torch.Tensor, level: int) -> torch.Tensor:
    """``x``'s first dimension made the legacy vmap's batch dimension at ``level`` (``torch._add_batch_dim``)."""
    return torch._add_batch_dim(x, 0, level)


def functorch_transforms_active() -> bool:
    """Whether a ``torch.func`` transform is active (``torch._C._are_functorch_transforms_active``): outside one,
    :func:`flashbob.autograd.apply` skips ``Function.apply``'s argument binding, ~15 us a call on the CPU."""
    return torch._C._are_functorch_transforms_active()


def unwrap_finished_transforms(args: tuple) -> tuple:
    """``args`` with tensors of finished ``torch.func`` transforms unwrapped, as ``Function.apply`` does before
    its C++ call (``torch._functorch.utils.unwrap_dead_wrappers``)."""
    return unwrap_dead_wrappers(args)


def is_functorch_wrapped(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``torch.func`` transform's wrapper, whose values cannot be read
    (``torch._C._functorch.is_functorch_wrapped_tensor``; no public test exists)."""
    return is_functorch_wrapped_tensor(x)


def is_traced(x) -> bool:
    """Whether ``x`` is a tensor being traced (torch.compile, ``make_fx``): a fake tensor, or aot_autograd's
    functional tensor over one. They have shapes but no data; nothing public tells them apart
    (``torch._subclasses.FakeTensor``, ``FunctionalTensor``)."""
    return isinstance(x, (FakeTensor, FunctionalTensor))


def triton_has_allocator() -> bool:
    """Whether this thread has a Triton scratch-memory allocator, which tensor descriptors made inside a kernel
    need. Triton's default raises at launch; ``triton.set_allocator`` is public but nothing public reads the
    current one (``triton.runtime._allocation``)."""
    from triton.runtime import _allocation

    return not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
