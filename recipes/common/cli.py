"""The command line every recipe shares: ``python -m recipes.<name> --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from recipes.common import run_folder
from recipes.common.config import ConfigError
from recipes.common.run_folder import RunLockedError
from recipes.common.checkpoint import CheckpointReadError, CheckpointWriteError


def run(
    name: str,
    description: str,
    load_config: Callable[[str | None, list[str]], DictConfig],
    train: Callable[[DictConfig], dict[str, float]],
    summary_keys: Callable[[str], bool],
    argv: list[str] | None = None,
) -> dict[str, float]:
    """Parse the arguments (``--config`` and ``--resume`` may stand anywhere among the overrides), load and
    validate the config, train, and print the summary values whose keys ``summary_keys`` accepts (rank 0
    only under ``torchrun``).

    Without ``name=`` among the overrides the run goes to a folder of its own (:func:`number_the_run`); a
    run folder that ``name=`` names is used as it is.

    A config error, found while loading or once training starts (no CUDA device, a checkpoint of
    another model), exits with status 2 and the one-line message; a run folder in use and an
    unreadable or unwritable checkpoint exit with status 1 and theirs, without a traceback.
    """
    parser = argparse.ArgumentParser(prog=f"python -m recipes.{name}", description=description)
    parser.add_argument("--config", help=f"YAML config, e.g. configs/{name}/tiny.yaml (default: the schema's defaults)")
    parser.add_argument("--resume", help="checkpoint file or folder, or 'auto' (same as train.resume=...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override any setting, e.g. train.steps=50")
    args = parser.parse_intermixed_args(argv)  # options anywhere among the overrides
    overrides = args.overrides + ([f"train.resume={args.resume}"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as error:
        parser.error(str(error))
    if not any(item.split("=", 1)[0] == "name" for item in args.overrides):
        number_the_run(cfg, parser.prog)
    try:
        summary = train(cfg)
    except ConfigError as error:
        parser.error(str(error))
    except (RunLockedError, CheckpointReadError, CheckpointWriteError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if os.environ.get("RANK", "0") == "0":
        print(" ".join(f"{key}={value:.4g}" for key, value in summary.items() if summary_keys(key)), file=sys.stderr)
    return summary


def number_the_run(cfg: DictConfig, prog: str) -> None:
    """Set ``cfg.name`` to the run folder :func:`run_folder.numbered_name` gives the config's name: the next
    number for a fresh run, the highest for ``--resume auto``; say so (rank 0 only) where that is not the
    config's own name."""
    name = run_folder.numbered_name(cfg.out_dir, cfg.name, cfg.train.resume)
    if name != cfg.name and os.environ.get("RANK", "0") == "0":
        where = Path(cfg.out_dir) / name
        if cfg.train.resume == "auto":
            print(f"{prog}: continuing {where}, the newest run of {cfg.name}", file=sys.stderr)
        else:
            print(f"{prog}: {Path(cfg.out_dir) / cfg.name} holds an earlier run; this run writes to {where} "
                  "(--resume auto continues the newest run, name=... chooses the folder)", file=sys.stderr)
    cfg.name = name
