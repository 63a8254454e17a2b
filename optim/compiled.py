"""Curvature passes with ``torch.compile``'d models.

``torch.compile`` (through AOTAutograd) compiles a forward and its backward, but not the backward's backward:
differentiating a compiled graph twice raises "torch.compile with aot_autograd does not currently support double
backward" (or, where inductor donated the backward's buffers, an error about donated buffers). Second-order
products therefore need the model's forward run eagerly. :func:`eager` runs a block so (compiled modules and
functions fall back to their Python code, ``torch.compiler.set_stance("force_eager")``): the optimizers evaluate
their closure under it on the steps that differentiate twice, and :func:`optim.functional` always does (its runs
carry forward-mode tangents), so training loops keep their compiled first-order steps. A loss the caller computed
through a compiled model and hands to a reverse-mode product cannot be run again: :func:`explained` turns PyTorch's
error into one that names torch.compile and the way out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: PyTorch's messages for a compiled graph differentiated twice
_COMPILED_TWICE = ("does not currently support double backward", "donated buffer")

COMPILED_TWICE_ERROR = (
    "the loss (or outputs) came from a torch.compile'd model, and torch.compile cannot differentiate its graph "
    "twice, which a second-order product does. Compute them eagerly for the curvature pass: "
    "`with torch.compiler.set_stance('force_eager'): loss = model(x)` (the compiled model runs its Python code), "
    "or pass a function of the parameters (optim.functional(model, fn), which runs eagerly), or let an optim "
    "optimizer evaluate the closure (its second-order passes run eagerly)"
)


def eager() -> contextlib.AbstractContextManager:
    """A context in which ``torch.compile``'d modules and functions run their Python code (no compiled graph)."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def explained(owner: str) -> Iterator[None]:
    """Re-raise PyTorch's error for a compiled graph differentiated twice as :data:`COMPILED_TWICE_ERROR`."""
    try:
        yield
    except RuntimeError as error:
        if any(message in str(error) for message in _COMPILED_TWICE):
            raise RuntimeError(f"{owner}: {COMPILED_TWICE_ERROR}") from error
        raise
