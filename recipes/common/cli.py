"""The command line every recipe shares: ``python -m recipes.<name> --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from omegaconf import DictConfig

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
    try:
        summary = train(cfg)
    except ConfigError as error:
        parser.error(str(error))
    except (RunLockedError, CheckpointReadError, CheckpointWriteError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if os.environ.get("RANK", "0") == "0":
        print(" ".join(f"{key}={value:.4g}" for key, value in summary.items() if summary_keys(key)), file=sys.stderr)
    return summary
