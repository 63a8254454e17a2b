"""The test-time-training recipe at micro scale on the CPU: exact meta-gradients, training, resume, configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from recipes.common.config import ConfigError
from recipes.common.transformer import Transformer
from recipes.lm import checkpoint
from recipes.ttt import ttt
from recipes.ttt.__main__ import main
from recipes.ttt.train import build_model, load_config, train

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "ttt"
MICRO = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "data.max_bytes=200000", "data.val_fraction=0.1",
    "data.context_length=32", "data.continuation_length=16", "data.batch_size=4", "train.steps=10",
    "train.eval_interval=5", "train.eval_batches=2", "train.log_interval=1", "train.progress=false",
    "logger.kind=none",
]


def micro_config(tmp_path: Path, *overrides: str):
    return load_config(str(CONFIGS / "tiny.yaml"), [*MICRO, f"out_dir={tmp_path}", *overrides])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def small_setup(attention: str, weights: str = "block", layers: int = 1, seed: int = 0):
    """A float64 two-layer byte LM with fast weights, and three sequences of 14 tokens (context 9)."""
    torch.manual_seed(seed)
    lm = Transformer(vocab_size=11, n_outputs=11, d_model=16, n_layers=2, n_heads=2, mlp_ratio=2.0, causal=True,
                     attention=attention, backend="blocked")
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
    flash, x, y = small_setup("flashbob", weights, layers)
    eager, _, _ = small_setup("eager", weights, layers)
    reference = recipe_meta_gradient(eager, x, y, steps)
    assert_close(recipe_meta_gradient(flash, x, y, steps), reference)
    assert_close(func_meta_gradient(eager, x, y, steps), reference)
    assert_close(func_meta_gradient(flash, x, y, steps), reference)
    assert all(g.abs().sum() > 0 for g in reference)  # every base weight and every step size gets a signal


def test_first_order_meta_gradient_differs_from_second_order():
    model, x, y = small_setup("flashbob")
    first, second = (recipe_meta_gradient(model, x, y, 2, first_order=fo) for fo in (True, False))
    difference = sum((a - b).norm() ** 2 for a, b in zip(first, second)).sqrt()
    assert difference > 1e-3 * sum(b.norm() ** 2 for b in second).sqrt()


def test_adaptation_is_per_sequence():
    """A sequence's adapted weights do not depend on the other sequences of the batch."""
    model, x, y = small_setup("flashbob")
    together, _ = ttt.adapt(model, x[:, :9], y[:, :9], 2)
    alone, _ = ttt.adapt(model, x[1:2, :9], y[1:2, :9], 2)
    assert all(torch.allclose(together[n][1], alone[n][0], rtol=1e-12, atol=1e-14) for n in model.fast_names)
    assert not torch.allclose(together[model.fast_names[0]][0], together[model.fast_names[0]][1])


def test_ttt_training_runs_logs_and_reports_the_gain(tmp_path):
    summary = train(micro_config(tmp_path, "train.steps=20", "train.eval_interval=10", "optimizer.lr=1e-2",
                                 "optimizer.warmup_steps=3"))
    rows = read_jsonl(tmp_path / "ttt_tiny" / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 21))
    for key in ("train/outer_loss", "train/context_loss_before", "train/context_loss_after", "train/inner_lr"):
        assert all(key in row for row in rows)
    assert sum(r["train/context_loss_after"] < r["train/context_loss_before"] for r in rows) >= 15  # inner loop learns
    assert summary["val/ttt_gain"] == pytest.approx(summary["val/loss_no_ttt"] - summary["val/loss_ttt"])
    assert summary["val/loss_ttt"] < rows[0]["val/loss_ttt"] - 1.0


def test_no_ttt_baseline_runs(tmp_path):
    summary = train(micro_config(tmp_path, "ttt.inner_steps=0", "train.steps=4"))
    assert set(summary) >= {"val/loss_no_ttt", "train/outer_loss"} and "val/ttt_gain" not in summary


def test_resume_continues_exactly(tmp_path):
    settings = ("train.steps=6", "train.checkpoint_interval=3", "train.keep_checkpoints=0", "train.eval_interval=3")
    train(micro_config(tmp_path, "name=whole", *settings))
    halfway = tmp_path / "whole" / "checkpoints" / "step_00000003.pt"
    train(micro_config(tmp_path, "name=resumed", f"train.resume={halfway}", *settings))
    drop = ("time", "train/tokens_per_s")
    whole, resumed = ([{k: v for k, v in row.items() if k not in drop}
                       for row in read_jsonl(tmp_path / run / "metrics.jsonl")] for run in ("whole", "resumed"))
    assert [row["step"] for row in resumed] == [4, 5, 6] and whole[3:] == resumed
    final = [checkpoint.load(tmp_path / run / "checkpoints" / "step_00000006.pt")["model"]
             for run in ("whole", "resumed")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_command_line_resume_auto_and_wandb_offline(tmp_path, capsys):
    args = ["--config", str(CONFIGS / "tiny.yaml"), *MICRO, f"out_dir={tmp_path}", "logger.kind=wandb",
            "ttt.first_order=true"]
    main([*args, "train.steps=2"])
    main([*args, "train.steps=3", "--resume", "auto"])
    assert [row["step"] for row in read_jsonl(tmp_path / "ttt_tiny" / "metrics.jsonl")] == [1, 2, 3]
    assert "val/ttt_gain=" in capsys.readouterr().err
    run_files = list((tmp_path / "ttt_tiny" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2 and all(b"val/ttt_gain" in f.read_bytes() for f in run_files)
    run_id = (tmp_path / "ttt_tiny" / "wandb_run_id").read_text().strip()
    assert all(f.name == f"run-{run_id}.wandb" for f in run_files), "the resumed process continues the same W&B run"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ttt.inner_step=2"], "'ttt.inner_step'"),
        (["ttt.inner_lr=fast"], "'ttt.inner_lr'"),
        (["ttt.weights=norms"], "ttt.weights must be one of mlp, attn, block"),
        (["ttt.layers=3"], "ttt.layers (3) must be <= model.n_layers (2)"),
        (["ttt.inner_steps=-1"], "ttt.inner_steps must be >= 0"),
        (["data.continuation_length=0"], "data.continuation_length must be > 0"),
        (["model.attention=flash"], "model.attention must be one of flashbob, eager"),
        (["data.source=text", "data.path=/nonexistent/**/*.txt"], "data.path '/nonexistent/**/*.txt' matches no files"),
        (["name=runs/../.."], "name must be a relative folder name inside out_dir, without '..'; got 'runs/../..'"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as error:
        micro_config(tmp_path, *overrides)
    assert message in str(error.value)


def test_bad_config_on_the_command_line_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(CONFIGS / "tiny.yaml"), "ttt.lerning_rate=1"])
    assert exit_.value.code == 2
    assert "'ttt.lerning_rate'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_validate_and_build(name):
    """Each shipped config validates as written, and its model adapts at full width on a short sequence."""
    cfg = load_config(str(CONFIGS / f"{name}.yaml"), ["model.backend=blocked"])
    model = build_model(cfg)
    tokens = torch.randint(0, 256, (1, 17))
    loss, inner = ttt.outer_loss(model, tokens[:, :-1], tokens[:, 1:], 12, cfg.ttt.inner_steps)
    assert torch.isfinite(loss) and len(inner) == cfg.ttt.inner_steps + (1 if cfg.ttt.inner_steps else 0)
