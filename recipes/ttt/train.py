"""Meta-learn a byte-level language model for test-time training (TTT) on its context.

    python -m recipes.ttt --config configs/ttt/tiny.yaml                   # CPU, a few minutes
    python -m recipes.ttt --config configs/ttt/tiny.yaml ttt.inner_steps=0  # the no-TTT baseline
    python -m recipes.ttt --config configs/ttt/tiny.yaml --resume auto      # continue the run

Each training sequence of ``data.context_length + data.continuation_length`` bytes is split in
two: the inner loop adapts the fast weights (``ttt.weights`` of the last ``ttt.layers`` blocks),
separately for every sequence, with ``ttt.inner_steps`` gradient steps on the next-token loss of
the context; the outer loss is the next-token loss of the continuation under the adapted weights,
and its gradient through the inner updates trains the base weights and the inner step sizes.
Validation reports the continuation loss with and without TTT (same weights) and their
difference, ``val/ttt_gain`` (nats per token; positive: TTT helps).

Every setting is below with its default and meaning; unknown keys, wrong types and bad values are
rejected with an error naming the key. A run writes to ``<out_dir>/<name>/``: the resolved
``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_*.pt`` and ``wandb/``, and holds
``run.lock`` there while it runs (see :mod:`recipes.common.run_folder`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig

from recipes.common import config as configs
from recipes.common import data, distributed, training
from recipes.common.config import ConfigError
from recipes.common.schedule import build_scheduler
from recipes.common.training import Autocast, Recipe, StepResult
from recipes.common.transformer import ATTENTION, Transformer
from recipes.ttt import ttt


@dataclass
class ModelConfig(configs.TransformerConfig):
    """The language model: width, depth, heads, MLP and attention (see the base class), and:"""

    window: Optional[int] = None  # sliding window: each token attends to itself and the window - 1 before it; None: all


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (the interpreter's own .py files) | packages (its installed packages' .py
    # files: site-packages) | text (glob in path) | binary (file in path)
    path: Optional[str] = None  # glob of text files, or a pre-tokenised uint8 binary file
    max_bytes: int = 4_000_000  # cap on the bytes read from stdlib/packages/text sources
    val_fraction: float = 0.05  # share of documents (stdlib/text) or of the tail (binary) held out
    context_length: int = 96  # tokens the inner loop trains on
    continuation_length: int = 32  # tokens the outer loss scores
    batch_size: int = 8  # sequences per step (each adapts its own fast weights)


@dataclass
class TTTConfig:
    inner_steps: int = 1  # inner gradient steps on the context; 0: no test-time training (the baseline)
    inner_lr: float = 0.1  # initial inner step size of every fast matrix
    learn_lr: bool = True  # meta-learn one log step size per fast matrix
    first_order: bool = False  # true: detach the inner gradients (no backward-over-backward)
    layers: int = 1  # fast weights live in the last `layers` blocks
    weights: str = "block"  # which matrices of those blocks adapt: block (attn + mlp) | attn (qkv, out) | mlp


@dataclass
class OptimizerConfig:
    lr: float = 3e-3  # outer AdamW peak learning rate (warm-up, then cosine decay to 10%)
    weight_decay: float = 0.0  # decoupled weight decay
    grad_clip: float = 1.0  # clip the meta-gradient norm; 0: off
    warmup_steps: int = 20  # linear warm-up steps


@dataclass
class TrainConfig(configs.TrainConfig):
    """Steps and evaluation of TTT training; seed, device, logging and checkpoint settings are inherited."""

    steps: int = 300  # outer steps
    eval_interval: int = 100  # steps between validations (and at the first and last step)
    eval_batches: int = 8  # fixed validation batches per evaluation


# name (outputs go to <out_dir>/<name>), out_dir, the sections above, and logger (W&B project flashbob-ttt)
Config = configs.recipe_schema("ttt", module=__name__, name="ttt", model=ModelConfig, data=DataConfig, ttt=TTTConfig,
                               optimizer=OptimizerConfig, train=TrainConfig)


CHOICES = {
    "model.attention": ATTENTION,
    "data.source": ("stdlib", "packages", "text", "binary"),
    "ttt.weights": tuple(ttt.WEIGHTS),
}
POSITIVE = ("model.d_model", "model.n_layers", "model.n_heads", "model.mlp_ratio", "data.max_bytes",
            "data.context_length", "data.continuation_length", "data.batch_size", "ttt.inner_lr", "ttt.layers",
            "optimizer.lr", "train.steps", "train.eval_interval", "train.eval_batches")
NON_NEGATIVE = ("ttt.inner_steps", "optimizer.weight_decay", "optimizer.grad_clip", "optimizer.warmup_steps")


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for values the schema's types allow but the recipe cannot run."""
    configs.check(cfg, CHOICES, POSITIVE, NON_NEGATIVE)
    configs.check_head_dim(cfg.model)
    if cfg.model.window is not None and cfg.model.window < 1:
        raise ConfigError(f"model.window must be a positive number of tokens (or null for all), got {cfg.model.window}")
    if cfg.ttt.layers > cfg.model.n_layers:
        raise ConfigError(f"ttt.layers ({cfg.ttt.layers}) must be <= model.n_layers ({cfg.model.n_layers})")
    configs.check_data(cfg.data)


def load_config(path: str | None = None, overrides: list[str] = ()) -> DictConfig:
    """The schema's defaults, updated by the YAML file ``path`` and then by ``key=value`` ``overrides``."""
    return configs.load(Config, path, overrides, validate)


def build_model(cfg: DictConfig) -> ttt.TTTModel:
    m = cfg.model
    lm = Transformer(vocab_size=data.VOCAB_SIZE, n_outputs=data.VOCAB_SIZE, d_model=m.d_model, n_layers=m.n_layers,
                     n_heads=m.n_heads, mlp_ratio=m.mlp_ratio, causal=True, readout="tokens", attention=m.attention,
                     window=m.window)
    names = ttt.fast_weight_names(lm, cfg.ttt.layers, cfg.ttt.weights)
    return ttt.TTTModel(lm, names, cfg.ttt.inner_lr, cfg.ttt.learn_lr)


def evaluate(model: ttt.TTTModel, batches: data.Batches, n: int, cfg: DictConfig, device: torch.device,
             autocast: Autocast) -> dict[str, float]:
    """Continuation loss on the first ``n`` validation batches with and without TTT, and the gain."""
    with_ttt, without = 0.0, 0.0
    context, steps = cfg.data.context_length, cfg.ttt.inner_steps
    for i in range(n):
        x, y = (t.to(device) for t in batches.get(i))
        with torch.no_grad():
            without += ttt.continuation_loss(model, None, x, y, context, autocast).item() / n
        if steps:
            loss, _ = ttt.outer_loss(model, x, y, context, steps, first_order=True, autocast=autocast)
            with_ttt += loss.item() / n
    metrics = {"val/loss_no_ttt": without}
    if steps:
        metrics.update({"val/loss_ttt": with_ttt, "val/ttt_gain": without - with_ttt})
    return metrics


def build(cfg: DictConfig, device: torch.device, autocast: Autocast, ctx: distributed.Context) -> Recipe:
    """The byte windows, the model with its fast weights, the outer optimizer and its schedule, and the
    outer step and validation."""
    d, o, t = cfg.data, cfg.optimizer, cfg.ttt
    corpus = data.load_corpus(d.source, d.path, d.max_bytes, d.val_fraction, "uint8")
    length = d.context_length + d.continuation_length
    train_batches = data.Batches(corpus.train, length, d.batch_size, cfg.train.seed, "train")
    val_batches = data.Batches(corpus.val, length, d.batch_size, data.VALIDATION_SEED, "validation")  # for every seed

    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, weight_decay=o.weight_decay)
    scheduler = build_scheduler(opt, o.warmup_steps, cfg.train.steps, min_ratio=0.1)

    def step() -> StepResult:
        lr = opt.param_groups[0]["lr"]
        x, y = (tensor.to(device) for tensor in train_batches.next())
        opt.zero_grad(set_to_none=True)
        loss, inner = ttt.outer_loss(model, x, y, d.context_length, t.inner_steps, t.first_order, autocast)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or float("inf")).item()
        opt.step()
        scheduler.step()

        def metrics(seconds: float) -> dict[str, float]:
            logged = {"train/outer_loss": loss.item(), "train/lr": lr, "train/grad_norm": grad_norm,
                      "train/tokens_per_s": x.numel() / seconds}
            if inner:
                logged.update({"train/context_loss_before": inner[0], "train/context_loss_after": inner[-1],
                               "train/inner_lr": model.inner_lrs().mean().item()})
            return logged

        return StepResult(loss.item(), metrics)

    def validation() -> dict[str, float]:
        return evaluate(model, val_batches, cfg.train.eval_batches, cfg, device, autocast)

    parts = {"model": model, "optimizer": opt, "scheduler": scheduler, "data": train_batches}
    val_loss = "val/loss_ttt" if t.inner_steps else "val/loss_no_ttt"
    return Recipe(parts, step, validation, val_loss, evaluate_first_step=True)


def train(cfg: DictConfig) -> dict[str, float]:
    """Run the meta-training ``cfg`` describes; returns the last logged metrics."""
    return training.run(cfg, functools.partial(build, cfg))
