"""The command line every recipe shares: ``python -m recipes.<name> --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from omegaconf import DictConfig

from recipes.common.config import ConfigError


def run(
    name: str,
    description: str,
    load_config: Callable[[str | None, list[str]], DictConfig],
    train: Callable[[DictConfig], dict[str, float]],
    summary_keys: Callable[[str], bool],
    argv: list[str] | None = None,
) -> dict[str, float]:
    """Parse the arguments, load and validate the config (errors exit with status 2 and the
    message), train, and print the summary values whose keys ``summary_keys`` accepts (rank 0 only
    under ``torchrun``)."""
    parser = argparse.ArgumentParser(prog=f"python -m recipes.{name}", description=description)
    parser.add_argument("--config", help=f"YAML config, e.g. configs/{name}/tiny.yaml (default: the schema's defaults)")
    parser.add_argument("--resume", help="checkpoint file or folder, or 'auto' (same as train.resume=...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override any setting, e.g. train.steps=50")
    args = parser.parse_args(argv)
    overrides = args.overrides + ([f"train.resume={args.resume}"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as error:
        parser.error(str(error))
    summary = train(cfg)
    if os.environ.get("RANK", "0") == "0":
        print(" ".join(f"{key}={value:.4g}" for key, value in summary.items() if summary_keys(key)), file=sys.stderr)
    return summary
