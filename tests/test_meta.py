"""The MAML recipe at micro scale on the CPU: exact meta-gradients, training and its log, shipped configs,
task streams (what all three recipes share is tested in test_recipes.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from recipes.common import checkpoint
from recipes.common.transformer import Transformer
from recipes.meta import maml
from recipes.meta.tasks import TaskStream
from recipes.meta.train import build_model, load_config, train
from tests.runs import META, ROOT, read_jsonl


def small_setup(attention: str, seed: int = 0, causal: bool = False):
    """A float64 two-layer classifier and two 3-way 2-shot tasks."""
    torch.manual_seed(seed)
    model = Transformer(vocab_size=8, n_outputs=3, d_model=16, n_layers=2, n_heads=2, mlp_ratio=2.0, causal=causal,
                        readout="mean", attention=attention).double()
    stream = TaskStream("prototype", n_way=3, k_shot=2, k_query=2, seq_len=10, vocab_size=8, noise=0.3, seed=seed)
    return model, stream.next(2)


def torchopt_meta_gradient(model, tasks, steps, lr, first_order, kind="sgd"):
    model.zero_grad(set_to_none=True)
    inner = maml.inner_optimizer(model, kind, lr, first_order)
    maml.meta_backward(model, inner, tasks, steps)
    return [p.grad.clone() for p in model.parameters()]


def func_meta_gradient(model, tasks, steps, lr, first_order):
    """The same meta-gradient written with torch.func alone: nested ``grad`` (second order), or the
    query gradient at the detached adapted weights (first order)."""
    names = [n for n, _ in model.named_parameters()]
    theta = {n: p.detach() for n, p in model.named_parameters()}

    def loss(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    def adapted(params, task):
        for _ in range(steps):
            g = torch.func.grad(loss)(params, task.support_x, task.support_y)
            params = {n: params[n] - lr * g[n] for n in names}
        return params

    if first_order:
        grads = [torch.func.grad(loss)(adapted(theta, t), t.query_x, t.query_y) for t in tasks]
        return [sum(g[n] for g in grads) / len(tasks) for n in names]

    def meta_loss(params):
        return sum(loss(adapted(params, t), t.query_x, t.query_y) for t in tasks) / len(tasks)

    g = torch.func.grad(meta_loss)(theta)
    return [g[n] for n in names]


def assert_close(a, b, rtol=1e-9, atol=1e-11):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_second_order_meta_gradient_is_exact(steps, causal):
    """torchopt + flashbob == torchopt + naive attention == torch.func + naive == torch.func + flashbob."""
    flash, tasks = small_setup("blocked", causal=causal)
    eager, _ = small_setup("eager", causal=causal)
    reference = torchopt_meta_gradient(eager, tasks, steps, 0.5, first_order=False)
    assert_close(torchopt_meta_gradient(flash, tasks, steps, 0.5, first_order=False), reference)
    assert_close(func_meta_gradient(eager, tasks, steps, 0.5, first_order=False), reference)
    assert_close(func_meta_gradient(flash, tasks, steps, 0.5, first_order=False), reference)


def test_first_order_meta_gradient_is_exact_and_differs_from_second_order():
    flash, tasks = small_setup("blocked")
    eager, _ = small_setup("eager")
    first = torchopt_meta_gradient(flash, tasks, 2, 0.5, first_order=True)
    assert_close(first, torchopt_meta_gradient(eager, tasks, 2, 0.5, first_order=True))
    assert_close(first, func_meta_gradient(flash, tasks, 2, 0.5, first_order=True))
    second = torchopt_meta_gradient(flash, tasks, 2, 0.5, first_order=False)
    difference = sum((a - b).norm() ** 2 for a, b in zip(first, second)).sqrt()
    assert difference > 1e-3 * sum(b.norm() ** 2 for b in second).sqrt()


def test_second_order_meta_adam_matches_naive_attention():
    """The same through torchopt.MetaAdam (its moments are differentiated too)."""
    flash, tasks = small_setup("blocked", seed=1)
    eager, _ = small_setup("eager", seed=1)
    assert_close(torchopt_meta_gradient(flash, tasks, 2, 1e-2, False, "adam"),
                 torchopt_meta_gradient(eager, tasks, 2, 1e-2, False, "adam"), rtol=1e-8, atol=1e-10)


def test_meta_backward_restores_the_meta_parameters():
    model, tasks = small_setup("blocked")
    before = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in before.items()}
    torchopt_meta_gradient(model, tasks, 2, 0.5, first_order=False)
    after = dict(model.named_parameters())
    assert all(after[n] is before[n] and after[n].is_leaf and torch.equal(after[n], values[n]) for n in before)


def test_second_order_meta_training_learns_and_logs(tmp_path):
    summary = train(META.config(tmp_path, "model.d_model=64", "task.seq_len=16", "maml.meta_batch=4",
                                 "train.steps=20", "train.eval_interval=10", "train.eval_tasks=8"))
    rows = read_jsonl(tmp_path / "meta_tiny" / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 21))
    for key in ("meta_train/query_loss", "meta_train/query_accuracy", "meta_train/grad_norm"):
        assert all(key in row for row in rows)
    tests = [row for row in rows if "meta_test/query_loss" in row]
    assert [row["step"] for row in tests] == [1, 10, 20]
    assert tests[-1]["meta_test/query_loss"] < tests[0]["meta_test/query_loss"]
    assert summary["meta_test/query_accuracy"] > summary["meta_test/query_accuracy_before"]  # adaptation helps
    assert (tmp_path / "meta_tiny" / "config.yaml").is_file()
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "meta_tiny" / "checkpoints")] == ["step_00000020.pt"]


@pytest.mark.parametrize("name", sorted(p.stem for p in META.configs.glob("*.yaml")))
def test_shipped_configs_validate_and_build(name):
    """Each shipped config validates as written, and its model runs at full width on short sequences."""
    cfg = load_config(str(META.configs / f"{name}.yaml"), ["model.attention=blocked"])
    model = build_model(cfg)
    logits = model(torch.randint(0, cfg.task.vocab_size, (2, 9)))
    assert logits.shape == (2, cfg.task.n_way) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["prototype", "motif"])
def test_task_streams_are_reproducible_balanced_and_split(family):
    def make(split):
        return TaskStream(family, n_way=4, k_shot=2, k_query=3, seq_len=10, vocab_size=12, seed=3, split=split)

    a, b = make("train").get(5), make("train").get(5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a.support_x.shape == (8, 10) and a.query_x.shape == (12, 10)
    assert torch.bincount(a.support_y).tolist() == [2] * 4 and torch.bincount(a.query_y).tolist() == [3] * 4
    assert not torch.equal(make("test").get(5).support_x, a.support_x)
    stream = make("train")
    stream.next(3)
    restored = make("train")
    restored.load_state_dict(stream.state_dict())
    assert torch.equal(stream.next(1)[0].query_x, restored.next(1)[0].query_x)
    if family == "motif":  # every example of a class contains that class's motif
        rng_task = make("train").get(0)
        for cls in range(4):
            rows = torch.cat([rng_task.support_x[rng_task.support_y == cls],
                              rng_task.query_x[rng_task.query_y == cls]])
            windows = [set(map(tuple, r.unfold(0, 3, 1).tolist())) for r in rows]
            assert set.intersection(*windows)


def test_maml_benchmark_smoke_and_out_of_memory(tmp_path, monkeypatch):
    """benchmarks/bench_maml.py at toy size on the CPU; an OOM is recorded and ends that sweep only."""
    import csv
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_maml", ROOT / "benchmarks" / "bench_maml.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    measure = bench.measure

    def measure_or_oom(impl, context, args, device):
        if impl == "eager" and context >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return measure(impl, context, args, device)

    monkeypatch.setattr(bench, "measure", measure_or_oom)
    out = tmp_path / "maml.csv"
    bench.main(["--device", "cpu", "--min-context", "8", "--max-context", "32", "--d-model", "16", "--n-heads", "2",
                "--repeats", "1", "--warmup", "0", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["impl"], r["context"], r["status"]) for r in rows] == [
        ("flashbob", "8", "ok"), ("flashbob", "16", "ok"), ("flashbob", "32", "ok"), ("eager", "8", "ok"),
        ("eager", "16", "oom")]
    by_context = {r["context"]: r for r in rows if r["impl"] == "eager"}
    flash = {r["context"]: r for r in rows if r["impl"] == "flashbob"}
    assert float(flash["8"]["meta_grad_norm"]) == pytest.approx(float(by_context["8"]["meta_grad_norm"]), rel=1e-5)
