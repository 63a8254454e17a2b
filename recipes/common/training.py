"""The training loop of the three recipes, around each recipe's own step and evaluation.

:func:`run` does, for the run folder ``<out_dir>/<name>``::

    claim the folder (lock it, remove what killed writes left)
    seed; build the recipe (model, optimizer, data) on the device
    resume: restore the recipe's parts and the random-number states from a checkpoint (train.resume);
        a run resumed at train.steps or later says it has finished and returns its logged metrics
    for each step up to train.steps (or until train.max_seconds of steps after this process's first):
        take the recipe's step; stop if its loss is not finite
        every train.log_interval steps (and the first and last): log the step's metrics
        every train.eval_interval steps (and the last; the first too if the recipe asks): evaluate and log
        every train.checkpoint_interval steps (and the last): write a checkpoint
    say which steps it trained, its wall time, and where its outputs are

The progress bar shows each step's loss and the last validation loss (``val``). Under ``torchrun``
(the LM recipe trains data parallel) every process runs the loop; rank 0 alone claims the folder,
logs, shows progress, writes checkpoints (which hold every rank's random-number states) and says
where the outputs are.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from recipes.common import checkpoint, distributed, progress, run_folder
from recipes.common.config import ConfigError, resolve_device
from recipes.common.logger import RunLogger

Autocast = Callable[[], ContextManager]  # a fresh autocast context (or a null one) per call


class StepResult(NamedTuple):
    """What a training step reports."""

    loss: float  # its training loss (on every rank the same), shown in the progress bar
    metrics: Callable[[float], dict[str, float]]  # its metrics to log, given the step's wall-clock seconds
    progress: dict[str, str] = {}  # more to show in the progress bar, e.g. {"acc": "0.81"}


@dataclass
class Recipe:
    """A recipe's model, optimizer and data, as the loop drives them.

    Attributes:
        parts: The stateful parts, by name (``model``, ``optimizer``, ``scheduler``, ``data``, ...):
            each checkpoint saves their ``state_dict()`` and a resume restores them (``None``: none).
        step: One training step.
        evaluate: Held-out metrics of the current weights.
        val_loss: The metric of ``evaluate`` the progress bar shows as ``val``.
        generator: The optimizer's own random generator (its probes), checkpointed with the global
            ones; ``None`` if it has none.
        evaluate_first_step: Evaluate after the first step too (the baseline of later evaluations).
    """

    parts: dict[str, Any]
    step: Callable[[], StepResult]
    evaluate: Callable[[], dict[str, float]]
    val_loss: str
    generator: torch.Generator | None = None
    evaluate_first_step: bool = False


Build = Callable[[torch.device, Autocast, distributed.Context], Recipe]


def run(cfg: DictConfig, build: Build, *, data_parallel: bool = False) -> dict[str, float]:
    """Train the recipe ``build(device, autocast, ctx)`` makes, as ``cfg`` describes (its ``name``,
    ``out_dir``, ``train`` and ``logger`` settings); returns the last logged value of each metric.

    With ``data_parallel`` the process joins the process group ``torchrun`` describes, if any. A recipe
    without it runs in one process: started as several (``WORLD_SIZE`` > 1) it raises :class:`ConfigError`.
    """
    started = time.perf_counter()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not data_parallel and world_size > 1:
        raise ConfigError(f"this recipe trains in one process, but {world_size} were started (WORLD_SIZE, "
                          "torchrun --nproc_per_node): launch it with python -m, or with --nproc_per_node=1")
    run_dir = Path(cfg.out_dir) / cfg.name
    device, autocast_dtype = resolve_device(cfg.train.device, cfg.train.dtype)
    ctx = distributed.setup(device.type) if data_parallel else distributed.Context(device=device)
    try:
        with run_folder.claim(run_dir) if ctx.is_main else contextlib.nullcontext():
            return _run(cfg, run_dir, build, ctx, autocast_dtype, started)
    finally:
        distributed.teardown(ctx)


def _run(cfg: DictConfig, run_dir: Path, build: Build, ctx: distributed.Context,
         autocast_dtype: torch.dtype | None, started: float) -> dict[str, float]:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)

    def autocast() -> ContextManager:
        return torch.autocast(ctx.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()

    recipe = build(ctx.device, autocast, ctx)
    step = 0
    resumed = run_folder.resume(cfg.train.resume, run_dir)
    if resumed is not None:
        source, state = resumed
        run_folder.restore(source, state, **recipe.parts)
        if "optimizer" in cfg:
            run_folder.check_restored_settings(source, state, OmegaConf.to_container(cfg.optimizer))
        checkpoint.restore_rng(state, recipe.generator, ctx.rank, ctx.world_size)
        step = state["step"]
    if step >= cfg.train.steps:
        return finished(run_dir, step, cfg.train.steps, ctx)

    def save_checkpoint() -> Path | None:
        """Write a checkpoint of this step; its path on rank 0, ``None`` on the others."""
        rngs = distributed.gather(checkpoint.rng_states(recipe.generator), ctx)  # a collective: every rank takes part
        if not ctx.is_main:
            return None
        state = {**run_folder.snapshot(**recipe.parts), "rng": rngs[0], "rng_ranks": rngs, "step": step,
                 "world_size": ctx.world_size, "config": OmegaConf.to_container(cfg)}
        return checkpoint.save(run_dir / "checkpoints", step, state, keep=cfg.train.keep_checkpoints)

    logger = None
    if ctx.is_main:
        OmegaConf.save(cfg, run_dir / "config.yaml")  # after resuming: a refused resume leaves it as it was
        logger = RunLogger(run_dir, OmegaConf.to_container(cfg, resolve=True), kind=cfg.logger.kind,
                           project=cfg.logger.project, name=cfg.name, wandb_mode=cfg.logger.wandb_mode,
                           entity=cfg.logger.entity, start_step=step)
    t = cfg.train
    last: dict[str, float] = {}
    bar = tqdm(total=t.steps, initial=step, disable=not (t.progress and ctx.is_main), desc=cfg.name, unit="step")
    first_step, trained_s, final, saved = step + 1, 0.0, False, None
    try:
        while step < t.steps and not final:
            start = time.perf_counter()
            result = recipe.step()
            step += 1
            elapsed = time.perf_counter() - start
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"training loss became {result.loss} at step {step}")
            trained_s += elapsed if step > first_step else 0.0
            final = step == t.steps or out_of_time(trained_s, t.max_seconds, ctx)
            metrics = {}
            if step % t.log_interval == 0 or step == 1 or final:
                metrics.update(result.metrics(elapsed))
            if step % t.eval_interval == 0 or final or (step == 1 and recipe.evaluate_first_step):
                metrics.update(recipe.evaluate())
            if metrics:
                if logger is not None:
                    logger.log(step, metrics)
                last.update(metrics)
            bar.set_postfix(progress.postfix(result.loss, last.get(recipe.val_loss), result.progress), refresh=False)
            bar.update()
            if (t.checkpoint_interval and step % t.checkpoint_interval == 0) or final:
                saved = save_checkpoint()
        distributed.barrier(ctx)  # rank 0's last checkpoint and logs are written when any rank returns
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    if ctx.is_main:
        print(progress.report(cfg.name, run_dir, first_step, step, t.steps, time.perf_counter() - started, saved,
                              logger.wandb), file=sys.stderr)
    return last


def finished(run_dir: Path, step: int, steps: int, ctx: distributed.Context) -> dict[str, float]:
    """A resumed run that has no step left: rank 0 says so and returns the last value of each metric that the
    run's ``metrics.jsonl`` holds up to ``step`` (the other ranks return ``{}``); nothing is written."""
    if not ctx.is_main:
        return {}
    print(f"{run_dir} finished at step {step} (train.steps={steps}): nothing to train; raise train.steps to train "
          "it further", file=sys.stderr)
    path, last = run_dir / "metrics.jsonl", {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else ():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step", step + 1) <= step:
            last.update({key: value for key, value in row.items() if key not in ("step", "time")})
    return last


def out_of_time(trained_s: float, max_seconds: float, ctx: distributed.Context) -> bool:
    """Whether ``trained_s`` seconds of training reach ``max_seconds`` (0: never), decided alike on every rank
    (their mean time: one scalar all-reduce per step, only with a limit)."""
    return max_seconds > 0 and distributed.average(trained_s, ctx) >= max_seconds
