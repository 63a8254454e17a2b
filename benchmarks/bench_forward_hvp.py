"""Forward-over-reverse against reverse-over-reverse Hessian-vector products through flashbob, and
curvlinops' GGN mat-vec through flashbob against SDPA's math backend, on a GPT (GPU).

    PYTHONPATH=. python benchmarks/bench_forward_hvp.py --out docs/results/bench_forward_hvp.csv

Model: ``recipes.lm.model.GPT`` with 4 layers, d_model 512, 8 heads (head_dim 64), RMSNorm, a GELU
MLP (as in the first runs, made when the recipe's SwiGLU could not take forward-over-reverse), tied embeddings, batch 1, bf16 autocast, random byte tokens (as ``bench_curvature.py``). Workloads, each
from scratch (forward included), at every ``--contexts`` length through flashbob (Triton kernels):

* ``grad``: one gradient, for scale;
* ``hvp_reverse``: ``optim.hvp(loss, params, v)``, reverse-over-reverse (a ``create_graph`` backward,
  then a backward through it: BoB in attention);
* ``hvp_forward``: ``optim.hvp(loss_fn, params, v, mode="forward")``, forward-over-reverse (a forward
  with tangents, then a backward that carries them: attention's forward and backward JVP kernels);
* ``hvp_forward_checkpointed``: the same with each block recomputed in the backward (the model's
  ``checkpoint_activations``, i.e. ``optim.checkpoint``): the blocks' activations and tangents are not kept,
  for one more forward with tangents per block, less attention's (its outputs are kept and reused);
* ``hvp_forward_checkpointed_recompute_attention``: the same with the model's ``save_attention=False``
  (``optim.checkpoint`` without kept outputs): the recomputation runs attention's forward and forward tangent again;
* ``hvp_reverse_checkpointed``: reverse-over-reverse with ``optim.checkpoint`` on every block.

and at ``--ggn-context``, ``curvlinops.GGNLinearOperator`` mat-vecs (``jvp`` of the model, the
cross-entropy Hessian, a ``vjp``; built on torch.func) with attention through flashbob
(``ggn_curvlinops`` / ``flashbob``) and through ``F.scaled_dot_product_attention`` restricted to its
math backend (``sdpa_math``, which materialises the scores and supports forward mode and double
backward). The curvlinops rows are skipped with a message if curvlinops is not installed.

Median of ``--reps`` CUDA-event timings after ``--warmup`` runs; peak ``torch.cuda.max_memory_allocated``
over the timed runs (model, optimizer-free, included). ``rel_diff`` is the relative difference of the
product to the reference product of its group (``hvp_reverse`` at the same context; curvlinops through
flashbob), computed once before timing. Writes a CSV and prints a table last.

CPU smoke test of the script (tiny GPT, blocked backend, wall-clock times, no memory)::

    PYTHONPATH=. python benchmarks/bench_forward_hvp.py --smoke --out /tmp/bench_forward_hvp.csv
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashbob
import optim
from benchmarks.results import write_rows
from benchmarks.timing import timed_with_peak
from recipes.lm import model as lm_model

VOCAB = 256
# GELU MLP, not the recipe's default SwiGLU, so that the figures compare with the first runs (before
# recipes.common.transformer.silu, PyTorch 2.13's F.silu had no forward-mode derivative of its backward).
GPU_MODEL = {"d_model": 512, "n_layers": 4, "n_heads": 8, "mlp": "gelu"}
SMOKE_MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "mlp": "gelu"}


def math_sdpa_attention(q, k, v, *, causal=False, scale=None, backend="auto"):
    """``F.scaled_dot_product_attention`` on its math backend, with flashbob.attention's signature."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


class ClassesSecond(nn.Module):
    """The GPT in float32 (curvlinops' products fail under bf16 autocast on the H200: "expected scalar type
    Float but found BFloat16" in its vjp), logits as ``(batch, vocab, seq)`` for ``nn.CrossEntropyLoss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return rearrange(self.model(tokens), "b t v -> b v t")


def autocast(device: str):
    """bf16 autocast on the GPU; float32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()


def hvp_workloads(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, device: str) -> dict[str, Callable]:
    """The gradient and both HVP modes, each from scratch, with one fixed random direction."""
    params = list(model.parameters())
    vec = [torch.randn_like(p) for p in params]

    def loss() -> torch.Tensor:
        with autocast(device):
            return lm_model.cross_entropy(model(tokens), targets)

    loss_fn = optim.functional(model, loss, params)

    def checkpointed(product: Callable, save_attention: bool = True) -> Callable:
        def run():
            model.checkpoint_activations = True
            try:
                with mock.patch.object(model, "save_attention", save_attention):
                    return product()
            finally:
                model.checkpoint_activations = False
        return run

    def hvp_reverse():
        return optim.hvp(loss(), params, vec)

    def hvp_forward():
        return optim.hvp(loss_fn, params, vec, mode="forward")

    return {
        "grad": lambda: torch.autograd.grad(loss(), params),
        "hvp_reverse": hvp_reverse,
        "hvp_forward": hvp_forward,
        "hvp_forward_checkpointed": checkpointed(hvp_forward),
        "hvp_forward_checkpointed_recompute_attention": checkpointed(hvp_forward, save_attention=False),
        "hvp_reverse_checkpointed": checkpointed(hvp_reverse),
    }


def curvlinops_workloads(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, device: str) -> dict[str, Callable]:
    """curvlinops' GGN mat-vec with attention through flashbob and through SDPA's math backend."""
    from curvlinops import GGNLinearOperator

    params = list(model.parameters())
    op = GGNLinearOperator(ClassesSecond(model), nn.CrossEntropyLoss(), params, [(tokens, targets)],
                           check_deterministic=False)
    vec = torch.randn(op.shape[1], device=device)

    def through_math_sdpa():
        with mock.patch.object(flashbob, "attention", math_sdpa_attention):
            return op @ vec

    return {"flashbob": lambda: op @ vec, "sdpa_math": through_math_sdpa}


def relative_difference(got, want) -> float:
    """``||got - want|| / ||want||`` over all tensors, in float64."""
    flat = [torch.cat([t.double().reshape(-1) for t in (x if isinstance(x, (list, tuple)) else [x])]) for x in (got, want)]
    return float((flat[0] - flat[1]).norm() / flat[1].norm())


def run_group(group: dict[str, Callable], reference: str | None, context: int, kind: str, args) -> list[dict]:
    """One row per workload of ``group``: time, peak memory, and the difference to ``reference``'s product."""
    rows, want = [], None
    for name, fn in group.items():
        row = {"workload": kind if kind != "hvp" else name, "attention": name if kind != "hvp" else "flashbob",
               "context": context, "ms": None, "peak_gib": None, "rel_diff": None, "status": "ok"}
        try:
            got = fn()
            if name == reference:
                want = got
            elif want is not None:
                row["rel_diff"] = relative_difference(got, want)
            del got
            row["ms"], row["peak_gib"] = timed_with_peak(fn, args.warmup, args.reps, args.device)
        except torch.cuda.OutOfMemoryError:
            row["status"] = "oom"
        if args.device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"{row['workload']:24s} {row['attention']:9s} context={context:6d} {row['status']:3s} "
              f"ms={row['ms']} peak_gib={row['peak_gib']} rel_diff={row['rel_diff']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/bench_forward_hvp.csv")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--ggn-context", type=int, default=8192, help="context of the curvlinops GGN rows")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny GPT and contexts, one rep")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.contexts, args.ggn_context, args.warmup, args.reps = "cpu", [24], 24, 0, 1
    else:
        args.device = "cuda"

    torch.manual_seed(0)
    model = lm_model.GPT(vocab_size=VOCAB, **(SMOKE_MODEL if args.smoke else GPU_MODEL)).to(args.device)
    rows = []
    for context in args.contexts:
        tokens = torch.randint(0, VOCAB, (1, context + 1), device=args.device)
        rows += run_group(hvp_workloads(model, tokens[:, :-1], tokens[:, 1:], args.device), "hvp_reverse",
                          context, "hvp", args)
    try:
        import curvlinops  # noqa: F401
    except ImportError:
        print("curvlinops is not installed: the ggn_curvlinops rows are skipped "
              "(pip install --no-deps curvlinops-for-pytorch==3.0.1 linear_operator==0.6.1 einconv==0.1.0)")
    else:
        tokens = torch.randint(0, VOCAB, (1, args.ggn_context + 1), device=args.device)
        rows += run_group(curvlinops_workloads(model, tokens[:, :-1], tokens[:, 1:], args.device), "flashbob",
                          args.ggn_context, "ggn_curvlinops", args)
    write_rows(args.out, rows)
    print("\n| workload | attention | context | ms | peak GiB | rel. diff |\n|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] is not None else r["status"]
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        diff = f"{r['rel_diff']:.2e}" if r["rel_diff"] is not None else "-"
        print(f"| {r['workload']} | {r['attention']} | {r['context']} | {ms} | {peak} | {diff} |")


if __name__ == "__main__":
    main()
