"""Command line of the TTT recipe: ``python -m recipes.ttt --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

import argparse
import sys

from recipes.common.config import ConfigError
from recipes.ttt.train import load_config, train


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m recipes.ttt",
                                     description="Meta-learn test-time training of a byte-level LM on flashbob.")
    parser.add_argument("--config", help="YAML config, e.g. configs/ttt/tiny.yaml (default: the schema's defaults)")
    parser.add_argument("--resume", help="checkpoint file or folder, or 'auto' (same as train.resume=...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override any setting, e.g. train.steps=50")
    args = parser.parse_args(argv)
    overrides = args.overrides + ([f"train.resume={args.resume}"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as error:
        parser.error(str(error))
    summary = train(cfg)
    print(" ".join(f"{key}={value:.4g}" for key, value in summary.items() if key.startswith("val/")), file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
