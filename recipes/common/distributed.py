"""Data-parallel plumbing: process-group setup under ``torchrun``, rank checks and small collectives
(the LM recipe trains data parallel).

``torchrun --nproc_per_node=N -m recipes.lm ...`` starts N processes and sets ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``; :func:`setup` joins them into one process group (NCCL on
CUDA, gloo on the CPU) and pins each process to GPU ``LOCAL_RANK``. Without those variables
(``python -m recipes.lm``) it is one process and every helper here is a no-op.

:func:`teardown` destroys the process group, and with it its backend's threads, only because this
module imports ``torch.distributed.nn`` before any group exists (see the import).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

if dist.is_available():
    # Its functions take ``group=group.WORLD`` as default arguments, evaluated when it is first imported, which
    # torch._dynamo does inside the first torch.optim optimizer of a process. First imported after
    # init_process_group, the defaults would hold the default group: destroy_process_group would leave its
    # backend alive (gloo's worker and socket threads running) until the interpreter tears it down at exit, which
    # can abort the process ("terminate called without an active exception"). Imported here, they hold none.
    import torch.distributed.nn  # noqa: F401

T = TypeVar("T")

@dataclass(frozen=True)
class Context:
    """Where this process stands: its rank among ``world_size`` and the device it computes on."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # setup() created the process group, so teardown() destroys it

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, shows progress and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device_type: str) -> Context:
    """Join the process group ``torchrun`` describes (if any) and choose this process's device.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; on CUDA each process uses GPU ``LOCAL_RANK``.

    If a process group already exists (a caller initialised it), it is used as is.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    already = dist.is_available() and dist.is_initialized()
    if already:
        world_size = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size == 1:
        return Context(device=device, rank=dist.get_rank() if already else 0)
    owns = False
    if not already:
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device_type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(minutes=30), **kwargs)
        owns = True
    return Context(rank=dist.get_rank(), local_rank=local_rank, world_size=world_size, device=device, owns_group=owns)


def teardown(ctx: Context) -> None:
    """Destroy the process group if :func:`setup` created it."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def average(value: float, ctx: Context) -> float:
    """The mean of a Python number over the ranks (the number itself in one process)."""
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return float(t) / ctx.world_size


def gather(obj, ctx: Context) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in one process."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: Context) -> None:
    """Wait for every rank (nothing in one process)."""
    if ctx.distributed:
        dist.barrier(device_ids=[ctx.device.index]) if ctx.device.type == "cuda" else dist.barrier()


def main_first(fn: Callable[[], T], ctx: Context) -> T:
    """``fn()`` on rank 0, then on the other ranks once rank 0's call has returned: for work whose result rank 0
    writes to disk and the others read (a trained tokenizer). In one process, ``fn()``."""
    if ctx.is_main:
        result = fn()
    barrier(ctx)
    if not ctx.is_main:
        result = fn()
    return result


def broadcast_module(module: torch.nn.Module, ctx: Context) -> None:
    """Copy rank 0's parameters and buffers to every rank (what DDP does when it wraps a model)."""
    if not ctx.distributed:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
