"""The three recipes at micro scale, for the tests: each one's tiny config with settings that make it
train in seconds on a CPU, its command line, and the metrics log a run writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig

from recipes.lm import __main__ as lm_command
from recipes.lm import train as lm
from recipes.meta import __main__ as meta_command
from recipes.meta import train as meta
from recipes.ttt import __main__ as ttt_command
from recipes.ttt import train as ttt

ROOT = Path(__file__).resolve().parent.parent


class Recipe(NamedTuple):
    """A recipe as the tests run it."""

    name: str  # python -m recipes.<name>; its configs are in configs/<name>/
    load_config: Callable[[str | None, list[str]], DictConfig]
    train: Callable[[DictConfig], dict[str, float]]
    main: Callable[[list[str]], dict[str, float]]
    micro: tuple[str, ...]  # settings on top of its tiny config
    run: str  # the run folder of its tiny config
    printed: str  # a metric its command line prints at the end
    val_loss: str  # the validation loss its progress bar shows as val=

    @property
    def configs(self) -> Path:
        return ROOT / "configs" / self.name

    def arguments(self, tmp_path: Path, *overrides: str) -> list[str]:
        """Its command line: the tiny config at micro scale, writing under ``tmp_path``, and ``overrides``."""
        return ["--config", str(self.configs / "tiny.yaml"), *self.micro, f"out_dir={tmp_path}", *overrides]

    def config(self, tmp_path: Path, *overrides: str) -> DictConfig:
        """Its tiny config at micro scale, writing under ``tmp_path``, with ``overrides``."""
        return self.load_config(str(self.configs / "tiny.yaml"), [*self.micro, f"out_dir={tmp_path}", *overrides])


LM = Recipe("lm", lm.load_config, lm.train, lm_command.main, (
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "data.max_bytes=200000", "data.val_fraction=0.1", "data.context_length=64", "data.batch_size=4",
    "optimizer.lr=1e-2", "optimizer.warmup_steps=4", "train.steps=20", "train.eval_interval=10",
    "train.eval_batches=2", "train.log_interval=1", "train.progress=false", "logger.kind=none",
), "tiny", "val/loss", "val/loss")
META = Recipe("meta", meta.load_config, meta.train, meta_command.main, (
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "task.seq_len=12", "task.k_query=3",
    "maml.meta_batch=2", "train.steps=12", "train.eval_interval=6", "train.eval_tasks=6", "train.log_interval=1",
    "train.progress=false", "logger.kind=none",
), "meta_tiny", "meta_test/query_accuracy", "meta_test/query_loss")
TTT = Recipe("ttt", ttt.load_config, ttt.train, ttt_command.main, (
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "data.max_bytes=200000", "data.val_fraction=0.1",
    "data.context_length=32", "data.continuation_length=16", "data.batch_size=4", "train.steps=10",
    "train.eval_interval=5", "train.eval_batches=2", "train.log_interval=1", "train.progress=false",
    "logger.kind=none",
), "ttt_tiny", "val/ttt_gain", "val/loss_ttt")
RECIPES = {recipe.name: recipe for recipe in (LM, META, TTT)}


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (a run's ``metrics.jsonl``)."""
    return [json.loads(line) for line in path.read_text().splitlines()]
