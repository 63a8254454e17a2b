"""Command line of the MAML recipe: ``python -m recipes.meta --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

import argparse
import sys

from recipes.common.config import ConfigError
from recipes.meta.train import load_config, train


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m recipes.meta",
                                     description="Meta-train a transformer with MAML through flashbob attention.")
    parser.add_argument("--config", help="YAML config, e.g. configs/meta/tiny.yaml (default: the schema's defaults)")
    parser.add_argument("--resume", help="checkpoint file or folder, or 'auto' (same as train.resume=...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override any setting, e.g. train.steps=50")
    args = parser.parse_args(argv)
    overrides = args.overrides + ([f"train.resume={args.resume}"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as error:
        parser.error(str(error))
    summary = train(cfg)
    print(" ".join(f"{key}={value:.4g}" for key, value in summary.items()
                   if key.startswith("meta_test/") or key == "meta_train/query_loss"), file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
