"""The guard against non-finite values: a step whose loss, gradient, curvature or update is not finite is skipped
with a ``RuntimeWarning`` and leaves the parameters and the optimizer state as they were."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

NON_FINITE_UPDATE = "update (a new parameter or state value)"  # the cause a warning names
#: Where the frames of a step live: a warning points at the first frame outside them (the user's call)
_INTERNAL = (str(Path(__file__).parent), str(Path(torch.__file__).parent))


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


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the caller of this function at the first frame outside
    optim and torch: the user's call of ``step`` (or of the function that warns)."""
    frame, level = inspect.currentframe(), 1
    frame = frame.f_back if frame is not None else None  # the function that warns: stacklevel 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def warn_skipped(owner: str, cause: str, unchanged: str = "the parameters and optimizer state") -> None:
    """Warn that a step was skipped because ``cause`` (e.g. 'loss') was not finite, leaving ``unchanged`` as it was."""
    warnings.warn(
        f"{owner}: non-finite {cause}; the step was skipped and {unchanged} left unchanged",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
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
        warn_skipped(owner, NON_FINITE_UPDATE)
        return False
    for item in items:
        commit(item, propose(item))
    return True
