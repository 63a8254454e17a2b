"""Command line of the LM recipe: ``python -m recipes.lm --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

from recipes.common import cli
from recipes.lm.train import load_config, train


def main(argv: list[str] | None = None) -> dict[str, float]:
    return cli.run("lm", "Pretrain a byte-level LM on flashbob.", load_config, train,
                   lambda key: key in ("train/loss", "val/loss", "val/perplexity"), argv)


if __name__ == "__main__":
    main()
