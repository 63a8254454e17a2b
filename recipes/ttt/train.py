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

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from recipes.common import config as configs
from recipes.common import run_folder
from recipes.common.config import ConfigError
from recipes.common.transformer import ATTENTION, BACKENDS, Transformer
from recipes.lm import checkpoint, data
from recipes.lm.logger import RunLogger
from recipes.lm.optimizers import warmup_cosine
from recipes.ttt import ttt


@dataclass
class ModelConfig:
    d_model: int = 64  # width of the residual stream
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # heads; head_dim = d_model / n_heads (must be even, for RoPE)
    mlp_ratio: float = 4.0  # MLP hidden width / d_model
    attention: str = "flashbob"  # flashbob | eager (naive materialised attention, the reference)
    backend: str = "auto"  # flashbob backend: auto (Triton on CUDA, blocked PyTorch elsewhere) | triton | blocked


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (the interpreter's own .py files) | text (glob in path) | binary (file in path)
    path: Optional[str] = None  # glob of text files, or a pre-tokenised uint8 binary file
    max_bytes: int = 4_000_000  # cap on the bytes read from stdlib/text sources
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


@dataclass
class LoggerConfig(configs.LoggerConfig):
    project: str = "flashbob-ttt"  # W&B project (kind, entity, wandb_mode: see recipes.common.config)


@dataclass
class Config:
    name: str = "ttt"  # run name: outputs go to <out_dir>/<name>
    out_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


CHOICES = {
    "model.attention": ATTENTION,
    "model.backend": BACKENDS,
    "data.source": ("stdlib", "text", "binary"),
    "ttt.weights": tuple(ttt.WEIGHTS),
}
POSITIVE = ("model.d_model", "model.n_layers", "model.n_heads", "model.mlp_ratio", "data.max_bytes",
            "data.context_length", "data.continuation_length", "data.batch_size", "ttt.inner_lr", "ttt.layers",
            "optimizer.lr", "train.steps", "train.eval_interval", "train.eval_batches")
NON_NEGATIVE = ("ttt.inner_steps", "optimizer.weight_decay", "optimizer.grad_clip", "optimizer.warmup_steps")


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for values the schema's types allow but the recipe cannot run."""
    configs.check(cfg, CHOICES, POSITIVE, NON_NEGATIVE)
    m = cfg.model
    configs.check_head_dim(m)
    if cfg.ttt.layers > m.n_layers:
        raise ConfigError(f"ttt.layers ({cfg.ttt.layers}) must be <= model.n_layers ({m.n_layers})")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    configs.check_data_path(cfg.data)


def load_config(path: str | None = None, overrides: list[str] = ()) -> DictConfig:
    """The schema's defaults, updated by the YAML file ``path`` and then by ``key=value`` ``overrides``."""
    cfg = configs.load(Config, path, overrides)
    validate(cfg)
    return cfg


def build_model(cfg: DictConfig) -> ttt.TTTModel:
    m = cfg.model
    lm = Transformer(vocab_size=data.VOCAB_SIZE, n_outputs=data.VOCAB_SIZE, d_model=m.d_model, n_layers=m.n_layers,
                     n_heads=m.n_heads, mlp_ratio=m.mlp_ratio, causal=True, readout="tokens", attention=m.attention,
                     backend=m.backend)
    names = ttt.fast_weight_names(lm, cfg.ttt.layers, cfg.ttt.weights)
    return ttt.TTTModel(lm, names, cfg.ttt.inner_lr, cfg.ttt.learn_lr)


def evaluate(model: ttt.TTTModel, batches: data.Batches, n: int, cfg: DictConfig, device: torch.device,
             autocast) -> dict[str, float]:
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


def train(cfg: DictConfig) -> dict[str, float]:
    """Run the meta-training ``cfg`` describes; returns the last logged metrics."""
    run_dir = Path(cfg.out_dir) / cfg.name
    device, autocast_dtype = configs.resolve_device(cfg.train.device, cfg.train.dtype)
    with run_folder.claim(run_dir):
        return _train(cfg, run_dir, device, autocast_dtype)


def _train(cfg: DictConfig, run_dir: Path, device: torch.device, autocast_dtype: torch.dtype | None
           ) -> dict[str, float]:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)

    def autocast():
        return torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()

    d = cfg.data
    corpus = data.load_corpus(d.source, d.path, d.max_bytes, d.val_fraction, "uint8")
    length = d.context_length + d.continuation_length
    train_batches = data.Batches(corpus.train, length, d.batch_size, cfg.train.seed, "train")
    val_batches = data.Batches(corpus.val, length, d.batch_size, cfg.train.seed + 1, "validation")

    model = build_model(cfg).to(device)
    o = cfg.optimizer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(o.warmup_steps, cfg.train.steps, min_ratio=0.1))

    step = 0
    parts = {"model": model, "optimizer": opt, "scheduler": scheduler, "data": train_batches}
    resumed = run_folder.resume(cfg.train.resume, run_dir)
    if resumed is not None:
        source, state = resumed
        run_folder.restore(source, state, **parts)
        checkpoint.set_rng_state(state["rng"])
        step = state["step"]

    def save_checkpoint() -> None:
        state = {**run_folder.snapshot(**parts), "rng": checkpoint.rng_state(), "step": step,
                 "config": OmegaConf.to_container(cfg)}
        checkpoint.save(run_dir / "checkpoints", step, state, keep=cfg.train.keep_checkpoints)

    OmegaConf.save(cfg, run_dir / "config.yaml")  # after resuming: a refused resume leaves it as it was
    logger = RunLogger(run_dir, OmegaConf.to_container(cfg, resolve=True), kind=cfg.logger.kind,
                       project=cfg.logger.project, name=cfg.name, wandb_mode=cfg.logger.wandb_mode,
                       entity=cfg.logger.entity, start_step=step)
    t = cfg.ttt
    last: dict[str, float] = {}
    bar = tqdm(total=cfg.train.steps, initial=step, disable=not cfg.train.progress, desc=cfg.name, unit="step")
    try:
        while step < cfg.train.steps:
            start = time.perf_counter()
            lr = opt.param_groups[0]["lr"]
            x, y = (tensor.to(device) for tensor in train_batches.next())
            opt.zero_grad(set_to_none=True)
            loss, inner = ttt.outer_loss(model, x, y, d.context_length, t.inner_steps, t.first_order, autocast)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"outer loss became {loss.item()} at step {step + 1}")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or float("inf")).item()
            opt.step()
            scheduler.step()
            step += 1
            elapsed = time.perf_counter() - start
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            metrics = {}
            if step % cfg.train.log_interval == 0 or step in (1, cfg.train.steps):
                metrics.update({"train/outer_loss": loss.item(), "train/lr": lr, "train/grad_norm": grad_norm,
                                "train/tokens_per_s": x.numel() / elapsed})
                if inner:
                    metrics.update({"train/context_loss_before": inner[0], "train/context_loss_after": inner[-1],
                                    "train/inner_lr": model.inner_lrs().mean().item()})
            if step % cfg.train.eval_interval == 0 or step in (1, cfg.train.steps):
                metrics.update(evaluate(model, val_batches, cfg.train.eval_batches, cfg, device, autocast))
            if metrics:
                logger.log(step, metrics)
                last.update(metrics)
            if (cfg.train.checkpoint_interval and step % cfg.train.checkpoint_interval == 0) or step == cfg.train.steps:
                save_checkpoint()
    finally:
        bar.close()
        logger.close()
    return last
