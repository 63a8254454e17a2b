"""Where one training step's time goes: its passes, host synchronisations and per-phase times.

Run from the checkout (one GPU; the LM recipe's model, data and optimizer as in the optimizer comparison)::

    FLASHBOB_AUTOTUNE=0 PYTHONPATH=. python benchmarks/profile_step.py --optimizers newtoncg sophiah
    # CPU smoke test, a few seconds:
    PYTHONPATH=. python benchmarks/profile_step.py --config configs/lm/tiny.yaml --optimizers newtoncg \\
        train.device=cpu model.d_model=32 data.context_length=64

Every optimizer name is one of ``benchmarks/compare_optimizers.py`` (its own settings, or a variant's)
and the ``key=value`` overrides apply to every run. For each, the recipe is built
(``recipes.lm.train.build``), trained ``--warmup`` steps (kernel compilation, first use of torch SDPA),
and then profiled on the next step of each kind: for Sophia a step that refreshes the Hessian estimate
and one that does not, for the others any step. Each kind is profiled twice, on two steps of that kind:

- **times**: every phase (:data:`PHASES`: the closure's forwards by grad mode, tangents and rows, the
  backwards, the attention calls by implementation, curvature products, CG, the line search, the
  update, ...) between two CUDA events (on the GPU) and by the host clock, nested: a phase's path
  names the phases it ran inside (``step / CG / GGN product / forward [tangents, 1 rows]``);
- **counts** (on the next step of that kind, under a :class:`Counter`): the aten operations (about
  one kernel launch each) and host synchronisations (``.item()``, ``float()``, ``bool()`` of a tensor,
  ``.tolist()``, boolean-mask indexing, ``nonzero``) in each phase.

Prints one Markdown table per profiled step; ``--out`` also writes every row to a CSV (rewritten after each
optimizer).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import TorchDispatchMode

import optim
from benchmarks.compare_optimizers import optimizer_names
from benchmarks.results import write_rows
from optim import newton_cg, operators, optimizer, sophia, sophia_g, sophia_h
from optim.operators import GGNOperator, HessianOperator
from recipes.common import distributed
from recipes.common.config import resolve_device
from recipes.common.transformer import sdpa
from recipes.lm import train as lm

ROOT = Path(__file__).resolve().parent.parent
#: (owner, attribute, phase name): the functions timed as phases, besides the model's forward, its attention
#: and the backwards (``torch.autograd.grad``, ``Tensor.backward``).
PHASES = [
    (GGNOperator, "matvec", "GGN product"),
    (HessianOperator, "matvec", "Hessian product"),
    (operators.GradientGraphHessian, "matvec", "Hessian product"),
    (newton_cg.NewtonCG, "_curvature", "gradient and curvature"),
    (newton_cg.NewtonCG, "_preconditioner", "preconditioner"),
    (newton_cg, "cg", "CG"),
    (newton_cg.NewtonCG, "_search", "search"),
    (optimizer, "apply_if_finite", "update"),
    (sophia._Sophia, "_propose", "update"),
    (sophia_h.SophiaH, "_hutchinson", "Hutchinson estimate"),
    (sophia_g.SophiaG, "_bartlett", "Gauss-Newton-Bartlett estimate"),
]
SYNCS = ("_local_scalar_dense", "nonzero", "equal", "masked_select")  # aten ops that wait for the device
#: aten ops that launch no kernel (besides views): left out of the operation counts
METADATA = ("is_same_size", "_has_same_storage_numel", "detach", "_efficientzerotensor", "empty", "empty_like",
            "empty_strided", "lift_fresh", "_local_scalar_dense", "promote_types")


@dataclass
class Call:
    """One timed call of a phase: its path, host milliseconds and (on CUDA) its start and end events."""

    path: str
    host_ms: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @property
    def device_ms(self) -> float:
        """Milliseconds between the events (the host time on the CPU); call after synchronising."""
        return self.events[0].elapsed_time(self.events[1]) if self.events else self.host_ms


@dataclass
class Profiler:
    """Times nested phases. ``with profiler.phase(name):`` records one call under the current path;
    :meth:`patch` makes a function a phase (undone by :meth:`restore`)."""

    cuda: bool
    calls: list[Call] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    patched: list[tuple[Any, str, Any]] = field(default_factory=list)

    @property
    def path(self) -> str:
        return " / ".join(self.stack)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.stack.append(name)
        call = Call(self.path, 0.0)
        self.calls.append(call)
        if self.cuda:
            call.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            call.events[0].record()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                call.events[1].record()
            call.host_ms = 1000 * (time.perf_counter() - start)
            self.stack.pop()

    def patch(self, owner: Any, attribute: str, name: str | Callable[..., str]) -> None:
        """Run ``owner.attribute`` as the phase ``name`` (or ``name(*args, **kwargs)``)."""
        own = vars(owner).get(attribute)  # None for a method of an instance's class
        inner = own if own is not None else getattr(owner, attribute)
        function = inner.__func__ if isinstance(inner, staticmethod) else inner

        def timed(*args, **kwargs):
            with self.phase(name(*args, **kwargs) if callable(name) else name):
                return function(*args, **kwargs)

        self.patched.append((owner, attribute, own))
        setattr(owner, attribute, staticmethod(timed) if isinstance(inner, staticmethod) else timed)

    def restore(self) -> None:
        for owner, attribute, own in reversed(self.patched):
            if own is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)
        self.patched.clear()

    def install(self, model: torch.nn.Module | None = None) -> None:
        """Phases of an optimizer step: :data:`PHASES` and the backwards; with the LM recipe's ``model`` also its
        forwards (``forward [grad | no grad | tangents, R rows]``) and attention calls (``attention: sdpa |
        flashbob``)."""
        for owner, attribute, name in PHASES:
            self.patch(owner, attribute, name)
        self.patch(torch.autograd, "grad", backward_name)
        self.patch(torch.Tensor, "backward", "backward")
        if model is None:
            return
        self.patch(model, "forward", lambda tokens: f"forward [{pass_kind(model)}, {tokens.shape[0]} rows]")
        switch = model.attention
        for attribute in ("first_order", "twice"):
            attend = getattr(switch, attribute)
            self.patch(switch, attribute, f"attention: {'sdpa' if attend is sdpa else 'flashbob'}")

    def rows(self) -> list[dict[str, Any]]:
        """One row per path, in order of first appearance: calls, device and host milliseconds (summed)."""
        if self.cuda:
            torch.cuda.synchronize()
        rows: dict[str, dict[str, Any]] = {}
        for call in self.calls:
            row = rows.setdefault(call.path, {"phase": call.path, "calls": 0, "device_ms": 0.0, "host_ms": 0.0})
            row["calls"] += 1
            row["device_ms"] += call.device_ms
            row["host_ms"] += call.host_ms
        return list(rows.values())


def backward_name(*args, create_graph: bool = False, **kwargs) -> str:
    return "backward (create_graph)" if create_graph else "backward"


def pass_kind(model: torch.nn.Module) -> str:
    """``tangents`` for a forward-mode pass (the parameters the model sees carry tangents), else ``grad`` or
    ``no grad``: whether the forward records a graph."""
    parameter = next(model.parameters())
    if fwAD.unpack_dual(parameter).tangent is not None:
        return "tangents"
    return "grad" if torch.is_grad_enabled() and parameter.requires_grad else "no grad"


class Counter(TorchDispatchMode):
    """Counts aten operations that compute (about one kernel launch each; views and :data:`METADATA` left out)
    and host synchronisations (:data:`SYNCS`, boolean-mask indexing, ``Tensor.tolist``), per phase of
    ``profiler`` (the path ``""`` without one)."""

    def __init__(self, profiler: Profiler | None = None) -> None:
        super().__init__()
        self.profiler = profiler
        self.ops: dict[str, int] = {}
        self.syncs: dict[str, int] = {}
        self.sync_ops: list[str] = []

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def _tally(self, counts: dict[str, int]) -> None:
        path = self.profiler.path if self.profiler is not None else ""
        counts[path] = counts.get(path, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if not (func.is_view or name in METADATA):
            self._tally(self.ops)
        masked = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if name in SYNCS or masked:
            self._sync(name)
        return func(*args, **kwargs)

    def _sync(self, name: str) -> None:
        self._tally(self.syncs)
        self.sync_ops.append(f"{name} in {self.profiler.path if self.profiler is not None else 'the step'}")

    def __enter__(self):
        tolist = self._tolist = torch.Tensor.tolist

        def counted(tensor, *args, **kwargs):
            self._sync("tolist")
            return tolist(tensor, *args, **kwargs)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def build(config: Path, optimizer: str, overrides: list[str]):
    """The LM recipe of ``config`` with ``optimizer`` (a name of benchmarks/compare_optimizers.py) and
    ``overrides``, as ``recipes.lm`` builds it; returns the recipe and its device."""
    from benchmarks.compare_optimizers import settings_of

    name, settings = settings_of(optimizer)
    cfg = lm.load_config(str(config), [f"optimizer.name={name}", *settings, *overrides])
    device, dtype = resolve_device(cfg.train.device, cfg.train.dtype)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    return lm.build(cfg, device, autocast, distributed.Context(device=device)), device


def next_kind(opt: torch.optim.Optimizer) -> str:
    """The kind of the next step: ``refresh`` or ``plain`` for Sophia (whether it refreshes its estimate), else ``step``."""
    if isinstance(opt, (optim.SophiaH, optim.SophiaG)):
        return "refresh" if opt.refreshes_next_step else "plain"
    return "step"


def profile_step(recipe, device: torch.device, counting: bool) -> tuple[Profiler, Counter | None]:
    """One step of ``recipe`` with every phase timed and, if ``counting``, its operations and syncs counted."""
    profiler = Profiler(cuda=device.type == "cuda")
    counter = Counter(profiler) if counting else None
    profiler.install(recipe.parts["model"])
    try:
        if profiler.cuda:
            torch.cuda.synchronize()
        with counter if counter is not None else contextlib.nullcontext(), profiler.phase("step"):
            recipe.step()
        profiler.rows()  # synchronises
    finally:
        profiler.restore()
    return profiler, counter


def profile(recipe, device: torch.device, warmup: int, max_steps: int) -> dict[str, tuple[Profiler, Counter | None]]:
    """After ``warmup`` steps, time the first step of each kind and count the second (within ``max_steps``)."""
    opt = recipe.parts["optimizer"]
    for _ in range(warmup):
        recipe.step()
    kinds = {"refresh", "plain"} if isinstance(opt, (optim.SophiaH, optim.SophiaG)) else {"step"}
    timed: dict[str, Profiler] = {}
    counted: dict[str, Counter | None] = {}
    for _ in range(max_steps):
        if timed.keys() == counted.keys() == kinds:
            break
        kind = next_kind(opt)
        if kind not in timed:
            timed[kind], _ = profile_step(recipe, device, counting=False)
        elif kind not in counted:
            _, counted[kind] = profile_step(recipe, device, counting=True)
        else:
            recipe.step()
    return {kind: (timed[kind], counted.get(kind)) for kind in sorted(timed)}


def table(optimizer: str, kind: str, profiler: Profiler, counter: Counter | None) -> tuple[str, list[dict]]:
    """The Markdown table of one profiled step and its CSV rows."""
    rows = profiler.rows()
    title = f"{optimizer}, one step" if kind == "step" else f"{optimizer}, a {kind} step"
    header = "| phase (nested by ' / ') | calls | device ms | host ms | aten ops (counted step) | host syncs (counted step) |"
    lines = [title, "", header, "|---|---|---|---|---|---|"]
    for row in rows:
        row.update(optimizer=optimizer, kind=kind,
                   aten_ops=counter.ops.get(row["phase"], "") if counter else "",
                   host_syncs=counter.syncs.get(row["phase"], "") if counter else "")
        lines.append(f"| {row['phase']} | {row['calls']} | {row['device_ms']:.2f} | {row['host_ms']:.2f} | "
                     f"{row['aten_ops']} | {row['host_syncs']} |")
    if counter is not None:
        lines.append(f"| all (counted step) | | | | {sum(counter.ops.values())} | {counter.total_syncs} |")
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm" / "compare_8k.yaml")
    parser.add_argument("--optimizers", nargs="+", default=["newtoncg", "sophiah"], choices=optimizer_names(),
                        metavar="NAME", help="recipe optimizers or variants of benchmarks/compare_optimizers.py "
                                             "(key=value overrides go before this option)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones (default 3)")
    parser.add_argument("--max-steps", type=int, default=30, help="most steps to find each kind (default 30)")
    parser.add_argument("--out", type=Path, help="CSV of every row")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for every run")
    args = parser.parse_args()
    every = []
    for optimizer in args.optimizers:
        recipe, device = build(args.config, optimizer, list(args.overrides))
        for kind, (profiler, counter) in profile(recipe, device, args.warmup, args.max_steps).items():
            text, rows = table(optimizer, kind, profiler, counter)
            print(text, end="\n\n", flush=True)
            every += rows
        if args.out is not None:  # after each optimizer, so that a run stopped early keeps what it measured
            write_rows(args.out, every, ["optimizer", "kind", "phase", "calls", "device_ms", "host_ms", "aten_ops",
                                         "host_syncs"])


if __name__ == "__main__":
    main()
