"""Kernel launches on tensors that are being traced (torch.compile, ``make_fx``): fake tensors, or functional
tensors over them, which have shapes but no data.

Such a launch goes through :func:`torch.library.wrap_triton`, which records the kernel in the graph being traced
(on fake tensors alone it does nothing); its configuration comes from the tuning cache, a table or the
defaults, never from timing candidates (there is nothing to time); and in Triton's interpreter, whose kernels
``wrap_triton`` cannot record, it launches nothing: a pass run on fake tensors there is the fake implementation
of its operator (:mod:`flashbob.operators`), whose outputs' shapes are all it gives.
"""

from __future__ import annotations

import os

import torch

from flashbob import _compat


def traced(args: tuple) -> bool:
    """Whether the first tensor of ``args`` is being traced (a fake or functional tensor)."""
    first = next((x for x in args if isinstance(x, torch.Tensor)), None)
    return _compat.is_traced(first)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launcher(jit_fn, args: tuple):
    """What launches ``jit_fn`` on ``args``: the kernel itself on real tensors, its :func:`torch.library.wrap_triton`
    on traced ones (which records it in the graph)."""
    return torch.library.wrap_triton(jit_fn) if traced(args) else jit_fn


def address(x: torch.Tensor) -> int:
    """The address of ``x``'s first element for alignment checks: for a traced tensor its offset in bytes into
    its storage (whose own start is aligned, as every allocation is)."""
    return x.storage_offset() * x.element_size() if traced((x,)) else x.data_ptr()
