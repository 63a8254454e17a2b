"""Data parallelism on the CPU (gloo, 2 processes): the optimizers on two half batches equal one process on the whole.

A float64 tiny transformer with flashbob attention takes NewtonCG, SophiaH and AdaHessian steps
on each rank's half of a batch with ``distributed=True``; the parameters must equal those of one
process on the whole batch to float64 rounding, and agree bit for bit across the ranks. Then the
LM recipe runs under ``torchrun --nproc_per_node=2``: rank 0 alone logs and checkpoints, two
ranks of batch B match one process of batch 2B, and a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any process group: see recipes/common/distributed.py
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.environment import child_environment
from optim import AdaHessian, NewtonCG, SophiaG, SophiaH
from optim import distributed as odist
from optim.preconditioner import label_generator
from recipes.common import data
from recipes.common.transformer import Transformer
from tests.helpers import assert_matches

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
TOL = 1e-10

# name -> (optimizer factory given (params, generator, distributed), steps)
CASES = {
    "newtoncg_ggn": (lambda p, g, d: NewtonCG(p, preconditioner="hutchinson", max_cg_iters=8, generator=g,
                                              distributed=d), 2),
    "newtoncg_hessian": (lambda p, g, d: NewtonCG(p, curvature="hessian", max_cg_iters=8, generator=g,
                                                  distributed=d), 1),
    "sophiah": (lambda p, g, d: SophiaH(p, lr=2e-2, update_period=2, generator=g, distributed=d), 3),
    "adahessian": (lambda p, g, d: AdaHessian(p, lr=5e-2, generator=g, distributed=d), 2),
}
# Random draws that differ from one process's (the shared default generator; SophiaG's sampled labels):
# the ranks must still agree exactly.
REPLICATED = {
    "sophiah_default_generator": (lambda p, g, d: SophiaH(p, lr=2e-2, update_period=2, distributed=d), 3),
    "sophiag": (lambda p, g, d: SophiaG(p, lr=2e-2, update_period=2, distributed=d), 3),
    "newtoncg_bartlett": (lambda p, g, d: NewtonCG(p, preconditioner="bartlett", max_cg_iters=4, generator=g,
                                                   distributed=d), 2),
}
# Probe generators seeded differently per rank: each rank's estimate would be of another probe, and their average
# not the whole batch's; the ranks still agreed, so nothing showed it. Now the refresh refuses.
MISMATCHED = {
    "sophiah": lambda p, g: SophiaH(p, update_period=2, generator=g, distributed=True),
    "newtoncg": lambda p, g: NewtonCG(p, preconditioner="hutchinson", max_cg_iters=2, generator=g, distributed=True),
    "adahessian": lambda p, g: AdaHessian(p, generator=g, distributed=True),
}


def lm_batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    start = torch.randint(0, 16, (rows, 1), generator=gen)
    tokens = (start + torch.arange(13) * torch.randint(1, 3, (rows, 1), generator=gen)) % 16
    return tokens[:, :-1], tokens[:, 1:]


def run_case(factory, steps: int, rank: int, world: int, distributed: bool) -> dict:
    """Initial and final parameters and the per-step losses of ``steps`` steps on this rank's rows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model runs faster on one thread, and the CI machine may be busy
    try:
        return _run_case(factory, steps, rank, world, distributed)
    finally:
        torch.set_num_threads(threads)


def _run_case(factory, steps: int, rank: int, world: int, distributed: bool) -> dict:
    torch.manual_seed(0)
    model = Transformer(vocab_size=16, n_outputs=16, d_model=16, n_heads=2, n_kv_heads=1, n_layers=2).double()
    x, y = lm_batch()
    rows = x.shape[0] // world
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = factory(model.parameters(), torch.Generator().manual_seed(5), distributed)

    def closure():
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits

    losses = [float(opt.step(closure)) for _ in range(steps)]
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"initial": initial, "final": final, "losses": losses, "stats": dict(opt.stats)}


def _optimizer_worker(rank: int, init_file: str, out_dir: str) -> None:
    """This rank's results of :func:`_optimizer_results`, and the gloo threads left once the process group is
    destroyed (none: the group's backend goes with it, not at the interpreter's exit), saved to ``out_dir``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = _optimizer_results(rank)
    finally:
        dist.destroy_process_group()
    results["gloo_threads"] = gloo_threads()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _optimizer_results(rank: int) -> dict:
    results = {name: run_case(factory, steps, rank, WORLD, True)
               for name, (factory, steps) in {**CASES, **REPLICATED}.items()}
    results["mismatched"] = {name: mismatched_error(factory, rank) for name, factory in MISMATCHED.items()}
    results["partly_reached"] = {name: partly_reached(factory, [rank]) for name, factory in PARTLY.items()}
    results["plain_partly"] = {name: plain_partly(factory, [rank]) for name, factory in PLAIN.items()}
    bartlett = NewtonCG([torch.nn.Parameter(torch.zeros(2))], preconditioner="bartlett", distributed=True)
    results["label_state"] = label_generator(bartlett.generator, bartlett.group).get_state()
    results["probe_state"] = bartlett.generator.get_state()
    zeros = [torch.nn.Parameter(torch.zeros(2))]
    results["default_generators"] = {"sophiag": SophiaG(zeros, distributed=True).generator.get_state(),
                                     "sophiah": SophiaH(zeros, distributed=True).generator.get_state()}
    return results


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo runs (its workers and its socket loop); Linux only."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return sorted(name for name in names if "gloo" in name)


# A parameter the loss reaches on one rank only: it counts on every rank (its gradient is the average of the rank's
# and zeros), so that the ranks average the same tensors and stay replicated.
PARTLY = {
    "sophiah": lambda p, g, d: SophiaH(p, lr=2e-2, update_period=2, weight_decay=0.1, generator=g, distributed=d),
    "newtoncg": lambda p, g, d: NewtonCG(p, preconditioner="hutchinson", max_cg_iters=3, weight_decay=0.1,
                                         generator=g, distributed=d),
    "adahessian": lambda p, g, d: AdaHessian(p, lr=5e-2, weight_decay=0.1, generator=g, distributed=d),
}


def partly_reached(factory, ranks: list[int]) -> dict:
    """Two steps on the mean of the losses of ``ranks`` (this rank's alone when distributed), where ``b`` enters the
    loss of rank 0 only and ``c`` no loss: ``a``, ``b``, ``c``, their gradients and which have state."""
    a, b, c = (torch.nn.Parameter(torch.linspace(-1, 1, 3, dtype=torch.float64) + i) for i in range(3))
    opt = factory([a, b, c], torch.Generator().manual_seed(5), len(ranks) == 1)

    def closure():
        losses = [(a.sin() * (r + 1)).sum() + a.square().sum() + (b.cos().sum() if r == 0 else 0) for r in ranks]
        return sum(losses) / len(losses)

    for _ in range(2):
        opt.step(closure)
    return {"params": [p.detach().clone() for p in (a, b, c)], "grads": [p.grad for p in (a, b, c)],
            "state": [bool(opt.state.get(p)) for p in (b, c)]}


# Without a closure: rank 0's loss gives a gradient to ``a`` only, rank 1's to ``b`` only (same shape). Each rank
# averaged the parameters that held a p.grad on it: rank 0's a with rank 1's b, silently.
PLAIN = {
    "sophiah": lambda p, g, d: SophiaH(p, lr=2e-2, update_period=2, weight_decay=0.1, generator=g, distributed=d),
    "adahessian": lambda p, g, d: AdaHessian(p, lr=5e-2, weight_decay=0.1, generator=g, distributed=d),
}


def plain_partly(factory, ranks: list[int]) -> dict:
    """Two steps of ``loss.backward(create_graph=True); opt.step()`` on the mean of the losses of ``ranks`` (this
    rank's alone when distributed): ``a``, ``b``, ``c`` and their gradients."""
    a, b, c = (torch.nn.Parameter(torch.linspace(-1, 1, 3, dtype=torch.float64) + i) for i in range(3))
    opt = factory([a, b, c], torch.Generator().manual_seed(5), len(ranks) == 1)
    for _ in range(2):
        opt.zero_grad()
        losses = [(a.sin() + a.square()).sum() if r == 0 else (2 * b.cos() + b.square()).sum() for r in ranks]
        (sum(losses) / len(losses)).backward(create_graph=True)
        opt.step()
    return {"params": [p.detach().clone() for p in (a, b, c)], "grads": [p.grad for p in (a, b, c)]}


def mismatched_error(factory, rank: int) -> str | None:
    """The error of a step whose probe generator is seeded with the rank (None if it ran)."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=16, n_outputs=16, d_model=16, n_heads=2, n_kv_heads=1, n_layers=1).double()
    x, y = lm_batch(4)
    opt = factory(model.parameters(), torch.Generator().manual_seed(rank))
    try:
        opt.step(lambda: (F.cross_entropy(model(x).flatten(0, 1), y.flatten()), model(x)))
    except RuntimeError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_optimizer_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_ranks_equal_one_process_on_the_concatenated_batch(name, two_rank_results):
    factory, steps = CASES[name]
    single = run_case(factory, steps, 0, 1, False)
    for rank, result in enumerate(two_rank_results):
        ours = result[name]
        assert torch.equal(ours["initial"], single["initial"])
        assert_matches(ours["final"] - ours["initial"], single["final"] - single["initial"], TOL, f"{name} rank {rank}")
        np.testing.assert_allclose(ours["losses"], single["losses"], rtol=TOL)
        assert ours["stats"].get("step_skipped", 0.0) == 0.0
    if name.startswith("newtoncg"):  # the search decisions agree with one process
        for key in ("cg_iters", "step_size", "damping"):
            assert two_rank_results[0][name]["stats"][key] == single["stats"][key]


@pytest.mark.parametrize("name", sorted({**CASES, **REPLICATED}))
def test_ranks_stay_bitwise_replicated(name, two_rank_results):
    first, second = (result[name] for result in two_rank_results)
    assert torch.equal(first["final"], second["final"]) and not torch.equal(first["final"], first["initial"])
    assert first["losses"] == second["losses"]


def test_probe_generators_that_differ_between_ranks_are_refused(two_rank_results):
    for rank in two_rank_results:
        for name, error in rank["mismatched"].items():
            assert error is not None and "the probe generator is in another state on some rank" in error, name


@pytest.mark.parametrize("name", sorted(PARTLY))
def test_a_parameter_reached_on_one_rank_counts_on_every_rank(name, two_rank_results):
    """A parameter the closure's loss does not reach is skipped (as torch.optim skips a None p.grad); distributed,
    one reached on some rank is kept on all, with the whole batch's gradient, as one process on both losses."""
    single = partly_reached(PARTLY[name], [0, 1])
    first, second = (result["partly_reached"][name] for result in two_rank_results)
    for ours in (first, second):
        for mine, theirs in zip(ours["params"] + ours["grads"][:2], single["params"] + single["grads"][:2]):
            torch.testing.assert_close(mine, theirs, rtol=TOL, atol=TOL)
        assert ours["grads"][2] is None and ours["state"] == [True, False]
        assert torch.equal(ours["params"][2], torch.linspace(-1, 1, 3, dtype=torch.float64) + 2)
    assert all(torch.equal(x, y) for x, y in zip(first["params"], second["params"]))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_without_a_closure_ranks_average_the_same_parameters_when_their_gradients_differ(name, two_rank_results):
    """A parameter with a p.grad on one rank only is averaged with zeros from the others (as one process on both
    losses), not paired with whatever parameter the other rank holds at that position."""
    single = plain_partly(PLAIN[name], [0, 1])
    first, second = (result["plain_partly"][name] for result in two_rank_results)
    for ours in (first, second):
        for mine, theirs in zip(ours["params"] + ours["grads"][:2], single["params"] + single["grads"][:2]):
            torch.testing.assert_close(mine, theirs, rtol=TOL, atol=TOL)
        assert ours["grads"][2] is None
    assert all(torch.equal(x, y) for x, y in zip(first["params"], second["params"]))


def test_newton_cg_bartlett_labels_are_drawn_independently_per_rank(two_rank_results):
    """NewtonCG's Bartlett preconditioner drew its labels from the shared probe generator: row i of every rank got
    the same draw, which correlated the ranks' rows and doubled the diagonal's trace on identical shards (71.9
    against 36.1). Its labels now come from a generator seeded per rank from one shared draw (so the state a
    checkpoint holds is still the shared generator's); the probes stay shared."""
    first, second = two_rank_results
    assert torch.equal(first["probe_state"], second["probe_state"])
    assert not torch.equal(first["label_state"], second["label_state"])


def test_default_generators_sample_labels_per_rank_and_probes_alike(two_rank_results):
    """Without a generator, SophiaG's (which samples labels for the rank's own rows) is seeded per rank from one
    shared draw, SophiaH's (Hutchinson's probes) alike on every rank. Seeded alike, SophiaG's ranks drew the same
    labels for their row i, as NewtonCG's Bartlett labels once did, and still stayed replicated."""
    first, second = (results["default_generators"] for results in two_rank_results)
    assert not torch.equal(first["sophiag"], second["sophiag"])
    assert torch.equal(first["sophiah"], second["sophiah"])


def test_destroying_the_process_group_ends_its_threads(two_rank_results):
    """Once the optimizers are gone, destroy_process_group ends the gloo threads in the worker. The first optimizer
    of a process imports torch._dynamo, which imports torch.distributed.nn, whose functions take the default group
    as default arguments: first imported after init_process_group, they would keep the group's backend alive past
    destroy_process_group, to be torn down with the interpreter at exit, which can abort the worker ("terminate
    called without an active exception", SIGABRT). This module imports torch.distributed.nn before any group
    exists."""
    assert [rank["gloo_threads"] for rank in two_rank_results] == [[], []]


def test_distributed_needs_an_initialised_process_group():
    params = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(RuntimeError, match="init_process_group"):
        SophiaH(params, distributed=True)
    assert odist.all_average((torch.ones(2),), None)[0].tolist() == [1.0, 1.0]


def test_all_average_divides_the_sum_and_keeps_each_tensors_dtype_across_buckets(monkeypatch):
    """all_average with a stand-in for a group of two ranks whose other rank holds 3 x this rank's values (so the
    all-reduced sum is 4 x, the average 2 x), mixed dtypes and buckets of at most 8 elements: every output is 2 x
    its input in the input's dtype, the inputs are untouched, and the all-reduces are the buckets expected (a
    tensor larger than a bucket goes alone). The two-process tests average float64 tensors of one dtype in one bucket and never saw the bucketing."""
    calls = []

    def all_reduce(tensor, op=None, group=None):
        assert op == dist.ReduceOp.SUM and group == "group"
        calls.append((tensor.dtype, tensor.numel()))
        tensor.mul_(4)

    monkeypatch.setattr(odist, "BUCKET_NUMEL", 8)
    monkeypatch.setattr(odist.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(odist.dist, "all_reduce", all_reduce)
    gen = torch.Generator().manual_seed(0)
    shapes_dtypes = [((3,), torch.float64), ((2, 2), torch.float32), ((5,), torch.float64), ((1,), torch.float32),
                     ((4,), torch.float64), ((9,), torch.float32), ((2,), torch.float64)]
    tensors = [torch.randn(shape, generator=gen, dtype=dtype) for shape, dtype in shapes_dtypes]
    copies = [t.clone() for t in tensors]
    averages = odist.all_average(tensors, "group")
    for average, t, copy in zip(averages, tensors, copies, strict=True):
        assert average.dtype == t.dtype and average.shape == t.shape
        assert torch.equal(average, 2 * copy) and torch.equal(t, copy)
    assert sorted(calls, key=str) == sorted([(torch.float64, 8), (torch.float64, 6), (torch.float32, 5),
                                             (torch.float32, 9)], key=str)


# ------------------------------------------------------------------------------------- data split


def test_rank_batches_are_slices_of_the_one_process_batch_and_cover_each_epoch_once():
    tokens = np.arange(1 + 10 * 8, dtype=np.uint16)  # 10 windows of 8 tokens, + 1 for the last target
    whole = data.Batches(tokens, 8, 4, seed=3, split="train")
    ranks = [data.Batches(tokens, 8, 2, seed=3, split="train", rank=r, world_size=2) for r in range(2)]
    starts = []
    for i in range(5):  # 5 global batches of 4 windows: two epochs of 10
        x, y = whole.get(i)
        parts = [b.get(i) for b in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])
        starts += x[:, 0].tolist()
    assert sorted(starts[:10]) == sorted(starts[10:]) == list(range(0, 80, 8)), "each epoch covers every window once"
    assert starts[:10] != starts[10:], "epochs are shuffled afresh"
    ranks[0].index = 3
    resumed = data.Batches(tokens, 8, 4, seed=3, split="train")
    resumed.load_state_dict(ranks[0].state_dict())  # 3 batches of 2 x 2 windows = 3 batches of 4
    assert resumed.index == 3 and ranks[0].epoch == pytest.approx(1.2)
    with pytest.raises(ValueError, match="not a multiple"):
        data.Batches(tokens, 8, 8, seed=3, split="train").load_state_dict(ranks[0].state_dict())


def test_a_validation_split_smaller_than_one_global_batch_is_not_evaluated_silently():
    """Two ranks of batch 2 on a validation split of 3 windows: the one batch draws 4, so a window is counted twice
    in the validation loss. With train.eval_batches=1 validation_batches said nothing; now it warns."""
    from recipes.lm.train import validation_batches

    tokens = np.arange(1 + 3 * 8, dtype=np.uint16)
    ranks = [data.Batches(tokens, 8, 2, seed=1, split="validation", rank=r, world_size=2) for r in range(2)]
    starts = torch.cat([b.get(0)[0][:, 0] for b in ranks]).tolist()
    assert len(set(starts)) == 3 < len(starts), "one window twice"
    with pytest.warns(RuntimeWarning, match="fewer than one batch of 4 .* counts some windows more than once"):
        assert validation_batches(1, ranks[0].windows, 2 * 2) == 1


# ------------------------------------------------------------------------------- recipe + torchrun

MICRO = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
    "data.max_bytes=60000", "data.val_fraction=0.1", "data.context_length=32", "data.batch_size=2",
    "optimizer.lr=1e-2", "optimizer.warmup_steps=2", "train.steps=4", "train.eval_interval=4",
    "train.eval_batches=1", "train.log_interval=1", "train.progress=false", "logger.kind=none",
    "train.checkpoint_interval=2", "train.keep_checkpoints=0", "train.threads=1", "train.device=cpu",
]


def launch(tmp_path: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc -m recipes.lm`` (or plain python for one process) with MICRO settings."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    prefix = torchrun if nproc > 1 else [sys.executable]
    env = child_environment(OMP_NUM_THREADS="1")
    args = [*prefix, "-m", "recipes.lm", "--config", str(ROOT / "configs/lm/tiny.yaml"), *MICRO,
            f"out_dir={tmp_path}", *overrides]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
def test_torchrun_two_processes_match_one_with_the_global_batch_and_resume(tmp_path):
    launch(tmp_path, 2, "name=ddp")
    launch(tmp_path, 1, "name=single", "data.batch_size=4")
    ddp, single = rows(tmp_path / "ddp"), rows(tmp_path / "single")
    assert [r["step"] for r in ddp] == [1, 2, 3, 4], "rank 0 alone writes the log"
    assert ddp[0]["train/tokens_per_s"] > 0
    for a, b in zip(ddp, single):  # DDP's averaged gradients = the 2B batch's, up to float32 rounding
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)
    assert ddp[-1]["val/loss"] == pytest.approx(single[-1]["val/loss"], rel=1e-4)
    saved = torch.load(tmp_path / "ddp" / "checkpoints" / "step_00000002.pt", weights_only=True)
    assert saved["world_size"] == 2 and len(saved["rng_ranks"]) == 2
    assert not any(k.startswith("module.") for k in saved["model"]), "the checkpoint holds the bare model"

    halfway = tmp_path / "ddp" / "checkpoints" / "step_00000002.pt"
    launch(tmp_path, 2, "name=resumed", f"train.resume={halfway}")
    resumed = rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in ddp[2:]]
    final = [torch.load(tmp_path / run / "checkpoints" / "step_00000004.pt", weights_only=True)["model"]
             for run in ("ddp", "resumed")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
def test_torchrun_with_checkpointed_blocks_matches_one_process(tmp_path):
    """optim.checkpoint hands the parameters' gradients to autograd as its outputs, so DDP's hooks average them:
    two ranks with recomputed blocks follow one process on the global batch without recomputation."""
    settings = ("model.n_layers=2", "train.checkpoint_interval=0")
    launch(tmp_path, 2, "name=ddp", "model.checkpoint_activations=true", *settings)
    launch(tmp_path, 1, "name=single", "data.batch_size=4", *settings)
    ddp, single = rows(tmp_path / "ddp"), rows(tmp_path / "single")
    assert [r["step"] for r in ddp] == [1, 2, 3, 4]
    for a, b in zip(ddp, single, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)
    assert ddp[-1]["train/loss"] != ddp[0]["train/loss"]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
def test_torchrun_second_order_optimizer_runs_replicated_with_one_wandb_run(tmp_path):
    settings = ("optimizer.name=sophiah", "optimizer.lr=1e-3", "optimizer.kwargs={update_period: 2}",
                "train.steps=3", "train.eval_interval=3", "logger.kind=wandb")
    launch(tmp_path, 2, "name=ddp", *settings)
    ddp = rows(tmp_path / "ddp")
    assert [r["step"] for r in ddp] == [1, 2, 3], "rank 0 alone writes the log"
    assert len(list((tmp_path / "ddp" / "wandb").glob("offline-run-*"))) == 1
    assert all(np.isfinite(r["train/loss"]) and "optimizer/clip_fraction" in r for r in ddp)
    saved = torch.load(tmp_path / "ddp" / "checkpoints" / "step_00000002.pt", weights_only=True)
    probe_states = [state["optimizer"] for state in saved["rng_ranks"]]
    assert probe_states[0] is not None and torch.equal(probe_states[0], probe_states[1]), "probes alike on all ranks"


@pytest.mark.parametrize("recipe", ["meta", "ttt"])
def test_one_process_recipes_started_as_several_are_refused(recipe, tmp_path, monkeypatch):
    """recipes.meta and recipes.ttt train in one process. Under torchrun --nproc_per_node=2 each process ran the
    whole recipe as rank 0 in the same run folder, and the second failed with 'in use by another run ...: wait for
    it to end or choose another name', which another name does not cure; now both say what is wrong, before
    touching the folder."""
    import importlib

    from recipes.common.config import ConfigError

    train = importlib.import_module(f"recipes.{recipe}.train")
    cfg = train.load_config(str(ROOT / f"configs/{recipe}/tiny.yaml"), [f"out_dir={tmp_path}", "train.steps=1"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="trains in one process, but 2 were started"):
        train.train(cfg)
    assert not any(tmp_path.iterdir())
