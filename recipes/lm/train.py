"""Pretrain a byte-level decoder-only transformer whose attention runs through flashbob.

    python -m recipes.lm --config configs/lm/tiny.yaml                       # CPU, a few minutes
    python -m recipes.lm --config configs/lm/gpu_32k.yaml optimizer.name=sophiah
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

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from recipes.common import config as configs
from recipes.common import run_folder
from recipes.common.config import ConfigError
from recipes.lm import checkpoint, data, distributed, optimizers
from recipes.lm.logger import RunLogger
from recipes.lm.model import GPT, cross_entropy


@dataclass
class ModelConfig:
    vocab_size: int = 256  # 256 for bytes; a binary corpus of uint16 ids needs its own vocabulary size
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
    checkpoint_activations: bool = False  # recompute each block in backward (torch.utils.checkpoint)
    attention_backend: str = "auto"  # auto (Triton on CUDA, blocked PyTorch elsewhere) | triton | blocked


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (the interpreter's own .py files) | text (glob in path) | binary (file in path)
    path: Optional[str] = None  # glob of text files, or a pre-tokenised binary file
    binary_dtype: str = "uint16"  # uint8 | uint16, token type of a binary file
    max_bytes: int = 4_000_000  # cap on the bytes read from stdlib/text sources
    val_fraction: float = 0.05  # share of documents (stdlib/text) or of the tail (binary) held out
    context_length: int = 256  # tokens per training sequence
    batch_size: int = 8  # sequences per micro-batch and process (torchrun: the global batch is N times this)


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


@dataclass
class LoggerConfig(configs.LoggerConfig):
    project: str = "flashbob-lm"  # W&B project (kind, entity, wandb_mode: see recipes.common.config)


@dataclass
class Config:
    name: str = "tiny"  # run name: outputs go to <out_dir>/<name>
    out_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.mlp": ("swiglu", "gelu"),
    "model.attention_backend": ("auto", "triton", "blocked"),
    "data.source": ("stdlib", "text", "binary"),
    "data.binary_dtype": tuple(data.BINARY_DTYPES),
}
POSITIVE = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.mlp_ratio",
            "data.max_bytes", "data.context_length", "data.batch_size", "optimizer.lr", "train.steps",
            "train.grad_accum_steps", "train.eval_interval", "train.eval_batches")
NON_NEGATIVE = ("optimizer.weight_decay", "optimizer.grad_clip", "optimizer.warmup_steps",
                "optimizer.min_lr_ratio", "model.dropout")


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for values the schema's types allow but the recipe cannot run."""
    configs.check(cfg, CHOICES, POSITIVE, NON_NEGATIVE)
    m = cfg.model
    configs.check_head_dim(m)
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(
            f"model.n_heads ({m.n_heads}) must be a positive multiple of model.n_kv_heads ({m.n_kv_heads})"
        )
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    configs.check_data_path(cfg.data)
    try:
        spec = optimizers.spec(cfg.optimizer.name)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if spec.second_order and cfg.train.grad_accum_steps != 1:
        raise ConfigError(f"train.grad_accum_steps must be 1 for the second-order optimizer {cfg.optimizer.name}")


def load_config(path: str | None = None, overrides: list[str] = ()) -> DictConfig:
    """The schema's defaults, updated by the YAML file ``path`` and then by ``key=value`` ``overrides``."""
    cfg = configs.load(Config, path, overrides)
    validate(cfg)
    return cfg


@torch.no_grad()
def evaluate(model: GPT, forward, batches: data.Batches, n: int, device: torch.device,
             ctx: distributed.Context = distributed.Context()) -> float:
    """Mean loss over the first ``n`` batches of ``batches`` (the same ones every time), averaged over the ranks."""
    model.eval()
    losses = [forward(*(t.to(device) for t in batches.get(i)))[0].item() for i in range(n)]
    model.train()
    return distributed.average(sum(losses) / n, ctx)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak CUDA memory of this process so far, in GiB (nothing on other devices)."""
    if device.type != "cuda":
        return {}
    return {"train/max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def rng_states(opt: torch.optim.Optimizer) -> dict:
    """This process's generator states: the global ones and the optimizer's own (probes), if it has
    one, with the type of device that generator is on (CPU and CUDA generators differ in kind)."""
    generator = getattr(opt, "generator", None)
    return {**checkpoint.rng_state(), "optimizer": generator.get_state() if generator is not None else None,
            "optimizer_device": generator.device.type if generator is not None else None}


def restore_rng(state: dict, opt: torch.optim.Optimizer, ctx: distributed.Context) -> None:
    """Restore this rank's generator states from a checkpoint written by as many processes; else keep fresh ones."""
    per_rank = state.get("rng_ranks", [state["rng"]])
    if len(per_rank) != ctx.world_size:
        warnings.warn(f"the checkpoint was written by {len(per_rank)} process(es), this run has {ctx.world_size}: "
                      "random-number states start afresh, so the run continues at the same data position but "
                      "not bit for bit", RuntimeWarning, stacklevel=2)
        return
    mine = per_rank[ctx.rank]
    checkpoint.set_rng_state(mine)
    generator = getattr(opt, "generator", None)
    if generator is None or mine.get("optimizer") is None:
        return
    saved_on = mine.get("optimizer_device")  # None in checkpoints written before it was recorded
    problem = f"it was a {saved_on} generator's" if saved_on not in (None, generator.device.type) else None
    if problem is None:
        try:
            generator.set_state(mine["optimizer"].cpu())
        except RuntimeError as error:  # a CUDA generator's state does not fit a CPU generator, nor the reverse
            problem = str(error)
    if problem is not None:
        warnings.warn(f"the optimizer's generator state in the checkpoint does not fit this run's "
                      f"{generator.device.type} generator ({problem}): its random probes start afresh, so the "
                      "run continues at the same step but not bit for bit", RuntimeWarning, stacklevel=2)


def train(cfg: DictConfig) -> dict[str, float]:
    """Run the training ``cfg`` describes; returns the last logged train and validation losses.

    Under ``torchrun`` every process calls this; see the module docstring.
    """
    run_dir = Path(cfg.out_dir) / cfg.name
    device, autocast_dtype = configs.resolve_device(cfg.train.device, cfg.train.dtype)
    ctx = distributed.setup(device.type)
    device = ctx.device if device.type == "cuda" else device
    try:
        with run_folder.claim(run_dir) if ctx.is_main else contextlib.nullcontext():
            return _train(cfg, run_dir, ctx, device, autocast_dtype)
    finally:
        distributed.teardown(ctx)


def _train(cfg: DictConfig, run_dir: Path, ctx: distributed.Context, device: torch.device,
           autocast_dtype: torch.dtype | None) -> dict[str, float]:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)

    corpus = data.load_corpus(cfg.data.source, cfg.data.path, cfg.data.max_bytes, cfg.data.val_fraction,
                              cfg.data.binary_dtype)
    length, batch = cfg.data.context_length, cfg.data.batch_size
    shard = {"rank": ctx.rank, "world_size": ctx.world_size}
    train_batches = data.Batches(corpus.train, length, batch, cfg.train.seed, "train", **shard)
    val_batches = data.Batches(corpus.val, length, batch, cfg.train.seed + 1, "validation", **shard)

    model = GPT(**OmegaConf.to_container(cfg.model)).to(device)
    spec = optimizers.spec(cfg.optimizer.name)
    # AdamW: DDP averages the gradients in backward. Second order: no DDP (torch.autograd.grad bypasses
    # its hooks); the optimizer averages gradients, curvature products and losses itself.
    trained = model
    if ctx.distributed and not spec.second_order:
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        distributed.broadcast_module(model, ctx)
    o = cfg.optimizer
    settings = {"lr": o.lr, "betas": tuple(o.betas) if o.betas else None, "eps": o.eps}
    opt = optimizers.build_optimizer(model, o.name, {k: v for k, v in settings.items() if v is not None},
                                     OmegaConf.to_container(o.kwargs), o.weight_decay, o.decay_all,
                                     distributed=ctx.distributed)
    scheduler = optimizers.build_scheduler(opt, o.warmup_steps, cfg.train.steps, o.min_lr_ratio)
    if ctx.distributed:  # the replicas start alike; dropout draws differ per rank
        torch.manual_seed(cfg.train.seed + 7919 * ctx.rank)

    step = 0
    parts = {"model": model, "optimizer": opt, "scheduler": scheduler, "data": train_batches}
    resumed = run_folder.resume(cfg.train.resume, run_dir)
    if resumed is not None:
        source, state = resumed
        run_folder.restore(source, state, **parts)
        restore_rng(state, opt, ctx)
        step = state["step"]

    def forward_of(module: torch.nn.Module):
        def forward(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype
                        else contextlib.nullcontext())
            with autocast:
                logits = module(inputs)
            return cross_entropy(logits, targets), logits

        return forward

    forward = forward_of(trained)

    def save_checkpoint() -> None:
        rngs = distributed.gather(rng_states(opt), ctx)  # a collective: every rank takes part
        if ctx.is_main:
            state = {**run_folder.snapshot(**parts), "rng": rngs[0], "rng_ranks": rngs, "step": step,
                     "world_size": ctx.world_size, "config": OmegaConf.to_container(cfg)}
            checkpoint.save(run_dir / "checkpoints", step, state, keep=cfg.train.keep_checkpoints)

    logger = None
    if ctx.is_main:
        OmegaConf.save(cfg, run_dir / "config.yaml")  # after resuming: a refused resume leaves it as it was
        logger = RunLogger(run_dir, OmegaConf.to_container(cfg, resolve=True), kind=cfg.logger.kind,
                           project=cfg.logger.project, name=cfg.name, wandb_mode=cfg.logger.wandb_mode,
                           entity=cfg.logger.entity, start_step=step)
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length * cfg.train.grad_accum_steps * ctx.world_size
    no_sync = trained.no_sync if isinstance(trained, DistributedDataParallel) else None
    last: dict[str, float] = {}
    bar = tqdm(total=cfg.train.steps, initial=step, disable=not (cfg.train.progress and ctx.is_main), desc=cfg.name,
               unit="step")
    try:
        while step < cfg.train.steps:
            start = time.perf_counter()
            lr = {"train/lr": opt.param_groups[0]["lr"]} if "lr" in opt.param_groups[0] else {}
            micro = [tuple(t.to(device) for t in train_batches.next()) for _ in range(cfg.train.grad_accum_steps)]
            loss, stats = optimizers.train_step(opt, forward, micro, spec.second_order, spec.closure_returns_logits,
                                                o.grad_clip, no_sync=no_sync)
            loss = distributed.average(loss, ctx)
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss} at step {step + 1}")
            if scheduler is not None:
                scheduler.step()
            step += 1
            elapsed = time.perf_counter() - start
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            metrics = {}
            if step % cfg.train.log_interval == 0 or step in (1, cfg.train.steps):
                metrics.update({"train/loss": loss, "train/perplexity": math.exp(loss),
                                "train/tokens_per_s": tokens_per_step / elapsed, "train/epoch": train_batches.epoch,
                                **lr, **memory_metrics(device),
                                **{f"optimizer/{k}": v for k, v in stats.items()}})
            if step % cfg.train.eval_interval == 0 or step == cfg.train.steps:
                val = evaluate(model, forward_of(model), val_batches, cfg.train.eval_batches, device, ctx)
                metrics.update({"val/loss": val, "val/perplexity": math.exp(val)})
            if metrics:
                if logger is not None:
                    logger.log(step, metrics)
                last.update(metrics)
            if (cfg.train.checkpoint_interval and step % cfg.train.checkpoint_interval == 0) or step == cfg.train.steps:
                save_checkpoint()
        distributed.barrier(ctx)  # rank 0's last checkpoint and logs are written when any rank returns
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    return last
