"""Meta-train a small transformer with MAML on few-shot sequence-classification tasks.

    python -m recipes.meta --config configs/meta/tiny.yaml                     # CPU, a few minutes
    python -m recipes.meta --config configs/meta/tiny.yaml maml.first_order=true
    python -m recipes.meta --config configs/meta/tiny.yaml --resume auto        # continue the run

Every setting is below with its default and meaning; a YAML file sets some of them and
``key=value`` arguments (OmegaConf dotlist) override any. Unknown keys, wrong types and bad
values are rejected with an error naming the key. A run writes to ``<out_dir>/<name>/``: the
resolved ``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_*.pt`` and ``wandb/``, and holds
``run.lock`` there while it runs (see :mod:`recipes.common.run_folder`). Each meta-step adapts
to ``maml.meta_batch`` fresh meta-train tasks and steps the outer Adam on the mean query loss;
every ``train.eval_interval`` steps the same ``train.eval_tasks`` held-out meta-test tasks are
adapted to and scored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig

from recipes.common import config as configs
from recipes.common import distributed, training
from recipes.common.config import ConfigError
from recipes.common.training import Autocast, Recipe, StepResult
from recipes.common.transformer import ATTENTION, Transformer
from recipes.meta import maml
from recipes.meta.tasks import FAMILIES, TaskStream


@dataclass
class ModelConfig(configs.TransformerConfig):
    """The classifier: width, depth, heads and attention (see the base class), and:"""

    mlp_ratio: float = 2.0  # MLP hidden width / d_model
    causal: bool = False  # causal attention (the classifier mean-pools every position either way)


@dataclass
class TaskConfig:
    family: str = "prototype"  # prototype (noisy copies of a random sequence) | motif (a random n-gram anywhere)
    n_way: int = 5  # classes per task
    k_shot: int = 1  # support sequences per class (inner loop)
    k_query: int = 5  # query sequences per class (outer loss)
    seq_len: int = 16  # tokens per sequence
    vocab_size: int = 16  # token alphabet
    noise: float = 0.3  # prototype: probability that a position is replaced by a random token
    motif_length: int = 3  # motif: length of the class's n-gram


@dataclass
class MAMLConfig:
    first_order: bool = False  # true: FOMAML (inner gradients detached); false: exact second-order MAML
    inner_optimizer: str = "sgd"  # sgd (torchopt.MetaSGD) | adam (torchopt.MetaAdam)
    inner_lr: float = 0.5  # inner-loop learning rate
    inner_steps: int = 1  # inner-loop steps per task when meta-training
    eval_inner_steps: Optional[int] = None  # inner-loop steps on meta-test tasks; None: inner_steps
    meta_batch: int = 4  # tasks per meta-step


@dataclass
class OptimizerConfig:
    lr: float = 1e-3  # outer (meta) Adam learning rate
    grad_clip: float = 1.0  # clip the meta-gradient norm; 0: off
    weight_decay: float = 0.0  # decoupled weight decay (AdamW)


@dataclass
class TrainConfig(configs.TrainConfig):
    """Steps and evaluation of meta-training; seed, device, logging and checkpoint settings are inherited."""

    steps: int = 300  # meta-steps
    eval_interval: int = 50  # steps between meta-test evaluations (and at the first and last step)
    eval_tasks: int = 32  # held-out meta-test tasks per evaluation (the same ones every time)


# name (outputs go to <out_dir>/<name>), out_dir, the sections above, and logger (W&B project flashbob-meta)
Config = configs.recipe_schema("meta", module=__name__, name="meta", model=ModelConfig, task=TaskConfig,
                               maml=MAMLConfig, optimizer=OptimizerConfig, train=TrainConfig)


CHOICES = {
    "model.attention": ATTENTION,
    "task.family": FAMILIES,
    "maml.inner_optimizer": ("sgd", "adam"),
}
POSITIVE = ("model.d_model", "model.n_layers", "model.n_heads", "model.mlp_ratio", "task.n_way", "task.k_shot",
            "task.k_query", "task.seq_len", "task.vocab_size", "task.motif_length", "maml.inner_lr",
            "maml.inner_steps", "maml.meta_batch", "optimizer.lr", "train.steps", "train.eval_interval",
            "train.eval_tasks")
NON_NEGATIVE = ("optimizer.grad_clip", "optimizer.weight_decay")


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for values the schema's types allow but the recipe cannot run."""
    configs.check(cfg, CHOICES, POSITIVE, NON_NEGATIVE)
    configs.check_head_dim(cfg.model)
    if not 0 <= cfg.task.noise <= 1:
        raise ConfigError(f"task.noise must be in [0, 1], got {cfg.task.noise}")
    if cfg.task.family == "motif" and cfg.task.motif_length > cfg.task.seq_len:
        raise ConfigError(f"task.motif_length ({cfg.task.motif_length}) must be <= task.seq_len ({cfg.task.seq_len})")
    if cfg.maml.eval_inner_steps is not None and cfg.maml.eval_inner_steps < 0:
        raise ConfigError(f"maml.eval_inner_steps must be >= 0, got {cfg.maml.eval_inner_steps}")


def load_config(path: str | None = None, overrides: list[str] = ()) -> DictConfig:
    """The schema's defaults, updated by the YAML file ``path`` and then by ``key=value`` ``overrides``."""
    return configs.load(Config, path, overrides, validate)


def build_model(cfg: DictConfig) -> Transformer:
    m = cfg.model
    return Transformer(vocab_size=cfg.task.vocab_size, n_outputs=cfg.task.n_way, d_model=m.d_model,
                       n_layers=m.n_layers, n_heads=m.n_heads, mlp_ratio=m.mlp_ratio, causal=m.causal,
                       readout="mean", attention=m.attention)


def task_stream(cfg: DictConfig, split: str) -> TaskStream:
    t = cfg.task
    return TaskStream(t.family, n_way=t.n_way, k_shot=t.k_shot, k_query=t.k_query, seq_len=t.seq_len,
                      vocab_size=t.vocab_size, noise=t.noise, motif_length=t.motif_length, seed=cfg.train.seed,
                      split=split)


def build(cfg: DictConfig, device: torch.device, autocast: Autocast, ctx: distributed.Context) -> Recipe:
    """The classifier, its outer (meta) optimizer, the task streams, and the meta-step and meta-test."""
    model = build_model(cfg).to(device)
    meta_opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    train_tasks = task_stream(cfg, "train")
    test_tasks = [task_stream(cfg, "test").get(i) for i in range(cfg.train.eval_tasks)]
    test_tasks = [type(t)(*(x.to(device) for x in t)) for t in test_tasks]
    mc = cfg.maml
    inner = maml.inner_optimizer(model, mc.inner_optimizer, mc.inner_lr, mc.first_order)
    eval_steps = mc.inner_steps if mc.eval_inner_steps is None else mc.eval_inner_steps

    def forward(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with autocast():
            return net(x)

    def step() -> StepResult:
        tasks = [type(t)(*(x.to(device) for x in t)) for t in train_tasks.next(mc.meta_batch)]
        meta_opt.zero_grad(set_to_none=True)
        stats = maml.meta_backward(model, inner, tasks, mc.inner_steps, forward)
        clip = cfg.optimizer.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        meta_opt.step()
        return StepResult(stats["loss"], lambda seconds: {
            "meta_train/query_loss": stats["loss"], "meta_train/query_accuracy": stats["accuracy"],
            "meta_train/query_accuracy_before": stats["accuracy_before"], "meta_train/grad_norm": grad_norm,
            "meta_train/step_s": seconds}, {"acc": f"{stats['accuracy']:.2f}"})

    def meta_test() -> dict[str, float]:
        result = maml.evaluate(model, test_tasks, mc.inner_optimizer, mc.inner_lr, eval_steps, forward)
        return {f"meta_test/query_{key}": value for key, value in result.items()}

    parts = {"model": model, "optimizer": meta_opt, "tasks": train_tasks}
    return Recipe(parts, step, meta_test, "meta_test/query_loss", evaluate_first_step=True)


def train(cfg: DictConfig) -> dict[str, float]:
    """Run the meta-training ``cfg`` describes; returns the last logged metrics."""
    return training.run(cfg, functools.partial(build, cfg))
