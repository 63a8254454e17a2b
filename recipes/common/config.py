"""Config loading shared by the recipes: structured OmegaConf schema defaults, then a YAML file, then
``key=value`` overrides; unknown keys, wrong types and bad values raise :class:`ConfigError` naming the key."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, make_dataclass
from pathlib import PurePath
from typing import Callable, Iterable, Optional

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes.common import data


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


@dataclass
class TrainConfig:
    """Run-control settings every recipe shares; each recipe subclasses it with its own steps and
    evaluation settings (and may change these defaults)."""

    seed: int = 0  # initialisation and data order
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 autocast on cuda, float32 elsewhere) | float32 | bfloat16
    threads: int = 0  # CPU threads of torch's matrix products; 0: PyTorch's default (one per core)
    log_interval: int = 10  # steps between logged training metrics (and at the first and last step)
    checkpoint_interval: int = 100  # steps between checkpoints (and at the last step); 0: last step only
    keep_checkpoints: int = 2  # newest checkpoints kept; 0: all
    resume: Optional[str] = None  # None | auto (newest checkpoint of this run, if any) | checkpoint file or folder
    progress: bool = True  # tqdm progress bar
    max_seconds: float = 0.0  # stop after the step at which this process's steps after its first (which
    # compiles) have taken this long in all (the step evaluates and checkpoints as the last); 0: off


@dataclass
class LoggerConfig:
    """Where a recipe logs; :func:`recipe_schema` names the W&B project after the recipe."""

    kind: str = "wandb"  # wandb | none (metrics.jsonl is written either way)
    project: str = "flashbob"  # W&B project
    entity: Optional[str] = None  # W&B entity (team or user); None: your default
    wandb_mode: str = "offline"  # offline (files only, `wandb sync` later) | online (needs `wandb login`) | disabled


@dataclass
class TransformerConfig:
    """Settings of the :class:`~recipes.common.transformer.Transformer` that the meta and TTT recipes build;
    each subclasses it with its own (and may change these defaults)."""

    d_model: int = 64  # width of the residual stream
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # heads; head_dim = d_model / n_heads (must be even, for RoPE)
    mlp_ratio: float = 4.0  # MLP hidden width / d_model
    attention: str = "auto"  # flashbob backend auto (Triton on CUDA, else blocked) | triton | blocked, or eager (naive)


def recipe_schema(recipe: str, name: str, module: str, **sections: type) -> type:
    """The config schema of the recipe ``recipe``: a dataclass of the run's ``name`` (its outputs go to
    ``<out_dir>/<name>``), ``out_dir`` (default ``runs``), the recipe's ``sections`` (dataclasses, by key, in
    order: ``model``, ``train``, ...) and ``logger``, whose W&B project is ``flashbob-<recipe>``. ``module``: the
    caller's ``__name__``, where the class lives (so that its configs pickle)."""
    logger = functools.partial(LoggerConfig, project=f"flashbob-{recipe}")
    fields = [("name", str, field(default=name)), ("out_dir", str, field(default="runs")),
              *((key, section, field(default_factory=section)) for key, section in sections.items()),
              ("logger", LoggerConfig, field(default_factory=logger))]
    return make_dataclass("Config", fields, namespace={"__module__": module})


# Keys of earlier versions, refused with their new spelling: one attention setting in every recipe.
RENAMED = {
    "model.attention_backend": "model.attention (auto, triton or blocked: flashbob's backend; or eager)",
    "model.backend": "part of model.attention (auto, triton or blocked: flashbob's backend; or eager)",
}


def load(schema: type, path: str | None, overrides: Iterable[str],
         validate: Callable[[DictConfig], None] = lambda cfg: None) -> DictConfig:
    """``schema``'s defaults, updated by the YAML file ``path`` and then by ``key=value`` ``overrides``,
    then checked by ``validate``.

    ``logger: none`` is accepted as shorthand for ``logger.kind: none``. Interpolations
    (``${oc.env:HOME}``) are resolved once here, so one that fails is reported now.
    """
    try:
        sources = [load_yaml(path)] if path else []
        sources.append(OmegaConf.from_dotlist(list(overrides)))
        for source in sources:
            check_renamed(source)
            if isinstance(source.get("logger"), str):
                source.logger = {"kind": source.logger}
        cfg = OmegaConf.merge(OmegaConf.structured(schema), *sources)
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        message = str(getattr(error, "msg", None) or error).splitlines()[0]  # msg is None for a merge error
        raise ConfigError(f"bad config key {key!r}: {message}" if key else f"bad config: {message}") from None
    validate(cfg)
    return cfg


def check_renamed(source: DictConfig) -> None:
    """Raise :class:`ConfigError` for a key of :data:`RENAMED`, saying what it is now."""
    for old, new in RENAMED.items():
        if OmegaConf.select(source, old) is not None:
            raise ConfigError(f"{old} is now {new}")


def load_yaml(path: str) -> DictConfig:
    """The settings in the YAML file ``path`` (a mapping; an empty file is no settings).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: the file is not valid YAML, or not a mapping; the message gives the line.
    """
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of settings (key: value), not a list")
    return loaded


# Rules of the shared TrainConfig and LoggerConfig keys, which check() applies to every recipe.
COMMON_CHOICES = {
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "float32", "bfloat16"),
    "logger.kind": ("wandb", "none"),
    "logger.wandb_mode": ("offline", "online", "disabled"),
}
COMMON_POSITIVE = ("train.log_interval",)
COMMON_NON_NEGATIVE = ("train.seed", "train.threads", "train.checkpoint_interval", "train.keep_checkpoints",
                       "train.max_seconds")


def check(cfg: DictConfig, choices: dict[str, tuple], positive: Iterable[str] = (),
          non_negative: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigError` for a value outside its ``choices``, or not > 0 / >= 0; the shared
    run-control keys (``COMMON_*``) are checked as well."""
    choices = {**COMMON_CHOICES, **choices}
    positive, non_negative = (*COMMON_POSITIVE, *positive), (*COMMON_NON_NEGATIVE, *non_negative)
    for key, allowed in choices.items():
        if OmegaConf.select(cfg, key) not in allowed:
            got = OmegaConf.select(cfg, key)
            raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}; got {got!r}")
    for key in positive:
        if not OmegaConf.select(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {OmegaConf.select(cfg, key)}")
    for key in non_negative:
        if not OmegaConf.select(cfg, key) >= 0:
            raise ConfigError(f"{key} must be >= 0, got {OmegaConf.select(cfg, key)}")
    check_name(cfg.name)


def check_name(name: str) -> None:
    """The run folder ``<out_dir>/<name>`` must lie inside ``out_dir``: ``name`` is relative, without ``..``."""
    parts = PurePath(name).parts
    if not parts or PurePath(name).is_absolute() or ".." in parts:
        raise ConfigError(f"name must be a relative folder name inside out_dir, without '..'; got {name!r}")


def check_data(data_cfg: DictConfig) -> None:
    """``data.val_fraction`` must be in (0, 1) and ``data.path`` name the files of the text (a glob)
    and binary (one file) sources."""
    if not 0 < data_cfg.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {data_cfg.val_fraction}")
    if data_cfg.source in ("stdlib", "packages"):
        return
    if not data_cfg.path:
        raise ConfigError(f"data.path is required for data.source={data_cfg.source}")
    try:
        if data_cfg.source == "text":
            data.text_sources(data_cfg.path)
        else:
            data.binary_file(data_cfg.path)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None


def check_head_dim(model: DictConfig) -> None:
    """``model.d_model`` must be ``model.n_heads`` times an even head_dim (rotary embeddings turn channel pairs)."""
    if model.d_model % model.n_heads or (model.d_model // model.n_heads) % 2:
        raise ConfigError(f"model.d_model ({model.d_model}) must be model.n_heads ({model.n_heads}) times an even "
                          "head_dim")


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype | None]:
    """The device (``auto``: CUDA if available) and the autocast dtype (``None``: no autocast;
    ``auto``: bfloat16 on CUDA, none elsewhere).

    Raises:
        ConfigError: ``device`` is ``cuda`` on a machine where torch finds no CUDA device.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but torch finds no CUDA device on this machine; "
                          "use train.device=auto or cpu")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device), (torch.bfloat16 if dtype == "bfloat16" else None)
