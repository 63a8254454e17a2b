"""Peak memory of a gradient and of both Hessian-vector product modes on the CPU, with and without
activation checkpointing.

    PYTHONPATH=. python benchmarks/forward_hvp_memory_cpu.py --contexts 2048 4096

Model: ``recipes.lm.model.GPT`` with 4 layers, d_model 256, 4 heads, a GELU MLP, vocabulary 256, float32,
batch 1, attention through flashbob's blocked backend with panels of 2^16 scores (so that the activations,
not the attention's panel temporaries, decide the peak). Workloads, each from scratch (forward included):
``grad`` (one gradient), ``ror`` (``optim.hvp``, reverse-over-reverse) and ``for`` (``optim.hvp(...,
mode="forward")``, forward-over-reverse), with ``checkpoint_activations`` off and on (non-reentrant
``torch.utils.checkpoint`` per block). Each runs in a process of its own, after a warm-up at 64 tokens;
the figure is the growth of the process's peak resident memory (``ru_maxrss``) during the workload, which
counts what the allocator held at the peak. Prints a Markdown table; ``--out`` also writes a CSV.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import torch

from benchmarks.environment import child_environment
from benchmarks.results import write_rows

WORKLOADS = ("grad", "ror", "for")
CHECKPOINT_UNSUPPORTED = "activation checkpointing (torch.utils.checkpoint)"  # optim's error where torch has no rule


def measure(workload: str, checkpoint: bool, context: int) -> float:
    """MiB by which the peak resident memory grows during one ``workload`` at ``context`` tokens (this process)."""
    import optim
    from flashbob import blocked
    from recipes.lm import model as lm_model

    blocked.PANEL_ELEMENTS = 2**16
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = lm_model.GPT(vocab_size=256, d_model=256, n_layers=4, n_heads=4, mlp="gelu",
                         checkpoint_activations=checkpoint)
    params = list(model.parameters())
    vec = [torch.randn_like(p) for p in params]

    def run(tokens: int):
        batch = torch.randint(0, 256, (1, tokens + 1))

        def loss():
            return lm_model.cross_entropy(model(batch[:, :-1]), batch[:, 1:])

        if workload == "grad":
            return torch.autograd.grad(loss(), params)
        if workload == "ror":
            return optim.hvp(loss(), params, vec)
        return optim.hvp(optim.functional(model, loss, params), params, vec, mode="forward")

    run(64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(context)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--out", help="CSV of the rows")
    parser.add_argument("--one", nargs=3, metavar=("WORKLOAD", "CHECKPOINT", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child process of one measurement
        workload, checkpoint, context = args.one
        print(measure(workload, checkpoint == "1", int(context)))
        return
    rows = []
    for context in args.contexts:
        for checkpoint in (False, True):
            mib = {}
            for workload in WORKLOADS:
                child = [sys.executable, __file__, "--one", workload, str(int(checkpoint)), str(context)]
                done = subprocess.run(child, capture_output=True, text=True, env=child_environment())
                if done.returncode and workload == "for" and CHECKPOINT_UNSUPPORTED in done.stderr:
                    print(f"context {context}: no forward-mode HVP with checkpointing in torch {torch.__version__} "
                          "(torch.utils.checkpoint has no forward-mode rule there); left blank", file=sys.stderr)
                    mib[workload] = None
                    continue
                if done.returncode:
                    sys.exit(f"{workload} at context {context}, checkpointing {checkpoint}: the child process "
                             f"exited {done.returncode}:\n{done.stderr[-3000:]}")
                mib[workload] = float(done.stdout.split()[-1])
            ratio = round(mib["for"] / mib["ror"], 3) if mib["for"] is not None and mib["ror"] > 0 else None
            rows.append({"context": context, "checkpoint_activations": checkpoint,
                         **{f"{w}_mib": None if mib[w] is None else round(mib[w], 1) for w in WORKLOADS},
                         "for_over_ror": ratio})
    if args.out:
        write_rows(args.out, rows)
    print("| context | checkpointing | gradient | HVP reverse | HVP forward | forward / reverse |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        forward = "-" if r["for_mib"] is None else f"{r['for_mib']:.0f} MiB"
        print(f"| {r['context']} | {'on' if r['checkpoint_activations'] else 'off'} | {r['grad_mib']:.0f} MiB | "
              f"{r['ror_mib']:.0f} MiB | {forward} | "
              + (f"{r['for_over_ror']:.2f}x |" if r["for_over_ror"] is not None else "- |"))


if __name__ == "__main__":
    main()
