"""Attention outputs kept from a first run and handed out again when that run is repeated (selective
activation checkpointing).

A checkpointed block (``optim.checkpoint``) runs twice: once in the forward, keeping nothing, and again in
the backward to rebuild its activations. Attention's forward (``O`` and the row statistics) and, in forward
mode, its tangent (``Ȯ`` and the statistics' tangent) are the dear part of that second run: ``O(N·M·d)`` work
each, against ``O(N·d)`` memory for their outputs. Inside :func:`keeping` the Functions of
:mod:`flashbob.autograd` store those outputs in call order; inside :func:`reusing` the same calls of the
repeated run take them from the store instead of launching the kernels.

As with any activation checkpointing the repeated run must compute the same function from the same inputs (so
that the kept outputs are the ones it would compute). What can be checked is, and the caller
(``optim.checkpoint``) repeats the run without reuse where a check fails:

- each call must match its counterpart of the first run (same pass, backend, shapes, dtypes, devices, strides,
  flags and scale, same tangents present), or :class:`Diverged` is raised (a repeated run may legitimately call
  attention differently: a module may switch its attention implementation between the runs);
- the repeated run must take every kept forward, and every kept tangent or none (:meth:`KeptOutputs.complete`):
  one that made fewer calls may have given a skipped call's outputs to a later call of the same signature;
- a kept output that was modified in place since it was kept (its version changed) makes the whole repeated
  run compute afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

Outputs = tuple[torch.Tensor | None, ...]


def _signature(args: tuple) -> tuple:
    """What a call depends on besides the tensors' values: for each tensor its shape, stride, dtype and device."""
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


def _aliases(outputs: Outputs) -> Outputs:
    """New tensors sharing each output's storage and version counter, with no graph or tangent."""
    return tuple(None if t is None else t.detach() for t in outputs)


def _describe(signature: tuple) -> str:
    """A signature as text (a backend by its name)."""
    return "(" + ", ".join(str(getattr(a, "name", a)) for a in signature) + ")"


@dataclass(eq=False)
class KeptOutputs:
    """The outputs of each pass (``"forward"``, ``"forward_jvp"``) of one run, in call order, with the signature
    of the call that made them and their versions when kept."""

    calls: dict[str, list[tuple[tuple, Outputs, list[int]]]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    reusing: bool = False

    def complete(self) -> bool:
        """Whether the repeated run took every kept forward, and every kept tangent or none (a backward after the
        forward-mode level ended takes none)."""
        def taken(name: str) -> tuple[int, int]:
            return self.positions.get(name, 0), len(self.calls.get(name, []))

        (forwards, kept_forwards), (tangents, kept_tangents) = taken("forward"), taken("forward_jvp")
        return forwards == kept_forwards and tangents in (0, kept_tangents)

    def intact(self) -> bool:
        """Whether no kept output was modified in place since it was kept."""
        return all(t is None or t._version == version for entries in self.calls.values()
                   for _, outputs, versions in entries for t, version in zip(outputs, versions))

    def keep(self, name: str, signature: tuple, outputs: Outputs) -> None:
        kept = _aliases(outputs)  # without the first run's tangent or graph
        self.calls.setdefault(name, []).append((signature, kept, [t is not None and t._version for t in kept]))

    def take(self, name: str, signature: tuple) -> Outputs:
        """The next kept outputs of pass ``name``; raises :class:`Diverged` if the call differs from the first
        run's."""
        position = self.positions.get(name, 0)
        entries = self.calls.get(name, [])
        if position >= len(entries) or entries[position][0] != signature:
            first = f"call {position + 1} of the first run's {len(entries)} was {_describe(entries[position][0])}" \
                if position < len(entries) else f"the first run made {len(entries)} such calls"
            raise Diverged(f"called attention's {name} differently from the first run: "
                           f"{_describe(signature)}, where {first}")
        self.positions[name] = position + 1
        return _aliases(entries[position][1])  # fresh ones per run, each run's graph sets their history


class Diverged(RuntimeError):
    """A repeated run called attention differently from the first run."""


_ACTIVE: ContextVar[KeptOutputs | None] = ContextVar("flashbob_kept_outputs", default=None)


@contextmanager
def _active(store: KeptOutputs | None) -> Iterator[None]:
    token = _ACTIVE.set(store)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def keeping(store: KeptOutputs | None) -> Iterator[None]:
    """Attention passes inside store their outputs in ``store`` (``None``: keep nothing; also stops an outer
    store from seeing them)."""
    if store is not None:
        store.calls.clear()
        store.reusing = False
    with _active(store):
        yield


@contextmanager
def reusing(store: KeptOutputs | None) -> Iterator[None]:
    """Attention passes inside take their outputs from ``store``, in the order they were kept, if no kept output
    was modified since; otherwise (or with ``store`` ``None``) they compute afresh."""
    if store is not None:
        store.positions.clear()
        store.reusing = store.intact()
    with _active(store if store is not None and store.reusing else None):
        yield


def through(name: str, args: tuple, compute: Callable[[], Outputs]) -> Outputs:
    """``compute()``, the attention pass ``name`` on ``args`` (its tensors and options), kept or reused as the active
    store says."""
    store = _ACTIVE.get()
    if store is None:
        return compute()
    signature = (name, *_signature(args))
    if store.reusing:
        return store.take(name, signature)
    outputs = compute()
    store.keep(name, signature, outputs)
    return outputs


class KeptAttention:
    """flashbob's attention outputs (``O`` and its row statistics, in forward mode their tangents) kept for one
    ``optim.checkpoint`` call (``optim.checkpoint(block, x, kept=flashbob.KeptAttention())``, an
    ``optim.checkpoint.KeptOutputs``): the recomputation of the checkpointed block takes them instead of running
    attention's forward kernels again, ``O(N·d)`` memory per attention call for ``O(N²·d)`` less work."""

    diverged = Diverged

    def __init__(self) -> None:
        self._store = KeptOutputs()

    def keeping(self) -> AbstractContextManager:
        """The first run's context: its attention calls keep their outputs here."""
        return keeping(self._store)

    def reusing(self) -> AbstractContextManager:
        """A recomputation's context: its attention calls take the kept outputs (raises :class:`Diverged` where a
        call differs from the first run's)."""
        return reusing(self._store)

    def mismatch(self) -> str | None:
        """Why the recomputation's outputs may differ from its first run's (it took fewer than were kept), or None."""
        if not self._store.reusing or self._store.complete():
            return None
        return "took fewer of the first run's attention outputs than it kept"
