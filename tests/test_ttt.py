"""The test-time-training recipe at micro scale on the CPU: exact meta-gradients, training and its log,
shipped configs (what all three recipes share is tested in test_recipes.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from recipes.common.transformer import Transformer
from recipes.ttt import ttt
from recipes.ttt.train import build_model, load_config, train
from tests.runs import TTT, read_jsonl


def small_setup(attention: str, weights: str = "block", layers: int = 1, seed: int = 0):
    """A float64 two-layer byte LM with fast weights, and three sequences of 14 tokens (context 9)."""
    torch.manual_seed(seed)
    lm = Transformer(vocab_size=11, n_outputs=11, d_model=16, n_layers=2, n_heads=2, mlp_ratio=2.0, causal=True,
                     attention=attention)
    model = ttt.TTTModel(lm, ttt.fast_weight_names(lm, layers, weights), inner_lr=0.3).double()
    with torch.no_grad():
        model.log_lr.add_(0.1 * torch.randn_like(model.log_lr))  # distinct step sizes
    tokens = torch.randint(0, 11, (3, 15), generator=torch.Generator().manual_seed(seed))
    return model, tokens[:, :-1], tokens[:, 1:]


def recipe_meta_gradient(model, x, y, steps, first_order=False):
    model.zero_grad(set_to_none=True)
    loss, _ = ttt.outer_loss(model, x, y, 9, steps, first_order)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def func_meta_gradient(model, x, y, steps):
    """The same meta-gradient with torch.func alone, one sequence at a time with unbatched fast weights
    (checks the batched per-sequence copies too)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = model.fast_names

    def lm_loss(weights, xs, ys):
        logits = functional_call(model.lm, weights, (xs[None],))
        return F.cross_entropy(logits[0], ys)

    def outer(params):
        base = {n[len("lm."):]: p for n, p in params.items() if n.startswith("lm.")}
        lrs = params["log_lr"].exp()
        total = 0
        for b in range(x.shape[0]):
            fast = {n: base[n] for n in names}
            for _ in range(steps):
                g = torch.func.grad(lambda f: lm_loss({**base, **f}, x[b, :9], y[b, :9]))(fast)
                fast = {n: fast[n] - lr * g[n] for n, lr in zip(names, lrs)}
            logits = functional_call(model.lm, {**base, **fast}, (x[b : b + 1],))
            total = total + F.cross_entropy(logits[0, 9:], y[b, 9:])
        return total / x.shape[0]

    g = torch.func.grad(outer)(params)
    return [g[n] for n, _ in model.named_parameters()]


def assert_close(a, b, rtol=1e-9, atol=1e-11):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("weights", "layers", "steps"), [("block", 1, 1), ("attn", 2, 2), ("mlp", 2, 1)])
def test_meta_gradient_is_exact(weights, layers, steps):
    """Through the inner updates: flashbob == naive attention == torch.func per sequence (with flashbob too)."""
    flash, x, y = small_setup("blocked", weights, layers)
    eager, _, _ = small_setup("eager", weights, layers)
    reference = recipe_meta_gradient(eager, x, y, steps)
    assert_close(recipe_meta_gradient(flash, x, y, steps), reference)
    assert_close(func_meta_gradient(eager, x, y, steps), reference)
    assert_close(func_meta_gradient(flash, x, y, steps), reference)
    assert all(g.abs().sum() > 0 for g in reference)  # every base weight and every step size gets a signal


def test_first_order_meta_gradient_differs_from_second_order():
    model, x, y = small_setup("blocked")
    first, second = (recipe_meta_gradient(model, x, y, 2, first_order=fo) for fo in (True, False))
    difference = sum((a - b).norm() ** 2 for a, b in zip(first, second)).sqrt()
    assert difference > 1e-3 * sum(b.norm() ** 2 for b in second).sqrt()


def test_adaptation_is_per_sequence():
    """A sequence's adapted weights do not depend on the other sequences of the batch."""
    model, x, y = small_setup("blocked")
    together, _ = ttt.adapt(model, x[:, :9], y[:, :9], 2)
    alone, _ = ttt.adapt(model, x[1:2, :9], y[1:2, :9], 2)
    assert all(torch.allclose(together[n][1], alone[n][0], rtol=1e-12, atol=1e-14) for n in model.fast_names)
    assert not torch.allclose(together[model.fast_names[0]][0], together[model.fast_names[0]][1])


def test_ttt_training_runs_logs_and_reports_the_gain(tmp_path):
    summary = train(TTT.config(tmp_path, "train.steps=20", "train.eval_interval=10", "optimizer.lr=1e-2",
                                 "optimizer.warmup_steps=3"))
    rows = read_jsonl(tmp_path / "ttt_tiny" / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 21))
    for key in ("train/outer_loss", "train/context_loss_before", "train/context_loss_after", "train/inner_lr"):
        assert all(key in row for row in rows)
    assert sum(r["train/context_loss_after"] < r["train/context_loss_before"] for r in rows) >= 15  # inner loop learns
    assert summary["val/ttt_gain"] == pytest.approx(summary["val/loss_no_ttt"] - summary["val/loss_ttt"])
    assert summary["val/loss_ttt"] < rows[0]["val/loss_ttt"] - 1.0


def test_no_ttt_baseline_runs(tmp_path):
    summary = train(TTT.config(tmp_path, "ttt.inner_steps=0", "train.steps=4"))
    assert set(summary) >= {"val/loss_no_ttt", "train/outer_loss"} and "val/ttt_gain" not in summary


@pytest.mark.parametrize("name", sorted(p.stem for p in TTT.configs.glob("*.yaml")))
def test_shipped_configs_validate_and_build(name):
    """Each shipped config validates as written, and its model adapts at full width on a short sequence."""
    cfg = load_config(str(TTT.configs / f"{name}.yaml"), ["model.attention=blocked"])
    model = build_model(cfg)
    tokens = torch.randint(0, 256, (1, 17))
    loss, inner = ttt.outer_loss(model, tokens[:, :-1], tokens[:, 1:], 12, cfg.ttt.inner_steps)
    assert torch.isfinite(loss) and len(inner) == cfg.ttt.inner_steps + (1 if cfg.ttt.inner_steps else 0)
