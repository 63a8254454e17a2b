"""Peak memory of a gradient and of both Hessian-vector product modes on the CPU, without activation
checkpointing, with ``optim.checkpoint`` and with ``torch.utils.checkpoint``.

    PYTHONPATH=. python benchmarks/forward_hvp_memory_cpu.py --contexts 2048 4096

Model: ``recipes.lm.model.GPT`` with 4 layers, d_model 256, 4 heads, a GELU MLP, vocabulary 256, float32,
batch 1, attention through flashbob's blocked backend with panels of 2^16 scores (so that the activations,
not the attention's panel temporaries, decide the peak). Workloads, each from scratch (forward included):
``grad`` (one gradient), ``ror`` (``optim.hvp``, reverse-over-reverse) and ``for`` (``optim.hvp(...,
mode="forward")``, forward-over-reverse), with each block checkpointed: ``off`` (not), ``optim`` (the model's
``checkpoint_activations=True``: ``optim.checkpoint``, which forward mode can go through) or ``torch``
(non-reentrant ``torch.utils.checkpoint``; torch 2.11 has no forward-mode rule for it, and that row's ``for``
is left blank). Each runs in a process of its own, after a warm-up at 64 tokens; the figure is the growth of
the process's peak resident memory (``ru_maxrss``) during the workload, which counts what the allocator held
at the peak. Prints a Markdown table; ``--out`` also writes a CSV.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from benchmarks.environment import child_environment
from benchmarks.results import write_rows
from optim.forward_mode_checks import CHECKPOINT_WITHOUT_FORWARD_RULE

WORKLOADS = ("grad", "ror", "for")
CHECKPOINTING = ("off", "optim", "torch")


class TorchCheckpointed(nn.Module):
    """``block`` run through non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(self.block, x, use_reentrant=False)


def measure(workload: str, checkpointing: str, context: int) -> float:
    """MiB by which the peak resident memory grows during one ``workload`` at ``context`` tokens (this process)."""
    import optim
    from flashbob import blocked
    from recipes.lm import model as lm_model

    blocked.PANEL_ELEMENTS = 2**16
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = lm_model.GPT(vocab_size=256, d_model=256, n_layers=4, n_heads=4, mlp="gelu",
                         checkpoint_activations=checkpointing == "optim")
    if checkpointing == "torch":
        model.blocks = nn.ModuleList(TorchCheckpointed(block) for block in model.blocks)
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


def ratio(numerator: float | None, denominator: float) -> float | None:
    """``numerator / denominator`` to 3 decimals, or None where either is missing or not positive."""
    return round(numerator / denominator, 3) if numerator is not None and denominator > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--out", help="CSV of the rows")
    parser.add_argument("--one", nargs=3, metavar=("WORKLOAD", "CHECKPOINTING", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child process of one measurement
        workload, checkpointing, context = args.one
        print(measure(workload, checkpointing, int(context)))
        return
    rows = []
    for context in args.contexts:
        for checkpointing in CHECKPOINTING:
            mib = {}
            for workload in WORKLOADS:
                child = [sys.executable, __file__, "--one", workload, checkpointing, str(context)]
                done = subprocess.run(child, capture_output=True, text=True, env=child_environment())
                if done.returncode and workload == "for" and CHECKPOINT_WITHOUT_FORWARD_RULE in done.stderr:
                    print(f"context {context}: torch {torch.__version__}'s torch.utils.checkpoint has no forward-mode "
                          "rule; the forward-mode HVP through it is left blank", file=sys.stderr)
                    mib[workload] = None
                    continue
                if done.returncode:
                    sys.exit(f"{workload} at context {context}, checkpointing {checkpointing}: the child process "
                             f"exited {done.returncode}:\n{done.stderr[-3000:]}")
                mib[workload] = float(done.stdout.split()[-1])
            if checkpointing == "off":
                plain_ror = mib["ror"]
            rows.append({"context": context, "checkpointing": checkpointing,
                         **{f"{w}_mib": None if mib[w] is None else round(mib[w], 1) for w in WORKLOADS},
                         "for_over_ror": ratio(mib["for"], mib["ror"]),
                         "for_over_plain_ror": ratio(mib["for"], plain_ror)})
    if args.out:
        write_rows(args.out, rows)
    print("| context | checkpointing | gradient | HVP reverse | HVP forward | forward / reverse | "
          "forward / reverse without checkpointing |\n|---|---|---|---|---|---|---|")
    for r in rows:
        forward = "-" if r["for_mib"] is None else f"{r['for_mib']:.0f} MiB"
        ratios = " | ".join("-" if x is None else f"{x:.2f}x" for x in (r["for_over_ror"], r["for_over_plain_ror"]))
        print(f"| {r['context']} | {r['checkpointing']} | {r['grad_mib']:.0f} MiB | {r['ror_mib']:.0f} MiB | "
              f"{forward} | {ratios} |")


if __name__ == "__main__":
    main()
