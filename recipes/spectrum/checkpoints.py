"""The LM recipe's checkpoints as the spectrum recipe reads them: which files, the config each was trained with,
the model and AdamW state it holds, and fixed validation windows of any length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recipes.common import checkpoint as checkpoints
from recipes.common import data, distributed
from recipes.lm import optimizers
from recipes.lm.model import GPT
from recipes.lm.train import load_tokens

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Checkpoint:
    """A checkpoint of the LM recipe: its file, training step, resolved config and saved state."""

    path: Path
    step: int
    cfg: DictConfig
    state: dict


def find(paths: list[str] | None, run: str | None) -> list[Path]:
    """The checkpoint files named, or every finished one of the run folder ``run``, by step.

    Raises:
        FileNotFoundError: a named file does not exist, or the run folder holds no checkpoint.
    """
    if run is not None:
        found = checkpoints.checkpoints(Path(run) / "checkpoints")
        if not found:
            raise FileNotFoundError(f"--run {run}: no checkpoints/step_*.pt in it (is it a run folder of recipes.lm?)")
        return found
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"--checkpoint {missing[0]} does not exist")
    return sorted((Path(path) for path in paths), key=lambda p: p.name)


def load(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` (verified), with the config it records, or its run folder's ``config.yaml``.

    Raises:
        ValueError: it holds no LM model state, or no config is found.
    """
    state = checkpoints.load(path)
    if state.get("classes", {}).get("model") != "GPT":
        raise ValueError(f"{path} holds no GPT model state: it was not written by recipes.lm")
    config, saved = state.get("config"), path.parent.parent / "config.yaml"
    if config is None and not saved.is_file():
        raise ValueError(f"{path} records no config and {saved} does not exist")
    cfg = OmegaConf.create(config) if config is not None else OmegaConf.load(saved)
    return Checkpoint(path, int(state["step"]), cfg, state)


def model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, attention: str | None) -> GPT:
    """The checkpoint's model in ``dtype`` on ``device``, in eval mode (no dropout: every product is of one
    matrix); ``attention`` replaces the trained model's attention if given (e.g. ``eager`` for comparison)."""
    settings = OmegaConf.to_container(ckpt.cfg.model)
    if attention is not None:
        settings["attention"] = attention
    gpt = GPT(**settings)
    gpt.load_state_dict(ckpt.state["model"])
    return gpt.to(device, dtype).eval()


def adamw(ckpt: Checkpoint, gpt: GPT) -> torch.optim.AdamW:
    """The run's AdamW over ``gpt``'s parameters with the checkpoint's state (moments, step, learning rates).

    Raises:
        ValueError: the run trained with another optimizer.
    """
    o = ckpt.cfg.optimizer
    if o.name != "adamw":
        raise ValueError(f"{ckpt.path} was trained with optimizer.name={o.name}; the preconditioned sharpness is "
                         "Adam's (optimizer.name=adamw)")
    settings = {"lr": o.lr, "betas": tuple(o.betas) if o.betas else None, "eps": o.eps}
    opt = optimizers.build_optimizer(gpt, o.name, {k: v for k, v in settings.items() if v is not None},
                                     OmegaConf.to_container(o.kwargs), o.weight_decay, o.decay_all)
    opt.load_state_dict(ckpt.state["optimizer"])
    return opt


@lru_cache(maxsize=4)
def _validation_tokens(data_settings: str) -> np.ndarray:
    """The validation split of the data ``data_settings`` (JSON of the config's ``out_dir`` and ``data``) describes."""
    cfg = OmegaConf.create(json.loads(data_settings))
    corpus, _ = load_tokens(cfg, distributed.Context())
    return corpus.val


def validation_batches(cfg: DictConfig, length: int, batch_size: int, count: int) -> list[Batch]:
    """The first ``count`` batches of ``batch_size`` validation windows of ``length`` tokens, in the order the LM
    recipe's validation draws them (:data:`recipes.common.data.VALIDATION_SEED`): the same windows at every step.

    Raises:
        ValueError: the validation split holds fewer than ``length + 1`` tokens.
    """
    settings = json.dumps({"out_dir": cfg.out_dir, "data": OmegaConf.to_container(cfg.data)}, sort_keys=True)
    windows = data.Batches(_validation_tokens(settings), length, batch_size, data.VALIDATION_SEED, "validation")
    return [windows.get(i) for i in range(count)]
