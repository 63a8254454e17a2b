"""flashbob under torch.compile (GPU): graph breaks, recompilations and gradients of the compiled recipe GPT, and
the time of its compiled training step against the same model compiled with torch's SDPA.

    PYTHONPATH=. FLASHBOB_AUTOTUNE=0 python benchmarks/bench_compile.py --out docs/results/compile.csv

Model: ``recipes.lm.model.GPT`` with 4 layers, d_model 512, 8 heads (head_dim 64), byte vocabulary, batch 1,
bf16 autocast, causal; attention through flashbob (the Triton kernels) or torch's SDPA (the recipe's ``sdpa``
setting, which runs torch's fused kernels on passes differentiated once). Random tokens. Two parts:

1. ``check``, at ``--check-length`` tokens: ``torch._dynamo.explain`` of the loss (graph breaks, flashbob
   operators in the graph); then, for inductor and aot_eager, three gradients on new tokens of the loss compiled
   with ``fullgraph=True`` and recompilation an error (``graphs``: Dynamo graphs compiled), each against eager's
   (``grad_rel_error``: relative error of the flattened gradient, the largest of the three); the same for the
   SDPA model, for what compiling alone does to bf16 gradients.
2. ``time``, at each ``--lengths``: one gradient (forward + backward) of the loss, eager and compiled by inductor,
   through flashbob and through SDPA; CUDA-event median of ``--reps`` after ``--warmup`` runs (the compilation);
   ``ratio`` = flashbob / SDPA in the same mode (target for compiled: at most 1.10).

Writes a CSV and prints a table last. CPU smoke test of the script (tiny GPT, blocked backend, aot_eager,
wall-clock times)::

    PYTHONPATH=. python benchmarks/bench_compile.py --device cpu --out /tmp/compile.csv
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.results import write_rows
from benchmarks.timing import median_ms, wall_median_ms
from recipes.lm import model as lm_model

#: Implementation name: the recipe GPT's ``attention`` setting that runs it.
IMPLS = {"flashbob": "auto", "sdpa": "sdpa"}
GPT = {"cuda": dict(vocab_size=256, d_model=512, n_layers=4, n_heads=8),
       "cpu": dict(vocab_size=256, d_model=32, n_layers=2, n_heads=2)}
COLUMNS = ("part", "impl", "compiler", "mode", "length", "status", "graph_breaks", "flashbob_ops", "graphs",
           "grad_rel_error", "ms", "ratio")


def make_model(attention: str, device: str) -> torch.nn.Module:
    """The benchmark's GPT with ``attention``, the same weights for every setting."""
    torch.manual_seed(0)
    return lm_model.GPT(**GPT[device], attention=attention).to(device)


def loss_of(model: torch.nn.Module, device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Next-token cross-entropy of ``model`` on ``tokens`` ``(1, length + 1)``, in bf16 autocast on a GPU."""

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(tokens[:, :-1])
        return lm_model.cross_entropy(logits, tokens[:, 1:])

    return loss


def gradient(loss: Callable, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The flattened gradient of ``loss(tokens)`` with respect to ``model``'s parameters."""
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss(tokens), list(model.parameters()))])


def steps(model: torch.nn.Module, compiler: str, length: int, device: str) -> dict:
    """Three gradients on new tokens, compiled with ``compiler`` (``fullgraph=True``, a recompilation raises),
    against eager's."""
    eager = loss_of(model, device)
    compiled = torch.compile(eager, backend=compiler, fullgraph=True, dynamic=False)
    torch._dynamo.utils.counters.clear()
    errors = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            tokens = torch.randint(0, 256, (1, length + 1), device=device)
            got, want = gradient(compiled, model, tokens), gradient(eager, model, tokens)
            errors.append(((got - want).norm() / want.norm()).item())
    return {"status": "ok", "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "grad_rel_error": f"{max(errors):.2e}"}


def failed(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"


def check_rows(length: int, device: str) -> list[dict]:
    torch._dynamo.reset()
    tokens = torch.randint(0, 256, (1, length + 1), device=device)
    explained = torch._dynamo.explain(loss_of(make_model("auto", device), device))(tokens)
    rows = [{"part": "check", "impl": "flashbob", "compiler": "explain", "length": length, "status": "ok",
             "graph_breaks": explained.graph_break_count,
             "flashbob_ops": sum(graph.code.count("torch.ops.flashbob.") for graph in explained.graphs)}]
    compilers = ("inductor", "aot_eager") if device == "cuda" else ("aot_eager",)
    for impl, setting in IMPLS.items():
        model = make_model(setting, device)
        for compiler in compilers:
            torch._dynamo.reset()
            row = {"part": "check", "impl": impl, "compiler": compiler, "length": length}
            try:
                row.update(steps(model, compiler, length, device))
            except Exception as error:  # noqa: BLE001 (recorded: the point of the check)
                row["status"] = failed(error)
            rows.append(row)
    return rows


def time_rows(lengths: list[int], warmup: int, reps: int, device: str) -> list[dict]:
    timer = median_ms if device == "cuda" else wall_median_ms
    compiler = "inductor" if device == "cuda" else "aot_eager"
    rows = []
    for length in lengths:
        tokens = torch.randint(0, 256, (1, length + 1), device=device)
        times = {}
        for impl, setting in IMPLS.items():
            model = make_model(setting, device)
            eager = loss_of(model, device)
            torch._dynamo.reset()
            for mode, loss in (("eager", eager), ("compiled", torch.compile(eager, backend=compiler, dynamic=False))):
                row = {"part": "time", "impl": impl, "compiler": compiler if mode == "compiled" else "",
                       "mode": mode, "length": length}
                try:
                    for _ in range(warmup):
                        gradient(loss, model, tokens)
                    times[impl, mode] = timer(lambda: gradient(loss, model, tokens), reps)
                    row.update(status="ok", ms=round(times[impl, mode], 3))
                except Exception as error:  # noqa: BLE001 (recorded, and the other rows still run)
                    row["status"] = failed(error)
                rows.append(row)
            del model, eager
            if device == "cuda":
                torch.cuda.empty_cache()
        for row in rows:
            key = ("sdpa", row.get("mode"))
            if row["length"] == length and "ms" in row and key in times:
                row["ratio"] = round(row["ms"] / times[key], 3)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'part':6} {'impl':9} {'compiler':9} {'mode':9} {'length':>6}  result")
    for row in rows:
        if row["status"] != "ok":
            result = row["status"]
        elif row["part"] == "time":
            result = f"{row['ms']} ms" + (f", ratio {row['ratio']}" if "ratio" in row else "")
        elif row["compiler"] == "explain":
            result = f"graph breaks {row['graph_breaks']}, flashbob operators in the graph {row['flashbob_ops']}"
        else:
            result = f"graphs {row['graphs']} (1: no recompilation), gradient vs eager {row['grad_rel_error']}"
        print(f"{row['part']:6} {row['impl']:9} {row['compiler']:9} {row.get('mode', ''):9} {row['length']:>6}  "
              f"{result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/compile.csv")
    parser.add_argument("--check-length", type=int, default=1024)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (the first compiles)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: smoke test of the script (tiny GPT, blocked backend)")
    args = parser.parse_args()
    if args.device == "cpu":
        args.check_length, args.lengths, args.warmup, args.reps = 32, [64], 1, 2
    rows = check_rows(args.check_length, args.device) + time_rows(args.lengths, args.warmup, args.reps, args.device)
    write_rows(args.out, rows, COLUMNS)
    print_table(rows)


if __name__ == "__main__":
    main()
