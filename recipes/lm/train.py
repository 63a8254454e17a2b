"""Pretrain a decoder-only transformer on bytes or on BPE tokens; its attention runs through flashbob.

    python -m recipes.lm --config configs/lm/tiny.yaml                       # CPU, a few minutes
    python -m recipes.lm --config configs/lm/gpu_32k.yaml optimizer.name=sophiah
    python -m recipes.lm --config configs/lm/bpe_32k.yaml                    # 32,768 BPE tokens, context 8K
    python -m recipes.lm --config configs/lm/tiny.yaml --resume auto          # continue the run

Data parallel on N GPUs of one host (or N CPU processes, gloo), with the same configs::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=N -m recipes.lm --config configs/lm/gpu_8k.yaml

Every process trains a replica on its own ``data.batch_size`` windows (the global batch is N
times that; the ranks' windows are disjoint and together cover the corpus once per epoch).
AdamW runs under DDP; the second-order optimizers get ``distributed=True`` and average their
gradients, curvature products and losses themselves (docs/distributed.md). Rank 0 alone logs
and writes checkpoints, which hold every rank's random-number state: a run resumes exactly on
the same number of processes, and at the same data position on another.

Every setting is below with its default and meaning; a YAML file sets some of them and
``key=value`` arguments (OmegaConf dotlist) override any. Unknown keys, wrong types and bad
values are rejected with an error naming the key. A run writes to ``<out_dir>/<name>/``: the
resolved ``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_*.pt`` and ``wandb/``; rank 0
holds ``run.lock`` there while it runs (see :mod:`recipes.common.run_folder`).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from recipes.common import bpe, data, distributed, training
from recipes.common import config as configs
from recipes.common.config import ConfigError
from recipes.common.schedule import build_scheduler
from recipes.common.training import Autocast, Recipe, StepResult
from recipes.common.transformer import ATTENTION, FIRST_ORDER_ATTENTION, mlp_hidden
from recipes.lm import optimizers
from recipes.lm.model import GPT, cross_entropy


@dataclass
class ModelConfig:
    vocab_size: Optional[int] = None  # None: the data's (256 bytes, the BPE tokenizer's, a binary file's top id + 1)
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads; head_dim = d_model / n_heads (must be even, for RoPE)
    n_kv_heads: Optional[int] = None  # key/value heads for grouped-query attention; None: n_heads
    norm: str = "rmsnorm"  # rmsnorm | layernorm (pre-norm)
    mlp: str = "swiglu"  # swiglu | gelu
    mlp_ratio: float = 4.0  # MLP hidden width / d_model (swiglu uses 2/3 of it, same parameter count)
    rope_base: float = 10000.0  # rotary embedding base
    tie_embeddings: bool = True  # output head shares the token embedding matrix
    dropout: float = 0.0  # after attention and MLP outputs
    checkpoint_activations: bool = False  # recompute each block in backward (optim.checkpoint; forward mode too)
    attention: str = "auto"  # flashbob: auto | triton | blocked; eager (naive); sdpa (torch, flashbob for curvature)
    window: Optional[int] = None  # sliding window: each token attends to itself and the window - 1 before it; None: all


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (the interpreter's own .py files) | packages (its installed packages' .py
    # files: site-packages) | text (glob in path) | binary (file in path)
    path: Optional[str] = None  # glob of text files, or a pre-tokenised binary file
    binary_dtype: str = "uint16"  # uint8 | uint16 | uint32, token type of a binary file
    tokenizer: str = "bytes"  # bytes (UTF-8 bytes; a binary file: its ids) | bpe (trained on the corpus, cached)
    vocab_size: int = 32768  # bpe: tokens of the trained tokenizer (>= 257: the 256 bytes and the separator)
    cache_dir: Optional[str] = None  # bpe: folder of the trained tokenizer and the token ids; None: <out_dir>/cache
    max_bytes: int = 4_000_000  # cap on the bytes read from stdlib/packages/text sources
    val_fraction: float = 0.05  # share of documents (stdlib/text) or of the tail (binary) held out
    context_length: int = 256  # tokens per training sequence
    batch_size: int = 8  # sequences per micro-batch and process (torchrun: the global batch is N times this)
    pack_documents: bool = False  # attend only within each document of a sequence (documents end with token 0,
    # the separator of the byte and BPE tokenizers)


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | sophiah | sophiag | newtoncg | adahessian
    lr: float = 3e-3  # peak learning rate (passed to optimizers whose constructor takes lr)
    betas: Optional[list[float]] = None  # passed when set and the constructor takes betas; None: its default
    eps: Optional[float] = None  # passed when set and the constructor takes eps; None: its default
    weight_decay: float = 0.1  # decoupled weight decay of linear-layer matrices
    decay_all: bool = False  # also decay norms, biases and embeddings
    grad_clip: float = 1.0  # clip the gradient norm (first-order optimizers); 0: off
    warmup_steps: int = 20  # linear warm-up, then cosine decay to min_lr_ratio * lr at the last step
    min_lr_ratio: float = 0.1
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra constructor arguments, e.g. {rho: 0.05}


@dataclass
class TrainConfig(configs.TrainConfig):
    """Steps and evaluation of pretraining; seed, device, logging and checkpoint settings are inherited."""

    steps: int = 200  # optimizer steps
    grad_accum_steps: int = 1  # micro-batches per step (first-order optimizers only)
    eval_interval: int = 50  # steps between validation losses (and at the last step)
    eval_batches: int = 4  # fixed validation batches per evaluation
    compile: bool = False  # torch.compile the model for the passes differentiated once (the optimizers run the
    # passes they differentiate twice eagerly: torch.compile cannot differentiate a compiled graph twice)


# name (outputs go to <out_dir>/<name>), out_dir, the sections above, and logger (W&B project flashbob-lm)
Config = configs.recipe_schema("lm", module=__name__, name="tiny", model=ModelConfig, data=DataConfig,
                               optimizer=OptimizerConfig, train=TrainConfig)


CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.mlp": ("swiglu", "gelu"),
    "model.attention": (*ATTENTION, *FIRST_ORDER_ATTENTION),
    "data.source": ("stdlib", "packages", "text", "binary"),
    "data.binary_dtype": tuple(data.BINARY_DTYPES),
    "data.tokenizer": ("bytes", "bpe"),
}
POSITIVE = ("model.d_model", "model.n_layers", "model.n_heads", "model.mlp_ratio", "model.rope_base",
            "data.max_bytes", "data.context_length", "data.batch_size", "optimizer.lr", "train.steps",
            "train.grad_accum_steps", "train.eval_interval", "train.eval_batches")
NON_NEGATIVE = ("optimizer.weight_decay", "optimizer.grad_clip", "optimizer.warmup_steps",
                "optimizer.min_lr_ratio", "model.dropout")


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for values the schema's types allow but the recipe cannot run."""
    configs.check(cfg, CHOICES, POSITIVE, NON_NEGATIVE)
    if cfg.model.window is not None and cfg.model.window < 1:
        raise ConfigError(f"model.window must be a positive number of tokens (or null for all), got {cfg.model.window}")
    m = cfg.model
    configs.check_head_dim(m)
    if m.dropout >= 1:
        raise ConfigError(f"model.dropout must be in [0, 1) (the probability of zeroing an output), got {m.dropout}")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(
            f"model.n_heads ({m.n_heads}) must be a positive multiple of model.n_kv_heads ({m.n_kv_heads})"
        )
    configs.check_data(cfg.data)
    check_vocabulary(cfg)
    try:
        optimizer = optimizers.optimizer_class(cfg.optimizer.name)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if optimizers.is_second_order(optimizer) and cfg.train.grad_accum_steps != 1:
        raise ConfigError(f"train.grad_accum_steps must be 1 for the second-order optimizer {cfg.optimizer.name}")
    check_optimizer(cfg)
    if m.checkpoint_activations and m.attention in FIRST_ORDER_ATTENTION and optimizers.is_second_order(optimizer):
        raise ConfigError(f"model.checkpoint_activations with model.attention={m.attention} and the second-order "
                          f"optimizer {cfg.optimizer.name}: the checkpoint recomputes its blocks during backward, "
                          "outside the switch to flashbob for curvature, so the recomputation would not match; use "
                          "model.attention=auto (or checkpoint_activations=false)")
    try:
        mlp_hidden(m.d_model, m.mlp, m.mlp_ratio)
    except ValueError as error:
        raise ConfigError(f"model.{error}") from None


def check_optimizer(cfg: DictConfig) -> None:
    """Settings the optimizer would otherwise ignore or misuse without a word."""
    o = cfg.optimizer
    if o.min_lr_ratio > 1:
        raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1] (the cosine decay ends at min_lr_ratio * lr), "
                          f"got {o.min_lr_ratio}")
    if o.betas is not None and (len(o.betas) != 2 or not all(0 <= beta < 1 for beta in o.betas)):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1) or null, got {list(o.betas)}")
    recipe_set = sorted(set(o.kwargs) & {"params", "module", "distributed", "weight_decay"})
    if recipe_set:
        key = recipe_set[0]
        where = "optimizer.weight_decay (per parameter group)" if key == "weight_decay" else "the recipe"
        raise ConfigError(f"optimizer.kwargs.{key} would be ignored or clash: it is set by {where}")
    if cfg.model.dropout > 0 and o.name == "newtoncg" and o.kwargs.get("mode") == "forward":
        raise ConfigError(f"model.dropout={cfg.model.dropout} with newtoncg's optimizer.kwargs.mode=forward: forward "
                          "mode runs the model again for each curvature product, with a new dropout mask each time, so "
                          "CG would not see one matrix; set model.dropout=0 or use mode=reverse")


def check_vocabulary(cfg: DictConfig) -> None:
    """``model.vocab_size`` must be positive or None; ``data.tokenizer=bpe`` needs a text source and at least
    :data:`bpe.MIN_VOCAB_SIZE` tokens."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size must be > 0 or null (the data's vocabulary), got {cfg.model.vocab_size}")
    if cfg.data.tokenizer != "bpe":
        return
    if cfg.data.source == "binary":
        raise ConfigError("data.tokenizer=bpe trains a tokenizer on text: data.source must be stdlib, packages or "
                          "text, not binary (a binary file holds token ids already: use data.tokenizer=bytes)")
    if cfg.data.vocab_size < bpe.MIN_VOCAB_SIZE:
        raise ConfigError(f"data.vocab_size must be >= {bpe.MIN_VOCAB_SIZE} for data.tokenizer=bpe (the 256 bytes "
                          f"and the separator), got {cfg.data.vocab_size}")


def load_config(path: str | None = None, overrides: list[str] = ()) -> DictConfig:
    """The schema's defaults, updated by the YAML file ``path`` and then by ``key=value`` ``overrides``."""
    return configs.load(Config, path, overrides, validate)


@torch.no_grad()
def evaluate(model: GPT, forward: optimizers.Forward, batches: data.Batches, n: int, device: torch.device,
             ctx: distributed.Context = distributed.Context()) -> float:
    """Mean loss over the first ``n`` batches of ``batches`` (the same ones every time), averaged over the ranks."""
    model.eval()
    losses = [forward(*(t.to(device) for t in batches.get(i)))[0].item() for i in range(n)]
    model.train()
    return distributed.average(sum(losses) / n, ctx)


def validation_batches(eval_batches: int, windows: int, global_batch: int) -> int:
    """``train.eval_batches``, or fewer where the validation split holds fewer windows than they would draw
    (``eval_batches * global_batch``): then every window once (at least one batch), with a warning, not some
    windows of a second pass counted twice in the mean. A split of fewer windows than one batch cannot be
    evaluated once each: one batch, with a warning that it repeats some."""
    if windows < global_batch:
        warnings.warn(f"the validation split's {windows} windows are fewer than one batch of {global_batch} "
                      "(data.batch_size x processes): the validation loss counts some windows more than once; "
                      "raise data.val_fraction or lower data.batch_size", RuntimeWarning, stacklevel=2)
        return 1
    fits = windows // global_batch
    if eval_batches > fits:
        warnings.warn(f"train.eval_batches={eval_batches} x {global_batch} windows (data.batch_size x processes) "
                      f"exceed the validation split's {windows} windows; evaluating {fits} batch(es)",
                      RuntimeWarning, stacklevel=2)
        return fits
    return eval_batches


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak CUDA memory of this process so far, in GiB (nothing on other devices)."""
    if device.type != "cuda":
        return {}
    return {"train/max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def load_tokens(cfg: DictConfig, ctx: distributed.Context) -> tuple[data.Corpus, int]:
    """The corpus as token ids, and how many ids there are: 256 bytes, the BPE tokenizer's vocabulary
    (trained by rank 0, or loaded from ``data.cache_dir``, before the other ranks load it), or a
    binary file's largest id + 1."""
    d = cfg.data
    corpus = data.load_corpus(d.source, d.path, d.max_bytes, d.val_fraction, d.binary_dtype)
    if d.tokenizer == "bpe":
        cache_dir = d.cache_dir or Path(cfg.out_dir) / "cache"
        tokens, tokenizer = distributed.main_first(lambda: bpe.tokenized(corpus, d.vocab_size, cache_dir), ctx)
        return tokens, tokenizer.vocab_size
    if d.source == "binary":
        return corpus, 1 + max((int(split.max()) for split in (corpus.train, corpus.val) if len(split)), default=0)
    return corpus, data.VOCAB_SIZE


def resolve_vocab_size(cfg: DictConfig, vocab_size: int) -> None:
    """Set ``model.vocab_size`` to the data's ``vocab_size`` where it is None (so the run's config.yaml
    records it); a smaller one is an error."""
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = vocab_size
    elif cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} is smaller than the data's vocabulary of "
                          f"{vocab_size} tokens (data.tokenizer={cfg.data.tokenizer}); leave it null for the data's")


def build(cfg: DictConfig, device: torch.device, autocast: Autocast, ctx: distributed.Context) -> Recipe:
    """This rank's data windows, the model (a DDP replica for AdamW under ``torchrun``), the optimizer
    and its schedule, and the training step and validation."""
    d, o, t = cfg.data, cfg.optimizer, cfg.train
    corpus, vocab_size = load_tokens(cfg, ctx)
    resolve_vocab_size(cfg, vocab_size)
    shard = {"rank": ctx.rank, "world_size": ctx.world_size}
    train_batches = data.Batches(corpus.train, d.context_length, d.batch_size, t.seed, "train", **shard)
    # the same validation windows for every train.seed (a fixed held-out set: runs of other seeds compare)
    val_batches = data.Batches(corpus.val, d.context_length, d.batch_size, data.VALIDATION_SEED, "validation", **shard)
    eval_batches = validation_batches(t.eval_batches, val_batches.windows, d.batch_size * ctx.world_size)

    model = GPT(**OmegaConf.to_container(cfg.model)).to(device)
    # AdamW: DDP averages the gradients in backward. Second order: no DDP (torch.autograd.grad bypasses
    # its hooks); the optimizer averages gradients, curvature products and losses itself.
    trained = model
    if ctx.distributed and not optimizers.is_second_order(optimizers.optimizer_class(o.name)):
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        distributed.broadcast_module(model, ctx)
    settings = {"lr": o.lr, "betas": tuple(o.betas) if o.betas else None, "eps": o.eps}
    opt = optimizers.build_optimizer(model, o.name, {k: v for k, v in settings.items() if v is not None},
                                     OmegaConf.to_container(o.kwargs), o.weight_decay, o.decay_all,
                                     distributed=ctx.distributed)
    scheduler = build_scheduler(opt, o.warmup_steps, t.steps, o.min_lr_ratio)
    if ctx.distributed:  # the replicas start alike; dropout draws differ per rank
        torch.manual_seed(t.seed + 7919 * ctx.rank)

    def forward_of(module: torch.nn.Module) -> optimizers.Forward:
        def forward(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with autocast():
                logits = module(inputs, data.document_ids(inputs)) if d.pack_documents else module(inputs)
            return cross_entropy(logits, targets), logits

        return forward

    # compiled: the first-order passes; the optimizers evaluate the closure eagerly where they differentiate it twice
    forward = forward_of(torch.compile(trained) if t.compile else trained)
    tokens_per_step = d.batch_size * d.context_length * t.grad_accum_steps * ctx.world_size
    no_sync = trained.no_sync if isinstance(trained, DistributedDataParallel) else None

    def step() -> StepResult:
        lr = {"train/lr": opt.param_groups[0]["lr"]} if "lr" in opt.param_groups[0] else {}
        micro = [tuple(x.to(device) for x in train_batches.next()) for _ in range(t.grad_accum_steps)]
        loss, stats = optimizers.train_step(opt, forward, micro, o.grad_clip, no_sync=no_sync,
                                            for_curvature=model.attention.for_curvature)
        loss = distributed.average(loss, ctx)
        if scheduler is not None:
            scheduler.step()
        return StepResult(loss, lambda seconds: {
            "train/loss": loss, "train/perplexity": math.exp(loss), "train/tokens_per_s": tokens_per_step / seconds,
            "train/epoch": train_batches.epoch, **lr, **memory_metrics(device),
            **{f"optimizer/{k}": v for k, v in stats.items()}})

    def validation() -> dict[str, float]:
        val = evaluate(model, forward_of(model), val_batches, eval_batches, device, ctx)
        return {"val/loss": val, "val/perplexity": math.exp(val)}

    parts = {"model": model, "optimizer": opt, "scheduler": scheduler, "data": train_batches}
    return Recipe(parts, step, validation, "val/loss", generator=getattr(opt, "generator", None))


def train(cfg: DictConfig) -> dict[str, float]:
    """Run the training ``cfg`` describes; returns the last logged train and validation losses.

    Under ``torchrun`` every process calls this; see the module docstring.
    """
    return training.run(cfg, functools.partial(build, cfg), data_parallel=True)
