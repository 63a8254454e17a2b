"""benchmarks/profile_step.py on the CPU: the passes, attentions and host synchronisations of one step of the LM
recipe (model.attention=sdpa) with NewtonCG and SophiaH as the optimizer comparison sets them up."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from benchmarks import profile_step
from optim import newton_cg
from optim.operators import GGNOperator
from tests.runs import ROOT

MICRO = [
    "train.device=cpu", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "data.context_length=32",
    "data.batch_size=2", "data.max_bytes=200000", "data.val_fraction=0.1", "model.attention=sdpa", "train.threads=1",
]  # fmt: skip
CONFIG = ROOT / "configs" / "lm" / "tiny.yaml"


def profiled(optimizer: str, *overrides: str) -> dict[str, tuple[dict[str, dict], profile_step.Counter]]:
    """Each kind of step of ``optimizer``: its rows by phase (from the timed step) and its counts."""
    recipe, device = profile_step.build(CONFIG, optimizer, [*MICRO, *overrides])
    found = profile_step.profile(recipe, device, warmup=2, max_steps=25)
    return {kind: ({row["phase"]: row for row in profiler.rows()}, counter)
            for kind, (profiler, counter) in found.items()}


def calls(rows: dict[str, dict], phase: str) -> int:
    return rows[phase]["calls"] if phase in rows else 0


def test_newton_cg_step_passes_attentions_and_syncs():
    """NewtonCG (curvature_batch 1, forward mode, 4 CG iterations, warm start, Gauss-Newton-Bartlett preconditioner):
    closure() and closure(rows) on SDPA with a graph, one forward with tangents per product on flashbob (cg_iters + 1:
    the warm start's residual), the trial points on SDPA without a graph; one host synchronisation per CG iteration
    and none in a product."""
    (rows, counter), = profiled("newtoncg").values()
    forward, cg = "step / forward [grad, 2 rows]", "step / CG / GGN product"
    curvature_rows = "step / gradient and curvature / forward [grad, 1 rows]"
    assert calls(rows, forward) == 1 and calls(rows, forward + " / attention: sdpa") == 2
    assert calls(rows, curvature_rows) == 1 and calls(rows, curvature_rows + " / attention: sdpa") == 2
    products = calls(rows, cg)
    assert 2 <= products <= 5 and calls(rows, cg + " / forward [tangents, 1 rows]") == products
    assert calls(rows, cg + " / forward [tangents, 1 rows] / attention: flashbob") == 2 * products
    assert calls(rows, cg + " / backward") == products
    trials = calls(rows, "step / search / forward [no grad, 2 rows]")
    assert trials >= 1 and calls(rows, "step / search / forward [no grad, 2 rows] / attention: sdpa") == 2 * trials
    assert not any("search / forward [grad" in phase or "flashbob" in phase and "tangents" not in phase
                   for phase in rows), list(rows)
    syncs = dict(counter.syncs)
    counted = {row["phase"]: row for row in counter.profiler.rows()}  # the passes of the counted step
    assert syncs.pop("step / CG") == calls(counted, cg) and "step / CG / GGN product" not in syncs  # 1 + 1 per iteration
    assert syncs.pop("step / search") == calls(counted, "step / search / forward [no grad, 2 rows]")  # each trial
    assert syncs.pop("step / preconditioner") <= 4  # sampling labels for the Gauss-Newton-Bartlett diagonal
    # the loss, the finiteness of the gradient, the diagonal and the update, the recipe's loss after the step
    assert sum(syncs.values()) == 5, counter.sync_ops


def test_sophia_steps_passes_attentions_and_syncs():
    """SophiaH: a plain step is one SDPA forward and backward with two host synchronisations (the optimizer's
    finiteness check and the recipe's loss, after the step); a refresh step with hessian_batch 1 (the comparison's
    setting) the gradient on SDPA and the estimate on closure(rows) through flashbob; without it (sophiah_full)
    flashbob and a create_graph backward on the whole batch; in forward mode (sophiah_forward) the estimate's pass
    carries tangents through flashbob and no create_graph backward runs, and on the whole batch
    (sophiah_full_forward) that pass is all the refresh step runs."""
    kinds = profiled("sophiah")
    plain, counter = kinds["plain"]
    assert set(plain) == {"step", "step / forward [grad, 2 rows]", "step / forward [grad, 2 rows] / attention: sdpa",
                          "step / backward", "step / update"}
    assert counter.total_syncs == 2, counter.sync_ops
    refresh, _ = kinds["refresh"]
    assert calls(refresh, "step / forward [grad, 2 rows] / attention: sdpa") == 2
    assert calls(refresh, "step / backward") == 1
    estimate = "step / forward [grad, 1 rows]"
    assert calls(refresh, estimate) == 1 and calls(refresh, estimate + " / attention: flashbob") == 2
    assert calls(refresh, "step / Hutchinson estimate / Hessian product") == 1
    refresh, _ = profiled("sophiah_full")["refresh"]
    assert calls(refresh, "step / forward [grad, 2 rows] / attention: flashbob") == 2
    assert calls(refresh, "step / backward (create_graph)") == 1 and "step / backward" not in refresh
    refresh, _ = profiled("sophiah_forward")["refresh"]  # the product by forward over reverse on closure(rows)
    product = "step / Hutchinson estimate / Hessian product"
    assert calls(refresh, "step / forward [grad, 2 rows] / attention: sdpa") == 2
    assert calls(refresh, product + " / forward [tangents, 1 rows] / attention: flashbob") == 2
    assert calls(refresh, product + " / backward") == 1 and not any("create_graph" in phase for phase in refresh)
    refresh, _ = profiled("sophiah_full_forward")["refresh"]  # on both windows: that pass is the refresh step's only
    assert set(refresh) == {"step", "step / Hutchinson estimate", product, product + " / forward [tangents, 2 rows]",
                            product + " / forward [tangents, 2 rows] / attention: flashbob", product + " / backward",
                            "step / update"}, list(refresh)


def test_main_prints_a_table_per_kind_and_writes_the_csv(tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.csv"
    argv = ["profile_step.py", "--config", str(CONFIG), "--optimizers", "sophiah", "--warmup", "1", "--out", str(out),
            *MICRO]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_step.main()
    printed = capsys.readouterr().out
    assert "sophiah, a plain step\n\n| phase" in printed and "sophiah, a refresh step\n\n| phase" in printed
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["kind"] for r in rows} == {"plain", "refresh"} and all(float(r["device_ms"]) >= 0 for r in rows)
    assert Path(out).stat().st_size > 0


def test_profiling_leaves_everything_it_patched_as_it_was():
    recipe, device = profile_step.build(CONFIG, "newtoncg", MICRO)
    model = recipe.parts["model"]

    def patched():
        return (vars(model).get("forward"), model.attention.first_order, model.attention.twice, newton_cg.cg,
                torch.autograd.grad, torch.Tensor.backward, GGNOperator.matvec, vars(GGNOperator)["matvec"])

    before = patched()
    profile_step.profile_step(recipe, device, counting=True)
    assert patched() == before and before[0] is None
