r"""Averaging gradients, curvature products and losses over data-parallel ranks for the second-order optimizers.

Data parallelism splits a batch over :math:`R` processes ("ranks"). When every rank's loss is
the mean over an equal share of the batch, :math:`L = \frac1R \sum_r L_r`, so every quantity
that is linear in the loss is the rank average of its local values:

.. math:: \nabla L = \frac1R \sum_r \nabla L_r, \qquad
          H v = \frac1R \sum_r H_r v, \qquad G v = \frac1R \sum_r G_r v.

DDP averages gradients in hooks that only ``loss.backward()`` runs; ``torch.autograd.grad``,
which the optimizers of :mod:`optim` use for gradients and curvature products, bypasses them.
The optimizers therefore take a ``distributed`` argument and call :func:`all_average` on every
such quantity themselves. Anything computed from averaged values (CG inner products, step
sizes, damping) is then bitwise the same on every rank and needs no communication, provided the
random probes are the same on every rank: :func:`shared_generator` makes such a generator.
``docs/distributed.md`` lists what each optimizer reduces per step and what it costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from optim.operators import CurvatureOperator

Group = dist.ProcessGroup | None
#: What the optimizers' ``distributed`` argument takes: ``False``, ``True`` (the default group) or a group.
Distributed = bool | dist.ProcessGroup
#: Elements per all-reduce call: bounds the temporary flat buffer (1 GiB in float32).
BUCKET_NUMEL = 1 << 28


def resolve(distributed: Distributed | None, owner: str) -> Group:
    """The process group to average over: ``None`` when ``distributed`` is false or the group has one rank.

    ``True`` means the default group (``torch.distributed.group.WORLD``); a ``ProcessGroup`` is used as given.

    Raises:
        RuntimeError: ``distributed`` is set but ``torch.distributed`` is not initialised.
    """
    if distributed is None or distributed is False:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{owner}(distributed=...) needs torch.distributed initialised first "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    group = dist.group.WORLD if distributed is True else distributed
    return group if dist.get_world_size(group) > 1 else None


def all_average(tensors: Sequence[Tensor], group: Group) -> tuple[Tensor, ...]:
    r"""The element-wise mean :math:`\frac1R \sum_r t^{(r)}` of each tensor over the ranks of ``group``.

    Tensors of one dtype and device travel together in flat buffers of at most
    :data:`BUCKET_NUMEL` elements, one ``all_reduce`` (sum) per buffer; the inputs are not
    modified. Every rank receives the same bits. With ``group=None`` the tensors are returned as
    they are.

    Args:
        tensors: The rank's local values; every rank passes tensors of the same shapes in the same order.
        group: A process group from :func:`resolve`, or ``None``.

    Returns:
        The averages, shaped like ``tensors``.
    """
    tensors = tuple(tensors)
    if group is None or not tensors:
        return tensors
    size = dist.get_world_size(group)
    out: list[Tensor | None] = [None] * len(tensors)
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    for indices in kinds.values():
        bucket: list[int] = []
        numel = 0
        for i in [*indices, None]:
            if bucket and (i is None or numel + tensors[i].numel() > BUCKET_NUMEL):
                flat = torch.cat([tensors[j].detach().reshape(-1) for j in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                flat.div_(size)
                for j, chunk in zip(bucket, torch.split(flat, [tensors[j].numel() for j in bucket])):
                    out[j] = chunk.view_as(tensors[j])
                bucket, numel = [], 0
            if i is not None:
                bucket.append(i)
                numel += tensors[i].numel()
    return tuple(out)


def all_average_together(
    first: Sequence[Tensor], second: Sequence[Tensor], group: Group
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """:func:`all_average` of both sequences in one call (a gradient and a curvature estimate), split again."""
    averaged = all_average((*first, *second), group)
    return averaged[: len(first)], averaged[len(first) :]


def average_loss(loss: Tensor, group: Group) -> Tensor:
    """The mean of a one-element loss over the ranks (detached); ``loss`` itself when ``group`` is ``None``."""
    if group is None:
        return loss
    return all_average([loss.detach().reshape(1).clone()], group)[0].reshape(loss.shape)


def on_any_rank(flags: Sequence[bool], device: torch.device, group: Group) -> list[bool]:
    """For each flag, whether it is true on some rank of ``group``: one all-reduce of ``len(flags)`` numbers and a
    host synchronisation (a collective: every rank must call this together); the flags as given when ``group`` is
    ``None``."""
    flags = list(flags)
    if group is None or not flags:
        return flags
    counts = torch.tensor(flags, dtype=torch.float32, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return (counts > 0).tolist()


def shared_generator(device: torch.device, group: Group, *, per_rank: bool = False) -> torch.Generator:
    """A generator on ``device`` seeded from one seed drawn on the first rank of ``group``.

    Every rank draws a seed from its global torch generator (advancing it once) and all take the
    first rank's by broadcast (a collective: every rank must call this together). The generators
    are then alike on every rank (for probes that must agree), or, with ``per_rank``, seeded with
    that seed plus the rank's index in ``group`` (for samples that should be independent).
    """
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    offset = 0
    if group is not None:
        seed = seed.to(device)
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
        offset = dist.get_rank(group) if per_rank else 0
    return torch.Generator(device=device).manual_seed(int(seed) + offset)


def check_alike(generator: torch.Generator | None, device: torch.device, group: Group, owner: str) -> None:
    r"""Raise ``RuntimeError`` unless ``generator`` is in the same state on every rank of ``group``.

    Probes that must agree across ranks (Hutchinson's: the rank average of :math:`u \circ H_r u` is the
    whole batch's estimate only for one :math:`u`) come from such a generator; one seeded differently per
    rank would give every rank the same, wrong, average without any sign. One all-reduce of two numbers
    (a fingerprint of the state and its square: their spread is 0 only if all ranks agree). Nothing to
    check in one process or without a generator.
    """
    if group is None or generator is None:
        return
    state = generator.get_state().double()
    fingerprint = float((state * torch.arange(1, state.numel() + 1, dtype=torch.float64)).sum())
    moments = torch.tensor([fingerprint, fingerprint**2], dtype=torch.float64, device=device)
    dist.all_reduce(moments, group=group)
    mean, mean_square = (moments / dist.get_world_size(group)).tolist()
    if mean_square - mean**2 > 1e-9 * max(mean_square, 1.0):
        raise RuntimeError(
            f"{owner}: the probe generator is in another state on some rank, so the ranks would average estimates "
            "of different probes (not the whole batch's estimate); pass a generator seeded alike on every rank, "
            "or none (optim.distributed.shared_generator)"
        )


class AveragedOperator(CurvatureOperator):
    r"""The rank average :math:`\frac1R \sum_r A_r` of each rank's curvature operator: the full-batch operator.

    Each product costs the local product and one all-reduce of :math:`n` elements; the result is
    the same on every rank. With ``group=None`` it is the local operator.

    Args:
        operator: This rank's operator (e.g. a :class:`~optim.operators.GGNOperator` on its shard).
        group: A process group from :func:`resolve`, or ``None``.
    """

    def __init__(self, operator: CurvatureOperator, group: Group) -> None:
        super().__init__(operator.params)
        self.local, self.group = operator, group

    def matvec(self, vec: Sequence[Tensor]) -> tuple[Tensor, ...]:
        r"""Return :math:`\frac1R \sum_r A_r v`, one tensor per parameter."""
        return all_average(self.local.matvec(vec), self.group)
