"""Per-kernel GPU time and compiler facts of flashbob's Triton kernels (torch.profiler + Triton).

Run on a CUDA machine from the checkout (defaults: B=1, H=16, N=16K, d=128, bf16, causal and not,
workloads fwd, fwd_bwd, fwd_bwd_bob)::

    PYTHONPATH=. python benchmarks/profile_kernels.py                          # autotuned configs
    FLASHBOB_AUTOTUNE=0 PYTHONPATH=. python benchmarks/profile_kernels.py      # hand-picked defaults
    PYTHONPATH=. python benchmarks/profile_kernels.py --n 8192 --head-dim 64 --causal 1 --sass

For every workload and causal flag, each through ``flashbob.attention``: ``--warmup`` untimed runs
(compilation and autotuning), one run that records every Triton launch, then ``--iters`` runs
under ``torch.profiler`` (CUDA activity). Kernel times are aggregated by kernel name (Triton names
a kernel after its ``@triton.jit`` function, e.g. ``_bob_rows_kernel``): calls per iteration,
median time per call, total time per iteration and its share of the iteration's kernel time. BoB's
three row sweeps are launches of that one kernel, told apart by its ``SWEEP`` flag (``bob_scalars``,
``bob_q_bar``, ``bob_do_bar``: their config keys in ``flashbob/kernels/configs.py``), so their times
are added up and the compiler facts are those of the last launch.
Kernels that are not Triton's (PyTorch fills, copies, reductions) are listed too.

For each Triton kernel, the compiler facts of the variant that actually ran (the last launch of
the recorded run, i.e. the autotuned config when tuning is on): block sizes, num_warps,
num_stages and the compile-time flags (from the launch's keyword arguments), registers per
thread and spilled registers (``CompiledKernel.n_regs``/``n_spills``, reported by the driver when
the binary is loaded), shared memory (``metadata.shared``), PTX lines naming ``.local`` memory
(``--sass``: ``LDL``/``STL`` instructions in the SASS, i.e. local-memory traffic including ptxas
spills), the grid, and an occupancy estimate per SM: resident blocks limited by threads (64 warps
per SM), registers (64K 32-bit registers per SM in four sub-partitions, allocated per warp in
units of 256) and shared memory (228 KiB per SM, 1 KiB reserved per block) on H100/H200; the
limits are read from the device where torch exposes them. ``waves`` = programs / (SMs x blocks per SM).

Writes ``--out`` (default docs/results/kernel_profile.csv, one row per kernel per workload and causal flag,
plus a ``(total)`` row per workload with the CUDA-event time of one iteration and its TFLOP/s under
the conventions of bench_attention.py) and prints a Markdown table last. ``--asm-dir DIR`` also
writes each kernel's PTX and TTGIR (and SASS with ``--sass``).

CPU smoke test of the script (Triton interpreter: no GPU times and no compiler facts, 'n/a';
bf16 is wrong in the interpreter, so float16)::

    PYTHONPATH=. python benchmarks/profile_kernels.py --device cpu --interpret --n 64 --head-dim 16 \\
        --heads 2 --dtype float16 --iters 1 --warmup 1 --out /tmp/kernel_profile.csv
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import math
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.timing import attention_tflops, median_ms

WORKLOADS = ("fwd", "fwd_bwd", "fwd_bwd_bob", "bob")
#: Launch keyword arguments that are launch options, not compile-time flags of the kernel.
LAUNCH_OPTIONS = ("grid", "warmup", "num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                  "launch_cooperative_grid", "launch_pdl", "debug", "instrumentation_mode")
FIELDS = ("workload", "causal", "n", "batch", "heads", "head_dim", "dtype", "kernel", "source", "calls_per_iter",
          "median_us", "us_per_iter", "share", "block_m", "block_n", "block_d", "num_warps", "num_stages", "n_regs",
          "n_spills", "shared_bytes", "ptx_local", "sass_local", "grid", "programs", "blocks_per_sm", "warps_per_sm",
          "occupancy", "limiter", "waves", "event_ms", "tflops", "flags", "tuned", "hash", "status")


# --------------------------------------------------------------------------------------------
# Which Triton kernels ran, with which config: a wrapper around JITFunction.run
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    """One launch of a Triton kernel: the CompiledKernel (None in the interpreter), its keyword
    arguments (constexprs such as BLOCK_M, BAND, and num_warps/num_stages) and its grid."""

    name: str
    kernel: object
    kwargs: dict
    grid: tuple | None


def jit_name(fn) -> str:
    """The name of a ``@triton.jit`` function (what the compiled kernel and the profiler are called)."""
    inner = getattr(fn, "fn", None)
    return getattr(inner, "__name__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def launch_grid(fn, grid, args, kwargs) -> tuple | None:
    """The grid of a launch as a tuple (a callable grid gets the arguments by name, as Triton does)."""
    try:
        if callable(grid):
            meta = dict(zip(getattr(fn, "arg_names", ()), args))
            meta.update({k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
            grid = grid(meta)
        return tuple(int(g) for g in grid)
    except Exception:  # noqa: BLE001 (a grid we cannot evaluate only costs the grid column)
        return None


class LaunchRecorder:
    """While active (``with``), every ``JITFunction.run`` (and the interpreter's ``run``) is wrapped:
    each launch that is not a warm-up is appended to :attr:`launches`. Autotuning launches go
    there too; call :meth:`reset` after warm-up so that only the configs in use remain.

    ``run`` returns the CompiledKernel in every Triton 3.x; the interpreter returns None.
    """

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._patched: list[tuple[type, object, bool]] = []

    def reset(self) -> None:
        self.launches = []

    def last_by_name(self) -> dict[str, Launch]:
        return {launch.name: launch for launch in self.launches}

    def variants_by_name(self) -> dict[str, int]:
        """How many distinct configs (keyword arguments) each kernel was launched with."""
        seen = defaultdict(set)
        for launch in self.launches:
            seen[launch.name].add(tuple(sorted((k, repr(v)) for k, v in launch.kwargs.items())))
        return {name: len(v) for name, v in seen.items()}

    def _wrap(self, original):
        recorder = self

        @functools.wraps(original)
        def run(fn, *args, **kwargs):
            kernel = original(fn, *args, **kwargs)
            if not kwargs.get("warmup", False):
                options = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                grid = launch_grid(fn, kwargs.get("grid"), args, kwargs)
                recorder.launches.append(Launch(jit_name(fn), kernel, options, grid))
            return kernel

        return run

    def __enter__(self):
        classes = []
        with contextlib.suppress(ImportError):
            from triton.runtime.jit import JITFunction

            classes.append(JITFunction)
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        for cls in classes:
            original = getattr(cls, "run", None)
            if callable(original):
                own = "run" in cls.__dict__
                cls.run = self._wrap(original)
                self._patched.append((cls, original, own))
        return self

    def __exit__(self, *exc) -> None:
        for cls, original, own in reversed(self._patched):
            if own:
                cls.run = original
            else:
                del cls.run
        self._patched = []


# --------------------------------------------------------------------------------------------
# Compiler facts of a CompiledKernel (version-tolerant: every field may be missing -> None)
# --------------------------------------------------------------------------------------------

def _metadata(kernel, key):
    metadata = getattr(kernel, "metadata", None)
    if isinstance(metadata, dict):
        return metadata.get(key)
    return getattr(metadata, key, None)


def _asm(kernel, key, compute=False):
    """``kernel.asm[key]``; ``compute`` lets Triton's AsmDict derive it (SASS runs cuobjdump)."""
    asm = getattr(kernel, "asm", None)
    if asm is None:
        return None
    try:
        if key in asm:
            return asm[key]
        if not compute:
            return None
        with contextlib.suppress(Exception):
            return asm[key]  # Triton >= 3.2: AsmDict disassembles the cubin on demand
        from triton.tools.disasm import get_sass

        return get_sass(asm["cubin"])
    except Exception:  # noqa: BLE001 (no SASS: the column stays empty)
        return None


def count_ptx_local(ptx: str | None) -> int | None:
    """Lines of PTX that declare or access ``.local`` memory (0 when the kernel uses none)."""
    if ptx is None:
        return None
    return sum(1 for line in ptx.splitlines() if re.search(r"\.local\b", line))


def count_sass_local(sass: str | None) -> int | None:
    """Local-memory loads and stores (``LDL``, ``STL``) in SASS: spills and local arrays."""
    if sass is None:
        return None
    return len(re.findall(r"\b(?:LDL|STL)(?:\.[\w.]+)?\b", sass))


def compiled_facts(kernel, sass: bool = False) -> dict:
    """n_regs, n_spills, shared_bytes, num_warps, num_stages, ptx_local, sass_local and hash of a
    Triton ``CompiledKernel`` (None for what this Triton does not expose, or without a kernel)."""
    facts = dict.fromkeys(("n_regs", "n_spills", "shared_bytes", "num_warps", "num_stages", "ptx_local",
                           "sass_local", "hash"))
    if kernel is None:
        return facts
    if not hasattr(kernel, "metadata") and hasattr(kernel, "result"):  # an asynchronous compile's future
        try:
            kernel = kernel.result()
        except Exception:  # noqa: BLE001
            return facts
    if getattr(kernel, "n_regs", None) is None and hasattr(kernel, "_init_handles"):
        with contextlib.suppress(Exception):  # loads the binary: needs the GPU driver
            kernel._init_handles()
    facts["n_regs"] = getattr(kernel, "n_regs", None)
    facts["n_spills"] = getattr(kernel, "n_spills", None)
    facts["shared_bytes"] = _metadata(kernel, "shared")
    facts["num_warps"] = _metadata(kernel, "num_warps")
    facts["num_stages"] = _metadata(kernel, "num_stages")
    facts["ptx_local"] = count_ptx_local(_asm(kernel, "ptx"))
    if sass:
        facts["sass_local"] = count_sass_local(_asm(kernel, "sass", compute=True))
    kernel_hash = getattr(kernel, "hash", None)
    facts["hash"] = str(kernel_hash)[:12] if kernel_hash else None
    return facts


def dump_asm(kernel, name: str, directory: Path, sass: bool) -> list[Path]:
    """Write the kernel's PTX and TTGIR (and SASS) as ``<name>-<hash>.<ext>``; returns the paths."""
    written = []
    if kernel is None:
        return written
    tag = str(getattr(kernel, "hash", "") or "")[:12]
    for key in ("ptx", "ttgir", *(("sass",) if sass else ())):
        text = _asm(kernel, key, compute=key == "sass")
        if isinstance(text, str):
            path = directory / f"{name}-{tag}.{key}"
            path.write_text(text)
            written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# Occupancy estimate
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SMLimits:
    """Per-SM resources; defaults are H100/H200 (sm_90)."""

    sms: int = 132
    registers: int = 65536
    shared_bytes: int = 228 * 1024
    reserved_shared_per_block: int = 1024
    max_warps: int = 64
    max_blocks: int = 32
    sub_partitions: int = 4
    register_unit: int = 256  # registers are allocated per warp in units of 256
    shared_unit: int = 128


def sm_limits(device: torch.device) -> SMLimits:
    """:class:`SMLimits` of ``device``, from ``torch.cuda.get_device_properties`` where it has them."""
    limits = SMLimits()
    if device.type != "cuda":
        return limits
    with contextlib.suppress(Exception):
        props = torch.cuda.get_device_properties(device)
        limits.sms = getattr(props, "multi_processor_count", limits.sms) or limits.sms
        limits.registers = getattr(props, "regs_per_multiprocessor", limits.registers) or limits.registers
        limits.shared_bytes = (getattr(props, "shared_memory_per_multiprocessor", limits.shared_bytes)
                               or limits.shared_bytes)
        threads = getattr(props, "max_threads_per_multi_processor", None)
        if threads:
            limits.max_warps = threads // getattr(props, "warp_size", 32)
    return limits


def occupancy(n_regs, shared_bytes, num_warps, limits: SMLimits) -> dict:
    """Resident blocks and warps per SM and what limits them ('registers', 'shared', 'threads' or
    'blocks'); all None when the register count is unknown."""
    out = {"blocks_per_sm": None, "warps_per_sm": None, "occupancy": None, "limiter": None}
    if not n_regs or not num_warps:
        return out
    per_warp = math.ceil(n_regs * 32 / limits.register_unit) * limits.register_unit
    warps_by_registers = limits.sub_partitions * (limits.registers // limits.sub_partitions // per_warp)
    blocks = {"registers": warps_by_registers // num_warps}
    if shared_bytes is not None:
        per_block = math.ceil((shared_bytes + limits.reserved_shared_per_block) / limits.shared_unit) * limits.shared_unit
        blocks["shared"] = limits.shared_bytes // per_block
    blocks["threads"] = limits.max_warps // num_warps
    blocks["blocks"] = limits.max_blocks
    resident = min(blocks.values())
    out["blocks_per_sm"] = resident
    out["warps_per_sm"] = resident * num_warps
    out["occupancy"] = round(resident * num_warps / limits.max_warps, 3)
    out["limiter"] = "+".join(k for k, v in blocks.items() if v == resident)
    return out


# --------------------------------------------------------------------------------------------
# GPU kernel times from torch.profiler
# --------------------------------------------------------------------------------------------

def device_kernel_durations(events) -> dict[str, list[float]]:
    """Durations (us) of the device-side events (kernels, memsets, copies) of a profile, by name."""
    from torch.autograd import DeviceType

    durations = defaultdict(list)
    for event in events:
        device_type = getattr(event, "device_type", None)
        if device_type is None or not (device_type == DeviceType.CUDA or str(device_type).endswith("CUDA")):
            continue
        time_range = getattr(event, "time_range", None)
        if time_range is None:
            continue
        durations[event.name].append(float(time_range.end - time_range.start))
    return dict(durations)


def profile_durations(fn, iters: int, cuda: bool) -> dict[str, list[float]]:
    """Run ``fn`` ``iters`` times under torch.profiler; device-event durations by name (empty on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
            if cuda:
                torch.cuda.synchronize()
    return device_kernel_durations(prof.events())


# --------------------------------------------------------------------------------------------
# Workloads and the sweep
# --------------------------------------------------------------------------------------------

def make_workload(workload, q, k, v, causal, backend):
    """A zero-argument callable running ``workload`` through flashbob.attention (as bench_attention.py)."""
    import flashbob

    def attn():
        return flashbob.attention(q, k, v, causal=causal, backend=backend)

    do = torch.randn_like(q)
    bars = [torch.randn_like(t) for t in (q, k, v)]
    inputs = (q, k, v)
    if workload == "fwd":
        return attn
    if workload == "fwd_bwd":
        return lambda: torch.autograd.grad(attn(), inputs, do)
    if workload == "fwd_bwd_bob":
        def run():
            grads = torch.autograd.grad(attn(), inputs, do, create_graph=True)
            return torch.autograd.grad(grads, inputs, bars)
        return run
    grads = torch.autograd.grad(attn(), inputs, do, create_graph=True)
    return lambda: torch.autograd.grad(grads, inputs, bars, retain_graph=True)


def autotune_state() -> str:
    try:
        from flashbob.kernels import configs

        return "yes" if configs.autotune_enabled() else "no"
    except Exception:  # noqa: BLE001
        return ""


def match_names(durations: dict[str, list[float]], names) -> dict[str, list[float]]:
    """Rename profiler events to the Triton kernel names: an event named ``<name>`` or ``<name>_<suffix>``
    (older Tritons appended a signature suffix) counts as the launches of ``<name>``."""
    matched = dict(durations)
    for name in names:
        if name in matched:
            continue
        for event in [e for e in matched if e.startswith(name + "_")]:
            matched.setdefault(name, []).extend(matched.pop(event))
    return matched


def kernel_rows(base, durations, iters, launches, variants, facts_of, limits) -> list[dict]:
    """One row per device kernel name (Triton kernels first, by time), with compiler facts."""
    durations = match_names(durations, launches)
    total_us = sum(sum(d) for d in durations.values()) / iters if durations else 0.0
    names = list(dict.fromkeys([*launches, *durations]))
    rows = []
    for name in names:
        times = durations.get(name, [])
        row = dict(base, kernel=name, source="triton" if name in launches else "torch", status="ok")
        if times:
            row["calls_per_iter"] = round(len(times) / iters, 3)
            row["median_us"] = round(statistics.median(times), 2)
            row["us_per_iter"] = round(sum(times) / iters, 2)
            row["share"] = round(sum(times) / iters / total_us, 4) if total_us else None
        elif durations or base["_cuda"]:
            row["status"] = "no profiler event"
        else:
            row["status"] = "no GPU timing"
        launch = launches.get(name)
        if launch is not None:
            row.update(facts_of(launch))
            kw = launch.kwargs
            row["block_m"], row["block_n"], row["block_d"] = kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("BLOCK_D")
            for key in ("num_warps", "num_stages"):
                if row.get(key) is None:
                    row[key] = kw.get(key)
            row["flags"] = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(kw.items())
                                    if not k.startswith("BLOCK_") and k not in LAUNCH_OPTIONS
                                    and isinstance(v, (bool, int, float, str)))
            if variants.get(name, 1) > 1:
                row["flags"] += f" (+{variants[name] - 1} other configs this iteration)"
            row["grid"] = "x".join(map(str, launch.grid)) if launch.grid else None
            row["programs"] = math.prod(launch.grid) if launch.grid else None
            row.update(occupancy(row.get("n_regs"), row.get("shared_bytes"), row.get("num_warps"), limits))
            if row["programs"] and row["blocks_per_sm"]:
                row["waves"] = round(row["programs"] / (limits.sms * row["blocks_per_sm"]), 2)
            if row.get("n_regs") is None:
                row["status"] = row["status"] + "; compiler facts n/a" if row["status"] != "ok" else "compiler facts n/a"
        rows.append(row)
    rows.sort(key=lambda r: (r["source"] != "triton", -(r.get("us_per_iter") or 0)))
    return rows


def profile_case(args, workload, causal, recorder, limits, facts_of) -> list[dict]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    base = {"workload": workload, "causal": causal, "n": args.n, "batch": args.batch, "heads": args.heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "tuned": autotune_state(), "_cuda": cuda}
    backend = "auto" if cuda else "triton"
    q = k = v = fn = None
    try:
        q, k, v = (torch.randn(args.batch, args.heads, args.n, args.head_dim, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        fn = make_workload(workload, q, k, v, causal, backend)
        for _ in range(args.warmup):  # compile and autotune
            fn()
        if cuda:
            torch.cuda.synchronize()
        recorder.reset()
        fn()  # the launches (and configs) of one iteration
        if cuda:
            torch.cuda.synchronize()
        launches, variants = recorder.last_by_name(), recorder.variants_by_name()
        recorder.reset()
        try:
            durations = profile_durations(fn, args.iters, cuda)
            profiler_status = "ok"
        except Exception as error:  # noqa: BLE001 (the compiler facts are still worth reporting)
            durations, profiler_status = {}, f"profiler error:{type(error).__name__}"
        rows = kernel_rows(base, durations, args.iters, launches, variants, facts_of, limits)
        total = dict(base, kernel="(total)", source="total", status=profiler_status if cuda else "no GPU timing")
        if durations:
            total["us_per_iter"] = round(sum(sum(d) for d in durations.values()) / args.iters, 2)
            total["calls_per_iter"] = round(sum(len(d) for d in durations.values()) / args.iters, 3)
            total["share"] = 1.0
        if cuda:
            ms = median_ms(fn, args.iters)
            total["event_ms"] = round(ms, 4)  # CUDA-event time of one whole iteration
            total["tflops"] = round(attention_tflops(workload, ms, batch=args.batch, heads=args.heads, n=args.n,
                                                     m=args.n, head_dim=args.head_dim, causal=causal), 1)
        rows.append(total)
        if args.asm_dir:
            Path(args.asm_dir).mkdir(parents=True, exist_ok=True)
            for name, launch in launches.items():
                dump_asm(launch.kernel, name, Path(args.asm_dir), args.sass)
    except Exception as error:  # noqa: BLE001 (one failing workload must not end the run)
        status = "oom" if isinstance(error, torch.cuda.OutOfMemoryError) else f"error:{type(error).__name__}"
        print(f"  {workload} causal={causal:d}: {type(error).__name__}: {str(error).strip()[:300]}", flush=True)
        rows = [dict(base, kernel="(workload)", source="total", status=status)]
    finally:
        q = k = v = fn = None
        if cuda:
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    for row in rows:
        row.pop("_cuda", None)
    return rows


def _cell(value, fmt="{}"):
    return "" if value is None or value == "" else fmt.format(value)


def markdown(rows: list[dict]) -> str:
    """The Markdown table of the rows: Triton kernels and totals, other kernels summed per workload."""
    head = ["workload", "causal", "kernel", "calls", "us/iter", "share", "BLOCK_M x N", "warps", "stages",
            "regs", "spills", "smem KiB", "blocks/SM", "warps/SM", "limiter", "waves", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = defaultdict(list)
    for row in rows:
        groups[(row["workload"], row["causal"])].append(row)
    for (workload, causal), group in groups.items():
        others = [r for r in group if r["source"] == "torch"]
        shown = [r for r in group if r["source"] == "triton"]
        if others:
            shown.append({"kernel": f"other ({len(others)} kernels)", "source": "torch",
                          "us_per_iter": round(sum(r.get("us_per_iter") or 0 for r in others), 2),
                          "share": round(sum(r.get("share") or 0 for r in others), 4),
                          "calls_per_iter": round(sum(r.get("calls_per_iter") or 0 for r in others), 3),
                          "status": ""})
        shown += [r for r in group if r["source"] == "total"]
        for r in shown:
            blocks = " x ".join(str(r[b]) for b in ("block_m", "block_n") if r.get(b) is not None)
            smem = _cell(r.get("shared_bytes") / 1024 if r.get("shared_bytes") is not None else None, "{:.1f}")
            kernel = r["kernel"]
            if r["source"] == "total" and r.get("event_ms") is not None:
                kernel += f" (CUDA events {r['event_ms']:.2f} ms, {r.get('tflops')} TFLOP/s)"
            cells = [workload, "yes" if causal else "no", kernel, _cell(r.get("calls_per_iter")),
                     _cell(r.get("us_per_iter"), "{:.1f}"), _cell(r.get("share"), "{:.1%}"), blocks,
                     _cell(r.get("num_warps")), _cell(r.get("num_stages")), _cell(r.get("n_regs")),
                     _cell(r.get("n_spills")), smem, _cell(r.get("blocks_per_sm")), _cell(r.get("warps_per_sm")),
                     _cell(r.get("limiter")), _cell(r.get("waves")), r.get("status") or ""]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384, help="sequence length (N = M)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["fwd", "fwd_bwd", "fwd_bwd_bob"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (compilation, autotuning)")
    parser.add_argument("--iters", type=int, default=5, help="profiled iterations")
    parser.add_argument("--sass", action="store_true", help="disassemble each kernel and count LDL/STL (cuobjdump)")
    parser.add_argument("--asm-dir", default="", help="write each kernel's PTX and TTGIR (and SASS) here")
    parser.add_argument("--out", default="docs/results/kernel_profile.csv")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--interpret", action="store_true", help="run the kernels in Triton's interpreter (CPU)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
    device = torch.device(args.device)
    limits = sm_limits(device)
    facts_cache: dict[int, dict] = {}

    def facts_of(launch: Launch) -> dict:
        key = id(launch.kernel)
        if key not in facts_cache:
            facts_cache[key] = compiled_facts(launch.kernel, sass=args.sass)
        return facts_cache[key]

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with LaunchRecorder() as recorder, open(args.out, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for causal in map(bool, args.causal):
            for workload in args.workloads:
                case_rows = profile_case(args, workload, causal, recorder, limits, facts_of)
                writer.writerows(case_rows)
                out.flush()
                rows += case_rows
                total = case_rows[-1]
                print(f"{workload:11s} causal={causal:d}: {len(case_rows) - 1} kernels, "
                      f"{total.get('us_per_iter') or 0:.1f} us of kernels per iteration, {total['status']}", flush=True)
    print(f"wrote {len(rows)} rows to {args.out} (SM limits: {dataclasses.asdict(limits)})")
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
